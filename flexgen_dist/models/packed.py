"""Weights kept in a checkpoint's own group-wise quantization (GGUF blocks: ``gguf_blocks``;
GPTQ/AWQ codes, FP8 codes with their scales), in the layout of the engine's compressed
tensors, so ``--compress-weight`` adopts them unexpanded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PackedWeight:
    """A 2-D weight kept in its file's own group-wise quantization, unexpanded.

    Groups of ``group_size`` consecutive elements along dim 1 (the input dim); element e of a
    row is ``codes(e) * scales[g] + mins[g]`` with g = e // group_size. ``codes`` packs
    ``8 // bits`` codes per byte, low bits first: the layout of the engine's compressed
    tensors (``memory.quant.QTensor`` with dim 1), so the engine adopts it without a copy.
    ``fmt`` ``e4m3`` (``memory.quant.E4M3``): FP8 codes, one a byte, each ``fp8(code) *
    scales[g]`` in float32 (scales float32, ``mins`` empty: (rows, 0)).
    """

    codes: torch.Tensor  # uint8, (rows, cols * bits / 8)
    mins: torch.Tensor  # (rows, cols / group_size), the source's dtype
    scales: torch.Tensor
    shape: tuple[int, int]
    bits: int
    group_size: int
    fmt: str = "int"

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.mins.nbytes + self.scales.nbytes)

    def rows(self, fn: Any) -> PackedWeight:
        """The same weight with ``fn`` applied to the rows of every part (a row permutation)."""
        return PackedWeight(fn(self.codes), fn(self.mins), fn(self.scales), self.shape, self.bits, self.group_size,
                            self.fmt)
