"""Memory budgets: the caps a user gives (``--gpu-mem/--cpu-mem/--disk-mem``) or, where none is
given, what this machine has; and the one check of a stage's predicted peaks against them.

Without a flag, a tier's budget is what this process may still use when the run is planned:
the device's free memory (GPU), the RAM the process may use (the least of the kernel's
``MemAvailable``, the cgroup's ``memory.max`` less its usage, and ``ulimit -v`` less the
process's mapped size) and the free space of the offload directory. On a machine without a
GPU the compute tier is host RAM too, so the two tiers are one pool, checked together, and
messages say "RAM".
"""
from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import ConfigError
from .memory.tiers import MemoryBudgetError
from .memory.units import format_bytes, parse_size
from .plan import Peaks

FLAGS = {"gpu": "--gpu-mem", "cpu": "--cpu-mem", "disk": "--disk-mem"}
HINTS = {"gpu": "lower the GPU percents (--percent) or --gpu-batch-size",
         "cpu": "move weights or cache to disk (--percent) or lower the batch size",
         "disk": "free space, choose another --offload-dir, or lower the batch size"}


@dataclass(frozen=True)
class Budgets:
    """Bytes per tier a stage may use (None: unlimited); ``pooled``: the gpu and cpu tiers are
    one pool of RAM (a CPU-only machine), capped by ``cpu``. ``given``: the tiers whose cap
    the user set; the others came from the machine (``source`` says from what)."""

    gpu: int | None = None
    cpu: int | None = None
    disk: int | None = None
    pooled: bool = False
    given: tuple[str, ...] = ()
    source: str = ""

    def cap(self, tier: str) -> int | None:
        return {"gpu": self.gpu, "cpu": self.cpu, "disk": self.disk}[tier]

    def with_headroom(self, keep: float) -> Budgets:
        """These budgets with only ``keep`` of each cap measured on the machine (the user's
        caps as given): what a sized default may fill, leaving room for what no model counts
        (allocator slack, other processes)."""
        def cut(tier: str, v: int | None) -> int | None:
            return v if v is None or tier in self.given else int(v * keep)
        return replace(self, gpu=cut("gpu", self.gpu), cpu=cut("cpu", self.cpu), disk=cut("disk", self.disk))


def user_caps(gpu_mem: str | None, cpu_mem: str | None, disk_mem: str | None) -> dict[str, int | None]:
    """The flags in bytes (None where not given)."""
    out: dict[str, int | None] = {}
    for t, v in (("gpu", gpu_mem), ("cpu", cpu_mem), ("disk", disk_mem)):
        try:
            out[t] = parse_size(v) if v is not None else None
        except ValueError as e:
            raise ConfigError(f"{FLAGS[t]} {v!r}: {e}") from None
    return out


def machine_budgets(caps: dict[str, int | None], device: torch.device, offload_dir: str) -> Budgets:
    """The user's caps, and the machine's figures for the tiers without one."""
    given = tuple(t for t, v in caps.items() if v is not None)
    ram, ram_source = available_ram()
    gpu = caps["gpu"]
    if gpu is None and device.type == "cuda":
        gpu = int(torch.cuda.mem_get_info(device)[0])
    cpu = caps["cpu"] if caps["cpu"] is not None else ram
    disk = caps["disk"] if caps["disk"] is not None else free_disk(offload_dir)
    return Budgets(gpu=gpu, cpu=cpu, disk=disk, pooled=device.type != "cuda", given=given, source=ram_source)


def available_ram() -> tuple[int, str]:
    """Bytes of RAM this process may still allocate, and which limit set it."""
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    found = [(avail, "available memory")]
    cg = _cgroup_room()
    if cg is not None:
        found.append((cg, "the cgroup's memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        found.append((max(0, soft - (_proc_kib("/proc/self/status", "VmSize") or 0)), "ulimit -v"))
    return min(found)


def free_disk(path: str) -> int:
    """Free bytes of the file system that holds (or will hold) ``path``."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return int(shutil.disk_usage(p).free)


def _proc_kib(path: str, key: str) -> int | None:
    """Bytes of a ``key: N kB`` line of a /proc file (None where absent or unreadable)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max less memory.current of this process's cgroup (None: no limit)."""
    try:
        rel = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        base = Path("/sys/fs/cgroup") / rel.strip().lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, StopIteration, ValueError):
        return None



def check_budgets(peaks: Peaks, budgets: Budgets, stage: int = 0) -> None:
    """Refuse a stage whose predicted peaks exceed a budget, in one line naming the tier as a
    user knows it, the peak, the cap and the fix."""
    where = f" on stage {stage}" if stage else ""
    if budgets.pooled:
        if budgets.gpu is not None and "gpu" in budgets.given and peaks.gpu > budgets.gpu:
            _refuse("gpu", "compute-tier (RAM)", peaks.gpu, budgets, where)
        ram = peaks.gpu + peaks.cpu
        if budgets.cpu is not None and ram > budgets.cpu:
            _refuse("cpu", "RAM", ram, budgets, where,
                    detail=f" (compute tier {format_bytes(peaks.gpu)} + host tier {format_bytes(peaks.cpu)})")
    else:
        for tier, name in (("gpu", "GPU memory"), ("cpu", "RAM")):
            cap = budgets.cap(tier)
            if cap is not None and getattr(peaks, tier) > cap:
                _refuse(tier, name, getattr(peaks, tier), budgets, where)
    if budgets.disk is not None and peaks.disk > budgets.disk:
        _refuse("disk", "disk", peaks.disk, budgets, where)


def _refuse(tier: str, name: str, peak: int, budgets: Budgets, where: str, detail: str = "") -> None:
    cap = budgets.cap(tier)
    assert cap is not None
    if tier in budgets.given:
        limit = f"{FLAGS[tier]} {format_bytes(cap)}"
    elif tier == "disk":
        limit = f"the {format_bytes(cap)} free in the offload directory"
    elif tier == "gpu":
        limit = f"the {format_bytes(cap)} free on the GPU"
    else:
        limit = f"the {format_bytes(cap)} of RAM this process may use ({budgets.source})"
    hint = HINTS["cpu" if budgets.pooled and tier != "disk" else tier]
    raise MemoryBudgetError(f"predicted {name} peak {format_bytes(peak)}{detail}{where} exceeds {limit}: "
                            f"{hint}, or use --policy auto")


def fits(peaks: Peaks, budgets: Budgets) -> bool:
    try:
        check_budgets(peaks, budgets)
    except MemoryBudgetError:
        return False
    return True
