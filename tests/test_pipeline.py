"""The pipeline runtime with real processes (torchrun, gloo on loopback)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PROMPTS, copy_with_eos, free_port, local_ranks, read_jsonl, reference_generate, write_jsonl

pytestmark = [pytest.mark.multinode, pytest.mark.slow]
GEN = 5
STAGES_YAML = """stages:
  - {percent: [100, 0, 100, 0, 100, 0]}
  - {percent: [0, 0, 0, 0, 0, 0], cpu_attention: false}
  - {percent: [30, 30, 20, 50, 50, 50], overlap: false}
"""


def torchrun(nproc: int, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return local_ranks(["-m", "flexgen_dist.run", "--no-progress", *args], nproc=nproc, timeout=timeout)


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
@pytest.mark.parametrize("nproc,groups,stage_layers,offload,prefill,schedule", [
    (2, 1, None, False, "batch", "sequential"), (2, 2, None, True, "batch", "sequential"),
    (3, 3, "1 2 1", True, "block", "sequential"), (3, 2, "2 1 1", False, "batch", "sequential"),
    (2, 1, None, True, "batch", "overlapped"), (3, 1, "2 1 1", False, "block", "overlapped"),
])
def test_pipeline_matches_transformers(kind: str, nproc: int, groups: int, stage_layers: str | None,
                                       offload: bool, prefill: str, schedule: str, tiny_models,
                                       tmp_path: Path) -> None:
    """Tokens equal transformers' for every split, offload, group count, prefill item size
    and schedule; with 6 prompts in blocks of 2 and G < 3, later blocks enter as earlier ones
    end (overlapped: their prefill rides on the decode steps of the block before)."""
    tm = tiny_models[kind]
    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "o.jsonl"
    args = ["--model", str(tm.path), "--prompts", str(p), "--gen-len", str(GEN), "--ignore-eos",
            "--gpu-batch-size", "1", "--num-gpu-batches", "2", "--num-micro-batches", str(groups),
            "--prefill-items", prefill, "--schedule", schedule,
            "--output", str(out), "--metrics", str(tmp_path / "m.json"), "--offload-dir", str(tmp_path / "off")]
    if stage_layers:
        args += ["--stage-layers", *stage_layers.split()]
    if nproc == 2 and offload:
        args.append("--warmup")  # every rank runs the untimed pass; the job's tokens stay the same
    if offload:
        y = tmp_path / "stages.yaml"
        y.write_text("stages:\n" + "\n".join(STAGES_YAML.splitlines()[1:nproc + 1]) + "\n")
        args += ["--policy", str(y)]
    r = torchrun(nproc, args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == reference_generate(tm, PROMPTS, GEN)
    assert f"prefill items per {prefill}" in r.stderr and f"schedule {schedule}" in r.stderr
    import json

    m = json.loads((tmp_path / "m.json").read_text())
    assert m["world_size"] == nproc and len(m["stage_times"]) == nproc and len(m["peak_bytes"]) == nproc
    assert m["decode_throughput"] > 0 and m["prefill_throughput"] > 0
    for rank in range(nproc):
        assert (tmp_path / f"m.rank{rank}.json").is_file()
    if offload:
        assert m["peak_bytes"][1]["disk"] > 0  # stage 1 really ran from disk
        assert list((tmp_path / "off").iterdir()) == []


def test_gen_len_one_and_more_groups_than_blocks(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["opt-post-proj"]
    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "o.jsonl"
    r = torchrun(2, ["--model", str(tm.path), "--prompts", str(p), "--gen-len", "1", "--ignore-eos",
                     "--gpu-batch-size", "8", "--num-micro-batches", "4", "--output", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == reference_generate(tm, PROMPTS, 1)


def _spawn_ranks(nproc: int, args: list[str], tmp_path: Path) -> list[subprocess.Popen]:
    """Start ranks as plain processes (no launcher agent that would kill the others for us)."""
    port = free_port(pair=True)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "flexgen_dist.run", "--no-progress"] + args, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def test_killed_rank_makes_the_others_exit(tmp_path: Path) -> None:
    args = ["--model", "opt-125m", "--dummy-weights", "--num-prompts", "4", "--prompt-len", "8",
            "--gen-len", "1500", "--ignore-eos", "--gpu-batch-size", "2", "--dist-timeout", "10",
            "--log-dir", str(tmp_path / "logs")]
    procs = _spawn_ranks(3, args, tmp_path)
    try:
        deadline = time.time() + 120
        log1 = tmp_path / "logs" / "rank1.log"
        while time.time() < deadline and not (log1.exists() and "stage 1" in log1.read_text()):
            time.sleep(0.5)
        time.sleep(3)  # well into the generation loop
        procs[1].send_signal(signal.SIGKILL)
        # not a hang: both survivors exit within the 10 s dist timeout plus polling
        # (wait raises TimeoutExpired past the bound)
        exit_by = time.time() + 40
        for k in (0, 2):
            procs[k].wait(timeout=max(1.0, exit_by - time.time()))
        errs = {k: procs[k].stderr.read() for k in (0, 2)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0 and procs[2].returncode != 0
    assert all("rank 1" in e for e in errs.values()), "\n----\n".join(errs.values())


def test_raising_rank_makes_the_others_exit(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    y = tmp_path / "stages.yaml"
    y.write_text("stages:\n  - {percent: [100, 0, 100, 0, 100, 0]}\n  - {percent: [0, 0, 100, 0, 100, 0]}\n")
    args = ["--model", "opt-125m", "--dummy-weights", "--num-prompts", "2", "--prompt-len", "8", "--gen-len", "4",
            "--policy", str(y), "--offload-dir", str(blocker / "sub"), "--dist-timeout", "10"]
    procs = _spawn_ranks(2, args, tmp_path)
    try:
        outs = {k: p.communicate(timeout=90) for k, p in enumerate(procs)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0 and procs[1].returncode != 0
    assert "offload" in outs[1][1].lower()  # the failing rank says why
    assert "rank 1" in outs[0][1]  # the other one names it


@pytest.mark.parametrize("nproc,num_gb,schedule", [(2, 1, "sequential"), (3, 1, "sequential"), (2, 2, "sequential"),
                                                   (2, 1, "overlapped"), (1, 1, "overlapped")])
def test_eos_stops_a_group_on_every_stage(nproc: int, num_gb: int, schedule: str, tiny_models,
                                          tmp_path: Path) -> None:
    """A group whose sequences have all reached EOS is dropped by every stage at the same step:
    outputs equal the reference cut at EOS, and each stage computes fewer (token, group) items.
    Overlapped: the prefill pieces that were to ride on the dropped steps run on their own."""
    import json

    tm = tiny_models["llama-gqa"]
    gen = 10
    ref = reference_generate(tm, PROMPTS, gen)
    eos = ref[0][2]  # the first prompt's third token: its group (one prompt) ends after step 2
    model = copy_with_eos(tm.path, tmp_path / "model", eos)
    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out, met = tmp_path / "o.jsonl", tmp_path / "m.json"
    args = ["--model", str(model), "--prompts", str(p), "--gen-len", str(gen), "--gpu-batch-size", "1",
            "--num-gpu-batches", str(num_gb), "--num-micro-batches", "2", "--output", str(out), "--metrics", str(met),
            "--prefill-items", "batch", "--schedule", schedule]
    r = torchrun(nproc, args)
    assert r.returncode == 0, r.stderr[-3000:]
    want = [x[:x.index(eos) + 1] if eos in x else x for x in ref]
    assert [x["tokens"] for x in read_jsonl(out)] == want
    steps = [s["token_steps"] for s in json.loads(met.read_text())["stage_times"]]
    # a group (block) runs until its longest sequence ends
    lens = [max(len(w) for w in want[a:a + num_gb]) for a in range(0, len(want), num_gb)]
    full = gen * len(lens)
    ended_early = sum(gen - n for n in lens)  # steps no stage needs to run
    assert steps == [full - ended_early] * nproc
    if num_gb == 1:
        assert ended_early > 0
