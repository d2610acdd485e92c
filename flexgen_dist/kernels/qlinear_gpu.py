"""The fused 4/8-bit product on a GPU: ``F.linear(x, W, b)`` (+ ``residual``) with W given by its
group-wise codes, expanded tile by tile in registers (a Triton kernel), never as a whole.

A decode step multiplies few rows by every weight, so it is bound by the weight bytes it reads:
the packed codes are a quarter (4-bit) or half (8-bit) of a float16 weight, and expanding the
whole weight first (``QWeight.dense``) writes and reads a dense copy besides. Products of many
rows (a prefill) still expand once and run cuBLAS, which is faster there.

Each program computes a tile of BLOCK_M rows by BLOCK_N output features, walking the input dim
BLOCK_K at a time (a whole number of groups): it loads the x tile and the packed codes, splits
each byte into its two codes (low nibble first, the packing of ``memory/quant.py``), applies
``code * scale + min`` in float32, rounds to x's dtype (the reference expansion's values: the
product is rounded on its own, ``mul_rn``, never fused with the add) and accumulates
``x @ W.T`` in float32 (IEEE float32 products for a float32 x, not TF32). The epilogue adds
the bias, rounds to x's dtype, and adds the residual in float32 and rounds again, as
``F.linear(x, W, b).add_(residual)`` rounds. With split-K
(``Tiles.split_k``) each part writes float32 partial sums and torch finishes the same epilogue.

``dequant`` expands codes to a dense tensor in one pass (a compressed KV cache before
attention, a compressed weight before a prefill's cuBLAS product), bit for bit the reference's
values: there the product is rounded on its own (``mul_rn``), as torch's two-pass expansion does.

A 4-bit table format (``table``: 16 float32 values; bitsandbytes' NF4/FP4, llama.cpp's IQ4,
MXFP4) reads each code as its table entry times the group's float32 scale, no mins (``mins``
is not read: pass the scales); both kernels take it.

``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors (tests/test_qlinear_gpu.py), so its
logic is tested on machines without a GPU. The interpreter multiplies bfloat16 tiles wrongly
(numpy has no bfloat16), so there the tiles are widened to float32 before the product: the same
products, since a product of two half-type values is exact in float32. This module belongs to
the kernels package, a leaf.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from . import _qparts_ok

log = logging.getLogger("flexgen_dist")

# Rows up to which the fused kernel runs on a GPU; beyond, expand once and run cuBLAS.
MAX_ROWS = 64


@functools.lru_cache(maxsize=1)
def _kernel():  # noqa: ANN202
    """The jitted kernels (``qlinear``, ``dequant``), or None where Triton is missing (the
    caller then expands with torch's ops)."""
    try:
        from . import qlinear_triton
    except ImportError:
        return None
    return SimpleNamespace(qlinear=qlinear_triton.qlinear_kernel, dequant=qlinear_triton.dequant_kernel)


# Why the kernels stopped being used in this process (a GPU or Triton build they do not
# compile for): the first failure is logged once, and every later call expands with torch.
_failed: list[str] = []

# A tiling that needs more of a multiprocessor than this GPU has (shared memory, registers) is
# not a broken kernel: fewer pipeline stages, then a shorter step along the input dim, fit.
# The fitted tiling is kept per launch shape; ``None`` where none fits (that product expands).
_fitted: dict[tuple, Tiles | None] = {}
_unfit_logged: set[tuple] = set()


class _OutOfResources(Exception):
    """A launch that asked for more than the GPU has (Triton's ``OutOfResources``)."""


def available() -> bool:
    return _kernel() is not None and not _failed


def _launch(kernel, grid: tuple[int, ...], *args, **kw) -> bool:  # noqa: ANN001
    """Run a kernel; False (logged once) where it cannot be built or launched here. Raises
    ``_OutOfResources`` where only this launch's tiling is too large for the GPU."""
    try:
        kernel[grid](*args, **kw)
        return True
    except Exception as e:  # a compile or launch failure: the torch path still gives the values
        if type(e).__name__ == "OutOfResources":
            raise _OutOfResources(str(e).splitlines()[0] if str(e) else "") from e
        if not _failed:
            log.warning("the GPU's 4-bit kernels cannot run here (%s: %s); expanding with torch instead",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        _failed.append(f"{type(e).__name__}: {e}")
        return False


def _smaller(t: Tiles, group: int) -> Tiles | None:
    """The next tiling to try when ``t`` does not fit: one pipeline stage fewer (down to 1),
    then half the step along the input dim (not below a group), else None."""
    if t.num_stages > 1:
        return replace(t, num_stages=t.num_stages - 1)
    if t.block_k > group:
        return replace(t, block_k=t.block_k // 2, num_stages=Tiles.num_stages)
    return None


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _takes(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, cols: int, group: int, bits: int,
           dtype: torch.dtype) -> bool:
    """Whether the kernels take these parts: Triton here and working, a group that is a power of
    two of at least 16, a compute dtype, and the layout of ``memory/quant.py`` on a GPU (on the
    CPU under Triton's interpreter)."""
    return (_kernel() is not None and not _failed and _pow2(group) and group >= 16
            and dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _qparts_ok(codes, mins, scales, cols, group, bits, "cpu" if _interpret() else "cuda"))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _block_m(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def _block_n(n: int, device: torch.device) -> int:
    """64 output features per program where that still gives every multiprocessor two
    programs, else 32 (or 16): a decode product has one row block, so the grid is N / BLOCK_N."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 1
    for bn in (64, 32):
        if -(-n // bn) >= 2 * sms:
            return bn
    return 16 if n < 32 * sms else 32


@dataclass(frozen=True)
class Tiles:
    """A launch's tiling: ``block_n`` output features and ``block_k`` inputs per step (a whole
    number of groups, raised to one group where smaller), the input dim cut into ``split_k``
    parts summed afterwards (more programs for a short output dim), Triton's warps and
    pipeline stages. ``choose_tiles`` picks the default; ``bench.qlinear_paths --tiles``
    compares others."""

    block_n: int
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def parse(cls, text: str) -> Tiles:
        """``BN:BK:SPLIT[:WARPS[:STAGES]]``, e.g. ``64:256:4``."""
        parts = [int(v) for v in text.split(":")]
        if not 3 <= len(parts) <= 5 or any(v < 1 for v in parts) or not all(_pow2(v) for v in parts[:2]):
            raise ValueError(f"tiles {text!r}: give BN:BK:SPLIT[:WARPS[:STAGES]], BN and BK powers of two")
        return cls(*parts)


def choose_tiles(n: int, device: torch.device) -> Tiles:
    """The default: the tiling measured on an H200 (docs/benchmarks.md, "GPU (H200)")."""
    return Tiles(_block_n(n, device))


def _table_ok(table: torch.Tensor | None, codes: torch.Tensor, scales: torch.Tensor, bits: int) -> bool:
    """Whether a table format's parts are what the kernels read (or there is no table)."""
    return table is None or (bits == 4 and table.numel() == 16 and table.dtype == torch.float32
                             and table.is_contiguous() and table.device == codes.device
                             and scales.dtype == torch.float32)


def qlinear(x: torch.Tensor, codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, out_features: int,
            group: int, bits: int, b: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, tiles: Tiles | None = None,
            table: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, W, b)`` (+ ``residual``), W (out, in) from its codes (out, packed) and
    mins/scales (out, groups) grouped along the input dim; x (..., in) on the codes' device in
    float32, bfloat16 or float16. None where the kernel does not apply (no Triton, more than
    ``MAX_ROWS`` rows, a group size that is not a power of two of at least 16, 2-bit codes, a
    layout it does not read), so the caller expands and multiplies. ``tiles``: the launch's
    tiling (default: ``choose_tiles``)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if not _table_ok(table, codes, scales, bits):
        return None
    if table is not None:
        mins = scales  # not read
    if (not 0 < m <= MAX_ROWS or x.device != codes.device or codes.dim() != 2 or codes.shape[0] != out_features
            or not _takes(codes, mins, scales, k, group, bits, x.dtype)):
        return None
    kern, interpret = _kernel(), _interpret()
    if b is not None and not (b.shape == (out_features,) and b.is_contiguous() and b.device == x.device):
        return None
    lead = x.shape[:-1]
    if residual is not None and not (residual.shape == (*lead, out_features) and residual.device == x.device):
        return None
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(m, out_features)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    asked = tiles or choose_tiles(out_features, x.device)
    key = (asked, x.dtype, _block_m(m), group, bits, r2 is not None, x.device, table is not None)
    t = _fitted.get(key, asked)
    while t is not None:
        try:
            y, part = _qlinear_launch(kern, interpret, x2, codes, mins, scales, b, r2, m, out_features, k,
                                      group, bits, t, table)
            break
        except _OutOfResources as e:
            smaller = _smaller(t, group)
            log.debug("4-bit kernel tiling %s does not fit this GPU (%s); trying %s", t, e, smaller)
            t = _fitted[key] = smaller
    if t is None:
        if key not in _unfit_logged:
            _unfit_logged.add(key)
            log.warning("no tiling of the 4-bit kernel fits this GPU for %d rows of %s (asked %s); "
                        "expanding with torch for it", m, x.dtype, asked)
        return None
    if y is None:
        return None
    if part is not None:  # the epilogue of the fused path, in torch: the same roundings
        acc = part.sum(0)
        if b is not None:
            acc += b.float()
        y = acc.to(x.dtype)
        if r2 is not None:
            y = (y.float() + r2.float()).to(x.dtype)
    return y.view(*lead, out_features)


def _qlinear_launch(kern, interpret: bool, x2: torch.Tensor, codes: torch.Tensor, mins: torch.Tensor,  # noqa: ANN001
                    scales: torch.Tensor, b: torch.Tensor | None, r2: torch.Tensor | None, m: int,
                    out_features: int, k: int, group: int, bits: int, t: Tiles,
                    table: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One launch of the product with tiling ``t``: (y, float32 partial sums or None), y None
    where the kernel failed here; raises ``_OutOfResources`` where ``t`` does not fit."""
    bm, bn, bk = _block_m(m), t.block_n, max(group, t.block_k)
    steps = -(-k // bk)
    split = max(1, min(t.split_k, steps))
    k_per = -(-steps // split) * bk  # a whole number of steps per part
    split = -(-k // k_per)
    y = torch.empty((m, out_features), dtype=x2.dtype, device=x2.device)
    part = torch.empty((split, m, out_features), dtype=torch.float32, device=x2.device) if split > 1 else None
    grid = (-(-out_features // bn), -(-m // bm), split)
    # an absent bias, residual or partial buffer points at x2, never at y: the interpreter
    # copies every tensor argument back after the run, which would overwrite y with its
    # unwritten copy
    if not _launch(kern.qlinear, grid, x2, codes, mins, scales, table if table is not None else scales,
                   b if b is not None else x2,
                   r2 if r2 is not None else x2, y, part if part is not None else x2,
                   m, out_features, k, codes.shape[1], mins.shape[1], k_per, x2.stride(0), codes.stride(0),
                   mins.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0),
                   GROUP=group, BITS=bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                   HAS_BIAS=b is not None, HAS_RES=r2 is not None, IEEE=x2.dtype == torch.float32, WIDEN=interpret,
                   TABLE=table is not None, num_warps=t.num_warps, num_stages=t.num_stages):
        return None, None
    return y, part


def dequant(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, cols: int, group: int, bits: int,
            dtype: torch.dtype, out: torch.Tensor | None = None, table: torch.Tensor | None = None
            ) -> torch.Tensor | None:
    """Codes (..., packed) grouped along the last dim -> (..., cols) in ``dtype`` on the GPU, in
    one pass (torch's expansion makes five over float32 intermediates): ``code * scale + min``
    with the product and the sum each rounded in float32, then rounded to ``dtype``, the
    reference's values bit for bit (``expand_reference``). Into ``out`` when given (contiguous,
    that shape and dtype). None where it does not apply (no Triton, 2-bit codes, a group that is
    not a power of two, a layout it does not read). ``table``: a 4-bit table format's values
    (module doc)."""
    if not _table_ok(table, codes, scales, bits):
        return None
    if table is not None:
        mins = scales  # not read
    if not _takes(codes, mins, scales, cols, group, bits, dtype):
        return None
    kern, interpret = _kernel(), _interpret()
    lead = mins.shape[:-1]
    r = math.prod(lead)
    c2, m2, s2 = codes.reshape(r, codes.shape[-1]), mins.reshape(r, mins.shape[-1]), scales.reshape(r, mins.shape[-1])
    if out is not None and not (out.shape == (*lead, cols) and out.dtype == dtype and out.is_contiguous()
                                and out.device == codes.device):
        return None
    y = out if out is not None else torch.empty((*lead, cols), dtype=dtype, device=codes.device)
    # the interpreter rounds float32 to bfloat16 by truncation, not to nearest even as a GPU
    # does: there the kernel writes float32 and torch rounds
    y2 = y.view(r, cols) if not (interpret and dtype == torch.bfloat16) else torch.empty((r, cols))
    bc = max(group, min(1024, 1 << max(cols - 1, 1).bit_length()))
    br = max(1, 4096 // bc)
    grid = (-(-r // br), -(-cols // bc))
    try:
        if not _launch(kern.dequant, grid, c2, m2, s2, table if table is not None else s2, y2, r, cols, c2.shape[1],
                       m2.shape[1], c2.stride(0), m2.stride(0), y2.stride(0), GROUP=group, BITS=bits, BLOCK_R=br,
                       BLOCK_C=bc, INTERPRET=interpret, TABLE=table is not None, num_warps=4):
            return None
    except _OutOfResources:  # a one-pass tile with no pipeline: not expected; torch expands
        return None
    if y2.dtype != dtype:
        y.view(r, cols).copy_(y2)
    return y
