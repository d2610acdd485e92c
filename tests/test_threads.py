"""Compute threads chosen from the CPUs a rank may use (flexgen_dist/threads.py), and the
one-time costs kept out of the clock."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexgen_dist import threads
from flexgen_dist.threads import ThreadChoice, cgroup_quota, choose_threads, local_ranks


def _cgroup_v2(tmp_path: Path, quota: str) -> tuple[Path, Path]:
    root = tmp_path / "cg"
    (root / "job" / "step").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text(quota + "\n")
    (root / "job" / "step" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step\n")
    return root, proc


def test_cgroup_quota_is_the_tightest_along_the_path(tmp_path: Path) -> None:
    root, proc = _cgroup_v2(tmp_path, "150000 100000")
    assert cgroup_quota(root, proc) == 1.5  # the parent's limit binds its children
    root, proc = _cgroup_v2(tmp_path / "b", "max 100000")
    assert cgroup_quota(root, proc) is None


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    d = tmp_path / "cg" / "cpu,cpuacct" / "slurm" / "job1"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:cpu,cpuacct:/slurm/job1\n3:memory:/slurm/job1\n")
    assert cgroup_quota(tmp_path / "cg", proc) == 3.0
    (d / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota(tmp_path / "cg", proc) is None


def test_local_ranks_from_each_launcher() -> None:
    assert local_ranks({}) == 1
    assert local_ranks({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == 2
    assert local_ranks({"SLURM_NTASKS_PER_NODE": "3"}) == 3
    assert local_ranks({"LOCAL_WORLD_SIZE": "x"}) == 1


def _fixed(monkeypatch, cpus: int, quota: float | None = None, busy: float | None = 0.0) -> None:
    monkeypatch.setattr(threads, "affinity_cpus", lambda: list(range(cpus)))
    monkeypatch.setattr(threads, "cgroup_quota", lambda: quota)
    monkeypatch.setattr(threads, "busy_cpus", lambda c, seconds=0.0: busy)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: cpus)


def test_choice_counts_what_the_rank_may_use(monkeypatch) -> None:
    _fixed(monkeypatch, 8)
    assert choose_threads(env={}).threads == 8
    assert choose_threads(requested=3, env={}).threads == 3  # --threads wins
    assert choose_threads(requested=3, env={}).why == "--threads"
    c = choose_threads(env={"OMP_NUM_THREADS": "2"})
    assert c.threads == 2 and "OMP_NUM_THREADS=2" in c.why
    assert choose_threads(env={"OMP_NUM_THREADS": "64"}).threads == 8  # never more than the CPUs
    c = choose_threads(env={"LOCAL_WORLD_SIZE": "4"})
    assert c.threads == 2 and c.busy is None and "4 ranks on this node" in c.why  # shared mask: a share each
    _fixed(monkeypatch, 8, quota=2.5)
    c = choose_threads(env={})
    assert c.threads == 2 and "quota of 2.5" in c.why
    _fixed(monkeypatch, 4, busy=1.2)
    c = choose_threads(env={})
    assert c.threads == 3 and c.busy == 1.2 and "kept busy" in c.why
    _fixed(monkeypatch, 2, busy=1.9)
    assert choose_threads(env={}).threads == 1  # never fewer than one
    _fixed(monkeypatch, 2, busy=0.3)
    assert choose_threads(env={}).threads == 2  # background noise is not a busy CPU


@pytest.mark.exclusive  # another test's load would be counted as busy CPUs
def test_a_busy_process_is_seen() -> None:
    cpus = threads.affinity_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to share")
    deadline = time.monotonic() + 30  # the last test's stragglers (a rank's exit) to settle
    idle = threads.busy_cpus(cpus, 0.3)
    while idle is not None and idle >= 0.5 and time.monotonic() < deadline:
        idle = threads.busy_cpus(cpus, 0.3)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        seen = threads.busy_cpus(cpus, 0.5)
    finally:
        busy.kill()
        busy.wait()
    assert idle is not None and seen is not None
    assert seen >= 0.7 and seen >= idle + 0.5, (idle, seen)


@pytest.mark.bundled
def test_choice_is_applied_and_reported(tmp_path: Path) -> None:
    """The CLI sets the threads before it computes and reports them, with the one-time costs,
    in the metrics."""
    m = tmp_path / "m.json"
    r = subprocess.run([sys.executable, "-m", "flexgen_dist.run", "--threads", "1", "--gen-len", "2",
                        "--print-outputs", "0", "--metrics", str(m)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "threads: 1 (--threads)" in r.stderr
    data = json.loads(m.read_text())
    assert data["threads"][0]["threads"] == 1 and data["threads"][0]["why"] == "--threads"
    cost = data["one_time_s"][0]
    assert set(cost) == {"kernel_build_s", "gemm_tune_s", "gemm_shapes_tuned"}
    assert all(v >= 0 for v in cost.values())


def test_bad_thread_count_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "flexgen_dist.run", "--threads", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "--threads 0: must be >= 1" in r.stderr


def test_threads_choice_record_is_plain_data() -> None:
    c = ThreadChoice(2, "x", 4, None, None, 1, 0.0)
    assert json.loads(json.dumps(c.as_dict()))["threads"] == 2
