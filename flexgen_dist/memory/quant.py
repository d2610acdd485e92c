"""Group-wise asymmetric min-max quantization (FlexGen style), packed 2/4/8-bit.

A tensor is cut into groups of ``group_size`` contiguous elements along one dimension
``dim``. Each group stores its minimum and its step ``scale = (max - min) / (2^bits - 1)``;
the codes are ``round((x - min) / scale)`` clamped to ``[0, 2^bits - 1]`` and packed
``8 // bits`` per byte (low bits first).

Layout of a :class:`QTensor` (``d`` is the grouping dim, ``L`` the other dims in order,
i.e. ``shape`` with ``d`` removed)::

    data   : uint8, L + (packed,)      packed = ceil(num_groups * group_size * bits / 8)
    mins   : dtype, L + (num_groups,)  num_groups = ceil(shape[d] / group_size)
    scales : dtype, L + (num_groups,)

For the usual ``dim=-1`` that is ``data.shape == x.shape[:-1] + (packed,)`` and
``mins.shape == x.shape[:-1] + (num_groups,)``: every part keeps the leading dims of the
original, so a caller can write a slice of rows/positions of a preallocated QTensor (e.g. a
KV cache ``(rows, seq, head_dim)`` grouped along ``head_dim``) part by part. The grouping dim
is padded (with copies of the group's values, which cannot widen its range) up to a whole
number of groups; the padding is dropped again by :func:`dequantize`.

Parts may also be :class:`~flexgen_dist.memory.disk.DiskTensor` s (a compressed tensor on the
disk tier); only ``nbytes`` and ``copy_between`` apply to those.

A QTensor of format ``E4M3`` (``fmt``) holds an FP8 checkpoint's own codes instead (8 bits, one
float8 e4m3 value a byte, stored as uint8): element e of a group is ``fp8(code) * scale`` in
float32, the scales float32, no mins (``mins`` is empty, ``L + (0,)``); the codes are padded
with zeros (the value 0) to whole groups. Nothing quantizes to it: a checkpoint's codes are
adopted (``models/packed.py``), and ``dequantize`` gives exactly the values the checkpoint's
expansion gives (the same float32 product).

A QTensor of a 4-bit table format (``LUT4``: ``nf4`` and ``fp4``, bitsandbytes' code tables;
``iq4nl``, llama.cpp's IQ4_NL/IQ4_XS values; ``mxfp4``, the e2m1 values doubled, beside a
scale of 2^(e - 128) a block: MXFP4's values, as llama.cpp writes them) holds 4-bit codes packed as ``INT``'s (two a byte,
low bits first) that stand for the 16 values of the format's table: element e of a group is
``table[code] * scale`` in float32, the scales float32, no mins (``L + (0,)``). Adopted from
checkpoints only, like ``E4M3``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

SUPPORTED_BITS = (2, 4, 8)
INT, E4M3 = "int", "e4m3"  # a QTensor's formats: min-max integer codes, or FP8 codes times a scale
# 4-bit code tables (module doc): each format's 16 values, float32 (bitsandbytes' NF4 and FP4 maps,
# llama.cpp's IQ4_NL values), exactly as the checkpoints' own expansions use them
LUT4: dict[str, tuple[float, ...]] = {
    "nf4": (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0),
    "fp4": (0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204,
            0.25, 0.0, -0.0052083334885537624, -0.6666666865348816, -1.0, -0.3333333432674408, -0.5,
            -0.1666666716337204, -0.25),
    "iq4nl": (-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0, 1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0,
              113.0),
    # e2m1's values times 2, so that the scale 2^(e - 128) of an E8M0 exponent e stays finite
    "mxfp4": (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0),
}


_TABLES: dict[tuple[str, str], torch.Tensor] = {}


def lut4_table(fmt: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 float32 values of 4-bit table format ``fmt`` (one tensor per format and device)."""
    key = (fmt, str(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(LUT4[fmt], dtype=torch.float32, device=device)
    return _TABLES[key]


@dataclass
class QTensor:
    """A quantized tensor: packed codes plus per-group min and scale (see module doc)."""

    data: Any    # torch.Tensor (uint8) or DiskTensor
    mins: Any    # torch.Tensor (original dtype) or DiskTensor
    scales: Any  # torch.Tensor (original dtype) or DiskTensor
    shape: torch.Size
    dtype: torch.dtype
    dim: int            # grouping dim, normalised to 0 <= dim < len(shape)
    group_size: int
    bits: int
    fmt: str = INT

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes plus group metadata."""
        return int(self.data.nbytes + self.mins.nbytes + self.scales.nbytes)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def parts(self) -> tuple[Any, Any, Any]:
        return self.data, self.mins, self.scales

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QTensor:
        return replace(self, data=self.data.to(device, non_blocking=non_blocking),
                       mins=self.mins.to(device, non_blocking=non_blocking),
                       scales=self.scales.to(device, non_blocking=non_blocking))

    def pin(self) -> QTensor:
        """Pinned-memory copy of a CPU QTensor; returns self without CUDA (nothing to pin for)."""
        if not torch.cuda.is_available():
            return self
        return replace(self, data=self.data.pin_memory(), mins=self.mins.pin_memory(),
                       scales=self.scales.pin_memory())


def _check_args(shape: torch.Size, dtype: torch.dtype, bits: int, group_size: int,
                dim: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"quantization bits={bits}: use one of {SUPPORTED_BITS}")
    if group_size < 1:
        raise ValueError(f"quantization group_size={group_size}: must be >= 1")
    if not dtype.is_floating_point:
        raise TypeError(f"can only quantize floating-point tensors, got {dtype}")
    if len(shape) == 0:
        raise ValueError("cannot quantize a 0-dim tensor: give it at least one dimension")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"quantization dim={dim} out of range for shape {tuple(shape)}")
    return dim % len(shape)


def qtensor_layout(shape: tuple[int, ...] | torch.Size, bits: int, group_size: int,
                   dim: int) -> tuple[torch.Size, torch.Size]:
    """``(data_shape, meta_shape)`` of the QTensor of a tensor of ``shape`` (module doc)."""
    shape = torch.Size(shape)
    dim = _check_args(shape, torch.float32, bits, group_size, dim)
    lead = shape[:dim] + shape[dim + 1:]
    num_groups = math.ceil(shape[dim] / group_size)
    packed = math.ceil(num_groups * group_size * bits / 8)
    return lead + (packed,), lead + (num_groups,)


def empty_qtensor(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, bits: int = 4,
                  group_size: int = 64, dim: int = -1,
                  device: torch.device | str = "cpu", pin_memory: bool = False) -> QTensor:
    """A preallocated QTensor to be filled in place (e.g. a KV cache); ``pin_memory``: in
    pinned host memory (a CPU ``device`` feeding a GPU).

    Zero-filled, not uninitialised: unwritten positions dequantize to 0, never to NaN, so a
    masked attention over them stays finite.
    """
    shape = torch.Size(shape)
    ndim_dim = _check_args(shape, dtype, bits, group_size, dim)
    data_shape, meta_shape = qtensor_layout(shape, bits, group_size, dim)
    return QTensor(data=torch.zeros(data_shape, dtype=torch.uint8, device=device, pin_memory=pin_memory),
                   mins=torch.zeros(meta_shape, dtype=dtype, device=device, pin_memory=pin_memory),
                   scales=torch.zeros(meta_shape, dtype=dtype, device=device, pin_memory=pin_memory),
                   shape=shape, dtype=dtype, dim=ndim_dim, group_size=group_size, bits=bits)


def quantize(x: torch.Tensor, bits: int = 4, group_size: int = 64, dim: int = -1) -> QTensor:
    """Quantize ``x`` group-wise along ``dim``; runs on ``x``'s device, math in float32 (on the CPU
    along the last dim, the native one-pass kernel where it applies: the same codes, minimums and
    scales)."""
    d = _check_args(x.shape, x.dtype, bits, group_size, dim)
    if x.device.type == "cpu" and d == x.dim() - 1:
        from ..kernels import quant as native  # the same codes in one pass (a leaf: no cycle)

        got = native(x.detach(), bits, group_size)
        if got is not None:
            return QTensor(data=got[0], mins=got[1], scales=got[2], shape=x.shape, dtype=x.dtype, dim=d,
                           group_size=group_size, bits=bits)
    n = x.shape[d]
    num_groups = math.ceil(n / group_size)
    xt = x.detach().movedim(d, -1).float()
    lead = xt.shape[:-1]
    pad = num_groups * group_size - n
    if pad:
        # Repeat the last element: padding inside the last group's existing range.
        xt = torch.cat([xt, xt[..., -1:].expand(*lead, pad)], dim=-1)
    groups = xt.reshape(*lead, num_groups, group_size)
    mn = groups.amin(dim=-1)
    mx = groups.amax(dim=-1)
    levels = 2 ** bits - 1
    # Codes are computed against the min/scale as stored (rounded to x.dtype), so the
    # stored metadata's rounding does not add to the reconstruction error.
    mins = mn.to(x.dtype)
    scales = ((mx - mn) / levels).to(x.dtype)
    mn_s = mins.float().unsqueeze(-1)
    sc_s = scales.float().unsqueeze(-1)
    safe = torch.where(sc_s > 0, sc_s, torch.ones_like(sc_s))  # constant group -> code 0
    codes = ((groups - mn_s) / safe).round_().clamp_(0, levels).to(torch.uint8)
    return QTensor(data=_pack(codes.reshape(*lead, -1), bits), mins=mins, scales=scales,
                   shape=x.shape, dtype=x.dtype, dim=d, group_size=group_size, bits=bits)


def dequantize(q: QTensor, device: torch.device | str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Back to a dense tensor of ``q.shape`` and ``q.dtype`` on ``device`` (default: q's),
    written into ``out`` (contiguous, that shape, dtype and device) when given."""
    data, mins, scales = q.data, q.mins, q.scales
    if not all(isinstance(p, torch.Tensor) for p in (data, mins, scales)):
        raise TypeError("dequantize needs the QTensor in memory: copy it off disk first "
                        "(copy_between into an empty_qtensor)")
    if device is not None:
        data, mins, scales = (p.to(device) for p in (data, mins, scales))
    n = q.shape[q.dim]
    if q.fmt == E4M3:  # each code's float value times its group's scale, in float32
        if data.device.type == "cpu" and q.dim == len(q.shape) - 1 == 1:
            from ..kernels import dequant_fp8  # the native one-pass expansion (a leaf: no cycle)

            fast = dequant_fp8(data, scales, n, q.group_size, q.dtype, out)
            if fast is not None:
                return fast
        return _expand_scaled(q, data, scales, n, out)
    if q.fmt in LUT4:  # each code's table value times its group's scale, in float32
        if q.dim == len(q.shape) - 1 == 1:
            from ..kernels.qweight import table_expansion  # one pass on the device (a leaf: no cycle)

            fast = table_expansion(data, scales, lut4_table(q.fmt, data.device), n, q.group_size, q.dtype, out)
            if fast is not None:
                return fast
        return _expand_scaled(q, data, scales, n, out)
    if q.dim == len(q.shape) - 1:
        # the same values in one pass (the kernels package is a leaf: no import cycle)
        from ..kernels.qweight import one_pass_expansion

        one_pass = one_pass_expansion(data.device)
        fast = one_pass(data, mins, scales, n, q.group_size, q.bits, q.dtype, out) if one_pass else None
        if fast is not None:
            return fast
    num_groups = mins.shape[-1]
    lead = mins.shape[:-1]
    codes = _unpack(data, q.bits)[..., : num_groups * q.group_size]
    groups = codes.reshape(*lead, num_groups, q.group_size).float()
    x = groups * scales.float().unsqueeze(-1) + mins.float().unsqueeze(-1)
    x = x.reshape(*lead, num_groups * q.group_size)[..., :n]
    x = x.movedim(-1, q.dim).to(q.dtype).contiguous()
    return x if out is None else out.copy_(x)


# values expanded at once in float32 by ``_expand_scaled`` (a GPU's temporary stays ~64 MB)
E4M3_CHUNK = 1 << 24


def _expand_scaled(q: QTensor, data: torch.Tensor, scales: torch.Tensor, n: int,
                 out: torch.Tensor | None) -> torch.Tensor:
    """An E4M3 or 4-bit table QTensor's values (module doc) in ``q.dtype``, through a float32
    product of at most ``E4M3_CHUNK`` values at a time along the leading rows (so expanding a
    large matrix on a GPU holds no float32 copy of all of it beyond the output the footprint
    counts)."""
    num_groups, g = scales.shape[-1], q.group_size
    lead = scales.shape[:-1]
    rows = max(1, E4M3_CHUNK // max(1, num_groups * g))
    table = lut4_table(q.fmt, data.device) if q.fmt in LUT4 else None
    packed = data.reshape(-1, data.shape[-1])
    sc = scales.reshape(-1, num_groups)
    last = q.dim == len(q.shape) - 1
    into = out.view(-1, n) if out is not None and last else None  # straight into the caller's buffer
    flat = torch.empty((packed.shape[0], n), dtype=q.dtype, device=data.device) if into is None else into
    for r0 in range(0, packed.shape[0], rows):
        part = packed[r0:r0 + rows]
        codes = part if table is None else _unpack(part, 4)
        codes = codes[:, :num_groups * g].reshape(-1, num_groups, g)
        vals = (codes.view(torch.float8_e4m3fn).float() if table is None else table[codes.long()]) \
            * sc[r0:r0 + rows].float().unsqueeze(-1)
        flat[r0:r0 + rows] = vals.reshape(vals.shape[0], -1)[:, :n]
    if into is not None:
        return out  # type: ignore[return-value]
    x = flat.reshape(*lead, n).movedim(-1, q.dim)
    if out is not None:
        return out.copy_(x)
    return x if last else x.contiguous()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes along the last dim, ``8 // bits`` per byte, low bits first."""
    per = 8 // bits
    if per == 1:
        return codes.contiguous()
    n = codes.shape[-1]
    pad = -n % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    codes = codes.reshape(*codes.shape[:-1], -1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes << shifts).sum(dim=-1, dtype=torch.uint8)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return data
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=data.device)
    mask = (1 << bits) - 1
    codes = (data.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*data.shape[:-1], -1)
