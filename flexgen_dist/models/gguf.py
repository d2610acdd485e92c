"""GGUF files (llama.cpp's format): which of its architectures the engine computes, the
``ModelSpec`` a file's metadata gives, and the ``WeightSource`` that reads its tensors.

llama.cpp's converter writes each Hugging Face family under an architecture name of its own
(``general.architecture``): Llama 2/3, SmolLM2 and Mistral as ``llama``, Qwen2/2.5 as
``qwen2``, Qwen3 as ``qwen3``, Phi-3 as ``phi3``, Gemma 2 as ``gemma2``, Gemma 3 (text) as
``gemma3``, GPT-NeoX / Pythia as ``gptneox``, Phi-1/1.5/2 as ``phi2``, StarCoder2 as
``starcoder2``, ...; ``gguf_arch.py`` holds
what differs between them. A file of one of these maps to
the ``ModelSpec`` the HF directory it was written from gives. Whatever in a file the engine
would not compute is refused in one line before anything is generated: another architecture,
a metadata key of the architecture not accounted for (``gguf_arch.py``), a tensor the engine
would not read, a missing tensor, a RoPE scaling it does not compute.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import rope_inv_freq
from .families import INDEX, ROWS
from .gguf_arch import (ARCHS, INERT, QWEN_NEXT_ARCHS, USED, GGUFArch, cohere_fields, decimal32, gemma_fields,
                        exaone_moe_fields, layer_scalars, llama_fields, post_norm_fields)
from .gguf_moe import MOE_ARCHS, nextn
from .gguf_neox import check_mlp_width, neox_fields
from .gguf_deepseek import join_kv_b
from .llama import unpermute_gguf
from .rope_config import rope_scaling
from .source import ModelLoadError, WeightSource
from .gguf_blocks import GGUF_NATIVE, gguf_packed
from .packed import PackedWeight
from .spec import ModelSpec, RopeScaling

log = logging.getLogger("flexgen_dist")


_MISSING = object()


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def spec_from_gguf(reader: Any, name: str) -> ModelSpec:
    """The ``ModelSpec`` of a GGUF file, with every tensor it holds checked to be one the
    engine reads and every tensor the engine reads checked to be there."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(f"{name}: GGUF architecture {arch!r} is not supported (supported: "
                             f"{', '.join(sorted(ARCHS))}; Mistral is written as llama): use a file of "
                             "one of these, or the model's Hugging Face directory")
    a = ARCHS[arch]
    tensors = _tensors(reader, arch)
    _refuse_what_is_not_computed(reader, arch, a, tensors, name)

    def key(k: str, default: Any = _MISSING) -> Any:
        v = gguf_field(reader, f"{arch}.{k}", default)
        if v is _MISSING:
            raise ModelLoadError(f"{name}: GGUF key {arch}.{k} is missing: the file is incomplete; "
                                 "convert the model again")
        if isinstance(v, list):
            raise ModelLoadError(f"{name}: GGUF key {arch}.{k} varies per layer: not supported")
        return v

    experts = int(key("expert_count", 0))
    if experts and arch not in MOE_ARCHS:
        raise ModelLoadError(f"{name}: a mixture-of-experts {arch} file is not supported (supported: "
                             f"{', '.join(sorted(MOE_ARCHS))})")
    if arch in MOE_ARCHS - {"llama"} and not experts:
        raise ModelLoadError(f"{name}: GGUF key {arch}.expert_count is missing: the file is incomplete; "
                             "convert the model again")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{name}: tensor token_embd.weight missing from the GGUF file: the file is "
                             "incomplete; convert the model again")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes run innermost first
    if key("vocab_size", vocab) != vocab:
        raise ModelLoadError(f"{name}: {arch}.vocab_size {key('vocab_size')} but token_embd.weight has "
                             f"{vocab} rows: corrupt file?")
    head_dim, rotary, partial = _head_sizes(key, arch, hidden, heads, name)
    theta = decimal32(key("rope.freq_base", 10000.0))
    llama_family = a.family == "llama"
    try:
        # rope_freqs (Llama 3.1's divisors) is llama's alone: in another file it is refused as unread
        scaling = _rope_scaling(key, tensors if llama_family else {}, rotary, theta, name, truncate=arch != "gpt-oss")
        if a.scalars:  # Apertus's xIELU scalars (metadata, one value a layer), checked here
            layer_scalars(a, lambda k: gguf_field(reader, k), int(key("block_count")))
        if llama_family:
            fields = llama_fields(arch, key, tensors, head_dim if head_dim * heads != hidden else 0, experts)
            pattern = gguf_field(reader, f"{arch}.attention.sliding_window_pattern")
            if arch in ("olmo2", "exaone4"):
                fields.update(post_norm_fields(arch, key, pattern, int(key("block_count"))))
            elif arch == "exaone-moe":
                fields.update(exaone_moe_fields(key, pattern, int(key("block_count")) - nextn(key, arch)))
            fields["rotary_dim"] = rotary if partial else 0
        elif a.family == "cohere":
            fields = cohere_fields(arch, key, set(tensors), int(key("block_count")))
        elif a.family == "neox":
            fields = neox_fields(arch, key, set(tensors), heads, rotary if partial else 0)
        else:
            fields = gemma_fields(arch, key, gguf_field(reader, f"{arch}.attention.sliding_window_pattern"),
                                  key("block_count"), hidden, heads, head_dim, theta, scaling,
                                  "output.weight" in tensors)
        kv_heads = fields.pop("num_kv_heads", None) or key("attention.head_count_kv", 0)
        spec = ModelSpec(
            name=name, family=a.family, num_layers=key("block_count") - nextn(key, arch), hidden_size=hidden,
            # Qwen3.5-MoE's files have no dense width (every layer sparse): the experts' stands in
            ffn_size=key("feed_forward_length") if arch != "qwen35moe" else
            key("feed_forward_length", key("expert_feed_forward_length")), num_heads=heads, num_kv_heads=kv_heads,
            vocab_size=vocab, max_positions=key("context_length", 2048),
            **({} if "norm_eps" in fields else {"norm_eps": decimal32(key("attention.layer_norm_rms_epsilon", 1e-5))}),
            rope_theta=theta,
            rope_scaling=scaling, bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=_stop_ids(reader),
            pad_token_id=gguf_field(reader, "tokenizer.ggml.padding_token_id"), **fields)
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None
    if a.family == "neox":
        check_mlp_width(spec, arch, tensors, name)
    # GLM-4.5's multi-token-prediction blocks follow the last layer: never read
    _check_tensors(spec, a, {t for t in tensors if _tensor_order(t)[0] < spec.num_layers}, name)
    return spec


def _head_sizes(key: Any, arch: str, hidden: int, heads: int, name: str) -> tuple[int, int, bool]:
    """(head size, the dims RoPE turns, whether that is part of the head) of a file, checked:
    the value heads as the keys', partial rotary only where the architecture has it."""
    head_dim = key("attention.key_length", hidden // heads if heads else 0)
    rotary = int(key("rope.dimension_count", head_dim))
    # Phi-4-mini turns 3/4 of each head, GLM-4, GLM-4.5 and MiniMax-M2 half, Pythia a quarter, Phi-2 0.4
    partial = arch in ("phi3", "glm4", "glm4moe", "minimax-m2", "gptneox", "phi2", *QWEN_NEXT_ARCHS) \
        and rotary != head_dim
    if partial and (rotary % 2 or not 0 < rotary < head_dim):
        raise ModelLoadError(f"{name}: {arch}.rope.dimension_count {rotary} is not an even count below the "
                             f"head size {head_dim}: corrupt file?")
    # DeepSeek's latent attention has heads of its own sizes (gguf_deepseek.mla_fields)
    for k in () if arch == "deepseek2" else ("attention.value_length",) + (() if partial else ("rope.dimension_count",)):
        if key(k, head_dim) != head_dim:
            what = "partial rotary embeddings" if k.startswith("rope") else "a value head size"
            raise ModelLoadError(f"{name}: {arch}.{k} {key(k)} differs from the head size {head_dim} "
                                 f"({what}): not supported")
    return head_dim, rotary, partial


def _stop_ids(reader: Any) -> tuple[int, ...]:
    """Every end-of-generation id the file names (end of sequence, of turn, of message), as
    llama.cpp stops at each."""
    stops = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return tuple(dict.fromkeys(int(i) for i in stops if i is not None))


def _tensors(reader: Any, arch: str) -> dict[str, Any]:
    """The file's tensors by name; a deepseek2 file's split kv_b joined back (``join_kv_b``)."""
    tensors = {t.name: t for t in reader.tensors}
    return join_kv_b(tensors) if arch == "deepseek2" else tensors


def _refuse_what_is_not_computed(reader: Any, arch: str, a: Any, tensors: dict[str, Any], name: str) -> None:
    """One line for a file this engine would read wrongly: a part of a split file, Phi-3's
    longrope factors, an ``{arch}.*`` key it does not compute."""
    if gguf_field(reader, "split.count", 1) > 1:
        raise ModelLoadError(f"{name}: one part of a GGUF split into {gguf_field(reader, 'split.count')} "
                             "files: merge them into one (llama-gguf-split --merge) and pass that")
    factors = {"rope_factors_long.weight", "rope_factors_short.weight"} & set(tensors)
    if factors and arch != "phi3":
        raise ModelLoadError(f"{name}: GGUF rope_factors_long/short (LongRoPE) in a {arch} file: supported "
                             "for phi3 only")
    if len(factors) == 1:
        raise ModelLoadError(f"{name}: GGUF tensor {factors.pop()} without its pair: the file is incomplete; "
                             "convert the model again")
    unknown = sorted(k for k in reader.fields if k.startswith(f"{arch}.")
                     and k[len(arch) + 1:] not in USED | INERT | a.keys)
    if unknown:
        raise ModelLoadError(f"{name}: GGUF key {unknown[0]} is not computed by this engine: a {arch} "
                             "file with it is not supported")


def _check_tensors(spec: ModelSpec, a: GGUFArch, present: set[str], name: str) -> None:
    """Every tensor the engine reads is in the file, and the file holds no other."""
    # rope_freqs: read into a llama file's RoPE scaling
    wanted = {"rope_freqs.weight"} & present if a.family == "llama" else set()
    if spec.rope_scaling is not None and spec.rope_scaling.rope_type == "longrope":
        wanted |= {"rope_factors_long.weight", "rope_factors_short.weight"}
    for part, layers in (("embed", [None]), ("layer", range(spec.num_layers)), ("head", [None])):
        for layer in layers:
            wanted.update(n.split("#")[0] for n in a.names(spec, part, layer).values())
    missing = sorted(wanted - present, key=_tensor_order)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{name}: tensor {missing[0]}{more} missing from the GGUF file: the file is "
                             "incomplete or corrupt; convert or download it again")
    extra = sorted(present - wanted, key=_tensor_order)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelLoadError(f"{name}: GGUF tensor {extra[0]}{more} is not read by this engine: a model "
                             "with it is not supported")


def _tensor_order(n: str) -> tuple[int, str]:
    parts = n.split(".")
    return (int(parts[1]) if n.startswith("blk.") and parts[1].isdigit() else -1, n)


def _rope_scaling(key: Any, tensors: dict[str, Any], head_dim: int, theta: float,
                  name: str, truncate: bool = True) -> RopeScaling | None:
    """The RoPE scaling a file describes: ``rope.scaling.type`` linear, YaRN, Llama 3.1's
    per-frequency divisors (``rope_freqs``), or Phi-3's LongRoPE (``rope_factors_long/short``,
    the original context and the attention factor); any other is refused in one line.
    ``head_dim``: the dims RoPE turns; ``truncate``: YaRN's ramp ends rounded (transformers'
    default; gpt-oss's config turns it off, which the file does not say)."""
    if "rope_factors_long.weight" in tensors:
        return _longrope(key, tensors, head_dim, name)
    kind = key("rope.scaling.type", "none")
    if kind not in ("none", "linear", "yarn"):
        raise ModelLoadError(f"{name}: GGUF rope scaling type {kind!r} is not supported (supported: none, "
                             "linear, yarn, and Llama 3.1's rope_freqs)")
    freqs = tensors.get("rope_freqs.weight")
    if kind == "yarn":
        return _yarn(key, freqs is not None, truncate, name)
    if kind == "linear":
        if freqs is not None:
            raise ModelLoadError(f"{name}: GGUF with both linear rope scaling and rope_freqs: not supported")
        try:
            return RopeScaling("linear", float(key("rope.scaling.factor")))
        except ValueError as e:
            raise ModelLoadError(f"{name}: {e}") from None
    if freqs is None:
        return None
    from gguf import dequantize

    divisors = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float32).reshape(-1)
    return llama3_from_divisors(divisors, head_dim, theta, name)


def _yarn(key: Any, has_freqs: bool, truncate: bool, name: str) -> RopeScaling:
    """YaRN from a file, as transformers derives it from the config llama.cpp's converter read:
    the factor, the original context, beta fast and slow (32 and 1 where the file has none),
    the attention factor 0.1 ln(factor) + 1. What llama.cpp would scale differently from the
    reference (an extrapolation factor or an attention factor other than 1) is refused."""
    for k in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
        if float(key(k, 1.0)) != 1.0:
            raise ModelLoadError(f"{name}: GGUF {k} {key(k)} is not supported (only 1: the reference's YaRN)")
    if has_freqs:
        raise ModelLoadError(f"{name}: GGUF with both yarn rope scaling and rope_freqs: not supported")
    rope = {"rope_type": "yarn", "factor": decimal32(float(key("rope.scaling.factor"))),
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": decimal32(float(key("rope.scaling.yarn_beta_fast", 32.0))),
            "beta_slow": decimal32(float(key("rope.scaling.yarn_beta_slow", 1.0))), "truncate": truncate}
    log_mul = decimal32(float(key("rope.scaling.yarn_log_multiplier", 0.0)))
    if log_mul:  # DeepSeek's 0.1 mscale_all_dim; its mscale is taken equal (as in every published model)
        rope["mscale"] = rope["mscale_all_dim"] = log_mul / 0.1
    scaling = rope_scaling(rope, name, int(key("context_length", 0)), 0)
    assert scaling is not None
    return scaling


def _longrope(key: Any, tensors: dict[str, Any], rotary: int, name: str) -> RopeScaling:
    """Phi-3's LongRoPE from a file: the factors as llama.cpp's converter writes them, the
    scaling factor the context's growth over the original (as transformers derives it), and
    the attention factor transformers computes from it unless the file says another (a
    checkpoint's own, or its converter's for an older type), so that a file and its
    Hugging Face directory run alike."""
    from gguf import dequantize

    long, short = (tuple(decimal32(float(v)) for v in np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1))
                   for t in (tensors["rope_factors_long.weight"], tensors["rope_factors_short.weight"]))
    if len(long) != rotary // 2 or len(short) != rotary // 2:
        raise ModelLoadError(f"{name}: GGUF rope_factors_long/short have {len(long)}/{len(short)} values for "
                             f"{rotary} rotated dims: expected {rotary // 2}; corrupt file?")
    old = int(key("rope.scaling.original_context_length", 0))
    if old < 1:
        raise ModelLoadError(f"{name}: GGUF with rope_factors_long/short but no rope.scaling.original_context_length: "
                             "the file is incomplete; convert the model again")
    factor = int(key("context_length")) / old
    att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    said = key("rope.scaling.attn_factor", None)
    if said is not None and abs(float(said) - att) > 1e-6 * att:
        att = decimal32(float(said))
    try:
        return RopeScaling("longrope", factor, original_max_position_embeddings=old, attention_factor=att,
                           long_factor=long, short_factor=short)
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None


def llama3_divisors(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs`` for Llama
    3.1's rule (its loop over frequencies, as tensor operations, float32)."""
    wavelen = 2 * math.pi / rope_inv_freq(head_dim, theta)
    lo, hi, old = s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1 / ((1 - smooth) / s.factor + smooth)
    return torch.where(wavelen < old / hi, torch.ones_like(mid),
                       torch.where(wavelen > old / lo, torch.full_like(mid, s.factor), mid))


def llama3_from_divisors(divisors: np.ndarray, head_dim: int, theta: float, name: str) -> RopeScaling | None:
    """The ``llama3`` scaling whose divisors are ``divisors``, or a one-line refusal.

    The file keeps the divisors, not the rule's parameters, and the engine computes the
    frequencies from the parameters, as transformers does from the HF config (bit for bit).
    So they are recovered: ``factor`` is the divisor of the low band, low/high_freq_factor
    are 1 and 4 (every Llama 3.1+ model's), and the original context length is solved from
    the interpolated divisors (with none between the bands: Llama 4 Scout's factors 1 and 1 at
    8192 first, then any length giving the same bands). The rule with them must give back
    every divisor of the file, or the file is refused.
    """
    if divisors.shape != (head_dim // 2,):
        raise ModelLoadError(f"{name}: GGUF rope_freqs has {divisors.size} values, expected {head_dim // 2} "
                             "(one per rotary frequency): corrupt file?")
    if np.all(divisors == 1):
        return None
    factor = decimal32(divisors.max())
    wavelen = (2 * math.pi / rope_inv_freq(head_dim, theta)).double().numpy()
    mid = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if mid.any():  # 1/d = (1 - s)/factor + s, s = (old/wavelen - lo)/(hi - lo): solve for old (lo 1, hi 4)
        smooth = (1 / divisors[mid].astype(np.float64) - 1 / factor) / (1 - 1 / factor)
        candidates = [(4.0, round(float(np.median(wavelen[mid] * (smooth * 3.0 + 1.0)))))]
    else:  # no band between: Llama 4 Scout's equal factors (1 and 1) at 8192, or any length putting
        # each frequency in the same band (equal factors, or 1 and 4), which gives the same frequencies
        high = divisors <= 1 + 1e-6
        low_end = wavelen[high].max() if high.any() else 0.0
        high_end = wavelen[~high].min()
        candidates = [(1.0, 8192), (1.0, round((low_end + high_end) / 2)), (4.0, 8192),
                      (4.0, round((4 * low_end + high_end) / 2))]
    for hi, old in candidates:
        try:
            s = RopeScaling("llama3", factor, 1.0, hi, max(int(old), 1))
        except ValueError:
            continue
        if np.allclose(llama3_divisors(head_dim, theta, s).numpy(), divisors, rtol=1e-5, atol=0):
            return s
    raise ModelLoadError(f"{name}: GGUF rope_freqs do not follow Llama 3.1's rule (low_freq_factor 1, "
                         "high_freq_factor 4, or both 1 as Llama 4's): not supported; use the Hugging Face directory")


class GGUFSource(WeightSource):
    """The tensors of a GGUF file, dequantized per tensor (``get``) or kept in the file's own
    blocks (``get_packed``: Q4_0 ... Q8_0 and the K-quants, ``gguf_blocks``). A fused tensor's rows are cut whole rows of blocks
    (blocks run along a row), so a slice of a packed tensor stays packed."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, reader: Any, path: Path) -> None:
        super().__init__(spec, dtype)
        self.reader, self.path = reader, path
        arch = gguf_field(reader, "general.architecture")
        self.tensors = _tensors(reader, arch)
        self.arch = ARCHS[arch]
        self._said: set[str] = set()  # tensor types already reported as not native
        # the learned scalars a layer the file keeps as metadata (Apertus's xIELU), as float32
        self.scalars = {k: torch.tensor(v, dtype=torch.float32) for k, v in layer_scalars(
            self.arch, lambda k: gguf_field(reader, k), int(gguf_field(reader, f"{arch}.block_count", 0))).items()}

    def _scalars(self, part: str, layer: int | None) -> dict[str, torch.Tensor]:
        """A layer's scalars read from the metadata, each as the one-element tensor it is in the
        checkpoint."""
        if part != "layer" or layer is None:
            return {}
        return {k: v[layer].reshape(1).clone() for k, v in self.scalars.items()}

    def _names(self, part: str, layer: int | None) -> dict[str, tuple[Any, Any, tuple[int, ...]]]:
        """Canonical name -> (tensor, its data or rows of it, the shape of that data)."""
        out = {}
        shapes = self.shapes(part, layer)
        for k, full in self.arch.names(self.spec, part, layer).items():
            name, _, rows = full.partition(ROWS)
            name, _, index = name.partition(INDEX)
            t = self.tensors.get(name)
            if t is None:
                raise ModelLoadError(f"{self.path}: tensor {name} missing from the GGUF file")
            shape = tuple(int(n) for n in t.shape[::-1])  # GGUF shapes run innermost first
            data = t.data
            if index:  # one expert of a 3-D tensor of all (experts x rows x cols), or of their biases
                e = int(index)
                if len(shape) < 2 or shape[0] <= e:
                    raise ModelLoadError(f"{self.path}: tensor {name} has shape {shape}, expected more than "
                                         f"{e} experts: corrupt file?")
                data, shape = data[e], shape[1:]
            if len(shape) == 1 and len(shapes.get(k, ())) == 2 and shapes[k][0] == 1:
                data, shape = data.reshape(1, -1), (1, shape[0])  # a gate of one row, kept as a vector
            if len(shape) == 2 and shape[0] == 1 and len(shapes.get(k, ())) == 1:
                data, shape = data.reshape(-1), (shape[1],)  # a vector kept as one row (ERNIE's 1 x experts bias)
            if len(shape) == 2 and len(shapes.get(k, ())) == 3 and shapes[k][1] == 1:
                data, shape = data.reshape(shape[0], 1, shape[1]), (shape[0], 1, shape[1])  # a depthwise conv's taps
            if rows:  # one range of rows, or several joined ("a:b,c:d": Qwen3-Next's interleaved heads)
                ranges = [tuple(int(r) for r in rng.split(":")) for rng in rows.split(",")]
                if shape[0] < max(r1 for _, r1 in ranges):
                    raise ModelLoadError(f"{self.path}: tensor {name} has {shape[0]} rows, expected >= "
                                         f"{max(r1 for _, r1 in ranges)}")
                parts = [data[r0:r1] for r0, r1 in ranges]
                data = parts[0] if len(parts) == 1 else np.concatenate(parts)
                shape = (sum(r1 - r0 for r0, r1 in ranges), *shape[1:])
            out[k] = (t, data, shape)
        return out

    def _read(self, part: str, layer: int | None) -> dict[str, torch.Tensor]:
        return {**{k: self._expanded(k, t, data) for k, (t, data, _) in self._names(part, layer).items()},
                **self._scalars(part, layer)}

    def _unpermute(self, k: str, w: Any) -> Any:
        return unpermute_gguf(k, w, self.spec) if self.arch.permuted else w

    def _expanded(self, k: str, t: Any, data: Any) -> torch.Tensor:
        from gguf import dequantize

        a = dequantize(data, t.tensor_type)
        if not (a.flags.writeable and a.flags.c_contiguous):  # a plain tensor is a view of the mapped file
            a = a.copy()
        w = torch.from_numpy(a).float()
        if k == "lin_A_log":  # the file holds A = -exp(A_log) (llama.cpp's converter)
            w = torch.log(-w)
        if self.arch.norm_shift and k.endswith("norm.w") and k != "lin_norm.w":  # (ssm_norm is stored as it is)
            # the file holds Gemma's 1 + w, rounded once by the converter; in float32 taking 1
            # off is exact for any such value, so the family's 1 + w is the file's bit for bit
            w -= self.arch.norm_shift
        return self._unpermute(k, w)

    def packed_formats(self, part: str, layer: int | None = None) -> dict[str, tuple[Any, ...]]:
        if not self.keep_packed:
            return {}
        shapes = self.shapes(part, layer)
        kinds = {k: t.tensor_type.name for k, (t, _, _) in self._names(part, layer).items()}
        return {k: GGUF_NATIVE[kind] for k, kind in kinds.items() if kind in GGUF_NATIVE and len(shapes[k]) == 2}

    def get_packed(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor | PackedWeight]:
        packed: dict[str, PackedWeight] = {}
        dense: dict[str, torch.Tensor] = {}
        shapes = self.shapes(part, layer)
        for k, (t, data, shape) in self._names(part, layer).items():
            kind = t.tensor_type.name
            if self.keep_packed and kind in GGUF_NATIVE and len(shapes[k]) == 2:
                if shape != tuple(shapes[k]):
                    raise ModelLoadError(f"{self.path}: tensor {t.name} has shape {shape}, "
                                         f"expected {shapes[k]}: corrupt checkpoint?")
                pw = gguf_packed(data, kind, shapes[k], self.dtype)
                packed[k] = pw.rows(lambda x, k=k: self._unpermute(k, x))
                continue
            if len(shapes[k]) == 2 and kind not in self._said:
                self._said.add(kind)
                log.info("%s: GGUF %s tensors have no native compressed form here; they are "
                         "re-quantized group-wise from their dequantized values", self.path.name, kind)
            dense[k] = self._expanded(k, t, data)
        dense.update(self._scalars(part, layer))
        return {**self._checked(part, layer, dense), **packed}
