"""Float-coded checkpoints: FP8 weights with their scales, and gpt-oss's MXFP4 experts (a
Hugging Face directory's reader hands them to ``FloatLayers``); each
matrix expanded to float32 as it is read (then kept in the run's dtype like any weight), or,
for a 2-D FP8 matrix under ``--compress-weight``, kept as its codes (``fp8_packed``: a
``PackedWeight`` of format e4m3, one byte a value and a float32 scale per row and block of
columns, which the engine stores as a ``QTensor`` and expands on the compute device to
exactly ``dequantize_fp8``'s values).

FP8 (e4m3) matrices come in three layouts, told apart by the config (``fp8_layout``):

- ``quant_method: fp8`` (transformers' fine-grained FP8, DeepSeek-V3's format: Qwen3-*-FP8,
  GLM-4.5-FP8, Kimi K2, MiniMax-M2): ``X.weight`` beside ``X.weight_scale_inv``, a grid of
  scales over ``weight_block_size`` blocks (float32, or E8M0 bytes), or one scale for the
  whole matrix without a block size.
- ``quant_method: fbgemm_fp8`` (Meta's Llama-3.1-405B-FP8 and the like): ``X.weight_scale``
  (out, 1), one scale per output row.
- ``quant_method: compressed-tensors`` with float weights (llm-compressor's FP8 and
  FP8-dynamic releases, format ``float-quantized``): ``X.weight_scale`` per tensor (1,),
  per output row (out, 1) or per block (``block_structure``).

Each value is code x the scale of its block (the row, the matrix), in float32, as transformers
expands them; a partial last block where the block does not divide the matrix. The schemes that also quantize each layer's input at run time (FP8-dynamic,
fbgemm's per-token activations, DeepSeek's 1 x 128 activation groups, compressed-tensors'
``input_activations``) are run with the inputs in the run's dtype: the outputs of the
dequantized model, as transformers' ``dequantize=True`` computes it (``activation_note``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .packed import PackedWeight
from .source import ModelLoadError

FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class Fp8Layout:
    """Where an FP8 checkpoint keeps a matrix's scales: ``X.weight`` + ``suffix``, over blocks
    of ``block`` (rows, cols) where the grid does not say (0: the grid says)."""
    method: str
    suffix: str
    block: tuple[int, int]


def quantization_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config's ``quantization_config`` (a multimodal one's from its text config)."""
    return cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}


def ct_groups(q: dict[str, Any]) -> list[dict[str, Any]]:
    """A compressed-tensors config's scheme groups."""
    return list((q.get("config_groups") or {}).values())


def ct_weights(q: dict[str, Any]) -> dict[str, Any]:
    """The weights' quantization args of a compressed-tensors config (its first group's: every
    group's alike, else refused)."""
    groups = ct_groups(q)
    return (groups[0].get("weights") or {}) if groups else {}


def ct_float(q: dict[str, Any]) -> bool:
    """Whether a compressed-tensors config quantizes the weights as floats (FP8)."""
    return ct_weights(q).get("type") == "float"


def fp8_layout(cfg: dict[str, Any]) -> Fp8Layout | None:
    """The config's FP8 layout (module doc); None: not an FP8 checkpoint."""
    q = quantization_config(cfg)
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        return Fp8Layout(method, "_scale_inv", (int(block[0]), int(block[1])) if block else (0, 0))
    if method == "fbgemm_fp8":
        return Fp8Layout(method, "_scale", (0, 0))
    if method == "compressed-tensors" and ct_float(q):
        w = ct_weights(q)
        block = w.get("block_structure") if w.get("strategy") == "block" else None
        return Fp8Layout(method, "_scale", (int(block[0]), int(block[1])) if block else (0, 0))
    return None


def fp8_problem(q: dict[str, Any]) -> str | None:
    """What of an ``fp8`` / ``fbgemm_fp8`` config is not read, in words (None: all of it)."""
    if q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
        return f"an 'fp8' checkpoint in format {q['fmt']!r} is not supported (e4m3 is)"
    return None


def ct_float_problem(w: dict[str, Any], formats: set[Any]) -> str | None:
    """What of a compressed-tensors float weight scheme is not read (None: all of it)."""
    if w.get("num_bits") != 8:
        return f"compressed-tensors float weights of {w.get('num_bits')} bits are not supported (FP8 is)"
    if not formats <= {"float-quantized", "naive-quantized", "dense"}:
        return (f"a compressed-tensors checkpoint in format {sorted(map(str, formats))[0]!r} is not supported "
                "(float-quantized FP8 weights are)")
    if w.get("strategy") not in ("tensor", "channel", "block"):
        return (f"compressed-tensors FP8 weights with strategy {w.get('strategy')!r} are not supported (tensor, "
                "channel and block are)")
    if w.get("strategy") == "block" and len(w.get("block_structure") or ()) != 2:
        return "compressed-tensors FP8 weights in blocks without a block_structure of two sizes are not supported"
    return None


def activation_note(cfg: dict[str, Any]) -> str | None:
    """A line saying the checkpoint's run-time input quantization is not applied (None: it has none)."""
    q = quantization_config(cfg)
    method = q.get("quant_method")
    if method == "compressed-tensors":
        acts = any(g.get("input_activations") for g in ct_groups(q))
    else:
        acts = method in ("fp8", "fbgemm_fp8")
    kv = bool(q.get("kv_cache_scheme"))
    if not acts and not kv:
        return None
    what = " and ".join((["its layers' inputs are not quantized at run time"] if acts else []) +
                        (["its KV cache is kept in the run's dtype (kv_cache_scheme; --compress-cache is the "
                          "engine's own)"] if kv else []))
    return (f"{what}: the outputs are those of its dequantized weights, as transformers' dequantize=True "
            "computes them")


def fp8_block(shape: tuple[int, ...], scale: torch.Tensor, block: tuple[int, int], name: str) -> tuple[int, int]:
    """The block each scale of an FP8 matrix of ``shape`` (..., rows, cols) covers, ``scale``
    (..., ceil(rows / b0), ceil(cols / b1)) holding one per block: the config's ``block`` where
    the grid is what it gives (what the quantizer used), else the one the grid gives where it
    divides the matrix (a scale per tensor or per output row, a block the config does not name:
    transformers' rule)."""
    rows, cols = shape[-2:]
    grid = _grid(scale)
    if block[0] > 0 and block[1] > 0 and (-(-rows // block[0]), -(-cols // block[1])) == grid:
        return block
    if min(grid) > 0 and rows % grid[0] == 0 and cols % grid[1] == 0:
        return rows // grid[0], cols // grid[1]
    raise ModelLoadError(f"{name}: FP8 weight of shape {tuple(shape)} with a scale grid of "
                         f"{tuple(scale.shape)} does not fit blocks of {block[0]}x{block[1]}: corrupt checkpoint?")


def _grid(scale: torch.Tensor) -> tuple[int, int]:
    return tuple(scale.shape[-2:]) if scale.dim() >= 2 else (1, 1) if scale.numel() == 1 else (-1, -1)  # type: ignore[return-value]


def _row_scales(shape: tuple[int, ...], scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """(..., rows, groups) float32: each row's scale of each block of columns (E8M0 bytes:
    2^(byte - 127))."""
    s = (scale.float() - 127.0).exp2() if scale.dtype == torch.uint8 else scale.float()
    return s.reshape(*shape[:-2], *_grid(scale)).repeat_interleave(block[0], -2)[..., :shape[-2], :]


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> torch.Tensor:
    """An FP8 matrix (..., rows, cols) in float32: each element times the scale of its block
    (``fp8_block``), the last blocks partial; computed as transformers computes it (float32
    product)."""
    block = fp8_block(tuple(w.shape), scale, block, name)
    s = _row_scales(tuple(w.shape), scale, block)
    return w.float() * s.repeat_interleave(block[1], -1)[..., :w.shape[-1]]


def fp8_packed(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], name: str) -> PackedWeight:
    """An FP8 matrix (rows, cols) kept as its codes (``PackedWeight`` of format e4m3): groups of
    the block's width along the row, each row's scale per group in float32, the codes padded
    with zeros to whole groups; it expands to exactly ``dequantize_fp8``'s values."""
    rows, cols = w.shape
    block = fp8_block((rows, cols), scale, block, name)
    scales = _row_scales((rows, cols), scale, block).contiguous()
    codes = w.view(torch.uint8)
    pad = scales.shape[-1] * block[1] - cols
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    return PackedWeight(codes.contiguous(), torch.empty(rows, 0), scales, (rows, cols), 8, block[1], "e4m3")


def fp8_format(shape: tuple[int, ...], grid: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int, str]:
    """``(bits, group_size, "e4m3")`` of an FP8 matrix ``fp8_packed`` keeps (``stored_nbytes``
    sizes it), from its shape and its scales' shape alone (a file's header): the group is the
    block's width."""
    scale = torch.empty(grid, device="meta")
    return 8, fp8_block(tuple(shape), scale, block, "")[1], "e4m3"


# e2m1: the 16 values of a 4-bit code (sign, two exponent bits, one mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """An MXFP4 matrix in float32: ``blocks`` (..., rows, groups, 16) bytes, two e2m1 codes each
    (the low nibble first), ``scales`` (..., rows, groups) E8M0 bytes, each group of 32 values
    times 2^(scale - 127): (..., rows, groups * 32), the values transformers expands."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ModelLoadError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                             f"{tuple(scales.shape)}: expected uint8 (..., groups, 16) and (..., groups); corrupt "
                             "checkpoint?")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    vals = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    out = torch.ldexp(vals.reshape(*scales.shape, 32), scales.to(torch.int32)[..., None] - 127)
    return out.reshape(*scales.shape[:-1], -1)


class FloatLayers:
    """A checkpoint's float-coded matrices read with their companions: an FP8 matrix ``X`` with
    its scales (``X`` + the layout's suffix), an MXFP4 one ``X_blocks`` with ``X_scales`` (of
    one expert where the tensors hold all). ``has(name)``: the checkpoint holds the tensor;
    ``raw(name)``: reads it; ``header_dtype(name)``: its stored dtype from the file's header
    (a safetensors dtype string, or a torch dtype) without reading it."""

    def __init__(self, layout: Fp8Layout | None, has: Callable[[str], bool], raw: Callable[[str], torch.Tensor],
                 header_dtype: Callable[[str], Any], where: str) -> None:
        self.layout, self.has, self.raw, self.header_dtype, self.where = layout, has, raw, header_dtype, where

    def scale_name(self, name: str) -> str:
        """The name of FP8 matrix ``name``'s scales (refused in one line where there are none)."""
        scale_name = name + (self.layout.suffix if self.layout else "_scale_inv")
        if self.layout is None or not self.has(scale_name):
            raise ModelLoadError(f"{self.where}: tensor {name} is FP8 but "
                                 + ("the config has no FP8 quantization_config" if self.layout is None
                                    else f"its scales {scale_name} are missing") + ": corrupt checkpoint?")
        return scale_name

    def scale(self, name: str) -> torch.Tensor:
        return self.raw(self.scale_name(name))

    def is_fp8(self, name: str) -> bool:
        """Whether tensor ``name`` is stored in float8 (from the file's header)."""
        return self.has(name) and self.header_dtype(name) in ("F8_E4M3", "F8_E4M3FN", *FP8_DTYPES)

    def expand_fp8(self, name: str, t: torch.Tensor, index: int | None) -> torch.Tensor:
        """FP8 matrix ``name`` (``t``: its codes, of expert ``index`` where given) in float32."""
        scale = self.scale(name)
        assert self.layout is not None  # scale() refused a file without one
        return dequantize_fp8(t, scale[index] if index is not None and scale.dim() > 0 and scale.numel() > 1
                              else scale, self.layout.block, f"{self.where}: {name}")

    def packed_fp8(self, name: str, t: torch.Tensor) -> PackedWeight:
        """A 2-D FP8 matrix kept as its codes (``fp8_packed``)."""
        scale = self.scale(name)
        assert self.layout is not None
        return fp8_packed(t, scale, self.layout.block, f"{self.where}: {name}")

    def mxfp4_parts(self, name: str, index: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """An MXFP4 tensor's blocks and E8M0 scales, of expert ``index`` where given (views of
        the file's mapped tensors: one expert's bytes are all that is read)."""
        scale_name = name.removesuffix("_blocks") + "_scales"
        if not self.has(scale_name):
            raise ModelLoadError(f"{self.where}: tensor {name} is MXFP4 but its scales {scale_name} are missing: "
                                 "corrupt checkpoint?")
        blocks, scales = self.raw(name), self.raw(scale_name)
        if index is not None:
            if blocks.dim() < 3 or blocks.shape[0] <= index:
                raise ModelLoadError(f"{self.where}: tensor {name} has shape {tuple(blocks.shape)}, expected more "
                                     f"than {index} experts: corrupt checkpoint?")
            blocks, scales = blocks[index], scales[index]
        return blocks, scales

    def expand_mxfp4(self, name: str, index: int | None) -> torch.Tensor:
        return dequantize_mxfp4(*self.mxfp4_parts(name, index), f"{self.where}: {name}")

    def packed_mxfp4(self, name: str, index: int | None, rows: str) -> PackedWeight:
        """One MXFP4 matrix (of expert ``index``, its ``rows`` "r0:r1:step" where given) in the
        ``mxfp4`` table format: the e2m1 codes as they are (two a byte, the low nibble first),
        a float32 scale 2^(e - 128) per 32 values (the table holds the values doubled)."""
        blocks, scales = self.mxfp4_parts(name, index)
        where = f"{self.where}: {name}"
        if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[:-1] != scales.shape \
                or blocks.shape[-1] != 16:
            dequantize_mxfp4(blocks, scales, where)  # its one-line refusal
        if rows:
            r0, r1, step = (int(r) for r in (rows + ":1").split(":")[:3])
            if blocks.shape[0] < r1:
                raise ModelLoadError(f"{where} has {blocks.shape[0]} rows, expected >= {r1}")
            blocks, scales = blocks[r0:r1:step], scales[r0:r1:step]
        n, groups = scales.shape
        half = torch.ldexp(torch.ones(n, groups), scales.to(torch.int32) - 128)
        return PackedWeight(blocks.reshape(n, groups * 16).contiguous(), torch.zeros(n, 0), half.contiguous(),
                            (n, groups * 32), 4, 32, "mxfp4")
