"""The KV cache of one stage for one block: preallocated, split by rows across tiers.

For each (layer, GPU batch) the cache has R = batch * kv_heads rows. The first rows go to the
compute device, the next to CPU RAM, the rest to disk, by the policy's cache fractions.
In RAM and on the device a chunk is K, V of shape (rows, max_len, head_dim), row-major so
attention reads each row contiguously. On disk it is position-major (max_len, rows, head_dim)
so that a prefill writes one contiguous range, each decode step appends one contiguous slab,
and a read of the first L positions is one sequential read.

Decode attention on a chunk that is not on the compute device runs on the CPU when
``cpu_attention`` is on (q goes to the cache); otherwise the chunk is copied to the device.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..memory.disk import DiskStore, DiskTensor
from ..memory.tiers import MemoryTracker, Tier, copy_between, pin_if_cuda
from .attention import attend_rows, merge_partial


def split_rows(rows: int, fractions: tuple[float, float, float]) -> list[tuple[Tier, int, int]]:
    """[(tier, r0, r1)] for the non-empty tiers, in gpu, cpu, disk order."""
    g, c, _ = fractions
    n_g = int(round(rows * g))
    n_c = min(rows - n_g, int(round(rows * (g + c))) - n_g)
    bounds = [(Tier.GPU, 0, n_g), (Tier.CPU, n_g, n_g + n_c), (Tier.DISK, n_g + n_c, rows)]
    return [(t, a, b) for t, a, b in bounds if b > a]


@dataclass
class Chunk:
    tier: Tier
    r0: int
    r1: int
    k: Any  # torch.Tensor (rows, L, d) or DiskTensor (L, rows, d)
    v: Any
    staged: tuple[torch.Tensor, torch.Tensor] | None = None  # disk: positions [0, p] in RAM
    pending: tuple[int, torch.Tensor, torch.Tensor] | None = None  # disk: (pos0, k, v) to write
    futures: list[Future] = field(default_factory=list)


class BlockCache:
    """KV cache of every (layer, GPU batch) of one block on one stage."""

    def __init__(self, layers: list[int], batch_sizes: list[int], kv_heads: int, max_len: int,
                 head_dim: int, fractions: tuple[float, float, float], device: torch.device,
                 dtype: torch.dtype, tracker: MemoryTracker, disk: DiskStore | None,
                 cpu_attention: bool, tag: str = "") -> None:
        self.device, self.dtype, self.tracker = device, dtype, tracker
        self.max_len, self.head_dim, self.kv_heads = max_len, head_dim, kv_heads
        self.cpu_attention = cpu_attention
        self._disk_store = disk
        self.chunks: dict[tuple[int, int], list[Chunk]] = {}
        self._bytes: list[tuple[Tier, int]] = []
        for j in layers:
            for kb, b in enumerate(batch_sizes):
                parts = []
                for tier, r0, r1 in split_rows(b * kv_heads, fractions):
                    parts.append(self._alloc(tier, r0, r1, f"kv{tag}-l{j}-b{kb}"))
                self.chunks[(j, kb)] = parts

    def _alloc(self, tier: Tier, r0: int, r1: int, name: str) -> Chunk:
        n = r1 - r0
        if tier == Tier.DISK:
            shape = (self.max_len, n, self.head_dim)
            k = _disk(name + "-k", shape, self.dtype, self)
            v = _disk(name + "-v", shape, self.dtype, self)
            nbytes = k.nbytes + v.nbytes
        else:
            dev = self.device if tier == Tier.GPU else torch.device("cpu")
            # never read before written: prefill fills [0, s), each decode step its position
            k = torch.empty((n, self.max_len, self.head_dim), dtype=self.dtype, device=dev)
            v = torch.empty_like(k)
            if tier == Tier.CPU:
                k, v = pin_if_cuda(k, self.device), pin_if_cuda(v, self.device)
            nbytes = 2 * k.nbytes
        self.tracker.add(tier, nbytes)
        self._bytes.append((tier, nbytes))
        return Chunk(tier, r0, r1, k, v)

    def free(self) -> None:
        for tier, n in self._bytes:
            self.tracker.sub(tier, n)
        self._bytes.clear()
        for parts in self.chunks.values():
            for ch in parts:
                for f in ch.futures:
                    f.cancel()
                if ch.tier == Tier.DISK and self._disk_store is not None:
                    self._disk_store.free(ch.k)
                    self._disk_store.free(ch.v)
        self.chunks.clear()

    # --- overlapped I/O steps ----------------------------------------------------------
    def load(self, j: int, kb: int, length: int) -> None:
        """Prefetch: read the first ``length`` positions of disk chunks into RAM (async)."""
        for ch in self.chunks.get((j, kb), []):
            if ch.tier != Tier.DISK or length == 0:
                continue
            n = ch.r1 - ch.r0
            kbuf = torch.empty((length + 1, n, self.head_dim), dtype=self.dtype)
            vbuf = torch.empty_like(kbuf)
            self.tracker.add(Tier.CPU, 2 * kbuf.nbytes)
            ch.staged = (kbuf, vbuf)
            store = ch.k.store
            ch.futures = [store.submit_read(ch.k, out=kbuf[:length], rows=(0, length)),
                          store.submit_read(ch.v, out=vbuf[:length], rows=(0, length))]

    def store(self, j: int, kb: int) -> list[Future]:
        """Write what compute produced for disk chunks (async); returns the futures."""
        futs: list[Future] = []
        for ch in self.chunks.get((j, kb), []):
            if ch.pending is None:
                continue
            pos0, kk, vv = ch.pending
            ch.pending = None
            rows = (pos0, pos0 + kk.shape[0])
            futs.append(ch.k.store.submit_write(ch.k, kk, rows=rows))
            futs.append(ch.v.store.submit_write(ch.v, vv, rows=rows))
            if ch.staged is not None:
                self.tracker.sub(Tier.CPU, 2 * ch.staged[0].nbytes)
                ch.staged = None
        return futs

    # --- compute ------------------------------------------------------------------------
    def write_prefill(self, j: int, kb: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Store the prompt's k/v rows (rows, s, d) into each chunk at positions [0, s)."""
        s = k_new.shape[1]
        for ch in self.chunks[(j, kb)]:
            kn, vn = k_new[ch.r0:ch.r1], v_new[ch.r0:ch.r1]
            if ch.tier == Tier.DISK:
                ch.pending = (0, kn.transpose(0, 1).contiguous().cpu(), vn.transpose(0, 1).contiguous().cpu())
            else:
                copy_between(ch.k[:, :s], kn, non_blocking=True)
                copy_between(ch.v[:, :s], vn, non_blocking=True)

    def attend(self, j: int, kb: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               mask: torch.Tensor, pos0: int, sparsity: float = 1.0) -> torch.Tensor:
        """Decode: write k_new/v_new (rows, 1, d) at pos0 and attend over [0, pos0].

        q (rows, G, 1, d), mask (rows, 1, 1, L). Each chunk is attended where it lives.
        """
        length = pos0 + k_new.shape[1]
        outs = []
        for ch in self.chunks[(j, kb)]:
            kn, vn = k_new[ch.r0:ch.r1], v_new[ch.r0:ch.r1]
            m = mask[ch.r0:ch.r1]
            if ch.tier == Tier.DISK:
                for f in ch.futures:
                    f.result()
                ch.futures = []
                kbuf, vbuf = ch.staged  # type: ignore[misc]
                kbuf[pos0:length].copy_(kn.transpose(0, 1))
                vbuf[pos0:length].copy_(vn.transpose(0, 1))
                ch.pending = (pos0, kbuf[pos0:length], vbuf[pos0:length])
                kc, vc = kbuf[:length].transpose(0, 1), vbuf[:length].transpose(0, 1)
            else:
                copy_between(ch.k[:, pos0:length], kn, non_blocking=True)
                copy_between(ch.v[:, pos0:length], vn, non_blocking=True)
                kc, vc = ch.k[:, :length], ch.v[:, :length]
            if ch.tier == Tier.GPU or kc.device == self.device:
                outs.append((ch.r0, ch.r1, attend_rows(q[ch.r0:ch.r1], kc, vc, m, sparsity)))
            elif self.cpu_attention:  # move q (small) to the cache instead of the cache to q
                o = attend_rows(q[ch.r0:ch.r1].to("cpu"), kc, vc, m.to("cpu"), sparsity)
                outs.append((ch.r0, ch.r1, o))
            else:
                kd, vd = kc.to(self.device, non_blocking=True), vc.to(self.device, non_blocking=True)
                outs.append((ch.r0, ch.r1, attend_rows(q[ch.r0:ch.r1], kd, vd, m, sparsity)))
        return merge_partial(outs, q.shape[0], self.device)


def _disk(name: str, shape: tuple[int, ...], dtype: torch.dtype, cache: BlockCache) -> DiskTensor:
    store: DiskStore | None = getattr(cache, "_disk_store", None)
    if store is None:
        raise RuntimeError("cache on disk needs an offload directory (--offload-dir)")
    return store.allocate(name, shape, dtype)
