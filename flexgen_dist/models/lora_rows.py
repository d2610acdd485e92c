"""Per-request LoRA adapters at compute time: which rows of a batch use which adapter
(``LoraRows``), and a weight that adds each row's adapter to its product (``LoraWeight``).

A layer served with several adapters holds, beside each adapted matrix ``KEY`` (out, in),
``KEY.lora_a`` (n, r, in) and ``KEY.lora_b`` (n, out, r): adapter a's A and B, B already times
its scale, zero-padded to the largest rank (``lora_stack.py``). A row of adapter a then gets

    y = x @ W.T + (x @ A_a.T) @ B_a.T

as PEFT computes an unmerged adapter (``lora_B(lora_A(x)) * scaling`` beside the base layer),
so the base weight is never changed and rows of different adapters (and of none) share one
batch and one pass over it. The update is computed once per adapter present in the batch,
over its rows alone, a contiguous run of them (a block's rows are ordered by adapter), added
into the output in place: two skinny products of r columns, about
``r (in + out) / (in x out)`` of the base product's work per row, with no copy of any adapter
per row (a gather of each row's A and B would read them once per row: on a GPU's decode step,
more bytes than the base matrix itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .families import LORA_A, LORA_B


@dataclass(frozen=True)
class LoraRows:
    """The rows of a batch (its leading dim) per adapter: (stack index, first row, end row) of
    each run of rows with the same adapter; base-model rows are in none. A block's rows are
    ordered by adapter (``worker.call_blocks``), so a batch holds one run per adapter present."""

    runs: tuple[tuple[int, int, int], ...]
    rows: int

    @classmethod
    def of(cls, adapters: Sequence[int]) -> LoraRows:
        """From each row's adapter (0: the base model, a > 0: stack index a - 1)."""
        runs, start = [], 0
        for n in range(1, len(adapters) + 1):
            if n == len(adapters) or adapters[n] != adapters[start]:
                if adapters[start]:
                    runs.append((adapters[start] - 1, start, n))
                start = n
        return cls(tuple(runs), len(adapters))


class LoraWeight:
    """A matrix with per-row adapters (module doc): ``models.common.linear`` multiplies the base
    weight as it would alone, then adds each adapter's update to its rows."""

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, rows: LoraRows) -> None:
        self.base, self.a, self.b, self.rows = base, a, b, rows

    @property
    def shape(self) -> Any:
        return self.base.shape

    def add_updates(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (x's product with the base weight) plus each row's adapter update, in place.
        x's leading dims are the batch's rows then positions, row-major (as the layers pass them)."""
        n, k, m = self.rows.rows, x.shape[-1], y.shape[-1]
        x2, y2 = x.reshape(-1, k), y.view(-1, m)
        per = x2.shape[0] // n  # positions per row
        for a, r0, r1 in self.rows.runs:  # a run's rows are contiguous: views, one product into y in place
            rows = slice(r0 * per, r1 * per)
            y2[rows].addmm_(torch.mm(x2[rows], self.a[a].to(x.dtype).t()), self.b[a].to(x.dtype).t())
        return y


def with_rows(w: dict[str, Any], rows: LoraRows | None) -> dict[str, Any]:
    """A layer's weights with each adapted matrix a ``LoraWeight`` for ``rows`` (``w`` itself
    where no row of the batch has an adapter or the layer has none)."""
    if rows is None or not rows.runs:
        return w
    out = dict(w)
    for k in w:
        if k.endswith(LORA_A):
            key = k[:-len(LORA_A)]
            out[key] = LoraWeight(w[key], w[k], w[key + LORA_B], rows)
    return out
