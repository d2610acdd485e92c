"""How many compute threads a rank runs: chosen from the CPUs it may use, once, at start.

torch's intra-op threads (and the native kernels, which share its OpenMP pool) split every
GEMM evenly between them and wait for the slowest at its end. On a CPU that other work also
uses, a thread the OS has descheduled holds every other one up: measured on a 2-core host,
the default job took 1.3 s alone and 4.2 s beside one busy single-threaded process with two
threads, 2.2 s with one. So the runtime counts the CPUs it may really use:

- the CPUs of its affinity mask (``taskset``, Slurm's binding, a launcher's pinning);
- the cgroup's CPU quota (a container's ``--cpus``, Slurm's ``cpu.max``), rounded down;
- the ranks of its job on this node, when they share one affinity mask (torchrun's
  ``LOCAL_WORLD_SIZE``, OpenMPI's local size, Slurm's tasks per node): each gets its share;
- the CPUs other processes keep busy right now (``/proc/stat`` over ``_SAMPLE_S`` at start;
  a rank that shares its node with other ranks of its job skips this, they load as it does);

and never more than ``OMP_NUM_THREADS`` where the user or the launcher set it. ``--threads N``
pins the count (the choice then changes nothing else). The count is taken once: results are
the same for the same count, and GEMMs of another count may sum in another order, so a run
that must reproduce another one's bits to the last digit pins ``--threads``. No OpenMP wait
policy is set: a passive wait costs a lone job more (1.46 s -> 2.31 s on the same host) than
it saves beside one.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_SAMPLE_S = 0.15  # how long the CPUs' load is sampled at start
_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


@dataclass(frozen=True)
class ThreadChoice:
    """The compute threads of one rank and what they were chosen from."""

    threads: int
    why: str
    cpus: int  # CPUs in this process's affinity mask
    quota: float | None  # the cgroup's CPU quota, in CPUs (None: no limit)
    omp_num_threads: int | None  # OMP_NUM_THREADS as given (None: unset)
    local_ranks: int  # ranks of this job on this node
    busy: float | None  # CPUs of the mask other processes kept busy at start (None: not sampled)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def affinity_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 ``cpu.max``, v1 ``cfs_quota_us``),
    the tightest along its path; None without one."""
    best: float | None = None
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, ctrls, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if ctrls == "":  # cgroup v2: cpu.max at every level up to the root
            d = root / rel
            while True:
                q = _v2_quota(d / "cpu.max")
                if q is not None:
                    best = q if best is None else min(best, q)
                if d == root or root not in d.parents:
                    break
                d = d.parent
        elif "cpu" in ctrls.split(","):
            for base in (root / "cpu", root / "cpu,cpuacct", root / ctrls):
                q = _v1_quota(base / rel)
                if q is not None:
                    best = q if best is None else min(best, q)
                    break
    return best


def _v2_quota(f: Path) -> float | None:
    try:
        quota, period = f.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def local_ranks(env: dict[str, str] | None = None) -> int:
    """Ranks of this job on this node, as the launcher says (1 without one)."""
    env = os.environ if env is None else env
    for var in _LOCAL_SIZE_VARS:
        try:
            n = int(env.get(var, "").split("(")[0])
        except ValueError:
            continue
        if n >= 1:
            return n
    return 1


def _cpu_times(cpus: list[int]) -> dict[int, tuple[int, int]]:
    """(busy, total) jiffies of each of ``cpus`` from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    want = set(cpus)
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line[3] == " ":
                    continue
                parts = line.split()
                c = int(parts[0][3:])
                if c in want:
                    v = [int(x) for x in parts[1:]]
                    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
                    total = sum(v[:8])  # guest time is already in user
                    out[c] = (total - idle, total)
    except (OSError, ValueError, IndexError):
        return {}
    return out


def _own_jiffies() -> int:
    try:
        parts = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(parts[11]) + int(parts[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return 0


def busy_cpus(cpus: list[int], seconds: float = _SAMPLE_S) -> float | None:
    """CPUs of ``cpus`` that other processes kept busy over the next ``seconds`` (this process's
    own time taken out); None where /proc/stat cannot be read."""
    a, own0 = _cpu_times(cpus), _own_jiffies()
    time.sleep(seconds)
    b, own1 = _cpu_times(cpus), _own_jiffies()
    if not a or a.keys() != b.keys():
        return None
    busy = sum(b[c][0] - a[c][0] for c in a) - (own1 - own0)
    span = sum(b[c][1] - a[c][1] for c in a) / len(a)
    return max(0.0, busy / span) if span > 0 else None


def choose_threads(requested: int | None = None, env: dict[str, str] | None = None,
                   sample: bool = True) -> ThreadChoice:
    """The compute threads for this rank (module doc); ``requested`` (``--threads``) wins."""
    env = os.environ if env is None else env
    cpus = affinity_cpus()
    quota = cgroup_quota()
    omp = None
    try:
        omp = int(env["OMP_NUM_THREADS"].split(",")[0]) if env.get("OMP_NUM_THREADS") else None
    except ValueError:
        omp = None
    ranks = local_ranks(env)
    if requested is not None:
        return ThreadChoice(requested, "--threads", len(cpus), quota, omp, ranks, None)
    n, why = len(cpus), [f"{len(cpus)} CPUs in the affinity mask"]
    if quota is not None and math.floor(quota) < n:
        n = max(1, math.floor(quota))
        why.append(f"a cgroup quota of {quota:g} CPUs")
    shared = ranks > 1 and len(cpus) == (os.cpu_count() or len(cpus))
    if shared:  # the node's ranks share one mask: each its part
        n = max(1, n // ranks)
        why.append(f"{ranks} ranks on this node")
    busy = busy_cpus(cpus) if sample and not shared and n > 1 else None
    if busy is not None and math.floor(busy + 0.5) >= 1:
        n = max(1, n - math.floor(busy + 0.5))
        why.append(f"{busy:.1f} CPUs kept busy by other processes at start")
    if omp is not None and omp < n:
        n = max(1, omp)
        why.append(f"OMP_NUM_THREADS={omp}")
    return ThreadChoice(n, ", ".join(why), len(cpus), quota, omp, ranks, busy)


def apply(choice: ThreadChoice) -> None:
    """Set torch's intra-op threads (the native kernels use the same count)."""
    import torch

    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
