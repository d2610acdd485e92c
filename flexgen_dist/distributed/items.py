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

PREFILL, DECODE, COLLECT = "prefill", "decode", "collect"


@dataclass(frozen=True)
class Item:
    kind: str  # PREFILL, DECODE or COLLECT
    slot: int
    block: int  # index into the call's blocks
    i: int  # token step: 0 prefill, 1.. decode; COLLECT: gen_len
    batches: tuple[int, int]  # GPU batches [a, b) of the block this item runs
    last: bool = True  # the last item of its step (a prefill's last piece)
    ride: Item | None = None  # a decode step's rider: a prefill piece of the slot's next block

    def parts(self) -> list[Item]:
        """What the item runs, in message order: its rider first, then itself."""
        return [self] if self.ride is None else [self.ride, self]

    def __str__(self) -> str:
        if self.kind == COLLECT:
            return f"C(b{self.block})"
        if self.kind == PREFILL:
            return f"P(b{self.block},k{self.batches[0]}{'' if self.batches[1] - self.batches[0] == 1 else '..' + str(self.batches[1] - 1)})"
        return f"D(b{self.block},i{self.i})" + ("" if self.ride is None else f"+{self.ride}")


class ItemStream:
    """Items of one call in execution order. ``num_batches[b]``: GPU batches of block b.

    ``ride`` (the overlapped schedule): the decode steps of a slot's block carry the prefill
    of the slot's next block, cut into GPU batches spread evenly over the steps (step i has
    prefilled floor(i * nb / (n - 1)) of the next block's nb batches, so the last piece rides
    on the last step). Each such item is one sweep over the stage's layers: every loaded
    layer serves the decode rows and the piece. A block whose prefill has ridden entirely
    starts at its first decode step; what an early stop left unridden runs as plain prefill
    pieces."""

    def __init__(self, num_batches: list[int], num_groups: int, gen_len: int, *,
                 pieces: str = "block", collect: bool = False, ride: bool = False) -> None:
        if pieces not in ("block", "batch"):
            raise ValueError(f"pieces={pieces!r}: 'block' or 'batch'")
        if num_groups < 1 or gen_len < 1:
            raise ValueError(f"num_groups={num_groups}, gen_len={gen_len}: both must be >= 1")
        self.num_batches, self.G, self.gen_len = num_batches, num_groups, gen_len
        self.pieces, self.collect, self.ride = pieces, collect, ride and gen_len > 1
        # per slot: its blocks (front = current), the next step, a finished block to collect
        self._queue = [list(range(t, len(num_batches), num_groups)) for t in range(num_groups)]
        self._step = [0] * num_groups
        self._to_collect: list[int | None] = [None] * num_groups
        self._prefilled: dict[int, int] = {}  # block -> GPU batches whose prefill is issued
        self._turn: list[Item] = []  # what is left of the current turn
        self._slot = -1  # the slot whose turn is current

    # --- one slot's next turn -----------------------------------------------------------
    def _has_work(self, t: int) -> bool:
        return bool(self._queue[t]) or self._to_collect[t] is not None

    def _next_turn(self, t: int, commit: bool = True) -> list[Item]:
        """Slot t's next turn; ``commit`` advances the slot's state past it."""
        out: list[Item] = []
        q, step = self._queue[t], self._step[t]
        done: tuple[int, int] | None = None  # (block, batches now prefilled)
        if q and step == 0:
            b = q[0]
            nb, a = self.num_batches[b], self._prefilled.get(b, 0)
            spans = [(a, nb)] if self.pieces == "block" else [(k, k + 1) for k in range(a, nb)]
            out += [Item(PREFILL, t, b, 0, sp, n == len(spans) - 1) for n, sp in enumerate(spans)]
            done = (b, nb)
        elif q:
            b = q[0]
            rider = self._rider(t, step)
            out.append(Item(DECODE, t, b, step, (0, self.num_batches[b]), ride=rider))
            if rider is not None:
                done = (rider.block, rider.batches[1])
        # the slot's previous block's last tokens arrive while its next block runs
        prev = self._to_collect[t]
        if prev is not None:
            out.append(Item(COLLECT, t, prev, self.gen_len, (0, self.num_batches[prev])))
        if commit:
            self._to_collect[t] = None
            if done is not None:
                self._prefilled[done[0]] = done[1]
            if q:
                self._advance(t)
        return out

    def _rider(self, t: int, step: int) -> Item | None:
        """The piece of slot t's next block that rides on decode step ``step`` of its current one."""
        q = self._queue[t]
        if not self.ride or len(q) < 2:
            return None
        nxt = q[1]
        nb, a = self.num_batches[nxt], self._prefilled.get(nxt, 0)
        target = step * nb // (self.gen_len - 1)
        if target <= a:
            return None
        return Item(PREFILL, t, nxt, 0, (a, target), target == nb)

    def _advance(self, t: int) -> None:
        self._step[t] += 1
        if self._step[t] == self.gen_len:
            self._finish(t, collect=self.collect)

    def _finish(self, t: int, *, collect: bool) -> None:
        b = self._queue[t].pop(0)
        self._prefilled.pop(b, None)
        q = self._queue[t]
        # a next block whose prefill has all ridden along starts at its first decode step
        self._step[t] = 1 if q and self._prefilled.get(q[0], 0) == self.num_batches[q[0]] else 0
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

    def more_sweeps(self) -> bool:
        """Whether an item that runs the stage's layers (a prefill piece or a decode step)
        follows the current one, unless blocks end early: the engine then starts reading the
        next sweep's first weights ahead (a speculation that an early end may waste)."""
        return any(it.kind != COLLECT for it in self._turn) or any(self._queue)

    def peek(self) -> Item | None:
        """The item after the current one, when nothing the current one may reveal can change
        it (see the module docstring); None otherwise, or at the end."""
        if self._turn:
            return self._turn[0]
        t = self._following_slot()
        if t is None or t == self._slot:
            return None
        return self._next_turn(t, commit=False)[0]

    def end_block(self, slot: int, block: int) -> None:
        """The slot's block ended early (every sequence at EOS): drop its remaining decode
        steps (none if it ended at its last). Its tokens are all at stage 0 already, so there
        is nothing to collect. The next block's prefill that has not ridden yet runs next.
        A rider's block that ended at its prefill (one stage) leaves the slot's queue."""
        q = self._queue[slot]
        if q and q[0] == block and self._step[slot] > 0:
            self._turn = [it for it in self._turn if it.slot != slot]
            self._finish(slot, collect=False)
        elif block in q[1:]:
            q.remove(block)
            self._prefilled.pop(block, None)

    def order(self) -> list[Item]:
        """Every item, assuming no block ends early (for printing and tests)."""
        out = []
        while (it := self.next()) is not None:
            out.append(it)
        return out

