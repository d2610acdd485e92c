"""GPTQ, AWQ and compressed-tensors checkpoints: integer codes (in int32 words, or int8), a
scale and a zero point per group of input columns, expanded to the values they encode as each
matrix is read.

A linear layer ``X`` of such a checkpoint has no ``X.weight``; it has ``X.qweight`` (the
codes), ``X.qzeros`` (the zero points, packed alike), ``X.scales`` (float16, one row per
group) and, for GPTQ, ``X.g_idx`` (each input column's group: act-order checkpoints shuffle
them). The value of input column i, output row o is ``scale[g, o] * (code[i, o] - zero[g, o])``
with g the column's group, computed in float32 (exact: a float16 scale times an integer of at
most 8 bits), then kept in the run's dtype like any weight; under ``--compress-weight`` a layer
whose groups are contiguous keeps its codes instead (``packed_parts``). Every method's tensors
come to one form first (``layer_codes``: unsigned codes and zeros, float32 scales, the column
groups), which both the expansion and the packing read; ``IntLayers`` reads a layer's tensors
through its source.

- GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``, 2, 3, 4 or 8 bits): ``qweight`` (in x
  bits / 32, out) holds each output row's codes as a stream of bits down its column of words,
  consecutive input columns from the lowest bit up (2, 4 and 8 bits: 32 / bits whole codes a
  word; 3 bits: 32 codes in three words, two of them split across a word's end);
  ``qzeros`` (groups, out x bits / 32) holds consecutive output rows alike. The original format
  (``checkpoint_format: gptq``, the default) stores each zero point minus 1 (so 0 is written
  as 15 in 4 bits); ``gptq_v2`` stores it as it is.
- AWQ (AutoAWQ's GEMM layout, ``quant_method: awq``, ``version: gemm``): ``qweight`` (in,
  out / 8) holds 8 output rows per word in the order 0 2 4 6 1 3 5 7; ``qzeros`` (groups,
  out / 8) alike; groups are consecutive input columns. Its GEMV layout (``version: gemv``)
  keeps each output row's codes along the row instead: ``qweight`` (out, in / 8), 8
  consecutive input columns a word from the lowest bits; ``qzeros`` (out, w) holds the row's
  groups alike and ``scales`` (out, 8 w) one per group, both padded past the in / group
  groups (AutoAWQ's ``calculate_zeros_width``).

- compressed-tensors (llm-compressor's weight-only schemes, ``quant_method:
  compressed-tensors``, W4A16 / W8A16, any width from 2 to 8 bits): ``X.weight_packed`` (out,
  in x bits / 32) holds consecutive input columns from the lowest bits, each code stored plus
  2^(bits-1) (so the codes are signed); a width that does not divide 32 is one stream of bits
  across the words (the packer's current layout) or, in older releases, 32 // bits whole codes
  a word with the top bits unused, told apart by the number of words; ``X.weight_scale`` (out, groups), (out, 1) per channel;
  ``X.weight_zero_point`` (asymmetric only: signed codes packed alike along the output
  rows); ``X.weight_g_idx`` where groups are activation-ordered; ``X.weight_shape``. The
  ``naive-quantized`` format stores 8-bit codes as an int8 ``X.weight`` beside its scale.

A compressed-tensors scheme that also quantizes each layer's input at run time (W8A8: int8
weights per output row, int8 inputs per token) is run with the inputs in the run's dtype (as
``float_quant`` runs FP8-dynamic); its float (FP8) weight schemes are ``float_quant``'s. Other
bit widths and other methods are refused in one line
(``config_fields.field_problem``).

Under ``--compress-weight`` codes of 2 and 3 bits are kept as 4-bit codes and those of 5 to 7
bits as 8-bit ones (``IntQuant.kept_bits``): the same values, exactly, in the engine's widths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .float_quant import ct_float, ct_float_problem, ct_groups, ct_weights, quantization_config
from .source import ModelLoadError

AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of a word's 8 is its (AWQ_REVERSE[j])-th code
GPTQ_BITS = (2, 3, 4, 8)  # the widths GPTQ's packers write
CT_BITS = (2, 3, 4, 5, 6, 7, 8)  # compressed-tensors' integer widths


@dataclass(frozen=True)
class IntQuant:
    method: str  # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int  # input columns per group (-1: one group over all)
    zero_minus_one: bool  # GPTQ's original format: zeros stored minus 1
    gemv: bool = False  # AWQ's GEMV layout (codes along each output row)

    @property
    def kept_bits(self) -> int:
        """The width the engine keeps these codes in under --compress-weight (4 or 8)."""
        return 4 if self.bits <= 4 else 8

    def codes_in(self, words: int) -> int:
        """How many codes ``words`` int32 words of a GPTQ stream hold (0: not a whole number)."""
        return words * 32 // self.bits if words * 32 % self.bits == 0 else 0


def int_quant(cfg: dict[str, Any]) -> IntQuant | None:
    """The checkpoint's GPTQ, AWQ or compressed-tensors layout (None: not one). Assumes
    ``int_quant_problem`` found nothing."""
    q = quantization_config(cfg)
    method = q.get("quant_method")
    if method == "compressed-tensors" and ct_float(q):
        return None  # FP8 weights (float_quant)
    if method == "compressed-tensors":
        w = ct_weights(q)
        size = int(w.get("group_size") or -1) if w.get("strategy") == "group" else -1
        return IntQuant(method, int(w.get("num_bits", 8)), size, False)
    if method not in ("gptq", "awq"):
        return None
    bits = int(q.get("bits", q.get("w_bit", 4)))
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    v1 = method == "gptq" and q.get("checkpoint_format", "gptq") == "gptq"
    return IntQuant(method, bits, group, v1, method == "awq" and str(q.get("version", "gemm")).lower() == "gemv")


def int_quant_problem(q: dict[str, Any]) -> str | None:
    """What of a GPTQ, AWQ or compressed-tensors ``quantization_config`` is not read, in
    words (None: all of it)."""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _ct_problem(q)
    bits = q.get("bits", q.get("w_bit", 4))
    if method == "gptq":
        if bits not in GPTQ_BITS:
            return f"a {bits}-bit GPTQ checkpoint is not supported (2, 3, 4 and 8 bits are)"
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            return f"a GPTQ checkpoint in format {fmt!r} is not supported (gptq and gptq_v2 are)"
        return None
    if method == "awq":
        if bits != 4:
            return f"a {bits}-bit AWQ checkpoint is not supported (4 bits is)"
        version = str(q.get("version", "gemm")).lower()
        if version not in ("gemm", "gemv"):
            return f"an AWQ checkpoint in the {version!r} layout is not supported (gemm and gemv are)"
        if q.get("zero_point", True) is not True:
            return "an AWQ checkpoint without zero points is not supported"
        return None
    return "not a GPTQ or AWQ checkpoint"


def _ct_problem(q: dict[str, Any]) -> str | None:
    fmt = q.get("format")
    groups = ct_groups(q)
    if not groups:
        return "a compressed-tensors checkpoint without config_groups is not supported"
    if any(g.get("weights") != groups[0].get("weights") for g in groups):
        return "a compressed-tensors checkpoint with several weight schemes is not supported (one for all layers is)"
    if any(g.get("output_activations") for g in groups):
        return "a compressed-tensors checkpoint that quantizes layer outputs is not supported"
    formats = {g.get("format", fmt) for g in groups}
    w = ct_weights(q)
    if ct_float(q):
        return ct_float_problem(w, formats)
    if not formats <= {"pack-quantized", "naive-quantized", "int-quantized", "dense"}:
        return (f"a compressed-tensors checkpoint in format {sorted(map(str, formats))[0]!r} is not supported "
                "(pack-quantized and naive-quantized integer weights are)")
    if w.get("type", "int") != "int" or w.get("num_bits") not in CT_BITS:
        return (f"compressed-tensors weights of type {w.get('type')!r} with {w.get('num_bits')} bits are not "
                "supported (2- to 8-bit int and 8-bit float are)")
    if w.get("strategy") not in ("group", "channel") or (w.get("strategy") == "group" and not w.get("group_size")):
        return (f"compressed-tensors weights with strategy {w.get('strategy')!r} are not supported (group, with a "
                "group_size, and channel are)")
    if w.get("dynamic"):
        return "compressed-tensors weights quantized at run time (dynamic) are not supported"
    return None


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their codes (int32), each word's 32 // bits codes consecutive along
    ``dim`` (0: rows, 1: columns), the first in the lowest bits (the top 32 % bits unused)."""
    shifts = torch.arange(32 // bits, dtype=torch.int32) * bits
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


def _stream(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words (rows, w) -> (rows, count) int32 codes: code i at bit i x bits of each row's
    stream of bits, word 0's lowest bit first, a code split across two words where the width
    does not divide 32."""
    if 32 % bits == 0:
        return _unpack(words, bits, 1)[:, :count]
    u = torch.cat([words.to(torch.int64) & 0xFFFFFFFF, torch.zeros(words.shape[0], 1, dtype=torch.int64)], 1)
    at = torch.arange(count, dtype=torch.int64) * bits
    word, shift = at // 32, at % 32
    low = u[:, word] >> shift
    high = u[:, word + 1] << (32 - shift)  # the next word's bits above the first's (none where shift + bits <= 32)
    return ((low | high) & ((1 << bits) - 1)).to(torch.int32)


def _unpack_dense(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' int32 words (rows, w) -> (rows, count) unsigned codes (stored plus
    2^(bits - 1): signed minus that): one stream of bits (``_stream``), or, where the width
    does not divide 32 and there are as many words as an older release writes, 32 // bits
    whole codes a word."""
    words = words.to(torch.int32)
    stream, whole = -(-count * bits // 32), -(-count // (32 // bits))
    if words.shape[1] == stream:
        return _stream(words, bits, count)
    if words.shape[1] == whole:
        return _unpack(words, bits, 1)[:, :count]
    raise ModelLoadError(f"{words.shape[1]} packed words do not hold {count} codes of {bits} bits (that takes "
                         f"{stream}{'' if stream == whole else f' or {whole}'}): corrupt checkpoint?")


Parts = dict[str, "torch.Tensor | None"]  # a layer's tensors by the suffixes its method names them with


def layer_codes(q: IntQuant, parts: Parts, shape: tuple[int, int], name: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's (codes (out, in) and zero points (out, groups), both unsigned int32; float32
    scales (out, groups); each input column's group (in,)), whatever the method stores them
    as (module doc): value = scale x (code - zero). A layout that does not agree with itself
    or with ``shape`` (out, in) is a one-line error."""
    rows, cols = shape
    if q.method == "compressed-tensors":
        off = 1 << (q.bits - 1)
        packed = parts.get("weight_packed")
        packed = parts.get("weight") if packed is None else packed  # naive-quantized: int8 codes
        assert packed is not None
        if packed.dtype == torch.int8:
            codes = packed.to(torch.int32) + off
        elif packed.dtype in (torch.int32, torch.uint32):
            codes = _unpack_dense(packed, q.bits, cols)
        else:
            raise ModelLoadError(f"{name}: packed weights of dtype {packed.dtype}, expected int32 or int8: corrupt "
                                 "checkpoint?")
        scale = parts["weight_scale"].float()  # type: ignore[union-attr]
        scale = scale.reshape(scale.shape[0], -1)
        zp = parts.get("weight_zero_point")  # packed along the output rows (asymmetric only)
        zeros = torch.full(scale.shape, off, dtype=torch.int32) if zp is None else \
            zp.to(torch.int32) + off if zp.dtype == torch.int8 else _unpack_dense(zp.t().contiguous(), q.bits, rows).t()
        g_idx, size = parts.get("weight_g_idx"), cols if scale.shape[1] == 1 else q.group_size
    else:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        assert qweight is not None and qzeros is not None and scales is not None
        if qweight.dtype not in (torch.int32, torch.uint32) or qzeros.dtype not in (torch.int32, torch.uint32):
            raise ModelLoadError(f"{name}: {q.method.upper()} qweight/qzeros of dtype {qweight.dtype}/"
                                 f"{qzeros.dtype}, expected int32: corrupt checkpoint?")
        if q.method == "gptq":
            if q.codes_in(qweight.shape[0]) != cols or q.codes_in(qzeros.shape[1]) != rows:
                raise ModelLoadError(f"{name}: {q.bits}-bit GPTQ qweight {tuple(qweight.shape)} and qzeros "
                                     f"{tuple(qzeros.shape)} for a {rows} x {cols} matrix do not agree: corrupt "
                                     "checkpoint?")
            codes, zeros = _stream(qweight.t(), q.bits, cols), _stream(qzeros, q.bits, rows).t()
            if q.zero_minus_one:
                zeros = (zeros + 1) & ((1 << q.bits) - 1)
        elif q.gemv:  # AWQ's GEMV: codes, zeros and scales along each output row, zeros and scales padded
            groups = 1 if q.group_size <= 0 else -(-cols // q.group_size)
            if qweight.shape != (rows, -(-cols // 8)) or qzeros.shape[0] != rows or qzeros.shape[1] * 8 < groups \
                    or scales.shape[0] != rows or scales.shape[1] < groups:
                raise ModelLoadError(f"{name}: AWQ GEMV qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} "
                                     f"and scales {tuple(scales.shape)} for a {rows} x {cols} matrix do not agree: "
                                     "corrupt checkpoint?")
            codes, zeros = _unpack(qweight, 4, 1)[:, :cols], _unpack(qzeros, 4, 1)[:, :groups]
            scale = scales[:, :groups].float()
        else:  # AWQ: each word's 8 output rows in its own order
            order = torch.tensor(AWQ_REVERSE)
            codes, zeros = (_unpack(t, 4, 1) for t in (qweight, qzeros))
            codes, zeros = (c.view(c.shape[0], -1, 8)[..., order].reshape(c.shape).t() for c in (codes, zeros))
        if not q.gemv:
            scale = scales.float().t()
        g_idx, size = parts.get("g_idx"), cols if q.group_size <= 0 else q.group_size
    groups = scale.shape[1]
    if codes.shape != (rows, cols) or zeros.shape != (rows, groups) or scale.shape[0] != rows:
        raise ModelLoadError(f"{name}: {q.method} codes {tuple(codes.shape)}, zeros {tuple(zeros.shape)} and scales "
                             f"{tuple(scale.shape)} for a {rows} x {cols} matrix do not agree: corrupt checkpoint?")
    return codes, zeros, scale, column_groups(g_idx, cols, groups, size, name)


def dequantize(q: IntQuant, parts: Parts, shape: tuple[int, int], name: str) -> torch.Tensor:
    """The (out, in) float32 matrix a layer's tensors encode: scale x (code - zero), exact."""
    codes, zeros, scale, g = layer_codes(q, parts, shape, name)
    return (codes - zeros[:, g]).float() * scale[:, g]


def packed_parts(q: IntQuant, parts: Parts, shape: tuple[int, int], name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A layer's codes as the engine stores compressed weights (``models/packed.PackedWeight``:
    (out, in) unsigned codes packed low bits first, per group of input columns a scale and
    a minimum, value = code x scale + min, so min = -zero x scale; in ``q.kept_bits``), or None
    where they cannot be kept so: activation-ordered groups, a group that does not divide the row."""
    codes, zeros, scale, g = layer_codes(q, parts, shape, name)
    cols, groups = shape[1], scale.shape[1]
    if cols % groups or not torch.equal(g, torch.arange(cols) // (cols // groups)):
        return None
    codes = codes.contiguous()
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)) if q.kept_bits == 4 else codes
    return packed.to(torch.uint8).contiguous(), (-zeros.float() * scale).contiguous(), scale.contiguous()


class IntLayers:
    """A checkpoint's GPTQ / AWQ / compressed-tensors layers, read through its source:
    ``read(name)`` a tensor, ``shape(name)`` one's shape from the header; ``names`` the
    checkpoint's tensors. Layer ``X`` (a stem ending in ".") is read as ``X.weight``
    (``virtual`` names those)."""

    def __init__(self, q: IntQuant, names: set[str], read: Any, shape: Any, where: str) -> None:
        self.q, self.read, self.shape_of, self.where = q, read, shape, where
        self.codes = "weight_packed" if q.method == "compressed-tensors" else "qweight"
        self.stems = {n.removesuffix(self.codes) for n in names if n.endswith("." + self.codes)}
        self.has = names.__contains__

    def virtual(self) -> dict[str, str]:
        """``X.weight`` -> the name of the tensor holding its codes, for each layer."""
        return {stem + "weight": stem + self.codes for stem in self.stems}

    def parts(self, stem: str, codes: torch.Tensor | None = None) -> Parts:
        """Layer ``stem``'s tensors (``codes``: a naive-quantized layer's int8 weight, read)."""
        ct = self.q.method == "compressed-tensors"
        names = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape") if ct else \
            ("qweight", "qzeros", "scales", "g_idx")
        missing = [stem + t for t in (("weight_scale",) if ct else ("qzeros", "scales")) if not self.has(stem + t)]
        if missing:
            raise ModelLoadError(f"{self.where}: {self.q.method} layer {stem}{self.codes} has no {missing[0]}: "
                                 "corrupt checkpoint?")
        out: Parts = {t: self.read(stem + t) if self.has(stem + t) else None for t in names}
        out["weight"] = codes
        return out

    def layer_shape(self, parts: Parts) -> tuple[int, int]:
        """(out, in) of a layer: its ``weight_shape``, its int8 weight's, or its packed codes'."""
        if parts.get("weight_shape") is not None:
            return int(parts["weight_shape"][0]), int(parts["weight_shape"][1])  # type: ignore[index]
        if parts.get("weight") is not None:
            return tuple(parts["weight"].shape)  # type: ignore[union-attr,return-value]
        qw = parts["qweight"]
        assert qw is not None
        if self.q.method == "gptq":
            return qw.shape[1], self.q.codes_in(qw.shape[0])
        return (qw.shape[0], qw.shape[1] * 8) if self.q.gemv else (qw.shape[1] * 8, qw.shape[0])

    def expand(self, stem: str, codes: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``stem``'s float32 matrix (``codes``: a naive-quantized layer's int8 weight)."""
        parts = self.parts(stem, codes)
        return dequantize(self.q, parts, self.layer_shape(parts), f"{self.where}: {stem}{self.codes}")

    def packed(self, stem: str) -> tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """Layer ``stem``'s shape and ``packed_parts``, or None where its codes cannot be kept."""
        parts = self.parts(stem)
        shape = self.layer_shape(parts)
        got = packed_parts(self.q, parts, shape, f"{self.where}: {stem}{self.codes}")
        return None if got is None else (shape, got)

    def packed_group(self, stem: str) -> int:
        """The group size ``packed`` keeps layer ``stem``'s codes in (0: expanded instead), from
        the shapes and the group order alone (no code read: for sizing before loading)."""
        q = self.q
        if q.method == "compressed-tensors":
            scale = self.shape_of(stem + "weight_scale")
            cols = int(self.read(stem + "weight_shape")[1]) if self.has(stem + "weight_shape") else 0
            groups, g = (scale[1] if len(scale) == 2 else 1), stem + "weight_g_idx"
        else:
            qw = self.shape_of(stem + "qweight")
            cols = q.codes_in(qw[0]) if q.method == "gptq" else qw[1] * 8 if q.gemv else qw[0]
            groups, g = self.shape_of(stem + "scales")[0], stem + "g_idx"
            if q.gemv:
                groups = 1 if q.group_size <= 0 else -(-cols // q.group_size)
        if not cols or cols % groups:
            return 0
        if self.has(g) and not torch.equal(self.read(g).long(), torch.arange(cols) // (cols // groups)):
            return 0
        return cols // groups
