"""A GPU batch's repeated prompts, computed once at the prefill.

Batch jobs repeat prompts: a request's ``n`` choices are ``n`` rows of one prompt, a beam
search's ``k`` beams are ``k``, and data sets ask the same question more than once. Where rows
of a GPU batch hold the same prompt (and adapter), their prefill computes the same hidden
states, keys and values. So a stage's prefill of that batch runs only each prompt's first row
(``Twins.narrow`` on the stage's first slot), writes each layer's keys and values to every row
of the cache (``Twins.widen`` in the ``attend`` callable, ``attend.attend_fn``), and hands the
rows back whole at the stage's end (``Twins.widen`` of the last layer's output, or of the
last position before a last stage's head), so messages between stages, the cache and every
decode step are as without. Decode then differs row by row (sampling draws, beams).

A linear-attention layer computes its state for the computed rows in buffers of their own
(``Twins.recurrent``) and copies it to every row's (``Twins.copy_states``), as attention copies its
keys and values. Rank 0 finds the repeats (``blocks.repeated_prompts``; not for scoring,
whose sequences are rarely repeated), the blocks put them next to each other
(``blocks.plan_blocks``), and ``BlockMeta.twins`` gives every stage each batch's rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.common import Positions
from ..models.families import Recurrent
from .block_state import BlockState


@dataclass
class Twins:
    """One GPU batch's rows at the prefill: ``reps`` the rows computed (each prompt's first),
    ``spread`` per row of the batch its place among them."""

    reps: torch.Tensor
    spread: torch.Tensor
    # per (window, chunked): the computed rows' positions and mask rows (``narrow_inputs``)
    inputs: dict[tuple[int, bool], tuple[Positions, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[int], device: torch.device) -> Twins:
        """From ``BlockMeta.twins``' rows (per row, the first row of its prompt)."""
        firsts = sorted(set(rows))
        at = {r: n for n, r in enumerate(firsts)}
        return cls(torch.tensor(firsts, device=device), torch.tensor([at[r] for r in rows], device=device))

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        """The computed rows of a batch's (b, ...) input."""
        return x.index_select(0, self.reps.to(x.device))

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        """Every row of the batch from the computed rows' (u, ...)."""
        return x.index_select(0, self.spread.to(x.device))

    def recurrent(self, rec: Recurrent) -> Recurrent:
        """A linear-attention layer's prefill state for the computed rows, in buffers of its
        own (``rec``'s views are every row's); ``copy_states`` then copies it to every row."""
        return Recurrent(self.narrow(rec.conv), self.narrow(rec.ssm), fresh=rec.fresh,
                         valid=None if rec.valid is None else self.narrow(rec.valid))

    def copy_states(self, small: Recurrent, rec: Recurrent) -> None:
        """Every row's state from the computed rows' (``recurrent``)."""
        rec.conv.copy_(self.widen(small.conv))
        rec.ssm.copy_(self.widen(small.ssm))

    def narrow_inputs(self, key: tuple[int, bool], pos: Positions,
                      mask: torch.Tensor | None) -> tuple[Positions, torch.Tensor | None]:
        """The computed rows' positions and prefill mask rows (once per window a batch's
        layers attend over)."""
        got = self.inputs.get(key)
        if got is None:
            got = self.inputs[key] = (Positions(self.narrow(pos.ids)), None if mask is None else self.narrow(mask))
        return got


def twins_at(st: BlockState, i: int, k: int, device: torch.device) -> Twins | None:
    """GPU batch k's ``Twins`` at token i: only at the prefill of a batch with repeats."""
    rows = st.meta.twins[k] if i == 0 and st.meta.twins is not None else None
    if rows is None:
        return None
    tw = st.twins.get(k)
    if tw is None:
        tw = st.twins[k] = Twins.of(rows, device)
    return tw
