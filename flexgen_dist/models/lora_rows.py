"""Per-request LoRA adapters at compute time: which rows of a batch use which adapter
(``LoraRows``), and a weight that adds each row's adapter to its product (``LoraWeight``).

A layer served with several adapters holds, beside each adapted matrix ``KEY`` (out, in),
``KEY.lora_a`` (n, r, in) and ``KEY.lora_b`` (n, out, r): adapter a's A and B, B already times
its scale, zero-padded to the largest rank (``lora_stack.py``). A row of adapter a then gets

    y = x @ W.T + (x @ A_a.T) @ B_a.T

as PEFT computes an unmerged adapter (``lora_B(lora_A(x)) * scaling`` beside the base layer),
so the base weight is never changed and rows of different adapters (and of none) share one
batch and one pass over it. The update is computed once per adapter present in the batch,
over its rows alone (gathered, multiplied, added back): two skinny products of r columns,
about ``2 r / out`` of the base product per row, with no copy of any adapter per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .families import LORA_A, LORA_B


@dataclass(frozen=True)
class LoraRows:
    """The rows of a batch (its leading dim) per adapter: (stack index, rows or None for
    every row) of each adapter present; base-model rows are in none."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]
    rows: int

    @classmethod
    def of(cls, adapters: Sequence[int], device: torch.device) -> LoraRows:
        """From each row's adapter (0: the base model, a > 0: stack index a - 1)."""
        out = []
        for a in sorted(set(adapters) - {0}):
            idx = [n for n, x in enumerate(adapters) if x == a]
            out.append((a - 1, None if len(idx) == len(adapters) else torch.tensor(idx, device=device)))
        return cls(tuple(out), len(adapters))


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
        n = self.rows.rows
        xs = x.reshape(n, -1, x.shape[-1])
        ys = y.view(n, -1, y.shape[-1])
        for a, idx in self.rows.groups:
            xa = xs if idx is None else xs.index_select(0, idx)
            d = torch.matmul(torch.matmul(xa, self.a[a].to(xa.dtype).t()), self.b[a].to(xa.dtype).t())
            if idx is None:
                ys.add_(d)
            else:
                ys.index_add_(0, idx, d)
        return y


def with_rows(w: dict[str, Any], rows: LoraRows | None) -> dict[str, Any]:
    """A layer's weights with each adapted matrix a ``LoraWeight`` for ``rows`` (``w`` itself
    where no row of the batch has an adapter or the layer has none)."""
    if rows is None or not rows.groups:
        return w
    out = dict(w)
    for k in w:
        if k.endswith(LORA_A):
            key = k[:-len(LORA_A)]
            out[key] = LoraWeight(w[key], w[k], w[key + LORA_B], rows)
    return out
