"""Long jobs: --resume finishes an interrupted job byte for byte, stop signals exit cleanly,
offload dirs of dead runs are reclaimed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, local_ranks, write_jsonl
from flexgen_dist.run import main

PROMPTS = [[5 + i, 6 + i, 7 + i, 8 + (i % 3)] for i in range(10)]


def _run(args: list[str], capsys=None) -> tuple[int, str]:
    rc = main(args + ["--no-progress"])
    err = capsys.readouterr().err if capsys is not None else ""
    return rc, err


def _job(tm, tmp_path: Path, out: Path, *extra: str) -> list[str]:
    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    return ["--model", str(tm.path), "--prompts", str(p), "--gen-len", "6", "--output", str(out),
            "--offload-dir", str(tmp_path / "off"), *extra]


def _cut(path: Path, lines: int, torn: bool) -> None:
    """Keep the first ``lines`` lines, plus half of the next one when ``torn``."""
    raw = path.read_bytes().split(b"\n")
    keep = b"".join(ln + b"\n" for ln in raw[:lines])
    if torn:
        keep += raw[lines][: len(raw[lines]) // 2]
    path.write_bytes(keep)


@pytest.mark.parametrize("sampling", [[], ["--temperature", "1.3", "--top-p", "0.9", "--seed", "7"]])
def test_resume_equals_an_uninterrupted_run(sampling: list[str], tiny_models, tmp_path: Path, capsys) -> None:
    """Greedy and seeded sampling: the resumed file is the uninterrupted one, byte for byte,
    though the resumed part runs in other blocks (other batch sizes) after a torn line."""
    tm = tiny_models["llama-gqa"]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert _run(_job(tm, tmp_path, ref, "--gpu-batch-size", "4", *sampling), capsys)[0] == 0
    assert _run(_job(tm, tmp_path, out, "--gpu-batch-size", "4", *sampling), capsys)[0] == 0
    _cut(out, 3, torn=True)
    rc, err = _run(_job(tm, tmp_path, out, "--gpu-batch-size", "3", "--num-gpu-batches", "2",
                        "--resume", *sampling), capsys)
    assert rc == 0 and "resuming: 3 of 10 prompts" in err
    assert out.read_bytes() == ref.read_bytes()
    rc, _ = _run(_job(tm, tmp_path, out, "--resume", *sampling), capsys)  # nothing left
    assert rc == 0 and out.read_bytes() == ref.read_bytes()
    fp = json.loads((tmp_path / "out.jsonl.run.json").read_text())
    assert fp["num_prompts"] == 10 and fp["gen_len"] == 6 and "gpu_batch_size" not in fp


def test_resume_refuses_another_job(tiny_models, tmp_path: Path, capsys) -> None:
    tm = tiny_models["opt-pre"]
    out = tmp_path / "out.jsonl"
    assert _run(_job(tm, tmp_path, out), capsys)[0] == 0
    _cut(out, 4, torn=False)
    rc, err = _run(_job(tm, tmp_path, out, "--resume", "--gen-len", "7"), capsys)
    assert rc == 1 and "gen_len (6 -> 7) changed" in err
    rc, err = _run(_job(tm, tmp_path, out, "--resume", "--seed", "3"), capsys)
    assert rc == 1 and "seed (0 -> 3)" in err
    rc, err = _run(_job(tm, tmp_path, out), capsys)
    assert rc == 1 and "--resume" in err and "--overwrite" in err
    assert len(out.read_text().splitlines()) == 4  # nothing lost
    rc, _ = _run(_job(tm, tmp_path, out, "--overwrite"), capsys)
    assert rc == 0 and len(out.read_text().splitlines()) == 10
    (tmp_path / "out.jsonl.run.json").unlink()
    rc, err = _run(_job(tm, tmp_path, out, "--resume"), capsys)
    assert rc == 1 and "run.json is missing" in err


_STOPPER = """
import os, signal, sys, threading
from flexgen_dist.distributed import pipeline
orig = pipeline.Pipeline.run
def run(self, *a, **k):
    for block in orig(self, *a, **k):
        yield block  # resumed once the caller has written the block
        if int(os.environ["STOP_AFTER"]) == 0:
            os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIG"]))
        os.environ["STOP_AFTER"] = str(int(os.environ["STOP_AFTER"]) - 1)
pipeline.Pipeline.run = run
from flexgen_dist.run import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig,window", [("SIGTERM", "1"), ("SIGUSR1", "2")])
def test_stop_signal_keeps_outputs_and_resume_finishes(sig: str, window: str, tiny_models, tmp_path: Path,
                                                       capsys) -> None:
    """A stop signal after two blocks: one error line, exit 128 + signum, the two blocks'
    lines on disk (a window of one block each, or one window of both, grouped by length), no
    offload files; --resume then completes the uninterrupted file."""
    tm = tiny_models["opt-pre"]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    policy = ["--gpu-batch-size", "2", "--percent", "0", "0", "100", "0", "100", "0",  # weights on disk
              "--sort-window", window]
    assert _run(_job(tm, tmp_path, ref, *policy), capsys)[0] == 0
    env = {**os.environ, "STOP_AFTER": "1", "STOP_SIG": sig}
    r = subprocess.run([sys.executable, "-c", _STOPPER, *_job(tm, tmp_path, out, *policy), "--no-progress"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 128 + getattr(signal, sig), r.stderr
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert errs == [f"error: stopped by {sig}; outputs written so far are kept (rerun with --resume to finish)"]
    assert "Traceback" not in r.stderr
    assert len(out.read_text().splitlines()) == 4  # two blocks of two
    assert not any((tmp_path / "off").iterdir())
    assert _run(_job(tm, tmp_path, out, *policy, "--resume"), capsys)[0] == 0
    assert out.read_bytes() == ref.read_bytes()


def test_sigkilled_run_leaves_nothing_after_the_next(tiny_models, tmp_path: Path, capsys) -> None:
    """A run killed outright keeps its offload dir; the next run under the same root frees it."""
    tm = tiny_models["opt-pre"]
    args = _job(tm, tmp_path, tmp_path / "o.jsonl", "--percent", "0", "0", "100", "0", "100", "0",
                "--gen-len", "100", "--ignore-eos")
    proc = subprocess.Popen([sys.executable, "-m", "flexgen_dist.run", *args, "--no-progress"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    off = tmp_path / "off"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and sum(1 for _ in off.glob("flexgen-rank0-*/*")) < 3:
            time.sleep(0.05)  # the dir, its owner file and some weight files
        assert any(off.glob("flexgen-rank0-*")), "the run never made its offload dir"
    finally:
        proc.kill()
        proc.wait()
    assert any(off.iterdir())  # left behind
    rc, _ = _run(_job(tm, tmp_path, tmp_path / "o2.jsonl"), capsys)
    assert rc == 0 and not any(off.iterdir())


@pytest.mark.slow
@pytest.mark.multinode
def test_resume_on_another_number_of_ranks(tiny_models, tmp_path: Path, capsys) -> None:
    """Interrupted on one process, finished on two ranks: the same bytes."""
    tm = tiny_models["llama-gqa"]
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    extra = ["--temperature", "1.1", "--seed", "2"]
    assert _run(_job(tm, tmp_path, ref, "--gpu-batch-size", "2", *extra), capsys)[0] == 0
    assert _run(_job(tm, tmp_path, out, "--gpu-batch-size", "2", *extra), capsys)[0] == 0
    _cut(out, 5, torn=True)
    r = local_ranks(["-m", "flexgen_dist.run",
                     *_job(tm, tmp_path, out, "--gpu-batch-size", "3", "--resume", *extra), "--no-progress"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.read_bytes() == ref.read_bytes()


def _spawn(nproc: int, args: list[str]) -> list[subprocess.Popen]:
    """Ranks as plain processes (no launcher agent that would end the others for us)."""
    port = free_port(pair=True)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "flexgen_dist.run", "--no-progress", *args],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.fixture(scope="module")
def kill_job(tiny_models, tmp_path_factory) -> tuple[list[str], bytes]:
    """The job the random kills interrupt (its options but the offload dir) and the output of
    an uninterrupted run of it."""
    d = tmp_path_factory.mktemp("kills")
    prompts = [[5 + i % 50, 6 + i % 7, 7, 8 + i % 3] for i in range(40)]
    common = ["--model", str(tiny_models["opt-pre"].path), "--prompts", str(write_jsonl(d / "p.jsonl", prompts)),
              "--gen-len", "110", "--ignore-eos", "--temperature", "0.9", "--seed", "5", "--gpu-batch-size", "2",
              "--dist-timeout", "8", "--percent", "50", "0", "100", "0", "100", "0"]
    ref = d / "ref.jsonl"
    assert main(common + ["--offload-dir", str(d / "off"), "--output", str(ref), "--no-progress"]) == 0
    return common, ref.read_bytes()


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("it", range(5))
def test_random_kills_then_resume(kill_job, it: int, tmp_path: Path, capsys) -> None:
    """5 cases: SIGKILL a random rank of a 2- or 3-rank job at a random moment; every survivor
    exits within the timeout naming the dead rank; --resume (on one process) then finishes the
    job, and its output equals an uninterrupted run's, byte for byte; the offload files the
    killed ranks left are gone after it. (A case per test, so parallel workers share them.)"""
    import random

    job, ref = kill_job
    rng = random.Random(1234 + it)
    common = job + ["--offload-dir", str(tmp_path / "off")]
    world = 2 if it % 2 == 0 else 3
    out = tmp_path / "out.jsonl"
    procs = _spawn(world, common + ["--output", str(out)])
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out.exists() and out.stat().st_size > 0):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))
        dead = rng.randrange(world)
        procs[dead].kill()
        for r, proc in enumerate(procs):
            if r == dead:
                continue
            proc.wait(timeout=40)  # no hang: raises past the bound
            err = proc.stderr.read()
            if proc.returncode != 0:  # it had not finished before the kill
                assert f"rank {dead}" in err, (world, dead, r, err[-2000:])
                assert "Traceback" not in err, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    rc, _ = _run(common + ["--output", str(out), "--resume", "--gpu-batch-size", "3"], capsys)
    assert rc == 0
    assert out.read_bytes() == ref
    left = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "off").rglob("*"))
    assert not left, left  # the killed ranks' files were reclaimed
