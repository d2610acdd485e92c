"""A block's shared prefix held once for its decode, not in every row of its cache.

Where every prompt of a block opens with the same L tokens (``blocks.shared_prefixes``), each
row's cache would hold L positions of keys and values that are the same in every row. With
the prefix held (``BlockCache(held=L)``), a row's cache keeps only its positions from L on,
and each layer keeps the prefix's keys and values once, on the compute device, from the
prefill's prefix pass (``hold``). A decode step attends in two parts (cascade attention): the
prefix, with one product per kv head over the queries of every row of the GPU batch
(``attention.prefix_attention``: the prefix read once a step, as a matrix product, where row
by row it would be read once per row), and each chunk of rows over its own positions where
the chunk lives (``attention.attend_rows_lse``); the two merge by their log-sum-exps
(``attention.merge_lse``). The row's own keys before L (its prefix's place after its left
padding) are masked (``block_state.step_inputs``).

The cache of a block shrinks by L positions a row, and every decode step reads that much less
of it (from RAM, or from disk). With a compressed cache the held prefix is quantized and
expanded once, so attention sees the values a row's cache would have held.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..memory.quant import dequantize, quantize
from ..memory.tiers import MemoryTracker, Tier
from ..models.spec import ModelSpec
from .attention import merge_parts, prefix_attention
from .blocks import BlockPlan
from .prefix_shape import PrefixShape


def holds_prefix(spec: ModelSpec, sparsity: float, length: int | None = None) -> bool:
    """Whether a block's shared prefix can be held once at decode for this model and policy,
    for sequences of at most ``length`` positions (None: any): every layer attends to all of
    them (a sliding layer's ring would drop the prefix's positions as the sequence grows past
    its window; one whose window holds ``length`` never does; a chunked layer's chunks start
    at each row's own first token), with no softcap or sinks, and attention reads every key
    (top-k sparsity picks over all of a row's keys at once)."""
    def whole(j: int) -> bool:
        w = spec.window(j)
        return not w or (length is not None and not spec.chunked(j) and w >= length)

    return (sparsity >= 1.0 and spec.attn_softcap == 0 and not spec.attn_sinks
            and all(whole(j) for j in range(spec.num_layers)))


def held_floor(blocks: Sequence[BlockPlan], shared: Sequence[int], total: int, block_size: int,
               kept: Sequence[int | None] | None = None) -> int:
    """The fewest positions a row's cache leaves out in any of ``blocks`` (``shared``: per
    request, its block's prefix), as the memory check counts it against full blocks of
    ``block_size`` rows and ``total`` positions: the least prefix of the blocks of two or more
    requests (0 where one shares none), or where ``kept`` (per block) gives one, what keeping its
    GPU batches' prompts once leaves out instead (``prompt_groups.kept_positions``); a block of
    one request shares nothing, and fits where ``block_size`` rows less that many positions take
    at least its one row."""
    multi = [shared[blk.members[0]] if kept is None or kept[i] is None else kept[i]  # type: ignore[misc]
             for i, blk in enumerate(blocks) if len(blk.members) > 1]
    if not multi:
        return 0
    return lone_block_fits(min(multi), total, block_size) if any(len(blk.members) == 1 for blk in blocks) \
        else min(multi)


def planned_hold(prefix: PrefixShape | None, total: int, block_size: int) -> int:
    """What planning counts on every block holding before the blocks are cut: the opening every
    prompt shares (``PrefixShape.floor``), where ``lone_block_fits``."""
    return lone_block_fits(prefix.floor if prefix is not None else 0, total, block_size)


def lone_block_fits(held: int, total: int, block_size: int) -> int:
    """``held``, or 0 where a block of one request (which shares nothing) would take more than a
    full block of ``block_size`` rows of ``total`` positions, less ``held`` each, as counted."""
    return held if block_size * (total - held) >= total else 0


class HeldPrefix:
    """Each layer's keys and values of a block's shared prefix, (kv_heads, L, d) float32 on the
    compute device (what ``prefix_attention`` computes in, converted once, not each step), from
    the end of the block's prefill there to the end of the block."""

    def __init__(self, length: int, device: torch.device, dtype: torch.dtype, tracker: MemoryTracker,
                 compress: tuple[int, int] | None = None) -> None:
        self.length, self.device, self.dtype, self.tracker = length, device, dtype, tracker
        self.compress = compress  # (bits, group size) of a compressed cache
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bytes = 0

    def hold(self, j: int, pk: torch.Tensor, pv: torch.Tensor) -> None:
        """Keep layer j's prefix: ``pk``/``pv`` (1, L', kv_heads, d) as the prefix pass made
        them (L' >= L: a prefix kept from an earlier block, whose first L are this one's)."""
        kv = tuple(self._form(x) for x in (pk, pv))
        self.kv[j] = kv  # type: ignore[assignment]
        n = sum(x.nbytes for x in kv)
        self.tracker.add(Tier.GPU, n)
        self._bytes += n

    def _form(self, x: torch.Tensor) -> torch.Tensor:
        x = x[0, :self.length].transpose(0, 1).to(self.device, self.dtype)  # as a row would store it
        if self.compress is not None:  # the values a compressed row would have held
            bits, group = self.compress
            x = dequantize(quantize(x, bits, group, dim=-1))
        return x.float().contiguous()

    def attend(self, j: int, q: torch.Tensor, parts: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor]]],
               scale: float | None) -> torch.Tensor:
        """Layer j's decode output for the rows of ``q`` (R, G, 1, d): the prefix's part for all
        rows at once, merged with each chunk's [(first row, end row, (output, log-sum-exp))]."""
        if j not in self.kv:
            raise RuntimeError(f"layer {j} decodes before the block's prefill left its shared prefix: "
                               "a block's GPU batches must all finish their prefill on a stage before its decode")
        pk, pv = self.kv[j]
        return merge_parts(prefix_attention(q, pk, pv, scale), parts, q.dtype)

    def free(self) -> None:
        self.tracker.sub(Tier.GPU, self._bytes)
        self._bytes = 0
        self.kv.clear()
