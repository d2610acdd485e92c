"""bitsandbytes checkpoints (``quant_method: bitsandbytes``: the ``-bnb-4bit`` releases, and
models saved after ``load_in_4bit`` / ``load_in_8bit``), expanded to the values they encode as
each matrix is read, then kept in the run's dtype like any weight (or, 4-bit under
``--compress-weight``, kept as their codes: below).

- **4-bit** (``load_in_4bit``, NF4 or FP4): ``X.weight`` holds the row-major matrix's codes
  two a byte, the first in the high nibble (stored as uint8, or viewed as another storage
  dtype: its bytes are read); ``X.weight.quant_map`` the 16 values a code stands for (NF4's or
  FP4's table, read from the file); ``X.weight.absmax`` one scale per ``blocksize`` consecutive
  values of the flattened matrix; ``X.weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``)
  a JSON record of the shape, block size and dtypes. Value i = ``quant_map[code i] x
  absmax[i // blocksize]`` in float32, rounded to the recorded dtype (the weights' before
  quantization), as bitsandbytes' expansion returns it. With double quantization the scales
  are themselves 8-bit codes: ``absmax[j] = nested_quant_map[code j] x nested_absmax[j // nested_blocksize]
  + nested_offset``.
- **8-bit** (``load_in_8bit``, LLM.int8()): ``X.weight`` int8 (out, in) and ``X.SCB`` (out,)
  float32, value ``code x SCB[row] / 127`` (bitsandbytes multiplies by the float32 reciprocal
  of 127, as here). Its run-time mixed int8 product (outlier columns above
  ``llm_int8_threshold`` in 16 bits, the rest of each input quantized to int8) is not
  computed: the outputs are those of the dequantized weights, and the load says so.

The values are what bitsandbytes' own ``dequantize_4bit`` / ``int8_vectorwise_dequant`` give
(tested against them). Under ``--compress-weight`` a 4-bit matrix keeps its codes instead
(``packed``: the engine's 4-bit table formats ``nf4`` / ``fp4``, ``memory.quant.LUT4``: the
codes two a byte, each block's float32 scale), where its blocks lie along its rows (the input
width a multiple of the block size), its table is the format's own and its recorded dtype is
float32 or the run's (so the kept values are bitsandbytes' exactly); other matrices, and
8-bit ones, are expanded and quantized by the engine.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..memory.quant import LUT4
from .float_quant import quantization_config
from .packed import PackedWeight
from .source import ModelLoadError

QS_SUFFIXES = (".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")
INT8_RECIPROCAL = 7.874015718698502e-3  # bitsandbytes' float32 1 / 127


@dataclass(frozen=True)
class BnbQuant:
    bits: int  # 4 or 8
    quant_type: str  # "nf4", "fp4" (4 bits) or "int8"


def bnb_quant(cfg: dict[str, Any]) -> BnbQuant | None:
    """The checkpoint's bitsandbytes layout (None: not one). Assumes ``bnb_problem`` found nothing."""
    q = quantization_config(cfg)
    if q.get("quant_method") != "bitsandbytes":
        return None
    if q.get("load_in_4bit") or q.get("_load_in_4bit"):
        return BnbQuant(4, str(q.get("bnb_4bit_quant_type", "fp4")))
    return BnbQuant(8, "int8")


def bnb_problem(q: dict[str, Any]) -> str | None:
    """What of a bitsandbytes ``quantization_config`` is not read, in words (None: all of it)."""
    four = bool(q.get("load_in_4bit") or q.get("_load_in_4bit"))
    eight = bool(q.get("load_in_8bit") or q.get("_load_in_8bit"))
    if four == eight:
        return "a bitsandbytes checkpoint that is neither load_in_4bit nor load_in_8bit is not supported"
    if four and q.get("bnb_4bit_quant_type", "fp4") not in ("nf4", "fp4"):
        return (f"a bitsandbytes 4-bit checkpoint of type {q['bnb_4bit_quant_type']!r} is not supported "
                "(nf4 and fp4 are)")
    if eight and q.get("llm_int8_has_fp16_weight"):
        return "a bitsandbytes 8-bit checkpoint with llm_int8_has_fp16_weight is not supported"
    return None


def activation_note_bnb(cfg: dict[str, Any]) -> str | None:
    """The line an 8-bit checkpoint's load logs: LLM.int8()'s mixed product is not computed."""
    b = bnb_quant(cfg)
    if b is None or b.bits != 8:
        return None
    return ("its LLM.int8() product (outlier input columns in 16 bits, the rest quantized to int8 at run time) is "
            "not computed: the outputs are those of its dequantized weights")


def _json_record(t: torch.Tensor, name: str) -> dict[str, Any]:
    try:
        return json.loads(bytes(t.reshape(-1).to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{name}: its bitsandbytes quant_state record does not parse ({e}): corrupt "
                             "checkpoint?") from None


def _blockwise(codes: torch.Tensor, table: torch.Tensor, scales: torch.Tensor, block: int, n: int,
               name: str) -> torch.Tensor:
    """``table[codes[i]] x scales[i // block]`` for the first n codes, float32 (n,)."""
    if block <= 0 or scales.numel() != -(-n // block) or table.numel() < int(codes.max()) + 1:
        raise ModelLoadError(f"{name}: {codes.numel()} codes, {scales.numel()} scales in blocks of {block} and a "
                             f"table of {table.numel()} values do not agree: corrupt checkpoint?")
    values = table.float()[codes[:n].long()]
    pad = -n % block
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return (values.view(-1, block) * scales.float().view(-1, 1)).reshape(-1)[:n]


class BnbLayers:
    """A checkpoint's bitsandbytes layers, read through its source: ``read(name)`` a tensor,
    ``has(name)`` whether the checkpoint holds it. ``layer(name)`` says whether ``name`` (an
    ``X.weight``) is one of its quantized matrices; ``expand(name, t)`` gives its values."""

    def __init__(self, b: BnbQuant, has: Callable[[str], bool], read: Callable[[str], torch.Tensor],
                 where: str) -> None:
        self.b, self.has, self.read, self.where = b, has, read, where

    def state(self, name: str) -> str | None:
        """The name of ``name``'s 4-bit quant_state record (None: it has none)."""
        return next((name + s for s in QS_SUFFIXES if self.has(name + s)), None)

    def layer(self, name: str, t: torch.Tensor) -> bool:
        if self.b.bits == 4:
            return name.endswith("weight") and self.state(name) is not None
        return t.dtype == torch.int8 and name.endswith("weight") and self.has(name.removesuffix("weight") + "SCB")

    def _state4(self, name: str) -> tuple[dict[str, Any], tuple[int, ...], int]:
        """A 4-bit matrix's quant_state record, its shape and its number of values."""
        qs_name = self.state(name)
        assert qs_name is not None
        qs = _json_record(self.read(qs_name), f"{self.where}: {name}")
        shape = tuple(int(s) for s in qs.get("shape") or ())
        n = 1
        for s in shape:
            n *= s
        return qs, shape, n

    def _absmax(self, name: str, qs: dict[str, Any]) -> torch.Tensor:
        """A 4-bit matrix's block scales, float32 (double quantization's expanded)."""
        absmax = self.read(name + ".absmax")
        if self.has(name + ".nested_absmax"):
            absmax = _blockwise(absmax.view(torch.uint8).reshape(-1), self.read(name + ".nested_quant_map"),
                                self.read(name + ".nested_absmax"), int(qs.get("nested_blocksize", 256)),
                                absmax.numel(), f"{self.where}: {name}") + float(qs.get("nested_offset", 0.0))
        return absmax.float().reshape(-1)

    def kept_format(self, name: str, run_dtype: torch.dtype,
                    state: tuple[dict[str, Any], tuple[int, ...], int] | None = None) -> tuple[int, int, str] | None:
        """``(4, block size, table format)`` where 4-bit matrix ``name`` keeps its codes under
        --compress-weight (module doc), else None; read from its record (``state``: already
        read) and table alone."""
        if self.b.bits != 4 or self.state(name) is None or self.b.quant_type not in LUT4:
            return None
        qs, shape, _ = state or self._state4(name)
        block = int(qs.get("blocksize", 64))
        dtype = getattr(torch, str(qs.get("dtype", "float32")), None)
        table = self.read(name + ".quant_map").float().reshape(-1)
        if len(shape) != 2 or block <= 0 or shape[1] % block or block % 2 or dtype not in (torch.float32, run_dtype):
            return None
        if not torch.equal(table, torch.tensor(LUT4[self.b.quant_type])):
            return None
        return 4, block, self.b.quant_type

    def packed(self, name: str, run_dtype: torch.dtype) -> PackedWeight | None:
        """4-bit matrix ``name``'s codes in the engine's table format, or None where they are
        not kept so (``kept_format``)."""
        if self.b.bits != 4 or self.state(name) is None:
            return None
        state = self._state4(name)  # the record read once, for the check and the codes
        fmt = self.kept_format(name, run_dtype, state)
        if fmt is None:
            return None
        qs, (rows, cols), n = state
        raw = self.read(name).contiguous().view(torch.uint8).reshape(-1)
        absmax = self._absmax(name, qs)
        if raw.numel() * 2 < n or absmax.numel() != n // fmt[1]:
            raise ModelLoadError(f"{self.where}: {name}: {raw.numel()} bytes of codes and {absmax.numel()} scales for "
                                 f"a {rows} x {cols} matrix in blocks of {fmt[1]}: corrupt checkpoint?")
        codes = ((raw[: n // 2] & 15) << 4) | (raw[: n // 2] >> 4)  # the first code into the low nibble
        return PackedWeight(codes.view(rows, cols // 2), torch.zeros(rows, 0), absmax.view(rows, cols // fmt[1]),
                            (rows, cols), 4, fmt[1], fmt[2])

    def expand(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The float32 matrix ``name`` (read as ``t``) encodes (module doc)."""
        where = f"{self.where}: {name}"
        if self.b.bits == 8:
            scb = self.read(name.removesuffix("weight") + "SCB").float()
            if t.dim() != 2 or scb.shape != (t.shape[0],):
                raise ModelLoadError(f"{where}: int8 weight {tuple(t.shape)} and SCB {tuple(scb.shape)} do not agree: "
                                     "corrupt checkpoint?")
            return t.float() * scb.view(-1, 1) * INT8_RECIPROCAL
        qs, shape, n = self._state4(name)
        raw = t.contiguous().view(torch.uint8).reshape(-1)
        if len(shape) != 2 or raw.numel() * 2 < n:
            raise ModelLoadError(f"{where}: {raw.numel()} bytes of 4-bit codes for a matrix of shape {shape}: "
                                 "corrupt checkpoint?")
        codes = torch.stack([raw >> 4, raw & 15], dim=1).reshape(-1)  # the first code in the high nibble
        values = _blockwise(codes, self.read(name + ".quant_map"), self._absmax(name, qs), int(qs.get("blocksize", 64)),
                            n, where)
        dtype = getattr(torch, str(qs.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ModelLoadError(f"{where}: its bitsandbytes quant_state names dtype {qs.get('dtype')!r}: corrupt "
                                 "checkpoint?")
        return values.to(dtype).float().view(shape)  # bitsandbytes gives its values in the recorded dtype
