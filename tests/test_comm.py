"""Point-to-point comm and the failure monitor, with real gloo processes.

World size 1 runs in process (loopback). Multi-rank tests start real processes, either through
launch/single_node.sh (torchrun) or directly with RANK/WORLD_SIZE set by hand; the direct ones
check each surviving rank's exit code, message and delay after the failure, which torchrun
would otherwise hide by killing the survivors itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, clean_env, free_port, kill_tree
from flexgen_dist.distributed.comm import StageComm
from flexgen_dist.distributed.monitor import FailureMonitor
from flexgen_dist.distributed.topology import DistContext, detect_topology

TIMEOUT = 10.0  # --timeout given to the ranks in failure tests


def fail_time(text: str) -> float:
    m = re.search(r"failing on purpose .* at unix time ([0-9.]+)", text)
    assert m, f"the failing rank did not announce its failure:\n{text[-2000:]}"
    return float(m.group(1))


# ---------------------------------------------------------------- world size 1, in process


def test_world_one_loopback() -> None:
    with DistContext.init(detect_topology({})) as ctx:
        comm = StageComm(ctx)
        x = torch.arange(6, dtype=torch.float16).reshape(2, 3)
        comm.send(x, 0)
        assert torch.equal(comm.recv((2, 3), torch.float16, 0), x)
        h_recv = comm.irecv(torch.empty(4, dtype=torch.int64), 0)  # posted before the send
        comm.wait(comm.isend(torch.tensor([1, 2, 3, 4]), 0))
        assert comm.wait(h_recv).tolist() == [1, 2, 3, 4]
        comm.send_obj({"ids": [1, 2], "eos": True}, 0)
        assert comm.recv_obj(0) == {"ids": [1, 2], "eos": True}
        with pytest.raises(RuntimeError, match="never sent"):
            comm.recv((1,), torch.float32, 0)
        comm.send(torch.zeros(2), 0)
        with pytest.raises(ValueError, match="loopback"):
            comm.recv((3,), torch.float32, 0)
        with pytest.raises(ValueError, match="outside"):
            comm.send(x, 1)
        with FailureMonitor(ctx, None) as mon:  # nothing to watch with one rank
            assert mon.store is None


# ---------------------------------------------------------------- through torchrun


def run_launcher(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """Run a launcher in its own process group; kill the group if it overstays."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.time()
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()


def single_node(nproc: int, *args: str, timeout: float = 90) -> tuple[int, str, float]:
    env = clean_env()
    cmd = [str(REPO / "launch" / "single_node.sh"), str(nproc), *args]
    return run_launcher(cmd, env, timeout)


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("nproc", [2, 3])
def test_ring_torchrun(nproc: int, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    rc, out, _ = single_node(nproc, "--rounds", "4", "--size", "1000", "--log-dir", str(logs))
    assert rc == 0, out
    assert f"ring ok: world={nproc} rounds=4 bytes={1000 * 4 * 4 * nproc}" in out
    assert "launcher=torchrun" in out and out.count("ring ok") == 1  # print0: rank 0 only
    for r in range(nproc):
        log = (logs / f"rank{r}.log").read_text()
        assert f"rank {r}/{nproc}" in log and "round 3 ok" in log


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("flag", ["--fail-rank", "--kill-rank"])
def test_failure_torchrun(flag: str) -> None:
    rc, out, end = single_node(2, flag, "1", "--timeout", str(TIMEOUT), "--rounds", "6")
    assert rc != 0, out
    assert end - fail_time(out) < 2 * TIMEOUT, out
    assert re.search(r"rank\s*:?\s*1\b", out), out  # ours, or torchrun's failure summary


# ---------------------------------------------------------------- ranks started by hand


def spawn_ranks(world: int, tmp_path: Path, *args: str) -> list[subprocess.Popen]:
    port = free_port(pair=True)
    procs = []
    for r in range(world):
        env = clean_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "flexgen_dist.distributed.check", *args], cwd=REPO, env=env,
            stdout=open(tmp_path / f"rank{r}.out", "w"), stderr=open(tmp_path / f"rank{r}.err", "w"),
            start_new_session=True))
    return procs


def wait_ranks(procs: list[subprocess.Popen], skip: int, limit: float) -> dict[int, float]:
    """Wait for every rank except `skip`; return each one's exit time."""
    ended: dict[int, float] = {}
    deadline = time.time() + limit
    while len(ended) < len(procs) - 1 and time.time() < deadline:
        for r, p in enumerate(procs):
            if r != skip and r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.05)
    return ended


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # also ends a SIGSTOPped rank
        p.wait()


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize(
    "world, bad, args, expect",
    [
        # The failing rank reports, then lingers: the others learn of it from the monitor.
        (3, 1, ["--fail-rank", "1", "--linger", "15"], "rank 1 failed: RuntimeError: rank 1 failing"),
        (3, 0, ["--kill-rank", "0"], "rank 0"),  # rank 0 also hosts the failure store
        # Stopped, connections open: only the heartbeat can tell (gloo's own timeout is 60 s).
        (2, 1, ["--hang-rank", "1", "--timeout", "60", "--monitor-timeout", "4"],
         "rank 1 failed: no heartbeat for 4 s"),
    ],
    ids=["fail", "kill-store-host", "hang"],
)
def test_survivors_exit_naming_the_failed_rank(
    tmp_path: Path, world: int, bad: int, args: list[str], expect: str
) -> None:
    common = ["--timeout", str(TIMEOUT), "--poll", "0.5", "--rounds", "6", "--size", "100000"]
    procs = spawn_ranks(world, tmp_path, *common, *args)
    try:
        ended = wait_ranks(procs, skip=bad, limit=120)
        t_fail = fail_time((tmp_path / f"rank{bad}.err").read_text())
        for r in range(world):
            if r == bad:
                continue
            err = (tmp_path / f"rank{r}.err").read_text()
            assert r in ended, f"rank {r} still running long after rank {bad} failed:\n{err}"
            assert procs[r].returncode != 0, err
            assert ended[r] - t_fail < 2 * TIMEOUT, err
            assert expect in err, err
    finally:
        kill_all(procs)


def test_launch_scripts_usage() -> None:
    scripts = ["launch/single_node.sh", "launch/multi_node.sh", "launch/mpirun.sh",
               "slurm/run.sbatch", "slurm/sweep.sh"]
    for script in scripts:
        res = subprocess.run([str(REPO / script), "-h"], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0 and Path(script).name in res.stdout, (script, res)
        assert os.access(REPO / script, os.X_OK), script
    res = subprocess.run([str(REPO / "launch/single_node.sh")], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 2 and "NPROC" in res.stdout
