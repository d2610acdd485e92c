"""What shared prefixes save a call, as the planner sees it before any block is cut
(``PrefixShape``): the prefill positions a block does not compute, the cache positions a row
leaves out where the prefix is held through decode (``held.py``), and the opening every
block will share at the least."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from .blocks import MIN_SHARED, lcp, saved_positions


@dataclass(frozen=True, eq=False)
class PrefixShape:
    """What shared prefixes save a call's prefill, as the cost model sees it before any block
    is cut: ``saved(rows)``, the prompt positions a block of ``rows`` requests does not compute,
    on average over the call's blocks.

    From the prompts (``of_prompts``): the requests in token order, cut into runs of ``rows``
    (what grouping by opening, then by length, approaches where it pays), each run sharing the
    least of its neighbours' common leading tokens (``lcp``: each request's with the next in
    that order); a run whose prefix is the start of the last one computed takes its keys
    instead (``prefix_reuse``). The run's own choice among groupings (``prefix_groupings``)
    saves at most this. Or one opening of ``opening`` tokens that every prompt shares
    (``call_wide``, the planner's ``--shared-prefix``), computed once per block.

    ``repeats``: how many requests ask each prompt (those of a prompt next to each other, as
    the blocks put them): a GPU batch's prefill computes each of its prompts once
    (``computed_share``). ``held``: each row's cache leaves its block's prefix out through
    decode (``held.holds_prefix``; ``held_positions``)."""

    prompts: tuple[Sequence[int], ...] = field(default=(), repr=False)
    opening: int = 0
    repeats: tuple[int, ...] = field(default=(), repr=False)
    held: bool = False
    kept_all: bool = True  # no prompt was left out (``of_prompts``' ``longest``)
    _saved: dict[int, float] = field(default_factory=dict, repr=False)

    @classmethod
    def of_prompts(cls, prompts: Sequence[Sequence[int]], longest: int | None = None,
                   held: bool = False) -> "PrefixShape | None":
        """The shape of ``prompts`` (None for fewer than two): a prompt longer than ``longest``
        shares nothing (``shared_prefixes``)."""
        keep = tuple(p for p in prompts if longest is None or len(p) <= longest)
        return cls(prompts=keep, held=held, kept_all=len(keep) == len(prompts)) if len(keep) > 1 else None

    @classmethod
    def call_wide(cls, opening: int, held: bool = False) -> "PrefixShape":
        return cls(opening=int(opening), held=held)

    @cached_property
    def floor(self) -> int:
        """The fewest leading positions a block of two or more of the requests shares, wherever
        the blocks are cut (``shared_prefixes``: its prompts' common opening, at most one short of
        its shortest, none under MIN_SHARED): every prompt's common opening; 0 where prefixes are
        not held (only a held prefix changes the cache a row takes) or some prompt may not share."""
        if not self.held:
            return 0
        if not self.prompts:
            n = self.opening
        else:
            n = min(int(self.lcp.min()), min(len(p) for p in self.prompts) - 1) if self.kept_all else 0
        return n if n >= MIN_SHARED else 0

    def held_positions(self, rows: int) -> float:
        """Mean positions a row's cache leaves out in a block of ``rows`` requests (its block's
        prefix, held once: ``engine/held.py``): what the block's rows do not compute, less the
        prefix's own row, per row."""
        if not self.held:
            return 0.0
        rows = max(1, int(rows))
        return self.saved(rows) / rows

    def kept_once(self, prompt_len: int, gbs: int, held: float = 0.0) -> float:
        """Mean prompt positions a row's cache leaves out where each GPU batch of ``gbs`` keeps its
        prompts once through decode (``engine/prompt_groups.py``): ``prompt_len`` less the share
        a row still takes of its prompt's one copy (``computed_share``), where that passes
        ``prompt_groups``' rule against ``held`` (a block's shared prefix held instead); else 0."""
        if not self.held or not self.repeats:
            return 0.0
        c = self.computed_share(gbs)
        return prompt_len * (1 - c) if 2 * c * prompt_len <= prompt_len - held else 0.0

    @cached_property
    def lcp(self) -> np.ndarray:
        """Leading tokens each request shares with the next, the requests in token order."""
        order = sorted(self.prompts, key=lambda p: p if isinstance(p, list) else list(p))  # lists: no copies
        return np.asarray([lcp(a, b) for a, b in zip(order, order[1:])], dtype=np.int64)

    def saved(self, rows: int) -> float:
        """Mean prompt positions a block of ``rows`` requests does not compute."""
        rows = max(1, int(rows))
        if not self.prompts:
            return float(saved_positions(rows, self.opening if self.opening >= MIN_SHARED else 0, False))
        if rows not in self._saved:
            self._saved[rows] = self._runs(rows)
        return self._saved[rows]

    def computed_share(self, gbs: int) -> float:
        """The share of the rows a prefill computes with GPU batches of ``gbs``: each batch
        computes each of its prompts once (``repeats`` laid out in a row, cut every gbs)."""
        if not self.repeats:
            return 1.0
        gbs, pos, rows = max(1, int(gbs)), 0, 0
        for n in self.repeats:
            rows += (pos + n - 1) // gbs - pos // gbs + 1  # the batches the prompt's requests fall in
            pos += n
        return rows / pos

    def _runs(self, rows: int) -> float:
        lcp = self.lcp
        n, total, blocks = len(lcp) + 1, 0, 0
        src, run = -1, 0  # the first request of the last run whose prefix was computed; that prefix's length
        for a in range(0, n, rows):
            b = min(n, a + rows)
            shared = int(lcp[a:b - 1].min()) if b - a > 1 else 0
            shared = shared if shared >= MIN_SHARED else 0
            reuse = bool(shared) and src >= 0 and run >= shared and int(lcp[src:a].min()) >= shared
            total += saved_positions(b - a, shared, reuse)
            blocks += 1
            if shared and not reuse:
                src, run = a, shared
            elif not shared:
                src = -1
        return total / blocks
