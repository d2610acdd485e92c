"""The order of a pipeline's work items, as data: the same on every rank.

An item is one step of one block on one stage: a prefill piece (token 0 of some GPU batches
of the block), a decode step (token i >= 1 of every GPU batch), or, on stage 0 of a
multi-stage pipeline only, a *collect* (receive the block's last tokens from the last stage).

G group slots take the blocks round-robin (slot t runs blocks t, t + G, t + 2G, ...). The
stream visits the slots in turn, one *turn* each: a block's whole prefill (all its pieces),
or one decode step. When a slot's block ends (its last step, or early when every sequence
has hit EOS) the slot's next turn is its next block's prefill, so a new block enters the
pipeline while the other slots are still decoding theirs: there are no waves that fill and
drain one after the other.

Prefill pieces: one per block (``pieces="block"``: each loaded layer serves every GPU batch
of the block, the zig-zag order) or one per GPU batch (``"batch"``: stage s + 1 starts on
batch 0 while stage s computes batch 1, so the pipeline's fill costs one GPU batch, not one
block; off-device weights are then read once per GPU batch).

Early stop changes only the items of the slot whose block ended, after the current item.
So the next item is known before the current one is done whenever it belongs to another
slot, or the current item is a prefill piece: ``peek`` returns it then (receives for it are
posted ahead), and None otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.policy import Policy

PREFILL, DECODE, COLLECT = "prefill", "decode", "collect"


@dataclass(frozen=True)
class Item:
    kind: str  # PREFILL, DECODE or COLLECT
    slot: int
    block: int  # index into the call's blocks
    i: int  # token step: 0 prefill, 1.. decode; COLLECT: gen_len
    batches: tuple[int, int]  # GPU batches [a, b) of the block this item runs
    last: bool = True  # the last item of its step (a prefill's last piece)

    def __str__(self) -> str:
        if self.kind == COLLECT:
            return f"C(b{self.block})"
        if self.kind == PREFILL:
            return f"P(b{self.block},k{self.batches[0]}{'' if self.batches[1] - self.batches[0] == 1 else '..' + str(self.batches[1] - 1)})"
        return f"D(b{self.block},i{self.i})"


class ItemStream:
    """Items of one call in execution order. ``num_batches[b]``: GPU batches of block b."""

    def __init__(self, num_batches: list[int], num_groups: int, gen_len: int, *,
                 pieces: str = "block", collect: bool = False) -> None:
        if pieces not in ("block", "batch"):
            raise ValueError(f"pieces={pieces!r}: 'block' or 'batch'")
        if num_groups < 1 or gen_len < 1:
            raise ValueError(f"num_groups={num_groups}, gen_len={gen_len}: both must be >= 1")
        self.num_batches, self.G, self.gen_len = num_batches, num_groups, gen_len
        self.pieces, self.collect = pieces, collect
        # per slot: its blocks (front = current), the next step, a finished block to collect
        self._queue = [list(range(t, len(num_batches), num_groups)) for t in range(num_groups)]
        self._step = [0] * num_groups
        self._to_collect: list[int | None] = [None] * num_groups
        self._turn: list[Item] = []  # what is left of the current turn
        self._slot = -1  # the slot whose turn is current

    # --- one slot's next turn -----------------------------------------------------------
    def _has_work(self, t: int) -> bool:
        return bool(self._queue[t]) or self._to_collect[t] is not None

    def _next_turn(self, t: int) -> list[Item]:
        """Slot t's next turn, advancing its state."""
        out: list[Item] = []
        prev, self._to_collect[t] = self._to_collect[t], None  # finished before this turn
        q = self._queue[t]
        if q and self._step[t] == 0:
            b = q[0]
            nb = self.num_batches[b]
            spans = [(0, nb)] if self.pieces == "block" else [(k, k + 1) for k in range(nb)]
            out += [Item(PREFILL, t, b, 0, sp, n == len(spans) - 1) for n, sp in enumerate(spans)]
            self._advance(t)
        elif q:
            b = q[0]
            out.append(Item(DECODE, t, b, self._step[t], (0, self.num_batches[b])))
            self._advance(t)
        # the slot's previous block's last tokens arrive while its next prefill runs
        if prev is not None:
            out.append(Item(COLLECT, t, prev, self.gen_len, (0, self.num_batches[prev])))
        return out

    def _advance(self, t: int) -> None:
        self._step[t] += 1
        if self._step[t] == self.gen_len:
            self._finish(t, collect=self.collect)

    def _finish(self, t: int, *, collect: bool) -> None:
        b = self._queue[t].pop(0)
        self._step[t] = 0
        if collect:
            self._to_collect[t] = b

    def _following_slot(self) -> int | None:
        """The first slot after the current one (cyclically, itself last) with work."""
        for d in range(1, self.G + 1):
            t = (self._slot + d) % self.G
            if self._has_work(t):
                return t
        return None

    # --- the stream ---------------------------------------------------------------------
    def next(self) -> Item | None:
        if not self._turn:
            t = self._following_slot()
            if t is None:
                return None
            self._slot = t
            self._turn = self._next_turn(t)
        return self._turn.pop(0)

    def peek(self) -> Item | None:
        """The item after the current one, when nothing the current one may reveal can change
        it (see the module docstring); None otherwise, or at the end."""
        if self._turn:
            return self._turn[0]
        t = self._following_slot()
        if t is None or t == self._slot:
            return None
        q = self._queue[t]
        if q:
            b = q[0]
            if self._step[t] == 0:
                nb = self.num_batches[b]
                return Item(PREFILL, t, b, 0, (0, nb) if self.pieces == "block" else (0, 1),
                            self.pieces == "block" or nb == 1)
            return Item(DECODE, t, b, self._step[t], (0, self.num_batches[b]))
        prev = self._to_collect[t]
        assert prev is not None
        return Item(COLLECT, t, prev, self.gen_len, (0, self.num_batches[prev]))

    def end_block(self, slot: int, block: int) -> None:
        """The slot's block ended early (every sequence at EOS): drop its remaining decode
        steps (none if it ended at its last). Its tokens are all at stage 0 already, so there
        is nothing to collect."""
        if self._queue[slot] and self._queue[slot][0] == block and self._step[slot] > 0:
            self._turn = [it for it in self._turn if it.slot != slot]
            self._finish(slot, collect=False)

    def order(self) -> list[Item]:
        """Every item, assuming no block ends early (for printing and tests)."""
        out = []
        while (it := self.next()) is not None:
            out.append(it)
        return out


def default_prefill_items(policies: list[Policy], device: torch.device) -> str:
    """Without a hardware profile: one prefill item per GPU batch where that costs no extra
    weight traffic (every stage's weights at rest on the compute device, uncompressed) and
    the stages share one GPU batch size; else one per block."""
    if len(policies) == 1 or len({p.gpu_batch_size for p in policies}) > 1:
        return "block"
    for p in policies:
        wg, wc, wd = p.fractions("w")
        resident = wd < 1e-9 if device.type == "cpu" else wg > 1 - 1e-9
        if p.num_gpu_batches == 1 or p.compress_weight or not resident:
            return "block"
    return "batch"
