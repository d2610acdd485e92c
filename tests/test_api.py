"""The library API: LLM(...).generate / stream / close, in one process and under torchrun."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROMPTS, left_padded, local_ranks, read_jsonl, reference_generate
from flexgen_dist import LLM, Completion, ConfigError, Policy, SamplingConfig
from flexgen_dist.run import main

GEN = 6
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_generate_matches_transformers_and_the_cli(kind: str, tiny_models, prompts_file: Path,
                                                   tmp_path: Path) -> None:
    tm = tiny_models[kind]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        outs = llm.generate(PROMPTS, gen_len=GEN)
        metrics = llm.metrics
    ref = reference_generate(tm, PROMPTS, GEN)
    assert all(isinstance(c, Completion) for c in outs)
    assert [c.index for c in outs] == list(range(len(PROMPTS)))
    assert [c.prompt_ids for c in outs] == PROMPTS
    assert [c.token_ids for c in outs] == ref
    out = tmp_path / "o.jsonl"
    met = tmp_path / "m.json"
    assert main(["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN), "--ignore-eos",
                 "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--output", str(out), "--metrics", str(met),
                 "--no-progress"]) == 0
    assert [r["tokens"] for r in read_jsonl(out)] == ref
    # one report format for the API and the CLI (which adds where the job stands)
    assert set(json.loads(met.read_text())) == set(metrics) | {"job_prompts", "resumed_prompts"}
    assert metrics["generated_tokens"] == GEN * len(PROMPTS) and metrics["world_size"] == 1


def test_stream_yields_blocks_in_order_and_calls_reuse_the_engine(tiny_models) -> None:
    tm = tiny_models["llama-tied"]
    ref = reference_generate(tm, PROMPTS, GEN)
    with LLM(str(tm.path), policy=Policy(gpu_batch_size=1, num_gpu_batches=2), ignore_eos=True,
             progress=False, sort_window=0) as llm:  # blocks in input order: each is its own window
        blocks = list(llm.stream(PROMPTS, gen_len=GEN))
        engine = llm.engine
        again = llm.generate(PROMPTS[:3], gen_len=2)  # a different workload on the same engine
        assert llm.engine is engine
        assert llm.metrics["num_prompts"] == 3
    assert [len(b) for b in blocks] == [2, 2, 2]  # blocks of num_gpu_batches x gpu_batch_size
    assert [c.index for b in blocks for c in b] == list(range(len(PROMPTS)))
    assert [c.token_ids for b in blocks for c in b] == ref
    assert [c.token_ids for c in again] == [r[:2] for r in ref[:3]]


def test_warmup_places_for_the_job_and_leaves_its_tokens_and_metrics(tiny_models, prompts_file: Path,
                                                                      tmp_path: Path, monkeypatch) -> None:
    """warmup() plans and places for the job's workload, runs one untimed token of one GPU
    batch, and changes neither the job's tokens nor its report; --warmup does it in the CLI."""
    tm = tiny_models["llama-gqa"]
    calls: list[tuple[int, int]] = []  # (prompts, gen_len) of each call that runs the engine
    from flexgen_dist import api

    start = api.LLM._start

    def recording_start(self, workload):
        work, peaks = start(self, workload)
        calls.append((work.num_prompts, work.gen_len))
        return work, peaks

    monkeypatch.setattr(api.LLM, "_start", recording_start)
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False,
             gen_len=GEN) as llm:
        llm.warmup(PROMPTS)
        plan = llm.plan
        assert llm.engine is not None and llm.metrics == {}
        outs = llm.generate(PROMPTS)
        assert llm.plan is plan  # the job's plan, made at the warm-up
        metrics = llm.metrics
    # the plan saw the job's workload; the untimed pass was one GPU batch for one token
    assert calls == [(len(PROMPTS), GEN), (2, 1), (len(PROMPTS), GEN)]
    assert [c.token_ids for c in outs] == reference_generate(tm, PROMPTS, GEN)
    assert metrics["num_prompts"] == len(PROMPTS) and metrics["generated_tokens"] == GEN * len(PROMPTS)
    out, met = tmp_path / "o.jsonl", tmp_path / "m.json"
    calls.clear()
    assert main(["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN), "--ignore-eos",
                 "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--output", str(out), "--metrics", str(met),
                 "--no-progress", "--warmup"]) == 0
    assert calls == [(len(PROMPTS), GEN), (2, 1), (len(PROMPTS), GEN)]
    assert [r["tokens"] for r in read_jsonl(out)] == [c.token_ids for c in outs]
    m = json.loads(met.read_text())
    assert m["num_prompts"] == len(PROMPTS) and m["generated_tokens"] == GEN * len(PROMPTS)


def test_sampling_argument_and_defaults(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    with LLM(str(tm.path), gpu_batch_size=3, ignore_eos=True, progress=False) as llm:
        a = llm.generate(PROMPTS, gen_len=8, sampling=SamplingConfig(temperature=1.5, seed=3, ignore_eos=True))
        b = llm.generate(PROMPTS, gen_len=8, sampling=SamplingConfig(temperature=1.5, seed=3, ignore_eos=True))
        greedy = llm.generate(PROMPTS, gen_len=8)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.token_ids for c in greedy] == reference_generate(tm, PROMPTS, 8)
    assert [c.token_ids for c in a] != [c.token_ids for c in greedy]


@pytest.mark.bundled
def test_text_prompts_with_the_bundled_model(capsys) -> None:
    texts = ["The capital of France is", "The three primary colors are"]
    with LLM(progress=False) as llm:
        outs = llm.generate(texts, gen_len=5)
        tok = llm.tokenizer
    assert [c.prompt for c in outs] == texts
    assert [c.prompt_ids for c in outs] == [list(tok(t)["input_ids"]) for t in texts]
    assert all(c.text == tok.decode(c.token_ids, skip_special_tokens=True) for c in outs)
    assert all(1 <= len(c.token_ids) <= 5 for c in outs)


def test_close_removes_offload_files(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["opt-pre"]
    off = tmp_path / "off"
    llm = LLM(str(tm.path), percent=(0, 0, 0, 0, 100, 0), offload_dir=str(off), ignore_eos=True, progress=False)
    outs = llm.generate(PROMPTS, gen_len=3)
    assert [c.token_ids for c in outs] == reference_generate(tm, PROMPTS, 3)
    assert any(off.rglob("*.bin"))  # weights and cache really lived on disk
    assert llm.metrics["peak_bytes"][0]["disk"] > 0
    st = llm.metrics["stage_times"][0]
    # the phase split of the stage's compute and waits: parts of the totals, prefill's own
    for k in ("compute_s", "io_wait_s", "comm_wait_s"):
        assert 0 <= st[f"prefill_{k}"] <= st[k], (k, st)
    assert 0 < st["prefill_compute_s"] < st["compute_s"] and st["prefill_io_wait_s"] > 0
    llm.close()
    assert list(off.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(PROMPTS, gen_len=1)


def test_bad_options_and_prompts_say_what_to_change(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    with pytest.raises(ConfigError, match="unknown option 'gpu_batchsize'"):
        LLM(str(tm.path), gpu_batchsize=2)
    with pytest.raises(ConfigError, match="--top-p"):
        LLM(str(tm.path), top_p=1.5)
    with LLM(str(tm.path), progress=False) as llm:
        with pytest.raises(ConfigError, match="no tokenizer"):
            llm.generate(["some text"])
        with pytest.raises(ConfigError, match="outside the vocabulary"):
            llm.generate([[1, 2, 100000]])
        with pytest.raises(ConfigError, match="positions"):
            llm.generate([[5] * 120], gen_len=20)
        with pytest.raises(ConfigError, match="non-empty list"):
            llm.generate([])
        # the LLM stays usable after a refused call
        assert [c.token_ids for c in llm.generate(PROMPTS[:2], gen_len=2)] == \
            [r[:2] for r in reference_generate(tm, PROMPTS[:2], 2)]


def test_example_script_runs(tiny_models, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    r = subprocess.run([sys.executable, str(REPO / "examples" / "generate_api.py"), "--model", "opt-125m",
                        "--dummy-weights", "--gen-len", "3", "--percent", "0", "100", "100", "0", "100", "0",
                        "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [c["index"] for c in data["completions"]] == [0]  # dummy weights: no tokenizer, the id prompt only
    assert len(data["completions"][0]["tokens"]) == 3
    assert data["metrics"]["world_size"] == 1


SPMD_SCRIPT = """
import json, sys
from flexgen_dist import LLM
prompts, gen, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with LLM(sys.argv[4], gpu_batch_size=1, num_gpu_batches=2, ignore_eos=True, progress=False,
         num_micro_batches=2) as llm:
    first = llm.generate(prompts, gen_len=gen)
    second = llm.generate(prompts[:2], gen_len=2)
    res = {"rank": llm.rank, "first": [c.token_ids for c in first], "second": [c.token_ids for c in second],
           "metrics": llm.metrics, "stage": llm.stage_metrics}
with open(f"{out}.{res['rank']}.json", "w") as f:
    json.dump(res, f)
"""


@pytest.mark.slow
@pytest.mark.multinode
def test_api_under_torchrun_two_ranks(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    script = tmp_path / "spmd.py"
    script.write_text(SPMD_SCRIPT)
    out = tmp_path / "res"
    r = local_ranks([str(script), json.dumps(PROMPTS), str(GEN), str(out), str(tm.path)], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    r0 = json.loads(Path(f"{out}.0.json").read_text())
    r1 = json.loads(Path(f"{out}.1.json").read_text())
    ref = reference_generate(tm, PROMPTS, GEN)
    assert r0["first"] == ref
    assert r0["second"] == [x[:2] for x in ref[:2]]
    assert r1["first"] == [] and r1["second"] == [] and r1["metrics"] == {}
    m = r0["metrics"]
    assert m["world_size"] == 2 and [s["stage"] for s in m["stage_times"]] == [0, 1]
    assert m["num_prompts"] == 2  # the metrics are the last call's
    assert r1["stage"]["stage"] == 1 and r1["stage"]["layers"] == [2, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("percent", [(100, 0, 100, 0, 100, 0), (0, 100, 0, 100, 100, 0), (30, 30, 20, 50, 50, 50)])
def test_api_on_cuda_float32_matches_transformers_on_cuda(percent: tuple, tiny_models, tmp_path: Path) -> None:
    import torch

    tm = tiny_models["llama-gqa"]
    ids, mask = left_padded(tm, PROMPTS, "cuda")
    s = ids.shape[1]
    model = tm.model.to("cuda")
    try:
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=GEN, min_new_tokens=GEN,
                                 do_sample=False, pad_token_id=tm.pad_id)[:, s:].tolist()
    finally:
        tm.model.to("cpu")
    with LLM(str(tm.path), device="cuda", dtype="float32", percent=percent, gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        outs = llm.generate(PROMPTS, gen_len=GEN)
    assert [c.token_ids for c in outs] == ref
