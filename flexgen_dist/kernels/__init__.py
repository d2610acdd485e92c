"""Native CPU kernels, compiled on first use for the machine that runs them: float32 decode
GEMM (and bfloat16 where the CPU has AVX512_BF16), RMSNorm, rotary, SwiGLU's ``silu(g) * u``
(``cpu_kernels.cpp``), decode attention over a cache in the dtype or compressed
(``cpu_attention.cpp``; its wrappers in ``attend.py``), group-wise 4/8-bit weights in the
compute dtype: their expansion in one pass and the fused product of few rows with the packed
codes (``cpu_qlinear.cpp``), and the quantization a compressed cache stores (``cpu_quant.cpp``).

The sources (``_SOURCES``) are built (``build.py``) with the system C++ compiler (``$CXX`` or g++) with ``_FLAGS``
into ``kernel_dir()`` (``$FLEXGEN_KERNEL_DIR``, else ``kernels/`` under ``cache_root()``:
``$FLEXGEN_CACHE``, ``$XDG_CACHE_HOME/flexgen_dist`` or ``~/.cache/flexgen_dist``), once per source, compiler and CPU feature set, so nodes
that share a home directory never load a build for another CPU. The build takes ~13 s on 2 cores. The
GEMM form policy (``gemm.py``) is stored in the same directory.
Without a compiler, on a CPU without AVX2+FMA, or with ``FLEXGEN_CPU_KERNELS=0``, ``library()``
returns None and callers use torch's own kernels; the reason is logged once.

This package is a leaf: it imports nothing else from flexgen_dist.
"""
from __future__ import annotations

from typing import Any

import torch

from .build import (_HEADERS, _SOURCES, _state, build_from, build_key, cache_root, cpu_info, enabled, kernel_dir,
                    library)

__all__ = ["_HEADERS", "_SOURCES", "build_from", "build_key", "cache_root", "cpu_info", "enabled", "kernel_dir",
           "library", "linear_f32", "linear_bf16", "rms_norm", "silu_mul", "rope", "native_bf16_product",
           "dequant_fp8", "dequant_lut4", "dequant", "quant", "qlinear"]

# dtype codes of the kernels that take several dtypes (DT_* in cpu_simd.h)
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x (..., n) as (rows, n) without a copy (each row contiguous, rows evenly strided), or None."""
    if x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def linear_f32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ w.T + b + residual`` for float32 CPU tensors with few rows, or None where the
    kernel does not apply (no library, another dtype or device, a weight or input whose rows
    are not contiguous).

    x (..., in) with its last dim contiguous, w (out, in) row-major, b (out,) or None,
    residual (..., out) contiguous or None.
    """
    lib = library()
    return None if lib is None else _dense(lib.fg_linear_f32, torch.float32, x, w, b, residual)


def linear_bf16(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ w.T + b + residual`` for bfloat16 CPU tensors with few rows, with VDPBF16PS (float32
    sums, the output rounded once, then the bias and the residual added with one rounding
    each), or None where the kernel does not apply (no library, a CPU without AVX512_BF16,
    another dtype or device, rows that are not contiguous). Shapes as ``linear_f32``."""
    lib = library()
    ok = lib is not None and native_bf16_product()
    return _dense(lib.fg_linear_bf16, torch.bfloat16, x, w, b, residual) if ok else None  # type: ignore[union-attr]


def _dense(fn: Any, dtype: torch.dtype, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           residual: torch.Tensor | None) -> torch.Tensor | None:
    """A native dense product of few rows in ``dtype`` (``fn``: ``fg_linear_f32`` or
    ``fg_linear_bf16``, one signature), or None where the operands do not suit it."""
    if (not _same_cpu(dtype, x, w) or w.dim() != 2 or w.stride(1) != 1 or x.shape[-1] != w.shape[1]
            or (b is not None and not (_same_cpu(dtype, b) and b.is_contiguous()))
            or (residual is not None and not (_same_cpu(dtype, residual) and residual.is_contiguous()
                                              and residual.shape == (*x.shape[:-1], w.shape[0])))):
        return None
    x2 = _rows(x)
    if x2 is None:
        return None
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=dtype)
    fn(x2.data_ptr(), m, k, x2.stride(0), w.data_ptr(), n, w.stride(0), b.data_ptr() if b is not None else None,
       residual.data_ptr() if residual is not None else None, y.data_ptr(), n, torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of CPU rows x (..., n) (last dim contiguous) with weight w (n,) of x's dtype, in
    one pass: float32 as ``w * (x * r)``; bfloat16 or float16 as the reference computes a half
    dtype (normalised in float32, rounded, then times w in the dtype). None where the kernel
    does not apply."""
    lib = library()
    ok = lib is not None and _same_cpu(x.dtype, x, w) and w.is_contiguous() and w.shape == x.shape[-1:]
    x2 = _rows(x) if ok else None
    if x2 is None:
        return None
    y = torch.empty(x.shape, dtype=x.dtype)
    lib.fg_rms_norm(x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0), w.data_ptr(), eps,  # type: ignore[union-attr]
                    y.data_ptr(), _DT[x.dtype], torch.get_num_threads())
    return y


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> bool:
    """``g = silu(g) * u`` in place in one pass, for contiguous CPU tensors of one shape and
    dtype (float32; bfloat16 or float16 rounded as torch rounds ``silu(g) * u`` there: silu
    rounded to the dtype, then the product); False (nothing done) where the kernel does not
    apply."""
    lib = library()
    if lib is None or not _same_cpu(g.dtype, g, u) or g.shape != u.shape or not g.is_contiguous() or not u.is_contiguous():
        return False
    lib.fg_silu_mul(g.data_ptr(), u.data_ptr(), g.numel(), _DT[g.dtype], torch.get_num_threads())
    return True


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding (rotate-half convention) of x (b, t, heads, d) with cos/sin
    (b, t, 1, d) of x's dtype, out of place, in one pass (a half dtype rounded as torch's
    ``x * cos`` then ``addcmul_`` round it); None where the kernel does not apply."""
    lib = library()
    if (lib is None or x.dim() != 4 or not _same_cpu(x.dtype, x, cos, sin)
            or not all(a.is_contiguous() for a in (x, cos, sin)) or cos.shape != (*x.shape[:2], 1, x.shape[3])
            or sin.shape != cos.shape or x.shape[3] % 2):
        return None
    b, t, h, d = x.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.fg_rope(x.data_ptr(), b * t, h, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), _DT[x.dtype],
                torch.get_num_threads())
    return out


def _same_cpu(dtype: torch.dtype, *ts: torch.Tensor) -> bool:
    """Every tensor a CPU tensor of ``dtype``, one the kernels take (float32, bfloat16, float16)."""
    return dtype in _DT and all(t.dtype == dtype and t.device.type == "cpu" for t in ts)


def native_bf16_product() -> bool:
    """Whether the kernels multiply bfloat16 natively here (AVX512_BF16's VDPBF16PS): the fused
    quantized product, rather than widening to float32, and ``linear_bf16`` at all."""
    return library() is not None and bool(_state.get("dpbf16"))


def _qparts_ok(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, cols: int, group: int,
               bits: int, device: str = "cpu") -> bool:
    """Whether codes, mins and scales are the layout the one-pass kernels read, on ``device``
    (the native ones here on the CPU, ``qlinear_gpu``'s on a GPU)."""
    return (bits in (4, 8) and codes.dtype == torch.uint8 and codes.device.type == device
            and mins.dtype in _DT and scales.dtype == mins.dtype and mins.device == codes.device
            and scales.device == codes.device
            and mins.shape == scales.shape and mins.stride() == scales.stride()
            and codes.shape[:-1] == mins.shape[:-1] and mins.shape[-1] == -(-cols // group)
            and codes.shape[-1] * 8 // bits >= cols and codes.stride(-1) == 1 and mins.stride(-1) == 1)


def dequant_fp8(codes: torch.Tensor, scales: torch.Tensor, cols: int, group: int, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows of FP8 e4m3 codes (rows, >= groups * group) uint8 expanded into ``dtype`` in one
    pass: each ``fp8(code) * scale`` in float32 (scales (rows, groups) float32), rounded to
    ``dtype``: the values ``memory.quant.dequantize`` computes. Into ``out`` when given. None
    where the kernel does not apply (no library, another dtype or device, rows not strided)."""
    lib = library()
    if lib is None or dtype not in _DT or codes.dim() != 2 or scales.dim() != 2 or scales.dtype != torch.float32:
        return None
    if codes.device.type != "cpu" or scales.device.type != "cpu" or codes.dtype != torch.uint8:
        return None
    if codes.stride(1) != 1 or scales.stride(1) != 1 or codes.shape[1] < scales.shape[1] * group:
        return None
    if scales.shape[1] != -(-cols // group) or codes.shape[0] != scales.shape[0]:
        return None
    if out is None:
        out = torch.empty((codes.shape[0], cols), dtype=dtype)
    elif out.shape != (codes.shape[0], cols) or not out.is_contiguous() or out.dtype != dtype or out.device.type != "cpu":
        return None
    lib.fg_dequant_fp8(codes.data_ptr(), codes.shape[0], cols, codes.stride(0), scales.data_ptr(), scales.stride(0),
                       group, out.data_ptr(), _DT[dtype], torch.get_num_threads())
    return out


def dequant_lut4(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor, cols: int, group: int,
                 dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows of 4-bit table codes (rows, >= groups * group / 2) uint8, two a byte low bits first,
    expanded into ``dtype`` in one pass: each ``table[code] * scale`` in float32 (table 16
    float32 values, scales (rows, groups) float32), rounded to ``dtype``: the values
    ``memory.quant.dequantize`` computes. Into ``out`` when given. None where the kernel does
    not apply (``dequant``'s conditions)."""
    if scales.dtype != torch.float32:
        return None
    return dequant(codes, scales, scales, cols, group, 4, dtype, out, table=table)


def dequant(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, cols: int, group: int, bits: int,
            dtype: torch.dtype, out: torch.Tensor | None = None, table: torch.Tensor | None = None
            ) -> torch.Tensor | None:
    """Rows of group-wise quantized codes expanded into ``dtype`` (float32, bfloat16 or
    float16) in one pass: codes (..., packed) uint8, mins/scales (..., groups) of any of those
    dtypes, each row contiguous -> (..., cols), contiguous (written into ``out`` when given: a
    reused buffer spares the page faults of a fresh allocation). Each value is
    ``code * scale + min`` in float32, rounded to ``dtype``: the reference expansion's value.
    None where the kernel does not apply (no library, bits other than 4 and 8, another dtype or
    device, rows that are neither one strided run nor two, as a slice of a cache chunk is).
    ``table``: a 4-bit table format's 16 float32 values (``table[code] * scale``; ``mins`` is
    not read: pass the scales)."""
    lib = library()
    if table is not None:
        if bits != 4 or table.numel() != 16 or table.dtype != torch.float32 or table.device.type != "cpu":
            return None
        table = table.contiguous()
    if lib is None or dtype not in _DT or not _qparts_ok(codes, mins, scales, cols, group, bits):
        return None
    lead = tuple(mins.shape[:-1])
    c2, m2 = _rows(codes), _rows(mins)
    if c2 is not None and m2 is not None:
        n0, n1, cs, ms = 1, c2.shape[0], (0, c2.stride(0)), (0, m2.stride(0))
    elif len(lead) == 2:
        n0, n1, cs, ms = lead[0], lead[1], codes.stride()[:2], mins.stride()[:2]
    else:
        return None
    if out is None:
        out = torch.empty((*lead, cols), dtype=dtype)
    elif out.shape != (*lead, cols) or not out.is_contiguous() or out.dtype != dtype or out.device.type != "cpu":
        return None
    lib.fg_dequant(codes.data_ptr(), n0, n1, cols, *cs, mins.data_ptr(), scales.data_ptr(), *ms, _DT[mins.dtype],
                   group, bits, out.data_ptr(), _DT[dtype], torch.get_num_threads(),
                   table.data_ptr() if table is not None else None)
    return out


def quant(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``memory.quant.quantize`` of x along its last dim in one pass on the CPU: (codes (..., packed)
    uint8, mins (..., groups), scales (..., groups)) in x's dtype, bit for bit the reference's;
    None where the kernel does not apply (no library or a build without it, other bits, another
    dtype or device)."""
    lib = library()
    if (lib is None or not hasattr(lib, "fg_quant") or bits not in (4, 8) or x.dtype not in _DT
            or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] == 0 or group < 1):
        return None
    n = x.shape[-1]
    lead = tuple(x.shape[:-1])
    x2 = _rows(x)
    if x2 is None:
        x2 = x.reshape(-1, n).contiguous()
    groups = -(-n // group)
    codes = torch.empty((*lead, -(-groups * group * bits // 8)), dtype=torch.uint8)
    mins = torch.empty((*lead, groups), dtype=x.dtype)
    scales = torch.empty_like(mins)
    rows = x2.shape[0]
    if rows:
        lib.fg_quant(x2.data_ptr(), rows, n, x2.stride(0), _DT[x.dtype], group, bits, codes.data_ptr(),
                     codes.shape[-1], mins.data_ptr(), scales.data_ptr(), groups, torch.get_num_threads())
    return codes, mins, scales


def qlinear(x: torch.Tensor, codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, out_features: int,
            group: int, bits: int, b: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, native_bf16: bool = True,
            table: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, W, b)`` (+ ``residual``) with W (out, in) given by its group-wise quantized
    codes (out, packed) and mins/scales (out, groups), grouped along the input dim, expanded a
    panel at a time inside the product (never as a whole). x (..., in) in float32, bfloat16 or
    float16 on the CPU, its last dim contiguous; the output and b and residual in x's dtype.
    Rounds as the reference does (module doc of ``cpu_qlinear.cpp``). None where the kernel does
    not apply (no library, another dtype or layout). ``native_bf16=False`` widens bfloat16 to
    float32 even where the CPU multiplies bfloat16 natively (the path of other CPUs, for tests).
    ``table``: a 4-bit table format's 16 float32 values (each code stands for its entry times the
    group's float32 scale; ``mins`` is not read: pass the scales)."""
    lib = library()
    k = x.shape[-1]
    dt = x.dtype
    if table is not None:
        if bits != 4 or table.numel() != 16 or table.dtype != torch.float32 or table.device.type != "cpu" \
                or scales.dtype != torch.float32:
            return None
        table = table.contiguous()
        mins = scales  # not read: the kernel's mins of a table format are 0
    if (lib is None or dt not in _DT or x.device.type != "cpu" or codes.dim() != 2 or mins.dim() != 2
            or codes.shape[0] != out_features or codes.stride(-1) != 1
            or not _qparts_ok(codes, mins, scales, k, group, bits)
            or (b is not None and not (b.dtype == dt and b.device.type == "cpu" and b.is_contiguous()
                                       and b.shape == (out_features,)))
            or (residual is not None and not (residual.dtype == dt and residual.device.type == "cpu"
                                              and residual.is_contiguous()
                                              and residual.shape == (*x.shape[:-1], out_features)))):
        return None
    x2 = _rows(x)
    if x2 is None:
        return None
    m = x2.shape[0]
    y = torch.empty((m, out_features), dtype=dt)
    native = dt == torch.bfloat16 and native_bf16 and bool(_state.get("dpbf16"))
    if native:  # x in the kernel's column order, padded
        xf: torch.Tensor | None = torch.empty((m, -(-k // 32) * 32), dtype=torch.bfloat16)
    else:  # x widened to float32 (none needed in float32)
        xf = torch.empty((m, k), dtype=torch.float32) if dt != torch.float32 else None
    lib.fg_qlinear(x2.data_ptr(), m, k, x2.stride(0), codes.data_ptr(), codes.stride(0), mins.data_ptr(),
                   scales.data_ptr(), mins.stride(0), _DT[mins.dtype], out_features, group, bits,
                   b.data_ptr() if b is not None else None,
                   residual.data_ptr() if residual is not None else None, y.data_ptr(), out_features, _DT[dt],
                   xf.data_ptr() if xf is not None else None, int(native), torch.get_num_threads(),
                   table.data_ptr() if table is not None else None)
    return y.view(*x.shape[:-1], out_features)
