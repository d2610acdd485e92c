"""Decode attention on the CPU (``cpu_attention.cpp``): one query position per head over cache
rows read in place, stored in the compute dtype (``attention``, ``attention_lse``) or as a
compressed cache's group-wise 4/8-bit codes (``attention_packed``: each value expanded in
registers as it is read, bit for bit what attention over the expanded cache gives, without
writing the expansion to memory and reading it back). Each returns None where its kernel does
not apply, and the caller runs torch's path."""
from __future__ import annotations

import ctypes

import torch

from . import _DT, _state, library

Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes, mins, scales


class PackedPart(ctypes.Structure):
    """``PackedPart`` of cpu_attention.cpp: codes' row and position strides in bytes, the
    groups' minimums' and scales' in elements."""

    _fields_ = [("codes", ctypes.c_void_p), ("cr", ctypes.c_int64), ("cl", ctypes.c_int64),
                ("mins", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mr", ctypes.c_int64),
                ("ml", ctypes.c_int64)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              scale: float, sinks: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """Decode attention over cache rows, in float32, bfloat16 or float16 (float32 arithmetic,
    the output rounded once): q (R, G, 1, d) contiguous, k/v (R, L, d) with each position's d
    elements contiguous and rows and positions evenly strided (strided views of a
    preallocated cache, row-major or position-major, are read in place), mask (R, 1, 1, L)
    bool -> (R, G, 1, d); or None where the kernel does not apply (no library, another dtype,
    device or layout, head_dim not a multiple of the vector width). ``sinks`` (R, G): a logit
    per query head joining each softmax's denominator (gpt-oss). ``lib``: another build of the
    kernels (``build_from``) to run instead of this one's."""
    got = _dense(q, k, v, mask, scale, sinks, False, lib)
    return None if got is None else got[0]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``attention`` in float32 (not rounded to the dtype: the merge rounds once) and each query
    head's log-sum-exp of its scores, (R, G, 1) float32: what merging it with attention over
    other keys takes (``attention.merge_lse``)."""
    return _dense(q, k, v, mask, scale, None, True)


def attention_packed(q: torch.Tensor, k: Parts, v: Parts, bits: int, group: int, mask: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None = None, with_lse: bool = False,
                     lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``attention`` (``with_lse``: ``attention_lse``) over a compressed cache: k and v each
    (codes, mins, scales) of ``memory/quant.py``'s layout grouped along the head dim, codes
    (R, L, packed) uint8 and mins/scales (R, L, groups) in q's dtype, each position's codes and
    groups contiguous, rows and positions evenly strided (views of a row-major chunk or of a
    position-major staged one, read in place); ``bits`` 4 or 8, ``group`` elements a group.
    Returns (out, lse or None), equal bit for bit to the dense kernel over the expanded cache;
    None where the kernel does not apply (no library or a build without it, other bits, a group
    that is not a whole number of vectors, another dtype or layout)."""
    if library() is None:
        return None
    lib = lib or library()
    if not hasattr(lib, "fg_attention_packed"):
        return None
    r, g, t, d = q.shape
    L = k[0].shape[1]
    w = int(_state["width"])
    if bits not in (4, 8) or group % w or not all(_parts_ok(x, r, L, d, bits, group, q.dtype) for x in (k, v)):
        return None
    ks, vs = (PackedPart(c.data_ptr(), c.stride(0), c.stride(1), m.data_ptr(), s.data_ptr(), m.stride(0),
                         m.stride(1)) for c, m, s in (k, v))

    def call(out: torch.Tensor, lse: torch.Tensor | None, sk: torch.Tensor | None) -> bool:
        return bool(lib.fg_attention_packed(q.data_ptr(), r, g, d, ctypes.byref(ks), ctypes.byref(vs), L, bits, group,
                                            mask.data_ptr(), mask.stride(0), None if sk is None else sk.data_ptr(),
                                            scale, out.data_ptr(), None if lse is None else lse.data_ptr(),
                                            _DT[q.dtype], torch.get_num_threads()))

    return _launch(q, L, mask, sinks, with_lse, call)


def _parts_ok(x: Parts, r: int, L: int, d: int, bits: int, group: int, dtype: torch.dtype) -> bool:
    codes, mins, scales = x
    groups = -(-d // group)
    return (codes.dtype == torch.uint8 and codes.dim() == 3 and codes.shape[:2] == (r, L)
            and codes.shape[2] * 8 // bits >= groups * group and codes.stride(2) == 1
            and mins.dtype == dtype and scales.dtype == dtype and mins.shape == (r, L, groups)
            and scales.shape == mins.shape and scales.stride() == mins.stride() and mins.stride(2) == 1
            and all(p.device.type == "cpu" for p in x))


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           sinks: torch.Tensor | None, with_lse: bool,
           lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if library() is None:  # also what sets the vector width read in _launch
        return None
    lib = lib or library()
    r, L = q.shape[0], k.shape[1]
    if (any(x.dtype != q.dtype or x.device.type != "cpu" for x in (k, v)) or k.shape != v.shape
            or k.shape[0] != r or any(x.stride(2) != 1 for x in (k, v))):
        return None

    def call(out: torch.Tensor, lse: torch.Tensor | None, sk: torch.Tensor | None) -> bool:
        lib.fg_attention(q.data_ptr(), r, q.shape[1], q.shape[3], k.data_ptr(), k.stride(0), k.stride(1),
                         v.data_ptr(), v.stride(0), v.stride(1), L, mask.data_ptr(), mask.stride(0),
                         None if sk is None else sk.data_ptr(), scale, out.data_ptr(),
                         None if lse is None else lse.data_ptr(), _DT[q.dtype], torch.get_num_threads())
        return True

    return _launch(q, L, mask, sinks, with_lse, call)


def _launch(q: torch.Tensor, L: int, mask: torch.Tensor, sinks: torch.Tensor | None, with_lse: bool,
            call) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The checks on q, the mask and the sinks both kernels share; the outputs, filled by
    ``call(out, lse, sinks)`` (False: the kernel declined)."""
    r, g, t, d = q.shape
    if (t != 1 or q.dtype not in _DT or q.device.type != "cpu" or d % int(_state["width"])
            or not q.is_contiguous() or mask.dtype != torch.bool or mask.shape != (r, 1, 1, L)
            or mask.stride(-1) != 1):
        return None
    if sinks is not None:
        sinks = sinks.to("cpu", torch.float32).contiguous()
        if sinks.shape != (r, g):
            return None
    out = torch.empty((r, g, 1, d), dtype=torch.float32 if with_lse else q.dtype)
    lse = torch.empty((r, g, 1), dtype=torch.float32) if with_lse else None
    return (out, lse) if call(out, lse, sinks) else None
