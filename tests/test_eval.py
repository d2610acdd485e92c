"""``python -m flexgen_dist.eval ppl`` and ``LLM.score``: perplexity equal to transformers'."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import local_ranks
from flexgen_dist import LLM
from flexgen_dist.eval import main, windows

IDS = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(11)).tolist()


def hf_reference(model: torch.nn.Module, ids: list[int], wins: list[tuple[int, int, int]]) -> tuple[float, int, int]:
    """Summed NLL, tokens scored and top-1 hits of each window, with transformers' full logits."""
    nll, count, hits = 0.0, 0, 0
    with torch.no_grad():
        for a, b, first in wins:
            x = torch.tensor([ids[a:b]])
            logits = model(input_ids=x).logits[0, :-1].float()
            tgt = x[0, 1:]
            keep = torch.arange(1, b - a) >= first
            lp = torch.log_softmax(logits, -1).gather(-1, tgt[:, None])[:, 0]
            nll -= float(lp[keep].double().sum())
            count += int(keep.sum())
            hits += int((logits.argmax(-1) == tgt)[keep].sum())
    return nll, count, hits


def ids_file(tmp_path: Path) -> Path:
    p = tmp_path / "ids.jsonl"
    p.write_text(json.dumps({"input_ids": IDS[:90]}) + "\n" + json.dumps({"input_ids": IDS[90:]}) + "\n")
    return p


def test_windows_score_every_token_once() -> None:
    assert windows(10, 4, 4) == [(0, 4, 1), (4, 8, 1), (8, 10, 1)]
    assert windows(10, 4, 2) == [(0, 4, 1), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    assert windows(10, 4, 2, max_windows=2) == [(0, 4, 1), (2, 6, 2)]
    # with overlap every token after the first is scored exactly once
    scored = [a + j for a, b, f in windows(50, 8, 3) for j in range(f, b - a)]
    assert sorted(scored) == list(range(1, 50))


@pytest.mark.parametrize("kind,stride,policy", [
    ("opt-pre", 32, []), ("llama-gqa", 20, []), ("opt-post-proj", 32, ["--gpu-batch-size", "2"]),
    ("llama-tied", 24, ["--percent", "0", "50", "0", "0", "100", "0", "--gpu-batch-size", "1",
                        "--num-gpu-batches", "2"]),
])
def test_ppl_equals_transformers(kind: str, stride: int, policy: list[str], tiny_models, tmp_path: Path,
                                 capsys) -> None:
    tm = tiny_models[kind]
    out = tmp_path / "r.json"
    rc = main(["ppl", "--text", str(ids_file(tmp_path)), "--window", "32", "--stride", str(stride),
               "--model", str(tm.path), "--json", str(out), "--no-progress", "--offload-dir", str(tmp_path / "off"),
               *policy])
    assert rc == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    nll, count, hits = hf_reference(tm.model, IDS, windows(len(IDS), 32, stride))
    assert res["tokens_scored"] == count
    assert abs(res["ppl"] - math.exp(nll / count)) <= 1e-4 * math.exp(nll / count)
    assert res["accuracy"] == hits / count
    assert "perplexity" in capsys.readouterr().out
    if "--percent" in policy:
        assert res["peak_bytes"][0]["disk"] > 0  # the offloading policy really ran from disk


def test_score_api_first_scored(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    seqs = [IDS[:20], IDS[20:31], IDS[40:45]]
    firsts = [1, 6, 4]
    with LLM(str(tm.path), gpu_batch_size=2, progress=False) as llm:
        scores = llm.score(seqs, firsts)
        also = llm.generate([IDS[:5]], gen_len=3)  # the same engine still generates
    assert [s.index for s in scores] == [0, 1, 2]
    for s, seq, f in zip(scores, seqs, firsts):
        nll, count, hits = hf_reference(tm.model, seq, [(0, len(seq), f)])
        assert s.count == count == len(seq) - f
        assert abs(s.nll - nll) <= 1e-4 * abs(nll)
        assert s.correct == hits
    assert len(also[0].token_ids) == 3


def decode_windows(n: int, window: int, stride: int, d: int) -> list[tuple[int, int, int]]:
    """The windows of ``eval ppl --decode-tokens d``: only each window's last d tokens count."""
    return [(a, b, max(f, b - a - d)) for a, b, f in windows(n, window, stride)]


@pytest.mark.parametrize("kind,policy", [
    ("opt-pre", []),
    ("llama-gqa", ["--gpu-batch-size", "2", "--num-gpu-batches", "2"]),  # CPU decode merges the batches
    ("llama-tied", ["--percent", "0", "50", "0", "0", "100", "0", "--gpu-batch-size", "1",
                    "--num-gpu-batches", "2"]),  # the cache on disk, CPU attention
])
def test_decode_scoring_equals_transformers(kind: str, policy: list[str], tiny_models, tmp_path: Path) -> None:
    """Tokens predicted by teacher-forced decode steps score as transformers' full logits do."""
    tm = tiny_models[kind]
    out = tmp_path / "r.json"
    # 150 ids, windows of 32 every 28: the last window (10 ids) is shorter than its decode part
    rc = main(["ppl", "--text", str(ids_file(tmp_path)), "--window", "32", "--stride", "28", "--decode-tokens",
               "12", "--model", str(tm.path), "--json", str(out), "--no-progress", "--offload-dir",
               str(tmp_path / "off"), *policy])
    assert rc == 0
    res = json.loads(out.read_text())
    nll, count, hits = hf_reference(tm.model, IDS, decode_windows(len(IDS), 32, 28, 12))
    assert res["decode_tokens"] == 12 and res["tokens_scored"] == count == 5 * 12 + 6
    assert abs(res["ppl"] - math.exp(nll / count)) <= 1e-4 * math.exp(nll / count)
    assert res["accuracy"] == hits / count


def test_decode_scoring_sees_cache_compression(tiny_models) -> None:
    """--compress-cache and --attn-sparsity change decode-scored tokens only: prefill attention
    runs over the fresh keys and values."""
    tm = tiny_models["opt-pre"]
    seqs = [IDS[:40], IDS[40:80], IDS[80:110]]

    def nll(decode_tokens: int, **opts: object) -> list[float]:
        with LLM(str(tm.path), gpu_batch_size=3, progress=False, **opts) as llm:
            return [s.nll for s in llm.score(seqs, decode_tokens=decode_tokens)]

    exact = nll(0)
    assert nll(0, compress_cache=True) == exact
    assert nll(20) == pytest.approx(exact, rel=1e-5)  # the same scores, by decode steps
    for opts in ({"compress_cache": True}, {"attn_sparsity": 0.2}):
        noisy = nll(20, **opts)
        assert noisy != pytest.approx(exact, rel=1e-6), opts
        assert noisy == pytest.approx(exact, rel=0.05), opts


@pytest.mark.bundled
def test_bundled_text_and_model() -> None:
    with LLM(progress=False) as llm:
        from flexgen_dist.eval import evaluate

        res = evaluate(llm, window=128, max_windows=2)
    assert res is not None and res["windows"] == 2 and res["tokens_scored"] == 2 * 127
    assert 2.0 < res["ppl"] < 60.0  # English prose under a small instruct model
    assert 0.2 < res["accuracy"] < 0.9


def test_bad_input_is_one_line(tiny_models, tmp_path: Path, capsys) -> None:
    model = ["--model", str(tiny_models["opt-pre"].path), "--no-progress"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    text = tmp_path / "t.txt"
    text.write_text("some words")
    cases = [
        (["ppl", "--text", str(tmp_path / "missing.txt")], 1, "no such file"),
        (["ppl", "--text", str(ids_file(tmp_path)), "--window", "500"], 1, "positions"),
        (["ppl", "--text", str(ids_file(tmp_path)), "--stride", "0"], 2, "--stride"),
        (["ppl", "--text", str(ids_file(tmp_path)), "--window", "16", "--decode-tokens", "15"], 2, "--decode-tokens"),
        (["ppl", "--text", str(empty)], 1, "no tokenizer"),
        (["ppl", "--text", str(text)], 1, "no tokenizer"),
    ]
    for argv, code, words in cases:
        assert main(argv + model) == code, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], (argv, err)
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"input_ids": [5]}) + "\n")
    assert main(["ppl", "--text", str(blank)] + model) == 1
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multinode
def test_ppl_on_two_ranks(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["opt-pre"]
    out = tmp_path / "r.json"
    args = ["-m", "flexgen_dist.eval", "ppl", "--text", str(ids_file(tmp_path)), "--window", "32", "--stride", "16",
            "--model", str(tm.path), "--gpu-batch-size", "2", "--json", str(out), "--no-progress"]
    r = local_ranks(args, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    nll, count, _ = hf_reference(tm.model, IDS, windows(len(IDS), 32, 16))
    assert res["world_size"] == 2 and res["tokens_scored"] == count
    assert abs(res["ppl"] - math.exp(nll / count)) <= 1e-4 * math.exp(nll / count)
    # decode-side scoring on two ranks: stage 0 feeds the known ids, the last stage adds up
    r = local_ranks(args + ["--decode-tokens", "10"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    nll, count, _ = hf_reference(tm.model, IDS, decode_windows(len(IDS), 32, 16, 10))
    assert res["tokens_scored"] == count
    assert abs(res["ppl"] - math.exp(nll / count)) <= 1e-4 * math.exp(nll / count)
