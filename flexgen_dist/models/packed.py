"""Weights kept in a checkpoint's own group-wise quantization (GGUF Q4_0, Q4_1, Q8_0, GPTQ/AWQ
codes, FP8 codes with their scales), in the layout of the engine's compressed tensors, so
``--compress-weight`` adopts them unexpanded."""
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



GGUF_NATIVE = ("Q4_0", "Q4_1", "Q8_0")


def gguf_packed(data: Any, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> PackedWeight:
    """A GGUF Q4_0 / Q4_1 / Q8_0 matrix (rows of 32-element blocks) as a ``PackedWeight``.

    Q4_1 blocks are ``d, m`` (float16) and 16 bytes of codes, ``w = d * q + m``; Q4_0 blocks
    ``d`` and 16 bytes, ``w = d * (q - 8)``, i.e. min ``-8 d``; Q8_0 blocks ``d`` and 32 int8,
    ``w = d * q``, i.e. codes ``q + 128`` and min ``-128 d``. A 4-bit block holds element j in
    the low nibble of byte j and element j + 16 in its high nibble; the engine packs
    neighbours, so the nibbles are reordered (no value changes)."""
    import numpy as np

    rows, cols = int(shape[0]), int(shape[1])
    nb = cols // 32
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blk = np.ascontiguousarray(data).reshape(rows, nb, size)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = blk[..., 2:34].copy().view(np.int8).astype(np.int16) + 128
        codes = torch.from_numpy(q.astype(np.uint8).reshape(rows, nb * 32))
        m, bits = -128.0 * d, 8
    else:
        if kind == "Q4_1":
            m, qs = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blk[..., 4:20]
        else:
            m, qs = -8.0 * d, blk[..., 2:18]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, nb, 32) in element order
        codes = torch.from_numpy((q[..., 0::2] | (q[..., 1::2] << 4)).reshape(rows, nb * 16).astype(np.uint8))
        bits = 4
    return PackedWeight(codes, torch.from_numpy(m).to(dtype), torch.from_numpy(d).to(dtype), (rows, cols), bits, 32)
