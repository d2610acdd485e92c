"""The linear-attention layers' states of one block, placed by whole layers across tiers.

A linear-attention layer (the gated delta rule) keeps no KV cache: per sequence it keeps the
convolution's last inputs (the model's dtype) and the rule's state (float32), a fixed size
however long the sequence (Qwen3-Next-80B: 2 MiB a sequence and layer, 72 MiB a sequence over
its 36 linear layers). They are placed by the policy's own state fractions
(``Policy.state_gpu_percent``/``state_cpu_percent``, ``--state-percent``), by whole layers in
layer order (``split_rows`` over the layers): the first layers' states stay on the compute
device, the next live in host RAM, the rest on disk. Not by the cache's fractions: with CPU
attention the KV cache in RAM costs only q and the output crossing the link, while a state in
RAM crosses it whole twice a step, so a plan wants the two in different places.

A layer whose states live elsewhere is *staged*: before the first GPU batch of a block
computes it in a sweep, the rows of the batches that sweep runs come to one buffer on the
compute device (none read for a prefill, which starts from zeros), the layer updates them in
place, and after the sweep's last batch they go back. The engine issues both on the
schedule's cache steps, so they overlap the neighbouring layer's compute as the KV cache's
transfers do. A block stages at most three layers at once (the one being computed, the next
one loading, the last one storing), which the footprint counts.

On a CPU device host RAM *is* the compute device: a layer placed in RAM is used in place there
(nothing to stage), and only the disk's layers move.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..interrupts import submit
from ..memory.disk import DiskStore
from ..memory.tiers import MemoryTracker, Tier, copy_between, host_empty
from .cache_layout import split_rows

# layers of one block staged on the compute device at once: computing, loading, storing
STAGED_LAYERS = 3


def state_tiers(layers: list[int], fractions: tuple[float, float, float]) -> dict[int, Tier]:
    """Where each linear layer's states live: whole layers by the state fractions, in order."""
    out = {}
    for tier, a, b in split_rows(len(layers), fractions):
        for j in layers[a:b]:
            out[j] = tier
    return out


def staged(tier: Tier, cuda: bool) -> bool:
    """Whether states on ``tier`` come to the compute device to be used: off it, except host
    RAM on a CPU device (the same memory)."""
    return tier == Tier.DISK or (tier == Tier.CPU and cuda)


class StateStore:
    """Every linear layer's states for the ``rows`` sequences of one block (GPU batches in
    order). ``conv_shape``/``ssm_shape``: one sequence's, without the row dimension."""

    def __init__(self, layers: list[int], rows: int, conv_shape: tuple[int, ...], ssm_shape: tuple[int, ...],
                 fractions: tuple[float, float, float], device: torch.device, dtype: torch.dtype,
                 tracker: MemoryTracker, disk: DiskStore | None, pool: ThreadPoolExecutor | None,
                 tag: str = "") -> None:
        self.device, self.tracker, self.pool = device, tracker, pool
        self.parts = (conv_shape, dtype), (ssm_shape, torch.float32)  # one sequence's (shape, dtype)
        self.tiers = state_tiers(layers, fractions)
        self.home: dict[int, tuple[Any, Any]] = {}  # layer -> (conv, ssm) where they live
        self.live: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # staged: (first row, conv, ssm)
        self._bytes: list[tuple[Tier, int]] = []
        cuda = device.type == "cuda"
        if any(t == Tier.DISK for t in self.tiers.values()) and disk is None:
            raise RuntimeError("linear-attention states on disk need an offload directory (--offload-dir)")
        for j, tier in self.tiers.items():
            parts = []
            for (shape, dt), what in zip(self.parts, ("conv", "ssm")):
                if tier == Tier.DISK:
                    x: Any = disk.allocate(f"state{tag}-l{j}-{what}", (rows, *shape), dt)  # type: ignore[union-attr]
                elif tier == Tier.CPU:
                    x = host_empty((rows, *shape), dt, device)
                else:
                    x = torch.empty((rows, *shape), dtype=dt, device=device)
                parts.append(x)
                self._add(tier, x.nbytes)
            self.home[j] = (parts[0], parts[1])
        self._staged = {j for j, t in self.tiers.items() if staged(t, cuda)}
        self._disk = disk

    def _add(self, tier: Tier, n: int) -> None:
        self.tracker.add(tier, n)
        self._bytes.append((tier, n))

    def is_staged(self, j: int) -> bool:
        return j in self._staged

    def load(self, j: int, a: int, b: int, read: bool) -> list[Future]:
        """Stage rows [a, b) of layer j on the compute device (``read``: with their contents;
        a prefill writes them before reading). Returns the reads still in flight."""
        if j not in self._staged:
            return []
        conv, ssm = (torch.empty((b - a, *shape), dtype=dt, device=self.device) for shape, dt in self.parts)
        self.tracker.add(Tier.GPU, conv.nbytes + ssm.nbytes)
        self.live[j] = (a, conv, ssm)
        if not read:
            return []
        return self._move(j, (conv, ssm), self.home[j], None, (a, b))

    def store(self, j: int) -> list[Future]:
        """Put layer j's staged rows back where they live and let go of the buffers. Returns the
        writes still in flight (each holds its buffers until done)."""
        got = self.live.pop(j, None)
        if got is None:
            return []
        a, conv, ssm = got
        self.tracker.sub(Tier.GPU, conv.nbytes + ssm.nbytes)
        return self._move(j, self.home[j], (conv, ssm), (a, a + conv.shape[0]), None)

    def _move(self, j: int, dsts: tuple[Any, Any], srcs: tuple[Any, Any], dst_rows: tuple[int, int] | None,
              src_rows: tuple[int, int] | None) -> list[Future]:
        """Copy layer j's states between where they live and the compute device: from pinned
        RAM asynchronously on the stream, to or from disk on an I/O thread (its future)."""
        if self.tiers[j] == Tier.CPU:
            _copy(dsts, srcs, dst_rows, src_rows, non_blocking=True)
            return []
        return [submit(self.pool, _copy, dsts, srcs, dst_rows, src_rows)]  # type: ignore[arg-type]

    def views(self, j: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(conv, ssm, the block row of their first row) of layer j on the compute device."""
        if j in self.live:
            a, conv, ssm = self.live[j]
            return conv, ssm, a
        if j in self._staged:
            raise RuntimeError(f"layer {j}'s states were not staged before its compute")
        conv, ssm = self.home[j]
        return conv, ssm, 0

    def free(self) -> None:
        for a, conv, ssm in self.live.values():
            self.tracker.sub(Tier.GPU, conv.nbytes + ssm.nbytes)
        self.live.clear()
        for tier, n in self._bytes:
            self.tracker.sub(tier, n)
        self._bytes.clear()
        for conv, ssm in self.home.values():
            for x in (conv, ssm):
                if not isinstance(x, torch.Tensor) and self._disk is not None:
                    self._disk.free(x)
        self.home.clear()


def _copy(dsts: tuple[Any, Any], srcs: tuple[Any, Any], dst_rows: tuple[int, int] | None,
          src_rows: tuple[int, int] | None, non_blocking: bool = False) -> None:
    for dst, src in zip(dsts, srcs):
        copy_between(dst, src, dst_rows=dst_rows, src_rows=src_rows, non_blocking=non_blocking)
