"""GGUF's quantized blocks as the engine's compressed weights: each block type's codes, and per
group of its elements a scale and a minimum, so that ``code x scale + min`` is the value
llama.cpp's (and ``gguf.dequantize``'s) formula gives, bit for bit in float32.

| type | block | value | kept as |
|---|---|---|---|
| Q4_0 | 32: d, 16 bytes of nibbles | d (q - 8) | 4-bit, groups of 32, min -8 d |
| Q4_1 | 32: d, m, nibbles | d q + m | 4-bit, groups of 32 |
| Q5_0 | 32: d, 4 bytes of fifth bits, nibbles | d (q - 16) | 8-bit, groups of 32, min -16 d |
| Q5_1 | 32: d, m, fifth bits, nibbles | d q + m | 8-bit, groups of 32 |
| Q8_0 | 32: d, 32 int8 | d q | 8-bit (q + 128), groups of 32, min -128 d |
| Q2_K | 256: 16 bytes of 4-bit scale and min, 2-bit codes, d, dmin | d sc q - dmin m | 4-bit, groups of 16 |
| Q3_K | 256: high-bit mask, 2-bit codes, 12 bytes of 6-bit scales, d | d (sc - 32) (q - 4) | 4-bit, groups of 16, min -4 scale |
| Q4_K | 256: d, dmin, 12 bytes of 6-bit scales and mins, nibbles | d sc q - dmin m | 4-bit, groups of 32 |
| Q5_K | 256: d, dmin, scales and mins, fifth bits, nibbles | d sc q - dmin m | 8-bit, groups of 32 |
| Q6_K | 256: low nibbles, high 2 bits, 16 int8 scales, d | d sc (q - 32) | 8-bit, groups of 16, min -32 scale |
| IQ4_NL | 32: d, nibbles | d k[q] | the ``iq4nl`` table, groups of 32 |
| IQ4_XS | 256: d, 2 + 4 bytes of 6-bit scales, nibbles | d (ls - 32) k[q] | the ``iq4nl`` table, groups of 32 |
| MXFP4 | 32: an E8M0 exponent e, nibbles | 2^(e - 128) 2 e2m1[q] | the ``mxfp4`` table, groups of 32 |

(k: llama.cpp's 16 IQ4_NL values, -127 ... 113; a table format's scales are kept in float32
and it has no minimums: ``memory.quant.LUT4``.)

Every product above is exact in float32 (an 11-bit float16 mantissa times integers of at
most 15 bits), so ``code x scale + min`` rounds once, as the reference's ``d x q - m`` does:
the same value. The scales and minimums are kept in the run's dtype (exact in float32; in
bfloat16 they round as every weight does), a table format's scales in float32 (``d (ls -
32) k[q]`` is one product of exact factors there too). Widths that have no engine code width
of their own are kept in the next one up (5 and 6 bits in 8, 2 and 3 in 4): more bytes than
the file's, the file's values exactly. Other types (the other IQ*, TQ*) are expanded and
re-quantized.

``encode_blocks`` writes Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS blocks (which the ``gguf``
package reads but does not write) by rounding to nearest (the nearest table value), for the
benchmarks' and tests' files; llama.cpp's own quantizer searches each block's scales, so its
blocks hold other codes in the same layout.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .packed import PackedWeight

QK = 256  # a K-quant super-block's elements

# type -> (the engine's code width, group[, a table format]) it is kept in
GGUF_NATIVE: dict[str, tuple[Any, ...]] = {
    "Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (8, 32), "Q5_1": (8, 32), "Q8_0": (8, 32),
    "Q2_K": (4, 16), "Q3_K": (4, 16), "Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16),
    "IQ4_NL": (4, 32, "iq4nl"), "IQ4_XS": (4, 32, "iq4nl"), "MXFP4": (4, 32, "mxfp4"),
}
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (QK, 84), "Q3_K": (QK, 110), "Q4_K": (QK, 144), "Q5_K": (QK, 176), "Q6_K": (QK, 210),
          "IQ4_NL": (32, 18), "IQ4_XS": (QK, 136), "MXFP4": (32, 17)}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes a block (n, 2) as float32 (n, 1)."""
    return b.copy().view(np.float16).astype(np.float32)


def _bits(b: np.ndarray, shifts: list[int], width: int, size: int) -> np.ndarray:
    """Bytes (n, k) read ``width`` bits at each of ``shifts``: (n, k / size * len(shifts) * size),
    runs of ``size`` bytes giving one run of elements per shift (llama.cpp's order)."""
    out = b.reshape(b.shape[0], -1, 1, size) >> np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return (out & np.uint8((1 << width) - 1)).reshape(b.shape[0], -1)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes -> 2^(e - 128) in float32, exactly (llama.cpp's ``e8m0_to_fp32_half``:
    subnormal below e = 2, finite up to e = 255)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def _unbits(v: np.ndarray, shifts: list[int], width: int, size: int) -> np.ndarray:
    """``_bits``' inverse: elements (n, e) -> bytes (n, e / len(shifts)), each element's low
    ``width`` bits at its shift."""
    v = v.astype(np.uint8).reshape(v.shape[0], -1, len(shifts), size) & np.uint8((1 << width) - 1)
    out = np.zeros((v.shape[0], v.shape[1], size), dtype=np.uint8)
    for i, sh in enumerate(shifts):
        out |= v[:, :, i] << np.uint8(sh)
    return out.reshape(v.shape[0], -1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes (n, 12) -> the 8 sub-blocks' 6-bit scales and mins, each (n, 8)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode_blocks(blk: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks (n, bytes) of ``kind`` -> (codes (n, elements) uint8 in element order, scales and
    mins (n, groups) float32): element e of a block is ``codes[e] * scales[g] + mins[g]``,
    g = e // group (module table); for a table format ``table[codes[e]] * scales[g]``, mins
    (n, 0)."""
    n = blk.shape[0]
    if kind == "IQ4_NL":
        return _bits(blk[:, 2:18], [0, 4], 4, 16), _f16(blk[:, 0:2]), np.zeros((n, 0), np.float32)
    if kind == "MXFP4":
        return _bits(blk[:, 1:17], [0, 4], 4, 16), e8m0_half(blk[:, 0:1]), np.zeros((n, 0), np.float32)
    if kind == "IQ4_XS":
        high = (blk[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
        ls = _bits(blk[:, 4:8], [0, 4], 4, 1)  # sub-block 2j: byte j's low nibble, 2j + 1: its high one
        scale = _f16(blk[:, 0:2]) * ((ls | (high.astype(np.uint8) << 4)).astype(np.float32) - 32.0)
        return _bits(blk[:, 8:136], [0, 4], 4, 16), scale, np.zeros((n, 0), np.float32)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(blk[:, 0:2])
        at = 4 if kind in ("Q4_1", "Q5_1") else 2
        q = _bits(blk[:, -16:], [0, 4], 4, 16)
        if kind in ("Q5_0", "Q5_1"):
            high = (blk[:, at:at + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
            q = q | (high.astype(np.uint8) << 4)
        mn = _f16(blk[:, 2:4]) if at == 4 else (-8.0 if kind == "Q4_0" else -16.0) * d
        return q, d, mn
    if kind == "Q8_0":
        d = _f16(blk[:, 0:2])
        return (blk[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128.0 * d
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        sc, m = _k_scales(blk[:, 4:16])
        q = _bits(blk[:, -128:], [0, 4], 4, 32)
        if kind == "Q5_K":
            q = q | (_bits(blk[:, 16:48], list(range(8)), 1, 32) << 4)
        return q, d * sc, -(dmin * m)
    if kind == "Q6_K":
        low = _bits(blk[:, 0:128], [0, 4], 4, 64)
        high = _bits(blk[:, 128:192], [0, 2, 4, 6], 2, 32)
        scale = _f16(blk[:, 208:210]) * blk[:, 192:208].view(np.int8).astype(np.float32)
        return low | (high << 4), scale, -32.0 * scale
    if kind == "Q3_K":
        low = _bits(blk[:, 32:96], [0, 2, 4, 6], 2, 32)
        high = _bits(blk[:, 0:32], list(range(8)), 1, 32)
        s = blk[:, 96:108]
        ls = _bits(s[:, 0:8], [0, 4], 4, 8)
        hs = _bits(s[:, 8:12], [0, 2, 4, 6], 2, 4)
        scale = _f16(blk[:, 108:110]) * ((ls | (hs << 4)).astype(np.float32) - 32.0)
        return low | (high << 2), scale, -4.0 * scale  # q - 4 + 4 x high bit: the code q + 4 x high, min -4
    if kind == "Q2_K":
        s = blk[:, 0:16]
        d, dmin = _f16(blk[:, 80:82]), _f16(blk[:, 82:84])
        q = _bits(blk[:, 16:80], [0, 2, 4, 6], 2, 32)
        return q, d * (s & 0x0F).astype(np.float32), -(dmin * (s >> 4).astype(np.float32))
    raise ValueError(f"GGUF type {kind} has no kept form (kept: {', '.join(GGUF_NATIVE)})")


def gguf_packed(data: Any, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> PackedWeight:
    """A GGUF matrix of ``kind`` blocks (module table; blocks run along a row) as a
    ``PackedWeight`` in the engine's layout: codes of 4 bits two a byte, neighbours together
    (a block's own nibble order is not the engine's: the codes are reordered, no value changes)."""
    rows, cols = int(shape[0]), int(shape[1])
    per, size = _BLOCK[kind]
    bits, group, *fmt = GGUF_NATIVE[kind]
    blk = np.ascontiguousarray(data).reshape(rows * (cols // per), size)
    q, scale, mn = decode_blocks(blk, kind)
    q = q.reshape(rows, cols)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    groups = cols // group
    codes = torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8))
    scales = torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, groups)))
    if fmt:  # a table format: float32 scales, no minimums
        return PackedWeight(codes, torch.zeros(rows, 0), scales, (rows, cols), bits, group, fmt[0])
    return PackedWeight(codes, torch.from_numpy(mn.reshape(rows, groups)).to(dtype), scales.to(dtype), (rows, cols),
                        bits, group)


def _as_f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 (n,) -> (its float16 rounding as float32 (n, 1), the two bytes (n, 2))."""
    h = x.astype(np.float16).reshape(-1, 1)
    return h.astype(np.float32), h.view(np.uint8).reshape(-1, 2)


def _round_step(x: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round(x / step) in [lo, hi], 0 where the step is 0."""
    safe = np.where(step == 0, 1.0, step)
    return np.where(step == 0, 0, np.clip(np.rint(x / safe), lo, hi)).astype(np.int32)


def encode_blocks(x: np.ndarray, kind: str) -> np.ndarray:
    """Rows of float32 values (n, a multiple of 256; of 32 for IQ4_NL) as ``kind`` blocks
    (Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS), rounded to nearest: (n, bytes) uint8, the layout
    ``decode_blocks`` and ``gguf.dequantize`` read."""
    rows = x.shape[0]
    v = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 32 if kind == "IQ4_NL" else QK)
    n = v.shape[0]
    if kind in ("IQ4_NL", "IQ4_XS"):
        from ..memory.quant import LUT4

        k = np.array(LUT4["iq4nl"], dtype=np.float32)
        sub = v.reshape(n, -1, 32)
        at = np.abs(sub).argmax(-1)
        step = np.take_along_axis(sub, at[..., None], -1)[..., 0] / -127  # the largest magnitude at -127
        if kind == "IQ4_NL":
            d, d_b = _as_f16(step[:, 0])
            scale = d
        else:
            d, d_b = _as_f16(np.abs(step).max(-1) / 31)
            ls = _round_step(step, d, -32, 31)
            scale = d * ls
        safe = np.where(scale == 0, 1.0, scale)[..., None]  # (n, sub-blocks, 1)
        # the nearest table value (k ascending): the count of midpoints below each value
        q = np.searchsorted((k[1:] + k[:-1]) / 2, sub / safe).astype(np.uint8)
        nibbles = _unbits(q.reshape(-1, 32), [0, 4], 4, 16).reshape(n, -1)
        if kind == "IQ4_NL":
            out = np.concatenate([d_b, nibbles], axis=1)
        else:
            u = (ls + 32).astype(np.uint16)
            high = ((u >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
            low = _unbits((u & 15).astype(np.uint8), [0, 4], 4, 1)
            out = np.concatenate([d_b, high.reshape(-1, 1).view(np.uint8), low, nibbles], axis=1)
    elif kind in ("Q4_K", "Q5_K"):
        top = 15 if kind == "Q4_K" else 31
        sub = v.reshape(n, 8, 32)
        lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
        step, low = (hi - lo) / top, -lo  # each sub-block's step and (positive) minimum
        d, d_b = _as_f16(step.max(-1) / 63)
        dmin, dmin_b = _as_f16(low.max(-1) / 63)
        sc, m = _round_step(step, d, 0, 63), _round_step(low, dmin, 0, 63)
        q = _round_step(sub + (dmin * m)[..., None], (d * sc)[..., None], 0, top).reshape(n, QK)
        scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                                 (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1).astype(np.uint8)
        parts = [d_b, dmin_b, scales]
        if kind == "Q5_K":
            parts.append(_unbits(q >> 4, list(range(8)), 1, 32))
        out = np.concatenate(parts + [_unbits(q & 15, [0, 4], 4, 32)], axis=1)
    elif kind == "Q6_K":
        sub = v.reshape(n, 16, 16)
        at = np.abs(sub).argmax(-1)
        step = np.take_along_axis(sub, at[..., None], -1)[..., 0] / -32  # the largest magnitude at -32
        d, d_b = _as_f16(np.abs(step).max(-1) / 127)
        sc = _round_step(step, d, -128, 127)
        q = (_round_step(sub, (d * sc)[..., None], -32, 31) + 32).reshape(n, QK)
        out = np.concatenate([_unbits(q & 15, [0, 4], 4, 64), _unbits(q >> 4, [0, 2, 4, 6], 2, 32),
                              sc.astype(np.int8).view(np.uint8), d_b], axis=1)
    else:
        raise ValueError(f"encode_blocks writes Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS, not {kind}")
    return out.reshape(rows, -1)
