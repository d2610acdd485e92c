"""Which sequences of a block are done: ``EosTracker`` (each row's ending ids, EOS and vLLM's
``stop_token_ids``, and its own limit of new tokens: the last stage's and stage 0's), and
``BlockWatch`` (stage 0's view, stop strings included). ``id_table``: per-row id lists as one
padded tensor, the form the trackers, the bans and the beam search compare ids against."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def id_table(rows: Sequence[Sequence[int]], device: torch.device, width: int = 0, fill: int = -1) -> torch.Tensor:
    """(len(rows), max(width, longest row)) long: each row's ids, then ``fill``."""
    w = max(width, max((len(r) for r in rows), default=0))
    return torch.tensor([list(r) + [fill] * (w - len(r)) for r in rows], dtype=torch.long, device=device)


class EosTracker:
    """Which sequences of a block have finished (at one of their ending ids: EOS unless
    ignored, and their ``stop_token_ids``; or at their own limit of new tokens), and the ids
    to feed once they have."""

    def __init__(self, ends: Sequence[Sequence[int]], pad_id: int, device: torch.device,
                 limits: list[int] | None = None) -> None:
        """``ends``: per row, the ids that end it (``SamplingConfig.ends``)."""
        width = max((len(e) for e in ends), default=0)
        self.done = torch.zeros(len(ends), dtype=torch.bool, device=device)
        self.ends = id_table(ends, device) if width else None
        self.pad_id, self.ignore = pad_id, not width
        self.limits = None if limits is None else torch.tensor(limits, dtype=torch.long, device=device)

    def update(self, tokens: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Replace tokens of finished sequences by padding; mark new endings and the rows whose
        token ``step`` was their last. Returns the tokens."""
        if self.ignore and self.limits is None:
            return tokens
        tokens = torch.where(self.done, torch.full_like(tokens, self.pad_id), tokens)
        if self.ends is not None:
            self.done |= (tokens.view(-1, 1) == self.ends).any(dim=1)
        if self.limits is not None:
            self.done |= self.limits <= step + 1
        return tokens

    def all_done(self) -> bool:
        return (not self.ignore or self.limits is not None) and bool(self.done.all())


class BlockWatch:
    """Stage 0's view of which sequences of one block are done: EOS and limits (``tracker``),
    and stop strings (``stops.hit(sequence, its new ids)``, for the sequences that have any).
    ``stopped``: row -> the number of tokens it keeps, where its stop string completed."""

    def __init__(self, tracker: EosTracker, members: list[int], stops: Any | None) -> None:
        self.tracker, self.members, self.stops = tracker, members, stops
        self.hist: dict[int, list[int]] = {} if stops is None else \
            {n: [] for n, m in enumerate(members) if stops.has(m)}
        self.stopped: dict[int, int] = {}

    def step(self, ids: torch.Tensor, i: int) -> bool:
        """Token i of every row is ``ids`` (b,); whether every row is now done."""
        self.tracker.update(ids, i)
        if self.hist:
            vals = ids.tolist()  # one host copy per step, only for blocks with stop strings
            for n in list(self.hist):
                self.hist[n].append(vals[n])
                if self.stops.hit(self.members[n], self.hist[n]):  # type: ignore[union-attr]
                    self.stopped[n] = i + 1
                    self.tracker.done[n] = True
                    del self.hist[n]
        return bool(self.tracker.done.all())
