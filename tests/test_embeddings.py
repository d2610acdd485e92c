"""Embeddings (``LLM.embed``, ``/v1/embeddings`` batch requests): each input's last hidden state
after the final norm equals transformers' ``last_hidden_state[:, -1]`` (left-padded, float32) on
every placement, with shared prefixes, a served LoRA adapter and two pipeline stages; cut to
``dimensions`` and normalized as asked; batch lines in OpenAI's format (floats or base64)."""
from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, left_padded, local_ranks, read_jsonl
from flexgen_dist import LLM
from flexgen_dist.config import ConfigError

EMB = "/v1/embeddings"


def reference_vectors(tm: TinyModel, prompts: list[list[int]]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) at each prompt's last token."""
    ids, mask = left_padded(tm, prompts)
    with torch.no_grad():
        return tm.model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1].float()


@pytest.mark.parametrize("kind", ["llama-gqa", "opt-pre", "opt-post-proj"])
def test_vectors_equal_transformers_last_hidden_state_on_every_placement(kind: str, tiny_models,
                                                                         tmp_path: Path) -> None:
    """Weights on the device, half on disk, all on disk over three GPU batches; OPT with a
    post-norm and project_out (its vectors have embed_dim, not hidden, values)."""
    tm = tiny_models[kind]
    want = reference_vectors(tm, PROMPTS)
    for pol in (dict(percent=(100, 0, 100, 0, 100, 0)), dict(percent=(0, 50, 0, 50, 100, 0)),
                dict(percent=(0, 0, 100, 0, 100, 0), num_gpu_batches=3)):
        with LLM(str(tm.path), offload_dir=str(tmp_path / "off"), progress=False, gpu_batch_size=2,
                 **{"num_gpu_batches": 1, **pol}) as llm:
            got = llm.embed(PROMPTS, normalize=False)
        assert [e.index for e in got] == list(range(len(PROMPTS)))
        assert [e.prompt_tokens for e in got] == [len(p) for p in PROMPTS]
        torch.testing.assert_close(torch.tensor([e.embedding for e in got]), want, atol=2e-5, rtol=1e-4)


def test_dimensions_normalize_and_shared_prefixes(tiny_models) -> None:
    """``dimensions`` keeps the first values, then normalizes (Matryoshka); prompts that open
    alike share their prefix's keys and still give transformers' vectors."""
    tm = tiny_models["llama-gqa"]
    prompts = [list(range(30, 50)) + p for p in PROMPTS]
    want = reference_vectors(tm, prompts)
    with LLM(str(tm.path), progress=False, gpu_batch_size=3, sort_window=0) as llm:
        raw = llm.embed(prompts, normalize=False)
        work = llm.prepare(prompts, 1)
        unit = llm.embed(prompts)
        cut = llm.embed(prompts, dimensions=8)
        with pytest.raises(ConfigError, match="dimensions 9999: this model's embeddings have 64"):
            llm.embed(prompts, dimensions=9999)
    assert set(work.shared or ()) == {20}
    torch.testing.assert_close(torch.tensor([e.embedding for e in raw]), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([e.embedding for e in unit]), torch.nn.functional.normalize(want, dim=-1),
                               atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([e.embedding for e in cut]),
                               torch.nn.functional.normalize(want[:, :8], dim=-1), atol=1e-5, rtol=1e-4)


def test_a_served_adapters_vectors(tiny_models, tmp_path: Path) -> None:
    """``lora=`` embeds with a served adapter: PEFT's model's last hidden state."""
    from test_lora import _adapted

    tm = tiny_models["llama-gqa"]
    m1 = _adapted(tm, tmp_path / "a1", ["q_proj", "v_proj", "down_proj"], seed=3, b_scale=0.5)
    with LLM(str(tm.path), lora_modules={"a1": str(tmp_path / "a1")}, progress=False, gpu_batch_size=2) as llm:
        got = llm.embed(PROMPTS, normalize=False, lora=["a1", None] * 3)
    want = torch.stack([reference_vectors(m1, PROMPTS)[n] if n % 2 == 0 else reference_vectors(tm, PROMPTS)[n]
                        for n in range(len(PROMPTS))])
    torch.testing.assert_close(torch.tensor([e.embedding for e in got]), want, atol=2e-5, rtol=1e-4)


def _emb(cid: str, x: object, **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": EMB, "body": {"input": x, **body}}


def test_batch_embeddings_lines_beside_completions(tiny_models) -> None:
    """/v1/embeddings requests in a batch with completions: one line per request with a vector
    per input (floats, or base64 float32), ``usage``, cut by ``dimensions``; bad bodies get
    their own error lines."""
    from test_batch import body, compl

    tm = tiny_models["llama-gqa"]
    want = torch.nn.functional.normalize(reference_vectors(tm, PROMPTS), dim=-1)
    reqs = [_emb("one", PROMPTS[0]), compl("c", PROMPTS[1], max_tokens=3),
            _emb("many", PROMPTS[2:5], model="whatever"), _emb("b64", PROMPTS[5], encoding_format="base64"),
            _emb("cut", PROMPTS[1], dimensions=4), _emb("bad-field", PROMPTS[0], temperature=0.5),
            _emb("bad-dims", PROMPTS[0], dimensions=65), _emb("empty", []), _emb("bad-fmt", PROMPTS[0],
                                                                                 encoding_format="int8")]
    with LLM(str(tm.path), progress=False, gpu_batch_size=2, ignore_eos=True) as llm:
        lines = {x["custom_id"]: x for x in llm.batch(reqs)}
        name = llm.model.spec.name
    one = body(lines["one"])
    assert one["object"] == "list" and one["model"] == name and one["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    torch.testing.assert_close(torch.tensor(one["data"][0]["embedding"]), want[0], atol=1e-5, rtol=1e-4)
    many = body(lines["many"])["data"]
    assert [d["index"] for d in many] == [0, 1, 2] and all(d["object"] == "embedding" for d in many)
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in many]), want[2:5], atol=1e-5, rtol=1e-4)
    raw = base64.b64decode(body(lines["b64"])["data"][0]["embedding"])
    torch.testing.assert_close(torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw)), want[5], atol=1e-5, rtol=1e-4)
    cut = torch.tensor(body(lines["cut"])["data"][0]["embedding"])
    torch.testing.assert_close(cut, torch.nn.functional.normalize(reference_vectors(tm, PROMPTS)[1, :4], dim=0),
                               atol=1e-5, rtol=1e-4)
    assert len(body(lines["c"])["choices"][0]["token_ids"]) == 3
    for cid, code in (("bad-field", "unsupported_field"), ("bad-dims", "invalid_value"), ("empty", "invalid_request"),
                      ("bad-fmt", "invalid_value")):
        assert lines[cid]["error"]["code"] == code, cid


@pytest.mark.slow
@pytest.mark.multinode
def test_the_batch_command_on_two_ranks_embeds_as_one(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["opt-pre"]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(_emb(f"e{n}", p)) + "\n" for n, p in enumerate(PROMPTS)))
    out = tmp_path / "out.jsonl"
    r = local_ranks(["-m", "flexgen_dist.batch", "--model", str(tm.path), "-i", str(inp), "-o", str(out),
                     "--no-progress", "--gpu-batch-size", "2", "--num-gpu-batches", "2"], nproc=2, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = torch.tensor([x["response"]["body"]["data"][0]["embedding"] for x in read_jsonl(out)])
    torch.testing.assert_close(got, torch.nn.functional.normalize(reference_vectors(tm, PROMPTS), dim=-1),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["Qwen3Model", "MistralModel"])
def test_a_base_model_checkpoint_loads_and_embeds(arch: str, tmp_path: Path, caplog) -> None:
    """Embedding models ship as base models (``Qwen3Model``, ``MistralModel``: no ``model.``
    prefix, no LM head): they load, the embedding matrix standing in for the head (said once),
    and their vectors are transformers'."""
    import transformers

    torch.manual_seed(0)
    cfg_cls = getattr(transformers, arch.replace("Model", "Config"))
    cfg = cfg_cls(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0,
                  tie_word_embeddings=arch == "Qwen3Model")
    m = getattr(transformers, arch)(cfg).eval()
    m.save_pretrained(tmp_path / "m")
    tm = TinyModel(arch, tmp_path / "m", m, 0)
    with caplog.at_level("WARNING", logger="flexgen_dist"):
        with LLM(str(tm.path), progress=False, gpu_batch_size=3) as llm:
            got = llm.embed(PROMPTS, normalize=False)
    torch.testing.assert_close(torch.tensor([e.embedding for e in got]), reference_vectors(tm, PROMPTS),
                               atol=2e-5, rtol=1e-4)
    assert ("a base model (MistralModel" in caplog.text) == (arch == "MistralModel")


def test_the_run_command_writes_embeddings_and_resumes(tiny_models, tmp_path: Path, capsys) -> None:
    """``--embed`` writes ``{"id", "embedding", "prompt_tokens"}`` lines (cut by
    ``--embed-dimensions``, normalized), a window at a time; ``--resume`` finishes the job."""
    from flexgen_dist.run import main

    tm = tiny_models["llama-gqa"]
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": f"d{n}", "input_ids": q}) + "\n" for n, q in enumerate(PROMPTS)))
    out = tmp_path / "o.jsonl"
    args = ["--model", str(tm.path), "--prompts", str(p), "--embed", "--embed-dimensions", "16", "--output", str(out),
            "--no-progress", "--gpu-batch-size", "2"]
    assert main(args) == 0
    rows = read_jsonl(out)
    assert [r["id"] for r in rows] == [f"d{n}" for n in range(len(PROMPTS))]
    assert [r["prompt_tokens"] for r in rows] == [len(q) for q in PROMPTS]
    want = torch.nn.functional.normalize(reference_vectors(tm, PROMPTS)[:, :16], dim=-1)
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in rows]), want, atol=1e-5, rtol=1e-4)
    assert "16 values" in capsys.readouterr().out
    out.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))  # an interrupted job
    assert main(args + ["--resume"]) == 0
    again = read_jsonl(out)
    assert again[:2] == rows[:2] and [r["id"] for r in again] == [r["id"] for r in rows]
    # the rest in other blocks (other padding): the same vectors to float32 rounding
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in again]), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch,labels", [("LlamaForSequenceClassification", 3), ("Qwen2ForSequenceClassification", 1),
                                         ("Gemma2ForSequenceClassification", 1)])
def test_a_sequence_classifier_scores_as_transformers(arch: str, labels: int, tmp_path: Path) -> None:
    """A ``*ForSequenceClassification`` checkpoint (a classifier; a reward model's one label):
    ``classify`` gives transformers' logits at the last token, their softmax and the label's
    name; the calls a language model serves are refused in one line."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, arch.replace("ForSequenceClassification", "Config"))(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, num_labels=labels,
        id2label={i: f"class-{i}" for i in range(labels)}, label2id={f"class-{i}": i for i in range(labels)})
    m = getattr(transformers, arch)(cfg).eval()
    m.save_pretrained(tmp_path / "m")
    ids, mask = left_padded(TinyModel(arch, tmp_path, m, 0), PROMPTS)
    with torch.no_grad():
        want = m(input_ids=ids, attention_mask=mask).logits.float()
    with LLM(str(tmp_path / "m"), progress=False, gpu_batch_size=2, num_gpu_batches=2) as llm:
        got = llm.classify(PROMPTS)
        for call, match in ((lambda: llm.generate(PROMPTS, gen_len=2), r"generate\(\) needs a language model"),
                            (lambda: llm.embed(PROMPTS), r"embed\(\) needs a language model"),
                            (lambda: llm.score(PROMPTS), r"score\(\) needs a language model")):
            with pytest.raises(ConfigError, match=match):
                call()
    assert [c.index for c in got] == list(range(len(PROMPTS)))
    torch.testing.assert_close(torch.tensor([c.logits for c in got]), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([c.probs for c in got]), want.softmax(-1), atol=1e-5, rtol=1e-4)
    assert [c.label for c in got] == [f"class-{int(i)}" for i in want.argmax(-1)]
    if labels > 1:  # the run command's --classify writes the same, a line per prompt
        from flexgen_dist.run import main

        p, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
        p.write_text("".join(json.dumps({"id": n, "input_ids": q}) + "\n" for n, q in enumerate(PROMPTS)))
        assert main(["--model", str(tmp_path / "m"), "--prompts", str(p), "--classify", "--output", str(out),
                     "--no-progress"]) == 0
        rows = read_jsonl(out)
        assert [r["label"] for r in rows] == [c.label for c in got]
        torch.testing.assert_close(torch.tensor([r["logits"] for r in rows]), want, atol=2e-5, rtol=1e-4)


def test_classify_needs_a_classifier(tiny_models) -> None:
    with LLM(str(tiny_models["llama-gqa"].path), progress=False) as llm:
        with pytest.raises(ConfigError, match=r"classify\(\) needs a sequence classifier"):
            llm.classify(PROMPTS)


def _sentence_model(tmp_path: Path, modes: dict[str, bool], extra: str = "") -> tuple[Path, torch.nn.Module]:
    """A random Qwen3 embedding model in sentence-transformers' layout: modules.json, a Pooling
    module with ``modes`` set, a Normalize module; ``extra`` "Dense": a Dense step (64 -> 24,
    tanh) after pooling; "LayerNorm": a step that is not computed."""
    import transformers

    torch.manual_seed(5)
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, pad_token_id=0, tie_word_embeddings=True)
    m = transformers.Qwen3Model(cfg).eval()
    d = tmp_path / "st"
    m.save_pretrained(d)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if extra:
        modules.append({"idx": 2, "name": "2", "path": f"2_{extra}", "type": f"sentence_transformers.models.{extra}"})
    if extra == "Dense":
        from safetensors.torch import save_file

        (d / "2_Dense").mkdir()
        (d / "2_Dense" / "config.json").write_text(json.dumps({
            "in_features": 64, "out_features": 24, "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh"}))
        save_file({"linear.weight": torch.randn(24, 64) * 0.1, "linear.bias": torch.randn(24) * 0.1},
                  str(d / "2_Dense" / "model.safetensors"))
    modules.append({"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"})
    (d / "modules.json").write_text(json.dumps(modules))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes,
                                                             "include_prompt": True}))
    return d, m


def _pooled_reference(m: torch.nn.Module, prompts: list[list[int]], how: str) -> torch.Tensor:
    """sentence-transformers' pooling of transformers' last hidden states, one input at a time."""
    out = []
    for p in prompts:
        with torch.no_grad():
            h = m(input_ids=torch.tensor([p])).last_hidden_state[0].double()
        n = torch.tensor(float(len(p)), dtype=torch.float64)
        w = torch.arange(1, len(p) + 1, dtype=torch.float64)[:, None]
        out.append({"last": h[-1], "cls": h[0], "mean": h.mean(0), "max": h.amax(0),
                    "mean_sqrt_len": h.sum(0) / n.sqrt(), "weighted_mean": (h * w).sum(0) / w.sum()}[how])
    return torch.stack(out)


SHARED = list(range(30, 50))  # 20 leading tokens: a prefix the engine would compute once


@pytest.mark.parametrize("how", ["mean", "cls", "max", "mean_sqrt_len", "weighted_mean", "last"])
def test_pooling_as_the_sentence_transformers_config_says(how: str, tmp_path: Path, caplog) -> None:
    """The Pooling module's mode (or ``--pooling``): the pooled last hidden states equal
    sentence-transformers' pooling of transformers' (float32), over left-padded batches of
    several lengths, with prompts that share a prefix (each input's states whole)."""
    st_name = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
               "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
               "weighted_mean": "pooling_mode_weightedmean_tokens", "last": "pooling_mode_lasttoken"}[how]
    d, m = _sentence_model(tmp_path, {st_name: True})
    prompts = PROMPTS + [SHARED + [7, 8], SHARED + [9, 10, 11], SHARED + [12]]
    want = _pooled_reference(m, prompts, how)
    with caplog.at_level("INFO", logger="flexgen_dist"):
        with LLM(str(d), progress=False, gpu_batch_size=3, num_gpu_batches=2) as llm:
            assert llm.model.spec.pooling == how
            got = llm.embed(prompts, normalize=False)
    torch.testing.assert_close(torch.tensor([e.embedding for e in got], dtype=torch.float64), want,
                               atol=2e-5, rtol=1e-4)
    assert ("embeddings pool" in caplog.text) == (how != "last")


def test_pooling_override_and_what_is_refused(tmp_path: Path, caplog) -> None:
    """``pooling=`` overrides the files; a Dense projection (not computed) and a Pooling module
    of two modes are refused by ``embed`` and by embeddings requests in one line each."""
    d, m = _sentence_model(tmp_path, {"pooling_mode_lasttoken": True})
    with LLM(str(d), progress=False, pooling="mean") as llm:
        got = llm.embed(PROMPTS, normalize=False)
    torch.testing.assert_close(torch.tensor([e.embedding for e in got], dtype=torch.float64),
                               _pooled_reference(m, PROMPTS, "mean"), atol=2e-5, rtol=1e-4)
    with pytest.raises(ConfigError, match="--pooling 'sum'"):
        LLM(str(d), progress=False, pooling="sum")
    d, _ = _sentence_model(tmp_path / "norm", {"pooling_mode_mean_tokens": True}, extra="LayerNorm")
    with LLM(str(d), progress=False) as llm:
        with pytest.raises(ConfigError, match="has a LayerNorm step, which is not computed"):
            llm.embed(PROMPTS)
        line = llm.batch([_emb("e", PROMPTS[0])])[0]
        assert line["error"]["code"] == "invalid_request" and "LayerNorm" in line["error"]["message"]
        assert len(llm.generate(PROMPTS[:1], gen_len=2)[0].token_ids) == 2  # generation is untouched
    with caplog.at_level("WARNING", logger="flexgen_dist"):
        d, m = _sentence_model(tmp_path / "two", {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
        with LLM(str(d), progress=False) as llm:
            with pytest.raises(ConfigError, match="no one pooling mode: choose one with --pooling"):
                llm.embed(PROMPTS)
    assert "sets 2 modes (mean, max)" in caplog.text
    with LLM(str(d), progress=False, pooling="max") as llm:
        got = llm.embed(PROMPTS, normalize=False)
    torch.testing.assert_close(torch.tensor([e.embedding for e in got], dtype=torch.float64),
                               _pooled_reference(m, PROMPTS, "max"), atol=2e-5, rtol=1e-4)


def test_a_dense_step_after_pooling(tmp_path: Path) -> None:
    """A pipeline's Dense step (tanh(W v + b), 64 -> 24) applies to each pooled vector before
    ``dimensions`` and normalizing, as sentence-transformers computes it; batch lines and
    pair scores get the projected vectors too."""
    from safetensors.torch import load_file

    d, m = _sentence_model(tmp_path, {"pooling_mode_mean_tokens": True}, extra="Dense")
    dense = load_file(str(d / "2_Dense" / "model.safetensors"))
    want = torch.tanh(_pooled_reference(m, PROMPTS, "mean") @ dense["linear.weight"].double().T
                      + dense["linear.bias"].double())
    with LLM(str(d), progress=False, gpu_batch_size=4) as llm:
        assert llm.model.embed_dim == 24
        got = llm.embed(PROMPTS, normalize=False)
        cut = llm.embed(PROMPTS[:2], dimensions=8)
        with pytest.raises(ConfigError, match="this model's embeddings have 24"):
            llm.embed(PROMPTS, dimensions=64)
        lines = llm.batch([_emb("e", PROMPTS[0]), _emb("too-wide", PROMPTS[0], dimensions=30)])
    torch.testing.assert_close(torch.tensor([e.embedding for e in got], dtype=torch.float64), want,
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor([e.embedding for e in cut], dtype=torch.float64),
                               torch.nn.functional.normalize(want[:2, :8], dim=-1), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(lines[0]["response"]["body"]["data"][0]["embedding"], dtype=torch.float64),
                               torch.nn.functional.normalize(want[0], dim=0), atol=2e-5, rtol=1e-4)
    assert lines[1]["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("value,how", [(1, "mean"), (2, "cls"), (3, "last"), (0, "last")])
def test_a_gguf_files_pooling_type(value: int, how: str, tmp_path: Path) -> None:
    """A GGUF embedding model's ``{arch}.pooling_type`` (llama.cpp's: 1 mean, 2 cls, 3 last;
    0 none) sets its pooling."""
    import transformers

    from flexgen_dist.models.loader import load_model
    from gguf_convert import rewrite, write_gguf

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=64, tie_word_embeddings=True)
    path = write_gguf(transformers.Qwen3ForCausalLM(cfg).eval(), tmp_path / "q.gguf")
    spec = load_model(str(rewrite(path, tmp_path / "p.gguf", {"qwen3.pooling_type": value})),
                      load_tokenizer=False).spec
    assert spec.pooling == how


def test_batch_classify_requests(tmp_path: Path, tiny_models) -> None:
    """``/v1/classify`` requests (vLLM's): each input's labels' softmax (the logits with
    ``use_activation`` off) and its label's name, equal to transformers'; a language model
    answers them, and a classifier completions, with an error line naming what it serves."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0, num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"},
                                   label2id={"neg": 0, "neu": 1, "pos": 2})
    m = transformers.LlamaForSequenceClassification(cfg).eval()
    m.save_pretrained(tmp_path / "m")
    ids, mask = left_padded(TinyModel("c", tmp_path, m, 0), PROMPTS)
    with torch.no_grad():
        want = m(input_ids=ids, attention_mask=mask).logits.double()

    def cls(cid: str, x: object, **body: object) -> dict:
        return {"custom_id": cid, "method": "POST", "url": "/v1/classify", "body": {"input": x, **body}}

    reqs = [cls("all", PROMPTS), cls("raw", PROMPTS[0], use_activation=False), cls("bad", PROMPTS[0], top_k=2),
            {"custom_id": "gen", "url": "/v1/completions", "body": {"prompt": PROMPTS[0]}}]
    with LLM(str(tmp_path / "m"), progress=False, gpu_batch_size=4) as llm:
        lines = {x["custom_id"]: x for x in llm.batch(reqs)}
    body = lines["all"]["response"]["body"]
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(PROMPTS)))
    torch.testing.assert_close(torch.tensor([d["probs"] for d in body["data"]], dtype=torch.float64),
                               want.softmax(-1), atol=1e-5, rtol=1e-4)
    assert [d["label"] for d in body["data"]] == [["neg", "neu", "pos"][int(i)] for i in want.argmax(-1)]
    assert all(d["num_classes"] == 3 for d in body["data"])
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    raw = lines["raw"]["response"]["body"]["data"][0]["probs"]
    torch.testing.assert_close(torch.tensor(raw, dtype=torch.float64), want[0], atol=2e-5, rtol=1e-4)
    assert lines["bad"]["error"]["code"] == "unsupported_field"
    assert "it serves /v1/classify" in lines["gen"]["error"]["message"]
    with LLM(str(tiny_models["llama-gqa"].path), progress=False) as llm:
        line = llm.batch([cls("lm", PROMPTS[0])])[0]
    assert "needs a sequence classifier" in line["error"]["message"]
