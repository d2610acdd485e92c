"""A 2-D weight handed to the model math still packed: group-wise 4/8-bit codes with a min
and a scale per group along the input dim (the engine's compressed weights and GGUF's Q4_0,
Q4_1 and Q8_0 blocks share that layout).

On the CPU a linear layer of few rows multiplies the codes directly (``kernels.qlinear``: a
panel of rows is expanded inside the product, in the compute dtype), so a decode step reads a
quarter of the bytes and writes no dense copy; on a GPU a Triton kernel does the same
(``kernels.qlinear_gpu``, up to its ``MAX_ROWS`` rows). A product of many rows (a prefill) expands the
weight once into a reused dense buffer (``dense``) and runs the BLAS, where the BLAS is faster.
An embedding lookup expands only the rows it gathers (``rows``).

Every expansion gives the reference's values: ``code * scale + min`` in float32, rounded to the
compute dtype (``expand_reference`` is that formula in torch; the native kernels equal it). A
4-bit table format (``table``: bitsandbytes' NF4/FP4, llama.cpp's IQ4 values) reads each code
as its table entry and has no mins: ``table[code] * scale``; the fused products and one-pass
expansions of both devices take it (``table_expansion``).

This module belongs to the kernels package, a leaf: it imports nothing else from flexgen_dist.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import dequant, dequant_lut4, qlinear, qlinear_gpu

# Rows of x up to which the fused product runs; beyond, the weight is expanded and the BLAS
# multiplies it. Measured per opt-1.3b layer (2 cores, AVX512_BF16, bfloat16): the fused
# product is 1.5x faster than the dense BLAS at 1 row and even at 64; expand-then-BLAS wins
# from 128 rows on (docs/benchmarks.md, "4-bit weights").
FUSED_MAX_ROWS = 64


def one_pass_expansion(device: torch.device) -> Callable[..., torch.Tensor | None] | None:
    """The one-pass expansion of ``device`` (``(codes, mins, scales, cols, group, bits, dtype,
    out=None)``, None where it does not take its arguments): the native kernel on the CPU, a
    Triton one on a GPU; None elsewhere (the caller expands with ``expand_reference``)."""
    return {"cpu": dequant, "cuda": qlinear_gpu.dequant}.get(device.type)


def table_expansion(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, cols: int, group: int,
                    dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """A 4-bit table format's rows expanded in one pass on their device (the native kernel on
    the CPU, the Triton one on a GPU); None where neither applies (the caller expands with
    ``expand_table_reference``)."""
    if codes.device.type == "cpu":
        return dequant_lut4(codes, scales, table, cols, group, dtype, out)
    if codes.device.type == "cuda":
        return qlinear_gpu.dequant(codes, scales, scales, cols, group, 4, dtype, out, table=table)
    return None


def fused_enabled() -> bool:
    """``FLEXGEN_FUSED_QLINEAR=0`` turns the fused product off: every packed weight is expanded,
    then multiplied (to compare the two, or to rule the kernel out)."""
    return os.environ.get("FLEXGEN_FUSED_QLINEAR", "1").lower() not in ("0", "false", "no", "off")


@dataclass
class QWeight:
    """A packed (out, in) weight: ``codes`` (out, packed) uint8, ``mins``/``scales`` (out,
    groups), groups of ``group_size`` along the input dim, ``bits`` 4 or 8 per code; values in
    ``dtype``. ``buffer``: a reused (out, in) tensor of that dtype that ``dense`` fills (a
    fresh one each call without it). ``table``: a 4-bit table format's 16 float32 values
    (module doc; ``mins`` unread, ``scales`` float32)."""

    codes: torch.Tensor
    mins: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    group_size: int
    bits: int
    dtype: torch.dtype
    buffer: torch.Tensor | None = None
    table: torch.Tensor | None = None
    _expanded: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dense(self) -> torch.Tensor:
        """The whole weight expanded in ``dtype`` (into ``buffer`` when there is one), once: the
        GPU batches of a block that each multiply many rows share one expansion."""
        if self._expanded is None:
            self._expanded = self._expand()
        return self._expanded

    def _expand(self) -> torch.Tensor:
        out = self.buffer
        if self.table is not None:
            return self._expand_table(self.codes, self.scales, out)
        one_pass = one_pass_expansion(self.device)
        if one_pass is not None:
            y = one_pass(self.codes, self.mins, self.scales, self.shape[1], self.group_size, self.bits, self.dtype, out)
            if y is not None:
                return y
        y = expand_reference(self.codes, self.mins, self.scales, self.shape[1], self.group_size, self.bits,
                             self.dtype)
        return y if out is None else out.copy_(y)

    def _expand_table(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Rows of a table format's codes expanded (``table_expansion``, else torch)."""
        assert self.table is not None
        y = table_expansion(codes, scales, self.table, self.shape[1], self.group_size, self.dtype, out)
        if y is not None:
            return y
        y = expand_table_reference(codes, scales, self.table.to(codes.device), self.shape[1], self.group_size,
                                   self.dtype)
        return y if out is None else out.copy_(y)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, self.dense())`` expanding only the gathered rows."""
        flat = ids.reshape(-1)
        if self.table is not None:
            return self._expand_table(self.codes[flat], self.scales[flat], None).view(*ids.shape, self.shape[1])
        codes, mins, scales = self.codes[flat], self.mins[flat], self.scales[flat]
        one_pass = one_pass_expansion(self.device)
        y = one_pass(codes, mins, scales, self.shape[1], self.group_size, self.bits, self.dtype) \
            if one_pass is not None else None
        if y is None:
            y = expand_reference(codes, mins, scales, self.shape[1], self.group_size, self.bits, self.dtype)
        return y.view(*ids.shape, self.shape[1])

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """``F.linear(x, self.dense(), b)`` (+ ``residual``) by the fused product, for few rows
        (the native kernel on the CPU, ``qlinear_gpu``'s Triton kernel on a GPU); None where it
        does not apply (the caller expands and multiplies)."""
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        if not fused_enabled() or x.device != self.device:
            return None
        if self.device.type == "cuda":
            return qlinear_gpu.qlinear(x, self.codes, self.mins, self.scales, self.shape[0], self.group_size,
                                       self.bits, b, residual, table=self.table)
        if self.device.type != "cpu" or not 0 < m <= FUSED_MAX_ROWS:
            return None
        return qlinear(x, self.codes, self.mins, self.scales, self.shape[0], self.group_size, self.bits, b,
                       residual, table=self.table)


def expand_reference(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, cols: int, group: int,
                     bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The reference expansion of rows grouped along the last dim, in torch on the codes'
    device: ``code * scale + min`` in float32, rounded to ``dtype`` -> (..., cols)."""
    per = 8 // bits
    if per > 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        codes = ((codes.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*codes.shape[:-1], -1)
    lead, groups = mins.shape[:-1], mins.shape[-1]
    x = codes[..., : groups * group].reshape(*lead, groups, group).float()
    x = x * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    return x.reshape(*lead, groups * group)[..., :cols].to(dtype).contiguous()


def expand_table_reference(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, cols: int, group: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """The reference expansion of a 4-bit table format's rows (codes two a byte, low bits
    first): ``table[code] * scale`` in float32, rounded to ``dtype``, on the codes' device."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=codes.device)
    c = ((codes.unsqueeze(-1) >> shifts) & 15).reshape(*codes.shape[:-1], -1)
    lead, groups = scales.shape[:-1], scales.shape[-1]
    x = table.float()[c[..., : groups * group].long()].reshape(*lead, groups, group) * scales.float().unsqueeze(-1)
    return x.reshape(*lead, groups * group)[..., :cols].to(dtype).contiguous()
