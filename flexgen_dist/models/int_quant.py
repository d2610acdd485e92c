"""GPTQ, AWQ and compressed-tensors checkpoints: integer codes (in int32 words, or int8), a
scale and a zero point per group of input columns, expanded to the values they encode as each
matrix is read.

A linear layer ``X`` of such a checkpoint has no ``X.weight``; it has ``X.qweight`` (the
codes), ``X.qzeros`` (the zero points, packed alike), ``X.scales`` (float16, one row per
group) and, for GPTQ, ``X.g_idx`` (each input column's group: act-order checkpoints shuffle
them). The value of input column i, output row o is ``scale[g, o] * (code[i, o] - zero[g, o])``
with g the column's group, computed in float32 (exact: a float16 scale times an integer of at
most 8 bits), then kept in the run's dtype like any weight (``--compress-weight`` quantizes
it again into the engine's own groups).

- GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``): ``qweight`` (in / p, out) holds p =
  32 / bits codes of consecutive input columns per word, the first in the lowest bits;
  ``qzeros`` (groups, out / p) holds consecutive output rows alike. The original format
  (``checkpoint_format: gptq``, the default) stores each zero point minus 1 (so 0 is written
  as 15 in 4 bits); ``gptq_v2`` stores it as it is.
- AWQ (AutoAWQ's GEMM layout, ``quant_method: awq``, ``version: gemm``): ``qweight`` (in,
  out / 8) holds 8 output rows per word in the order 0 2 4 6 1 3 5 7; ``qzeros`` (groups,
  out / 8) alike; groups are consecutive input columns.

- compressed-tensors (llm-compressor's weight-only schemes, ``quant_method:
  compressed-tensors``, W4A16 / W8A16): ``X.weight_packed`` (out, in * bits / 32) holds
  consecutive input columns from the lowest bits, each code stored plus 2^(bits-1) (so the
  codes are signed); ``X.weight_scale`` (out, groups), (out, 1) per channel;
  ``X.weight_zero_point`` (asymmetric only: signed codes packed alike along the output
  rows); ``X.weight_g_idx`` where groups are activation-ordered; ``X.weight_shape``. The
  ``naive-quantized`` format stores 8-bit codes as an int8 ``X.weight`` beside its scale.

Other bit widths, AWQ's GEMV layout, schemes that quantize activations at run time (W8A8,
FP8-dynamic: their outputs depend on computing that quantization) and other methods are
refused in one line (``config_fields.field_problem``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .source import ModelLoadError

AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word's 8 is its (AWQ_REVERSE[j])-th code


@dataclass(frozen=True)
class IntQuant:
    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int  # input columns per group (-1: one group over all)
    zero_minus_one: bool  # GPTQ's original format: zeros stored minus 1

    @property
    def per_word(self) -> int:
        return 32 // self.bits


def _config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}


def int_quant(cfg: dict[str, Any]) -> IntQuant | None:
    """The checkpoint's GPTQ, AWQ or compressed-tensors layout (None: not one). Assumes
    ``int_quant_problem`` found nothing."""
    q = _config(cfg)
    method = q.get("quant_method")
    if method == "compressed-tensors":
        w = _ct_weights(q)
        size = int(w.get("group_size") or -1) if w.get("strategy") == "group" else -1
        return IntQuant(method, int(w.get("num_bits", 8)), size, False)
    if method not in ("gptq", "awq"):
        return None
    bits = int(q.get("bits", q.get("w_bit", 4)))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    v1 = method == "gptq" and q.get("checkpoint_format", "gptq") == "gptq"
    return IntQuant(method, bits, group, v1)


def _ct_weights(q: dict[str, Any]) -> dict[str, Any]:
    """The weights' quantization args of a compressed-tensors config (every group's alike)."""
    groups = list((q.get("config_groups") or {}).values())
    return (groups[0].get("weights") or {}) if groups else {}


def int_quant_problem(q: dict[str, Any]) -> str | None:
    """What of a GPTQ, AWQ or compressed-tensors ``quantization_config`` is not read, in
    words (None: all of it)."""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _ct_problem(q)
    bits = q.get("bits", q.get("w_bit", 4))
    if method == "gptq":
        if bits not in (4, 8):
            return f"a {bits}-bit GPTQ checkpoint is not supported (4 and 8 bits are)"
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            return f"a GPTQ checkpoint in format {fmt!r} is not supported (gptq and gptq_v2 are)"
        return None
    if method == "awq":
        if bits != 4:
            return f"a {bits}-bit AWQ checkpoint is not supported (4 bits is)"
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            return f"an AWQ checkpoint in the {version!r} layout is not supported (gemm is)"
        if q.get("zero_point", True) is not True:
            return "an AWQ checkpoint without zero points is not supported"
        return None
    return "not a GPTQ or AWQ checkpoint"


def _ct_problem(q: dict[str, Any]) -> str | None:
    fmt = q.get("format")
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        return "a compressed-tensors checkpoint without config_groups is not supported"
    if any(g.get("input_activations") or g.get("output_activations") for g in groups):
        return ("a compressed-tensors checkpoint that quantizes activations at run time (W8A8, FP8-dynamic) is not "
                "supported (weight-only W4A16/W8A16 are)")
    if any(g.get("weights") != groups[0].get("weights") for g in groups):
        return "a compressed-tensors checkpoint with several weight schemes is not supported (one for all layers is)"
    formats = {g.get("format", fmt) for g in groups}
    if not formats <= {"pack-quantized", "naive-quantized", "int-quantized", "dense"}:
        return (f"a compressed-tensors checkpoint in format {sorted(map(str, formats))[0]!r} is not supported "
                "(pack-quantized and naive-quantized integer weights are)")
    w = groups[0].get("weights") or {}
    if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
        return (f"compressed-tensors weights of type {w.get('type')!r} with {w.get('num_bits')} bits are not "
                "supported (4- and 8-bit int are)")
    if w.get("strategy") not in ("group", "channel") or (w.get("strategy") == "group" and not w.get("group_size")):
        return (f"compressed-tensors weights with strategy {w.get('strategy')!r} are not supported (group, with a "
                "group_size, and channel are)")
    if w.get("dynamic"):
        return "compressed-tensors weights quantized at run time (dynamic) are not supported"
    return None


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their codes (int32), each word's codes consecutive along ``dim`` (0:
    rows, 1: columns), the first in the lowest bits."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.to(torch.int32)
    if dim == 0:
        codes = (w.unsqueeze(1) >> shifts[None, :, None]) & ((1 << bits) - 1)  # (rows, per word, cols)
        return codes.reshape(-1, w.shape[1])
    codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (rows, cols, per word)
    return codes.reshape(w.shape[0], -1)


def column_groups(g_idx: torch.Tensor | None, cols: int, groups: int, size: int, name: str) -> torch.Tensor:
    """Each input column's group (cols,): the file's order (``g_idx``, act-order shuffles it)
    or consecutive groups of ``size``; a layout that does not fit is a one-line error."""
    if g_idx is not None:
        g = g_idx.long()
        if g.shape != (cols,) or int(g.min()) < 0 or int(g.max()) >= groups:
            raise ModelLoadError(f"{name}: g_idx of shape {tuple(g.shape)} for {cols} input columns and {groups} "
                                 "groups: corrupt checkpoint?")
        return g
    if size <= 0 or -(-cols // size) != groups:
        raise ModelLoadError(f"{name}: {cols} input columns in groups of {size} are not {groups} groups: the "
                             "config's group_size does not fit the checkpoint")
    return torch.arange(cols) // size


def dequantize(q: IntQuant, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None, name: str) -> torch.Tensor:
    """The (out, in) float32 matrix a GPTQ or AWQ layer's tensors encode (module doc)."""
    p = q.per_word
    if qweight.dtype not in (torch.int32, torch.uint32) or qzeros.dtype not in (torch.int32, torch.uint32):
        raise ModelLoadError(f"{name}: {q.method.upper()} qweight/qzeros of dtype {qweight.dtype}/{qzeros.dtype}, "
                             "expected int32: corrupt checkpoint?")
    if q.method == "gptq":
        codes = _unpack(qweight, q.bits, 0)  # (in, out)
        zeros = _unpack(qzeros, q.bits, 1)  # (groups, out)
        if q.zero_minus_one:
            zeros = (zeros + 1) & ((1 << q.bits) - 1)
    else:
        order = torch.tensor(AWQ_REVERSE)
        codes = _unpack(qweight, 4, 1)
        codes = codes.view(codes.shape[0], -1, p)[..., order].reshape(codes.shape)
        zeros = _unpack(qzeros, 4, 1)
        zeros = zeros.view(zeros.shape[0], -1, p)[..., order].reshape(zeros.shape)
    cols, rows = codes.shape
    groups = scales.shape[0]
    if scales.dim() != 2 or scales.shape[1] != rows or zeros.shape != (groups, rows):
        raise ModelLoadError(f"{name}: {q.method.upper()} codes for {cols} x {rows}, scales {tuple(scales.shape)} "
                             f"and zeros {tuple(zeros.shape)} do not agree: corrupt checkpoint?")
    g = column_groups(g_idx, cols, groups, cols if q.group_size <= 0 else q.group_size, name)
    w = (codes - zeros[g]).float() * scales.float()[g]  # (in, out): exact in float32
    return w.t().contiguous()


def _unpack_dense(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' int32 words (rows, w) -> (rows, count) signed codes: code i at bit
    i x bits of the row's little-endian stream, stored plus 2^(bits - 1)."""
    codes = _unpack(words, bits, 1)
    if codes.shape[1] < count:
        raise ModelLoadError(f"{words.shape[1]} packed words hold {codes.shape[1]} codes, fewer than {count}")
    return codes[:, :count] - (1 << (bits - 1))


def dequantize_ct(q: IntQuant, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  g_idx: torch.Tensor | None, shape: tuple[int, int], name: str) -> torch.Tensor:
    """The (out, in) float32 matrix of a compressed-tensors layer: ``packed`` int32 words
    (pack-quantized) or int8 codes (naive-quantized), scale (out, groups), the packed zero
    points (asymmetric), the groups' order, and the matrix's (out, in) shape."""
    rows, cols = shape
    if packed.dtype == torch.int8:
        codes = packed.to(torch.int32)
    elif packed.dtype in (torch.int32, torch.uint32):
        codes = _unpack_dense(packed.to(torch.int32), q.bits, cols)
    else:
        raise ModelLoadError(f"{name}: packed weights of dtype {packed.dtype}, expected int32 or int8: corrupt "
                             "checkpoint?")
    scale = scale.float().reshape(scale.shape[0], -1)
    groups = scale.shape[1]
    if codes.shape != (rows, cols) or scale.shape[0] != rows:
        raise ModelLoadError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scale.shape)} for a {rows} x "
                             f"{cols} matrix do not agree: corrupt checkpoint?")
    z = torch.zeros(rows, groups, dtype=torch.int32)
    if zero is not None:  # packed along the output rows: (rows * bits / 32, groups)
        z = zero.to(torch.int32) if zero.dtype == torch.int8 else \
            _unpack_dense(zero.to(torch.int32).t().contiguous(), q.bits, rows).t()
        if z.shape != (rows, groups):
            raise ModelLoadError(f"{name}: zero points {tuple(z.shape)} for {rows} rows and {groups} groups do not "
                                 "agree: corrupt checkpoint?")
    g = column_groups(g_idx, cols, groups, cols if groups == 1 else q.group_size, name)
    return (codes - z[:, g]).float() * scale[:, g]


def packed_parts(q: IntQuant, parts: dict[str, torch.Tensor | None], shape: tuple[int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A layer's codes as the engine stores compressed weights (``models/packed.PackedWeight``:
    (out, in) unsigned codes packed low bits first, per group of input columns a scale and
    a minimum, value = code x scale + min, so min = -zero x scale), or None where they cannot
    be kept so: activation-ordered groups, a group that does not divide the row, other bits.
    ``parts``: the layer's tensors by the suffixes its method names them with."""
    rows, cols = shape
    g_idx = parts.get("g_idx" if q.method == "gptq" else "weight_g_idx")
    if q.bits not in (4, 8):
        return None
    if q.method == "compressed-tensors":
        codes = parts["weight_packed"]
        assert codes is not None
        off = 1 << (q.bits - 1)
        u = _unpack_dense(codes.to(torch.int32), q.bits, cols) + off
        scale = parts["weight_scale"].float().reshape(rows, -1)  # type: ignore[union-attr]
        zp = parts.get("weight_zero_point")
        z = torch.full(scale.shape, off, dtype=torch.int32) if zp is None else (
            (zp.to(torch.int32) if zp.dtype == torch.int8 else
             _unpack_dense(zp.to(torch.int32).t().contiguous(), q.bits, rows).t()) + off)
    else:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        assert qweight is not None and qzeros is not None and scales is not None
        if q.method == "gptq":
            u, z = _unpack(qweight, q.bits, 0).t(), _unpack(qzeros, q.bits, 1).t()
            if q.zero_minus_one:
                z = (z + 1) & ((1 << q.bits) - 1)
        else:
            order = torch.tensor(AWQ_REVERSE)
            c, zz = _unpack(qweight, 4, 1), _unpack(qzeros, 4, 1)
            u = c.view(c.shape[0], -1, 8)[..., order].reshape(c.shape).t()
            z = zz.view(zz.shape[0], -1, 8)[..., order].reshape(zz.shape).t()
        scale = scales.float().t()
    groups = scale.shape[1]
    if u.shape != (rows, cols) or z.shape != (rows, groups) or cols % groups:
        return None
    size = cols // groups
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(cols) // size):
        return None
    u = u.contiguous()
    packed = (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8) if q.bits == 4 else u.to(torch.uint8)
    return packed.contiguous(), (-z.float() * scale).contiguous(), scale.contiguous()
