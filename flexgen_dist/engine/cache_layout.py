"""How a block's KV cache is laid out (``kvcache.BlockCache`` holds it): a GPU batch's rows
split over the tiers by fractions (``split_rows``), a chunk of rows and the slots it holds
(``Chunk``: every position, a sliding layer's ring, or the positions past a held prefix),
the bytes a position takes, compressed or not, and the helpers that read, write and reorder
what a chunk stores (a tensor in memory or on disk, or a ``QTensor`` of either) without
materialising more than they must."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..memory.quant import QTensor, dequantize, qtensor_layout
from ..memory.tiers import Tier


def split_rows(rows: int, fractions: tuple[float, float, float]) -> list[tuple[Tier, int, int]]:
    """[(tier, r0, r1)] for the non-empty tiers, in gpu, cpu, disk order."""
    g, c, _ = fractions
    n_g = int(round(rows * g))
    n_c = min(rows - n_g, int(round(rows * (g + c))) - n_g)
    bounds = [(Tier.GPU, 0, n_g), (Tier.CPU, n_g, n_g + n_c), (Tier.DISK, n_g + n_c, rows)]
    return [(t, a, b) for t, a, b in bounds if b > a]


def cache_group_size(head_dim: int, group_size: int) -> int:
    """The quantization group of the cache: at most head_dim (groups never span positions)."""
    return min(group_size, head_dim)


def cache_bytes_per_position(head_dim: int, dtype_bytes: int, compress: bool = False,
                             bits: int = 4, group_size: int = 64) -> int:
    """Bytes one row of K (or of V) stores per position, exactly as :class:`BlockCache` allocates."""
    if not compress:
        return head_dim * dtype_bytes
    data, meta = qtensor_layout((head_dim,), bits, cache_group_size(head_dim, group_size), -1)
    return data[-1] + 2 * meta[-1] * dtype_bytes  # packed codes + a min and a scale per group


Stored = Any  # torch.Tensor, DiskTensor, or a QTensor of either


@dataclass
class Chunk:
    tier: Tier
    r0: int
    r1: int
    k: Stored  # (rows, cap, d) in RAM / on device, (cap, rows, d) on disk; QTensor when compressed
    v: Stored  # k itself where the values are the keys (``BlockCache.shared``)
    cap: int  # positions held: the block's length, or a sliding layer's window (a ring)
    base: int = 0  # the first position held (a shared prefix held once, ``held.py``, is not)
    staged: tuple[Stored, Stored] | None = None  # disk: slots [0, p] in RAM
    pending: list[tuple[int, Stored, Stored]] = field(default_factory=list)  # disk: (slot0, k, v) to write
    futures: list[Future] = field(default_factory=list)

    def slot(self, pos: int) -> int:
        """Where position ``pos`` lives: itself (less ``base``), or its place in the ring of a
        sliding layer."""
        return (pos - self.base) % self.cap

    def held(self, length: int) -> int:
        """How many slots hold positions once [0, length) were written."""
        return max(0, min(length - self.base, self.cap))

    def landed(self) -> tuple[Stored, Stored]:
        """A disk chunk's staged K, V once its reads (``BlockCache.load``) have landed."""
        for f in self.futures:
            f.result()
        self.futures = []
        if self.staged is None:
            raise RuntimeError("a cache chunk on disk is read before it was loaded")
        return self.staged


def ring_pieces(s: int, cap: int) -> list[tuple[int, int, int]]:
    """Where a prompt of s positions goes in a cache of ``cap`` slots: [(first position, first
    slot, count)]. All of it when it fits; else its last ``cap`` positions, each at its ring
    slot (position % cap), in at most two contiguous pieces."""
    if s <= cap:
        return [(0, 0, s)]
    r = s % cap
    return [(p, slot, n) for p, slot, n in ((s - cap, r, cap - r), (s - r, 0, r)) if n]


def copy_rows(dst: torch.Tensor, src: torch.Tensor, r0: int, r1: int, non_blocking: bool = False) -> None:
    """``dst[:] = to_rows(src, r0, r1)`` without materialising the rows: src (b, t, kvh, d),
    dst a (r1 - r0, t, d) view (any strides). Whole sequences go in one strided copy; a chunk
    boundary that splits a sequence's kv heads adds at most two small ones."""
    kvh = src.shape[2]
    r = r0
    while r < r1:
        bi, h = divmod(r, kvh)
        if h == 0 and r1 - r >= kvh:
            nb = (r1 - r) // kvh
            dst[r - r0: r - r0 + nb * kvh].view(nb, kvh, *dst.shape[1:]).copy_(
                src[bi:bi + nb].transpose(1, 2), non_blocking=non_blocking)
            r += nb * kvh
        else:
            n = min(kvh - h, r1 - r)
            dst[r - r0: r - r0 + n].copy_(src[bi, :, h:h + n].transpose(0, 1), non_blocking=non_blocking)
            r += n


PERMUTE_BYTES = 8 << 20  # a cache reorder's temporary at most (slots are independent: moved a piece at a time)


def permute_rows(stored: tuple[Stored, ...], perm: torch.Tensor, n: int, pos_major: bool) -> None:
    """Row r of each tensor (each part of a compressed one) over its first ``n`` slots becomes
    row ``perm[r]``'s, in place (rows: dim 0, or dim 1 position-major)."""
    rows, slots = (1, 0) if pos_major else (0, 1)
    for x in stored:
        for part in parts(x):
            p = perm.to(part.device)
            per_slot = part.numel() // part.shape[slots] * part.element_size()
            step = max(1, PERMUTE_BYTES // max(1, per_slot))  # slots per piece: a bounded temporary
            for a in range(0, n, step):
                held = part.narrow(slots, a, min(step, n - a))
                held.copy_(held.index_select(rows, p))


def pairs(k: Stored, k_src: Any, v: Stored, v_src: Any) -> tuple[tuple[Stored, Any], ...]:
    """(K, what goes into it), and (V, its own) unless V is K (a shared cache: written once)."""
    return ((k, k_src),) if v is k else ((k, k_src), (v, v_src))


def each_kv(k: Any, v: Any, f: Any) -> tuple[Any, Any]:
    """(f(k), f(v)), with f applied once where V is K (a shared cache keeps V the same object)."""
    fk = f(k)
    return fk, fk if v is k else f(v)


def staged_nbytes(staged: tuple[Stored, Stored]) -> int:
    k, v = staged
    return int(k.nbytes + (0 if v is k else v.nbytes))


def parts(x: Stored) -> tuple[Any, ...]:
    return x.parts() if isinstance(x, QTensor) else (x,)


def positions(x: Stored, a: int, b: int, dim: int) -> Stored:
    """A view of positions [a, b) along leading dim ``dim`` of an in-memory tensor or QTensor."""
    if isinstance(x, QTensor):
        data, mins, scales = (p.narrow(dim, a, b - a) for p in x.parts())
        shape = list(x.shape)
        shape[dim] = b - a
        return replace(x, data=data, mins=mins, scales=scales, shape=torch.Size(shape))
    return x.narrow(dim, a, b - a)


def dense(x: Stored, device: torch.device, pos_major: bool) -> torch.Tensor:
    """Row-major (rows, L, d) K or V on ``device``, dequantized there when compressed."""
    x = dequantize(x, device) if isinstance(x, QTensor) else x.to(device, non_blocking=True)
    return x.transpose(0, 1) if pos_major else x


def host_copy(x: Stored) -> Stored:
    """A CPU copy that an async disk write can own."""
    return x.to("cpu") if isinstance(x, QTensor) else x.contiguous().cpu()
