"""The model math the families share: linear layers, norms, SwiGLU, rotary positions.

Family modules (``opt.py``, ``llama.py``) build their layers from these and register
themselves in ``families.py``; this module imports none of them. On the CPU the hot pieces
go to the native kernels (``flexgen_dist.kernels``).
"""
from __future__ import annotations

import functools
import math
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels import gemm
from ..kernels.qweight import QWeight
from .lora_rows import LoraWeight
from .spec import ModelSpec, RopeScaling


Weight = torch.Tensor | QWeight  # a dense matrix, or one still packed in 4/8-bit groups


# --------------------------------------------------------------------------------------
# names and shapes the decoder families share (llama, gemma, cohere)
# checkpoint names of attention and the gated MLP, the same in every such family
ATTN_MLP_HF = {
    "q.w": "self_attn.q_proj.weight", "k.w": "self_attn.k_proj.weight",
    "v.w": "self_attn.v_proj.weight", "o.w": "self_attn.o_proj.weight",
    "q.b": "self_attn.q_proj.bias", "k.b": "self_attn.k_proj.bias",
    "v.b": "self_attn.v_proj.bias", "o.b": "self_attn.o_proj.bias",
    "q_norm.w": "self_attn.q_norm.weight", "k_norm.w": "self_attn.k_norm.weight",
    "gate.w": "mlp.gate_proj.weight", "up.w": "mlp.up_proj.weight", "down.w": "mlp.down_proj.weight",
    "gate.b": "mlp.gate_proj.bias", "up.b": "mlp.up_proj.bias", "down.b": "mlp.down_proj.bias",
}
# ... and llama.cpp's
ATTN_MLP_GGUF = {
    "q.w": "attn_q.weight", "k.w": "attn_k.weight", "v.w": "attn_v.weight", "o.w": "attn_output.weight",
    "q.b": "attn_q.bias", "k.b": "attn_k.bias", "v.b": "attn_v.bias", "o.b": "attn_output.bias",
    "q_norm.w": "attn_q_norm.weight", "k_norm.w": "attn_k_norm.weight",
    "gate.w": "ffn_gate.weight", "up.w": "ffn_up.weight", "down.w": "ffn_down.weight",
    "gate.b": "ffn_gate.bias", "up.b": "ffn_up.bias", "down.b": "ffn_down.bias",
}
# where a checkpoint keeps its language model: a text model's, or an image-text one's
# (Gemma 3, Mistral 3: language_model.model.* as published; model.language_model.* as
# transformers writes it)
# "": a base model's checkpoint (``Qwen3Model``, ``MistralModel``: embedding models' form)
LM_PREFIXES = ("model.", "language_model.model.", "model.language_model.", "")
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


def embed_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {"tok.w": (spec.vocab_size, spec.hidden_size)}


def head_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The final norm's weight and the head (the embedding itself where they are tied)."""
    shapes: dict[str, tuple[int, ...]] = {"norm.w": (spec.hidden_size,)}
    if spec.num_labels:  # a sequence classifier's score head
        shapes["score.w"] = (spec.num_labels, spec.hidden_size)
        return shapes
    shapes["tok.w" if spec.tie_word_embeddings else "lm_head.w"] = (spec.vocab_size, spec.hidden_size)
    return shapes


def lm_hf_names(spec: ModelSpec, part: str, layer: int | None, table: dict[str, str],
                keys: Iterable[str]) -> dict[str, list[str]]:
    """Candidate checkpoint names (first found wins) of ``part``: layer ``layer``'s ``keys``
    through ``table`` (canonical -> name within the layer), or the embedding's, or the final
    norm's and head's, under every prefix in ``LM_PREFIXES``."""
    if part == "layer":
        return {k: [f"{p}layers.{layer}.{table[k]}" for p in LM_PREFIXES] for k in keys}
    embed = [f"{p}embed_tokens.weight" for p in LM_PREFIXES]
    if part == "embed":
        return {"tok.w": embed}
    out = {"norm.w": [f"{p}norm.weight" for p in LM_PREFIXES]}
    if spec.num_labels:
        out["score.w"] = ["score.weight"]
    elif spec.tie_word_embeddings:
        out["tok.w"] = embed + list(LM_HEADS)
    else:
        out["lm_head.w"] = list(LM_HEADS)
    return out


def lm_gguf_names(spec: ModelSpec, part: str) -> dict[str, str]:
    """llama.cpp's names of the embedding (``part`` "embed") or of the final norm and head."""
    if part == "embed":
        return {"tok.w": "token_embd.weight"}
    if spec.tie_word_embeddings:
        return {"norm.w": "output_norm.weight", "tok.w": "token_embd.weight"}
    return {"norm.w": "output_norm.weight", "lm_head.w": "output.weight"}


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` with w of shape (out, in), as ``F.linear``, plus ``residual`` when given
    (rounded as ``F.linear(x, w, b).add_(residual)``; the native kernel adds it as it writes).

    On the CPU a GEMM of few rows runs in the form the machine's kernel policy stores for its
    shape (``kernels/gemm.py``: ``F.linear``, ``w @ x.T`` or the native kernel, chosen once
    per machine, never by timing this call), so every run computes the same sums in the same
    order. ``FLEXGEN_GEMM_TUNE=0`` runs ``F.linear`` always.

    A packed weight (``QWeight``, from ``--compress-weight``) is multiplied as it is stored
    where the fused kernel applies (few rows on the CPU), else expanded and multiplied as a
    dense one.
    """
    if isinstance(w, LoraWeight):  # adapters served per request: the base product, then theirs
        return w.add_updates(x, linear(x, w.base, b, residual))
    if isinstance(w, QWeight):
        y = w.linear(x, b, residual)
        if y is not None:
            return y
        w = w.dense()
    if x.device.type != "cpu":
        return _add(F.linear(x, w, b), residual)
    if b is not None and x.dtype != torch.float32:
        # a half-type addmm on the CPU first broadcasts the bias into the output, then runs
        # a slower GEMM path than the bias-free one: add the bias afterwards instead
        return _add(linear(x, w).add_(b), residual)
    return gemm.linear(x, w, b, residual)


def _add(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return y if residual is None else y.add_(residual)


EXPERTS = "experts"  # the weights key under which a sparse layer's routed experts come, when not in place
EXPERT_PARTS = ("gate.w", "up.w", "down.w")  # a routed expert's matrices (``experts.{e}.<part>``)
EXPERT_BIASES = ("gate.b", "up.b", "down.b")  # ... and its biases, where it has them (gpt-oss)


class Experts(Protocol):
    """A sparse layer's routed experts, read when the tokens choose them: ``prefetch(ids)``
    says which will be needed (ascending), ``get(e)`` gives expert e's ``gate.w``, ``up.w`` and
    ``down.w`` (waiting for its read)."""

    def prefetch(self, ids: list[int]) -> None: ...

    def get(self, e: int) -> dict[str, Weight]: ...


class DictExperts:
    """The experts of a weight dict that holds them all (``experts.{e}.gate.w``, ...)."""

    def __init__(self, w: dict[str, Weight]) -> None:
        self.w = w

    def prefetch(self, ids: list[int]) -> None:
        pass

    def get(self, e: int) -> dict[str, Weight]:
        return {k: self.w[f"experts.{e}.{k}"] for k in EXPERT_PARTS + EXPERT_BIASES if f"experts.{e}.{k}" in self.w}


def embedding(ids: torch.Tensor, w: Weight) -> torch.Tensor:
    """``F.embedding(ids, w)``; a packed table expands only the rows it gathers."""
    return w.rows(ids) if isinstance(w, QWeight) else F.embedding(ids, w)


def project_qkv(spec: ModelSpec, w: dict[str, torch.Tensor], x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, t, heads, head_dim), k and v (b, t, kv_heads, head_dim) of x (b, t, hidden), with
    their biases where the checkpoint has them (the LLaMA and Gemma families)."""
    b, t, _ = x.shape
    d = spec.head_dim
    return (linear(x, w["q.w"], w.get("q.b")).view(b, t, spec.num_heads, d),
            linear(x, w["k.w"], w.get("k.b")).view(b, t, spec.num_kv_heads, d),
            linear(x, w["v.w"], w.get("v.b")).view(b, t, spec.num_kv_heads, d))


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u``, in place in g (SwiGLU's gate times its up projection)."""
    if g.device.type == "cpu" and kernels.silu_mul(g, u):  # one pass
        return g
    return F.silu(g, inplace=True).mul_(u)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # On the CPU a native kernel, one pass (torch's rms_norm runs five there). Half types are
    # normalised in float32 and cast back before the weight, as the reference implementation does.
    y = kernels.rms_norm(x, w, eps) if x.device.type == "cpu" else None
    if y is not None:
        return y
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class Positions:
    """Integer positions (b, t) of a batch, with the rotary tables memoised.

    Every layer of a stage sees the same positions for one (token, GPU batch), so the engine
    builds one ``Positions`` and the layers share its cos/sin instead of recomputing them.
    """

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, head_dim: int, theta: float, dtype: torch.dtype, scaling: RopeScaling | None = None,
             interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (b, t, 1, head_dim): each frequency twice, the halves concatenated
        (``apply_rope``), or, ``interleaved``, each repeated in place (``apply_rope_interleaved``)."""
        key = (head_dim, theta, dtype, scaling, interleaved)
        if key not in self._rope:
            if interleaved:
                cos, sin = self.rope(head_dim, theta, dtype, scaling)
                half = head_dim // 2
                self._rope[key] = (cos[..., :half].repeat_interleave(2, dim=-1),
                                   sin[..., :half].repeat_interleave(2, dim=-1))
            else:
                self._rope[key] = rope_cos_sin(self.ids, head_dim, theta, dtype, scaling)
        return self._rope[key]


def as_positions(pos: "torch.Tensor | Positions") -> Positions:
    return pos if isinstance(pos, Positions) else Positions(pos)


@functools.lru_cache(maxsize=64)
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  device: torch.device | None = None, long: bool = False) -> torch.Tensor:
    """The rotary inverse frequencies (head_dim / 2,), scaled as ``scaling`` says, computed
    as the reference implementation computes them (float32, the same operations in order).
    ``long``: longrope's frequencies for a sequence past the original context (else its short ones).
    Kept per arguments (every step's tables start from them): the tensor is shared, never written."""
    if scaling is not None and scaling.rope_type == "longrope":
        ext = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32,
                           device=device)
        if ext.numel() * 2 != head_dim:
            raise ValueError(f"longrope has {ext.numel()} factors for {head_dim} rotated dims: "
                             f"expected {head_dim // 2}")
        return 1.0 / (ext * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
                                      / head_dim))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                             dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.rope_type == "dynamic":  # dynamic: plain within max positions
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, device)
    # llama3: low frequencies divided by factor, high kept, medium interpolated
    factor, lo, hi = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, sc: RopeScaling, device: torch.device | None) -> torch.Tensor:
    """YaRN's frequencies, with the reference's operations in order."""
    def correction_dim(rotations: float) -> float:  # the dimension that turns this often
        return (dim * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(sc.beta_fast), correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (sc.factor * pos_freqs)
    keep = 1 - ramp  # the share of the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (b, t, 1, head_dim) for integer positions (b, t).

    longrope picks its long frequencies for a row whose positions reach past the original
    context (the reference's rule, ``max(position) + 1 > original``, taken per row: the
    reference takes it over the whole batch, so a row's result would depend on its batch-mates;
    per row, every request gets what it gets run alone), chosen on the device, no sync."""
    if scaling is not None and scaling.rope_type == "longrope":
        short = rope_inv_freq(head_dim, theta, scaling, pos.device)
        long = rope_inv_freq(head_dim, theta, scaling, pos.device, long=True)
        past = (pos.amax(dim=1, keepdim=True) + 1 > scaling.original_max_position_embeddings)[..., None]
        inv_freq = torch.where(past, long, short)  # (b, 1, head_dim / 2)
    else:
        inv_freq = rope_inv_freq(head_dim, theta, scaling, pos.device)
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = emb.cos(), emb.sin()
    if scaling is not None and scaling.attention_factor != 1.0:  # yarn, longrope: float32 as the reference
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           in_float32: bool = False) -> torch.Tensor:
    """RoPE on interleaved pairs (dims 2i and 2i+1 turn together; ``apply_rope`` turns i and
    i + d/2) of x (b, t, heads, d), with cos/sin (b, t, 1, r) from ``Positions.rope(...,
    interleaved=True)``; r < d turns the leading r dims only (GLM-4). ``in_float32``: computed
    in float32 and cast back (Cohere), else in x's dtype (GLM-4)."""
    rot = cos.shape[-1]
    xr = x[..., :rot]
    if in_float32:
        xr, cos, sin = xr.float(), cos.float(), sin.float()
    turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    out = (xr * cos + turned * sin).to(x.dtype)
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on x of shape (b, t, heads, head_dim), rotate-half convention.

    ``x * cos + rotate_half(x) * sin`` without building ``rotate_half(x)``: the two halves are
    updated in place with fused multiply-adds (two passes over x instead of five). cos/sin
    narrower than a head (a partial rotary embedding, Phi-4-mini) turn its leading dims only;
    the rest of the head passes through.
    """
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        half = rot // 2
        x1, x2, s = x[..., :half], x[..., half:rot], sin[..., :half]
        out = x.clone()
        out[..., :rot].mul_(cos)
        out[..., :half].addcmul_(x2, s, value=-1)
        out[..., half:rot].addcmul_(x1, s)
        return out
    if x.device.type == "cpu":
        y = kernels.rope(x, cos, sin)  # one pass
        if y is not None:
            return y
    half = x.shape[-1] // 2
    x1, x2, s = x[..., :half], x[..., half:], sin[..., :half]
    out = x * cos
    out[..., :half].addcmul_(x2, s, value=-1)
    out[..., half:].addcmul_(x1, s)
    return out

