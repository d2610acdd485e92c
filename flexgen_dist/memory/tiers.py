"""Memory tiers, byte budgets and peak accounting, and the one tier-to-tier copy function.

Three tiers: ``gpu`` (the compute device, which is the CPU itself on a CPU-only machine),
``cpu`` (host RAM) and ``disk`` (files of a :class:`~flexgen_dist.memory.disk.DiskStore`).
Every move of bytes between tiers in the project goes through :func:`copy_between`; every
count of bytes per tier goes through a :class:`MemoryTracker`.
"""
from __future__ import annotations

import enum
import threading
from typing import Union

import torch

from flexgen_dist.memory.disk import DiskTensor, aligned_empty
from flexgen_dist.memory.quant import QTensor

Movable = Union[torch.Tensor, DiskTensor, QTensor]


class Tier(str, enum.Enum):
    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


class MemoryBudgetError(RuntimeError):
    """A predicted or measured peak does not fit a tier's budget."""


class MemoryTracker:
    """Thread-safe current/peak bytes per tier.

    Callers ``add`` when they allocate on a tier and ``sub`` when they free (the compute
    thread and the I/O threads both do); this is the one place bytes per tier are counted,
    and ``peak_bytes()`` is what the metrics report. Budgets are checked before the run, on
    predicted peaks (``engine/footprint.py``), not here.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current = {t: 0 for t in Tier}
        self._peak = {t: 0 for t in Tier}

    def add(self, tier: Tier | str, nbytes: int) -> None:
        tier, nbytes = Tier(tier), int(nbytes)
        if nbytes < 0:
            raise ValueError(f"add({tier.value}, {nbytes}): bytes must be >= 0; use sub()")
        with self._lock:
            self._current[tier] += nbytes
            self._peak[tier] = max(self._peak[tier], self._current[tier])

    def sub(self, tier: Tier | str, nbytes: int) -> None:
        tier, nbytes = Tier(tier), int(nbytes)
        with self._lock:
            if nbytes < 0 or nbytes > self._current[tier]:
                raise ValueError(
                    f"sub({tier.value}, {nbytes}) with {self._current[tier]} bytes counted: "
                    f"frees must match earlier add() calls")
            self._current[tier] -= nbytes

    def peak_bytes(self) -> dict[str, int]:
        """Peaks keyed ``"gpu"``, ``"cpu"``, ``"disk"`` (for the metrics JSON)."""
        with self._lock:
            return {t.value: self._peak[t] for t in Tier}


def tensor_nbytes(x: Movable) -> int:
    """Bytes held by a torch.Tensor (its elements), a DiskTensor or a QTensor."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (DiskTensor, QTensor)):
        return int(x.nbytes)
    raise TypeError(f"tensor_nbytes: unsupported type {type(x).__name__}")


def host_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str,
               zero: bool = False) -> torch.Tensor:
    """A new CPU tensor (uninitialised, or ``zero``-filled), pinned when ``device`` is CUDA for
    fast asynchronous copies: allocated pinned (the caching host allocator reuses freed blocks),
    where ``pin_if_cuda`` of a fresh tensor would allocate twice and copy it whole."""
    pin = torch.device(device).type == "cuda"
    return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, pin_memory=pin)


def pin_if_cuda(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A pinned copy of CPU tensor ``t`` when ``device`` is CUDA (fast async H2D), else ``t``."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        return t.pin_memory()
    return t


def _row_shape(shape: torch.Size, rows: tuple[int, int] | None, what: str) -> torch.Size:
    if rows is None:
        return shape
    r0, r1 = rows
    if len(shape) == 0 or not 0 <= r0 <= r1 <= shape[0]:
        raise ValueError(f"{what} rows {rows} out of range for shape {tuple(shape)}")
    return torch.Size((r1 - r0,)) + shape[1:]


def _rows_of(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0]:rows[1]]


def copy_between(dst: Movable, src: Movable, *, dst_rows: tuple[int, int] | None = None,
                 src_rows: tuple[int, int] | None = None, non_blocking: bool = False) -> None:
    """Copy ``src`` (or its rows ``src_rows`` along dim 0) into ``dst`` (or ``dst_rows``).

    Each side is a torch.Tensor on any device, a DiskTensor, or a QTensor (then both are,
    with equal layout, and the rows index dim 0 of its parts; see quant.py). Shapes after
    row selection must match exactly; dtypes too for disk. ``non_blocking`` applies to
    device copies only: disk I/O here is synchronous (use ``DiskStore.submit_*`` for async).
    Device <-> disk goes through a 4096-aligned CPU staging buffer, pinned on CUDA.
    """
    if isinstance(dst, QTensor) or isinstance(src, QTensor):
        _copy_qtensor(dst, src, dst_rows, src_rows, non_blocking)
        return
    for side, x in (("dst", dst), ("src", src)):
        if not isinstance(x, (torch.Tensor, DiskTensor)):
            raise TypeError(f"copy_between: {side} is a {type(x).__name__}, "
                            f"expected torch.Tensor, DiskTensor or QTensor")
    dshape = _row_shape(torch.Size(dst.shape), dst_rows, "dst")
    sshape = _row_shape(torch.Size(src.shape), src_rows, "src")
    if dshape != sshape:
        raise ValueError(f"copy_between: dst {tuple(dshape)} and src {tuple(sshape)} "
                         f"shapes differ")

    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        _rows_of(dst, dst_rows).copy_(_rows_of(src, src_rows), non_blocking=non_blocking)
    elif isinstance(src, DiskTensor) and isinstance(dst, torch.Tensor):
        view = _rows_of(dst, dst_rows)
        if view.device.type == "cpu":
            src.read(out=view, rows=src_rows)
        else:
            staging = aligned_empty(sshape, src.dtype, pin=view.device.type == "cuda",
                                    offset=src.byte_range(src_rows)[0])
            src.read(out=staging, rows=src_rows)
            # Safe to drop `staging` after an async copy: the pinned allocator keeps the
            # block until the copy's stream event completes.
            view.copy_(staging, non_blocking=non_blocking)
    elif isinstance(dst, DiskTensor) and isinstance(src, torch.Tensor):
        view = _rows_of(src, src_rows)
        if view.device.type != "cpu":
            staging = aligned_empty(sshape, view.dtype, pin=view.device.type == "cuda",
                                    offset=dst.byte_range(dst_rows)[0])
            staging.copy_(view)  # blocking: the bytes must be on the host before write()
            view = staging
        dst.write(view, rows=dst_rows)
    else:  # disk -> disk
        dst.write(src.read(rows=src_rows), rows=dst_rows)


def _copy_qtensor(dst: Movable, src: Movable, dst_rows: tuple[int, int] | None,
                  src_rows: tuple[int, int] | None, non_blocking: bool) -> None:
    if not (isinstance(dst, QTensor) and isinstance(src, QTensor)):
        raise TypeError("copy_between: a QTensor can only be copied into a QTensor; "
                        "quantize()/dequantize() explicitly to change representation")
    if (dst.bits, dst.group_size, dst.dim, dst.dtype, dst.fmt) != (src.bits, src.group_size, src.dim,
                                                                   src.dtype, src.fmt):
        raise ValueError(
            f"copy_between: QTensor layouts differ (bits, group_size, dim, dtype, format): "
            f"dst {(dst.bits, dst.group_size, dst.dim, dst.dtype, dst.fmt)} vs "
            f"src {(src.bits, src.group_size, src.dim, src.dtype, src.fmt)}")
    if (dst_rows is not None or src_rows is not None) and src.dim == 0:
        raise ValueError("copy_between: row ranges on a QTensor grouped along dim 0 would "
                         "cut through groups; quantize along another dim to copy rows")
    for d, s in zip(dst.parts(), src.parts()):
        copy_between(d, s, dst_rows=dst_rows, src_rows=src_rows, non_blocking=non_blocking)
