"""Scoring's rows in the pipeline: what the last stage accumulates per block (each sequence's
[sum of -log p, positions scored, top-1 hits] and, with per-token log-probabilities, each
position's row from ``engine.head.score``), the message's shape stage 0 posts for, and how stage
0 turns a block's rows into results. A leaf of ``pipeline.py``: the loop decides when; this
module holds the layout."""
from __future__ import annotations

from typing import Any

import torch

from ..engine.blocks import BlockPlan, score_rows
from ..engine.head import score_width
from ..engine.sampling import TokenLogprobs


class BlockScores:
    """Per block in flight, a (sequences, 3 + P * w) float64 row per sequence: the sums, then
    (``k`` not None: per-token log-probabilities with k alternatives) P positions of w values,
    laid out as the block's cache positions (``score_rows``)."""

    def __init__(self, blocks: list[BlockPlan], targets: list[list[int]] | None, gen_len: int, k: int | None,
                 embed_dim: int = 0) -> None:
        self.blocks, self.targets, self.gen_len, self.k = blocks, targets, gen_len, k
        self.w = 0 if k is None else score_width(k)
        # embedding (``embed_dim`` > 0): a row per sequence is its embedding, set at the prefill
        self.embed_dim = embed_dim
        self._acc: dict[int, torch.Tensor] = {}  # last stage: the rows of each block so far

    def positions(self, b: int) -> int:
        """The cache positions of block b whose targets are laid out: its prompt, then one per
        decode step (gen_len - 1 of them)."""
        return self.blocks[b].prompt_len + self.gen_len - 1

    def targets_of(self, blk: BlockPlan) -> torch.Tensor:
        """(sequences, positions) ids the block's positions are scored against (-1: not scored)."""
        assert self.targets is not None
        return score_rows([self.targets[m] for m in blk.members], blk.lens, blk.prompt_len, self.positions(blk.index))

    def shape(self, b: int) -> tuple[int, int]:
        """The block's rows, as the last stage sends them and stage 0 receives them."""
        if self.embed_dim:
            return len(self.blocks[b].lens), self.embed_dim
        return len(self.blocks[b].lens), 3 + self.positions(b) * self.w

    def add(self, b: int, i: int, r0: int, r1: int, scores: torch.Tensor) -> None:
        """Step i's (r1 - r0, 3 + t * w) rows of sequences r0..r1 (``head.score``): the sums
        added, the positions' rows placed (the prompt's at prefill, s + i - 1 at step i)."""
        acc = self._acc.get(b)
        if acc is None:
            acc = self._acc[b] = torch.zeros(self.shape(b), dtype=torch.float64, device=scores.device)
        if self.embed_dim:  # the prefill's embeddings (``head.embed``)
            acc[r0:r1] = scores
            return
        acc[r0:r1, :3] += scores[:, :3]
        if self.w:
            blk = self.blocks[b]  # a prefill with a shared prefix computes slots [L, s)
            p0 = 3 + (blk.shared if i == 0 else blk.prompt_len + i - 1) * self.w
            acc[r0:r1, p0:p0 + scores.shape[1] - 3] = scores[:, 3:]

    def pop(self, b: int) -> torch.Tensor:
        """Block b's rows after its last step (they leave the last stage)."""
        return self._acc.pop(b)

    def results(self, b: int, acc: torch.Tensor) -> list[Any]:
        """Stage 0: block b's sums per sequence, each with (per-token) the ``TokenLogprobs``
        of its scored tokens and their ranks, in order."""
        acc = acc.cpu()
        if self.embed_dim:  # one embedding per sequence
            return list(acc.float().unbind(0))
        sums = acc[:, :3].tolist()
        if not self.w:
            return sums
        assert self.targets is not None
        where = self.targets_of(self.blocks[b]) >= 0
        per = acc[:, 3:].view(len(self.blocks[b].lens), -1, self.w)
        return [(row, TokenLogprobs.of_rows(p[m], self.k or 0), [int(r) for r in p[m][:, -1].tolist()])
                for row, p, m in zip(sums, per, where)]
