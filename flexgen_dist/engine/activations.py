"""Hidden states between slots, per GPU batch, split by rows across tiers.

After a slot computes batch k, ``store`` moves the batch's hidden states to their tiers
(rows of the batch by the policy's activation fractions); before the next slot, ``load``
brings them back to the compute device. With everything on the compute device both are no-ops.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from ..memory.disk import DiskStore
from ..memory.tiers import MemoryTracker, Tier, copy_between, host_empty
from .cache_layout import split_rows


class ActStore:
    def __init__(self, batch_sizes: list[int], row_elems: int, fractions: tuple[float, float, float],
                 device: torch.device, dtype: torch.dtype, tracker: MemoryTracker,
                 disk: DiskStore | None, tag: str = "") -> None:
        self.device, self.dtype, self.tracker, self.disk = device, dtype, tracker, disk
        self.fractions, self.sizes = fractions, batch_sizes
        self.splits = [split_rows(b, fractions) for b in batch_sizes]
        self.on_device = all(len(sp) == 1 and sp[0][0] == Tier.GPU for sp in self.splits)
        self.cur: list[Any] = [None] * len(batch_sizes)  # device tensor or Future of one
        self.stored: list[Any] = [None] * len(batch_sizes)  # (shape, [(tier, r0, r1, data)])
        self._files: dict[int, Any] = {}
        if not self.on_device and any(t == Tier.DISK for sp in self.splits for t, _, _ in sp):
            if disk is None:
                raise RuntimeError("activations on disk need an offload directory (--offload-dir)")
            for k, sp in enumerate(self.splits):
                for t, r0, r1 in sp:
                    if t == Tier.DISK:
                        self._files[k] = disk.allocate(f"act{tag}-b{k}", ((r1 - r0) * row_elems,), dtype)
                        tracker.add(Tier.DISK, self._files[k].nbytes)
        self._held = [0] * len(batch_sizes)
        self._writing: list[Future | None] = [None] * len(batch_sizes)

    def set_inputs(self, xs: list[torch.Tensor], ks: range | None = None) -> None:
        """The inputs of GPU batches ``ks`` (default: every batch) for the next token."""
        for k, x in zip(range(len(xs)) if ks is None else ks, xs):
            self.cur[k] = x
            self.stored[k] = None

    def get(self, k: int) -> torch.Tensor:
        x = self.cur[k]
        if isinstance(x, Future):
            x = self.cur[k] = x.result()
        return x

    def put(self, k: int, y: torch.Tensor) -> None:
        self.cur[k] = y

    def store(self, k: int) -> list[Future]:
        if self.on_device or self.cur[k] is None:
            return []
        y = self.get(k)
        parts, futs = [], []
        # a prefill computing a batch's repeated prompts once holds fewer rows (``twins.py``);
        # their tiers' shares are no larger than the whole batch's (a disk file holds them)
        splits = self.splits[k] if y.shape[0] == self.sizes[k] else split_rows(y.shape[0], self.fractions)
        for tier, r0, r1 in splits:
            rows = y[r0:r1]
            if tier == Tier.GPU:
                data: Any = rows
            elif tier == Tier.CPU:
                data = host_empty(rows.shape, rows.dtype, self.device)
                copy_between(data, rows, non_blocking=True)
                self._account(k, Tier.CPU, data.nbytes)
            else:
                flat = rows.reshape(-1)
                data = self._files[k]
                w = self.disk.submit_write(data, flat.cpu(), rows=(0, flat.numel()))  # type: ignore[union-attr]
                self._writing[k] = w
                futs.append(w)
            parts.append((tier, r0, r1, data))
        self.stored[k] = (tuple(y.shape), y.dtype, parts)
        self.cur[k] = None
        return futs

    def load(self, k: int) -> list[Future]:
        if self.stored[k] is None:
            return []
        shape, dtype, parts = self.stored[k]
        self.stored[k] = None
        out = torch.empty(shape, dtype=dtype, device=self.device)
        futs: list[Future] = []
        for tier, r0, r1, data in parts:
            if tier == Tier.DISK:
                n = (r1 - r0) * int(torch.Size(shape[1:]).numel())
                writing, self._writing[k] = self._writing[k], None
                if writing is not None:  # the store of this batch may still be in flight
                    writing.result()
                futs.append(self.disk.submit_read(data, out=None, rows=(0, n)))  # type: ignore[union-attr]
            else:
                copy_between(out[r0:r1], data, non_blocking=True)
        self._release(k)
        if futs:
            disk_part = [(r0, r1) for t, r0, r1, _ in parts if t == Tier.DISK][0]

            def finish(f: Future = futs[0]) -> torch.Tensor:
                r0, r1 = disk_part
                out[r0:r1].copy_(f.result().view(out[r0:r1].shape))
                return out

            fut: Future = Future()
            futs[0].add_done_callback(lambda _f: _complete(fut, finish))
            self.cur[k] = fut
            return [fut]
        self.cur[k] = out
        return []

    def _account(self, k: int, tier: Tier, n: int) -> None:
        self.tracker.add(tier, n)
        self._held[k] += n

    def _release(self, k: int) -> None:
        if self._held[k]:
            self.tracker.sub(Tier.CPU, self._held[k])
            self._held[k] = 0

    def free(self) -> None:
        for k in range(len(self._held)):
            self._release(k)
        for dt in self._files.values():
            self.tracker.sub(Tier.DISK, dt.nbytes)
            if self.disk is not None:
                self.disk.free(dt)
        self._files.clear()


def _complete(fut: Future, fn: Any) -> None:
    try:
        fut.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - surfaced to the waiting thread
        fut.set_exception(e)
