"""Who am I in the pipeline, and the one object that holds the process group.

`detect_topology` reads the launcher's environment (torchrun, OpenMPI's mpirun, Slurm's srun,
or nothing) into a frozen `Topology`; `DistContext.init` turns it into a process group. The
rest of the package receives the `DistContext` as an argument: nothing here is global except
the logging configuration that `setup_rank_logging` installs.

Run as a module to expand a Slurm host list without `scontrol` (used by slurm/run.sbatch):
    python -m flexgen_dist.distributed.topology --first "node[01-03,07],other"   ->  node01
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import random
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import torch
import torch.distributed as dist

DEFAULT_MASTER_PORT = 29500
LAUNCHERS = ("torchrun", "mpirun", "slurm", "single")
LOGGER_NAME = "flexgen_dist"


@dataclass(frozen=True)
class Topology:
    """This process's place in the pipeline: stage `rank` of `world_size`."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" | "mpirun" | "slurm" | "single"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, world_size={self.world_size}), got {self.rank}; "
                "check the launcher's rank variables (RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID)"
            )
        if not 0 <= self.local_rank < self.world_size:
            raise ValueError(
                f"local_rank must be in [0, world_size={self.world_size}), got {self.local_rank}"
            )
        if not self.master_addr:
            raise ValueError("master_addr is empty; set MASTER_ADDR to the address of rank 0")
        if not 0 < self.master_port < 65535:
            raise ValueError(
                f"master_port must be in [1, 65534] (the failure monitor uses port + 1), "
                f"got {self.master_port}; set MASTER_PORT"
            )
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        if self.launcher == "single" and self.world_size != 1:
            raise ValueError(f"launcher 'single' means world_size 1, got {self.world_size}")

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last else self.rank + 1


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list: "node[01-03,07],gpu[1-2]-ib,other" -> node01 node02 ...

    Handles several bracket groups per name (cartesian product, in Slurm's order) and keeps
    zero padding. Does not handle nested brackets, which Slurm never produces.
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(hostlist.strip()):
        if not item:
            continue
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices: list[list[str]] = []
        for piece in pieces:
            if piece.startswith("["):
                if not piece.endswith("]"):
                    raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
                choices.append(_expand_range(piece[1:-1], hostlist))
            elif "[" in piece or "]" in piece:
                raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
            else:
                choices.append([piece])
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    items.append(text[start:])
    return items


def _expand_range(spec: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"bad range {part!r} in host list {hostlist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in host list {hostlist!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _int_env(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise ValueError(f"environment variable {name} is not set (the launcher sets it)")
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def detect_topology(
    env: Mapping[str, str] | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> Topology:
    """Read rank, world size and master from the launcher's environment.

    Precedence torchrun > mpirun > slurm > single: srun inside sbatch sets SLURM_* and a
    torchrun started by srun also sets RANK, so the innermost launcher wins. Explicit
    `master_addr`/`master_port` arguments beat MASTER_ADDR/MASTER_PORT, which beat defaults.
    """
    env = os.environ if env is None else env
    if master_port is None:
        master_port = _int_env(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
    port = DEFAULT_MASTER_PORT if master_port is None else master_port
    addr = master_addr or env.get("MASTER_ADDR") or None

    if "RANK" in env and "WORLD_SIZE" in env:
        launcher, rank, world = "torchrun", _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local = _int_env(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "mpirun"
        rank, world = _int_env(env, "OMPI_COMM_WORLD_RANK"), _int_env(env, "OMPI_COMM_WORLD_SIZE")
        local = _int_env(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else 0
        if addr is None and world > 1:
            raise ValueError(
                "mpirun gives no master address: export MASTER_ADDR (the host of rank 0) and "
                "pass it with `mpirun -x MASTER_ADDR -x MASTER_PORT`, or pass master_addr"
            )
    elif "SLURM_PROCID" in env and not _in_slurm_batch_shell(env):
        launcher, rank = "slurm", _int_env(env, "SLURM_PROCID")
        # SLURM_STEP_NUM_TASKS is this srun step's size; SLURM_NTASKS is the allocation's.
        world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        world = _int_env(env, world_var) if world_var in env else 1
        local = _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        if addr is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
            hosts = expand_hostlist(nodelist) if nodelist else []
            if not hosts and world > 1:
                raise ValueError("Slurm gives no SLURM_JOB_NODELIST: set MASTER_ADDR")
            addr = hosts[0] if hosts else None
    else:
        launcher, rank, world, local = "single", 0, 1, 0
    return Topology(rank, world, local, addr or "127.0.0.1", port, launcher)


def _in_slurm_batch_shell(env: Mapping[str, str]) -> bool:
    """True in an sbatch script itself (not an srun task): one process, although Slurm sets
    SLURM_PROCID=0 and SLURM_NTASKS to the allocation's size there. Only srun sets a step id."""
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env


def cuda_device_for(local_rank: int) -> torch.device:
    """The one rule for a rank's accelerator: the node-local rank, modulo the visible devices
    (more ranks than GPUs on a node share them round-robin)."""
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


class DistContext:
    """One per process: topology, compute device, backend, timeout and the process group.

    World size 1 creates no process group; communication helpers then do nothing (or loop back
    to themselves), so one stage and many stages run the same code.
    """

    def __init__(self, topology: Topology, device: torch.device, backend: str, timeout_s: float):
        self.topology = topology
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        self._owns_group = False

    @classmethod
    def init(
        cls,
        topology: Topology,
        device_kind: str = "cpu",
        backend: str | None = None,
        timeout_s: float = 120.0,
    ) -> DistContext:
        if device_kind not in ("cpu", "cuda"):
            raise ValueError(f"device_kind must be 'cpu' or 'cuda', got {device_kind!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if device_kind == "cuda":
            device = cuda_device_for(topology.local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        backend = backend or ("nccl" if device_kind == "cuda" else "gloo")
        if backend == "nccl" and device_kind != "cuda":
            raise ValueError("backend 'nccl' needs device_kind 'cuda'; use 'gloo' on CPU")
        ctx = cls(topology, device, backend, float(timeout_s))
        if topology.world_size > 1:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{topology.master_addr}:{topology.master_port}",
                rank=topology.rank,
                world_size=topology.world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            ctx._owns_group = True
        logging.getLogger(LOGGER_NAME).info(
            "rank %d/%d (local %d, %s) device=%s backend=%s master=%s:%d",
            topology.rank, topology.world_size, topology.local_rank, topology.launcher,
            device, backend, topology.master_addr, topology.master_port,
        )
        return ctx

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def wire_device(self) -> torch.device:
        """Where tensors must be to go through the backend: gloo moves CPU tensors only."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if self._owns_group:
            dist.barrier()

    def close(self) -> None:
        """Destroy the process group; safe to call twice."""
        if self._owns_group:
            self._owns_group = False
            if dist.is_initialized():
                dist.destroy_process_group()

    def __enter__(self) -> DistContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"DistContext(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"backend={self.backend!r}, timeout_s={self.timeout_s})"
        )


def _env_rank(env: Mapping[str, str]) -> int:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


def print0(*args: object, ctx: DistContext | None = None, **kw: object) -> None:
    """print() on rank 0 only (rank from ctx, else from the launcher's environment)."""
    rank = ctx.rank if ctx is not None else _env_rank(os.environ)
    if rank == 0:
        print(*args, **kw)  # type: ignore[call-overload]


def rank_log_path(dir: str | Path, rank: int) -> Path:
    return Path(dir) / f"rank{rank}.log"


def setup_rank_logging(dir: str | Path, rank: int, level: int = logging.INFO) -> Path:
    """Send the "flexgen_dist" logger to dir/rank{rank}.log (replacing an earlier rank file)."""
    path = rank_log_path(dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(LOGGER_NAME)
    for h in list(logger.handlers):
        if getattr(h, "_flexgen_rank_log", False):
            logger.removeHandler(h)
            h.close()
    handler = logging.FileHandler(path)
    handler._flexgen_rank_log = True  # type: ignore[attr-defined]
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Expand a Slurm host list, one host per line.")
    parser.add_argument("hostlist", help='e.g. "node[01-03,07],other"')
    parser.add_argument("--first", action="store_true", help="print only the first host")
    args = parser.parse_args(argv)
    hosts = expand_hostlist(args.hostlist)
    if not hosts:
        print(f"empty host list {args.hostlist!r}", file=sys.stderr)
        return 1
    print("\n".join(hosts[:1] if args.first else hosts))
    return 0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(pair: bool = False) -> int:
    """A free TCP port on loopback for a rendezvous (tests, the scaling benchmark; with ``pair``,
    p and p + 1 both free: the failure monitor listens on MASTER_PORT + 1).

    Drawn below the kernel's ephemeral range: a port handed out by ``bind(0)`` lies inside it,
    where any process's next outgoing connection (gloo opens many) may take it, or its
    neighbour, before the test's rank binds it.
    """
    high = min(_ephemeral_low(), 65535) - 2
    for _ in range(200):
        port = random.randint(20000, max(20001, high))
        try:
            for p in (port, port + 1) if pair else (port,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


if __name__ == "__main__":
    sys.exit(main())
