"""Gemma 2 and Gemma 3 (text): the token embedding scaled by sqrt(hidden), RMSNorm with
(1 + w), a norm before and after both attention and MLP ("sandwich" norms), GeGLU with the
tanh GELU, grouped-query attention scaled by ``query_pre_attn_scalar``, sliding and global
layers alternating, a tied LM head.

Gemma 2 soft-caps the attention scores and the final logits; Gemma 3 instead normalises each
head of q and k (``spec.qk_norm``) and gives its sliding layers their own RoPE base
(``spec.rope(layer)``). Every operation follows transformers' ``modeling_gemma2.py`` and
``modeling_gemma3.py`` in order and dtype; how a config becomes a ``ModelSpec`` is
``gemma_config.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import (ATTN_MLP_GGUF, ATTN_MLP_HF, Positions, apply_rope, as_positions, embed_shapes, embedding,
                     head_shapes, linear, lm_gguf_names, lm_hf_names, project_qkv, rms_norm)
from .families import Attend, Family, Weights, register
from .spec import ModelSpec

_LAYER_HF = {
    **ATTN_MLP_HF, "attn_norm.w": "input_layernorm.weight", "post_attn_norm.w": "post_attention_layernorm.weight",
    "mlp_norm.w": "pre_feedforward_layernorm.weight", "post_mlp_norm.w": "post_feedforward_layernorm.weight",
}
# llama.cpp's names (its gemma2 / gemma3 architectures): the norm after attention is
# ``post_attention_norm``, the one before the MLP ``ffn_norm``
# Gemma 1 has no norms after the sublayers: its post_attention_layernorm is the one before the MLP
_LAYER_HF_V1 = {**_LAYER_HF, "mlp_norm.w": "post_attention_layernorm.weight"}
_LAYER_GGUF = {
    **ATTN_MLP_GGUF, "attn_norm.w": "attn_norm.weight", "post_attn_norm.w": "post_attention_norm.weight",
    "mlp_norm.w": "ffn_norm.weight", "post_mlp_norm.w": "post_ffw_norm.weight",
}


def layer_shapes(spec: ModelSpec, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    h, f, qd, kvd = spec.hidden_size, spec.ffn_size, spec.q_dim, spec.kv_dim
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.w": (h,), "q.w": (qd, h), "k.w": (kvd, h), "v.w": (kvd, h), "o.w": (h, qd),
        "post_attn_norm.w": (h,), "mlp_norm.w": (h,), "gate.w": (f, h), "up.w": (f, h),
        "down.w": (h, f), "post_mlp_norm.w": (h,),
    }
    if spec.norm_layout == "pre":  # Gemma 1
        del shapes["post_attn_norm.w"], shapes["post_mlp_norm.w"]
    if spec.attention_bias:
        shapes.update({"q.b": (qd,), "k.b": (kvd,), "v.b": (kvd,), "o.b": (h,)})
    if spec.qk_norm:
        shapes.update({"q_norm.w": (spec.head_dim,), "k_norm.w": (spec.head_dim,)})
    return shapes


def hf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, list[str]]:
    """Canonical name -> candidate checkpoint names (first found wins)."""
    table = _LAYER_HF_V1 if spec.norm_layout == "pre" else _LAYER_HF
    return lm_hf_names(spec, part, layer, table, layer_shapes(spec) if part == "layer" else ())


def gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """Canonical name -> GGUF tensor name (llama.cpp convention). llama.cpp's converter stores
    every Gemma norm weight as (1 + w); ``models/gguf.py`` takes the 1 back off on read."""
    if part == "layer":
        return {k: f"blk.{layer}.{_LAYER_GGUF[k]}" for k in layer_shapes(spec)}
    return lm_gguf_names(spec, part)


def norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` all in float32, then cast to
    x's dtype (Llama's casts before the weight; this one after it)."""
    scale = 1.0 + w.float()  # (1 + w) in float32 always: in a half type it would round first
    if x.dtype == torch.float32:
        return rms_norm(x, scale, eps)  # (x * r) * scale, the reference's order
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * scale).to(x.dtype)


def embed(spec: ModelSpec, w: Weights, ids: torch.Tensor, pos: torch.Tensor | Positions) -> torch.Tensor:
    # sqrt(hidden) as a float32 scalar tensor cast to the weights' dtype, as the reference
    # does (in bfloat16, sqrt(3072) = 55.43 becomes 55.5: the checkpoints were trained so)
    tok = w["tok.w"]
    scale = torch.tensor(spec.hidden_size ** 0.5, dtype=torch.float32, device=tok.device).to(tok.dtype)
    return embedding(ids, tok).mul_(scale)


def layer_forward(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                  attend: Attend, layer: int = 0) -> torch.Tensor:
    """One decoder layer; ``attend`` writes k/v into the engine's cache and attends (with the
    layer's window, ``spec.softmax_scale`` and Gemma 2's ``spec.attn_softcap``)."""
    b, t, _ = x.shape
    d, eps = spec.head_dim, spec.norm_eps
    residual = x
    x = norm(x, w["attn_norm.w"], eps)
    q, k, v = project_qkv(spec, w, x)
    if spec.qk_norm:  # Gemma 3: RMSNorm (1 + w) over each head's q and k, before the rotation
        q, k = norm(q, w["q_norm.w"], eps), norm(k, w["k_norm.w"], eps)
    theta, scaling = spec.rope(layer)
    cos, sin = as_positions(pos).rope(d, theta, x.dtype, scaling)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    a = attend(q, k, v)
    del q, k, v  # not held through the MLP (the footprint counts them in attention only)
    if spec.norm_layout == "pre":  # Gemma 1: the sublayers' outputs added as they are
        x = linear(a, w["o.w"], w.get("o.b"), residual)
        del a, residual
        h = norm(x, w["mlp_norm.w"], eps)
        g = F.gelu(linear(h, w["gate.w"]), approximate="tanh").mul_(linear(h, w["up.w"]))
        return linear(g, w["down.w"], None, x)
    # residual + norm(out): the same sum as norm(out) + residual, so the add may be in place
    x = norm(linear(a, w["o.w"], w.get("o.b")), w["post_attn_norm.w"], eps).add_(residual)
    del a
    residual = x
    h = norm(x, w["mlp_norm.w"], eps)
    g = F.gelu(linear(h, w["gate.w"]), approximate="tanh").mul_(linear(h, w["up.w"]))
    return norm(linear(g, w["down.w"]), w["post_mlp_norm.w"], eps).add_(residual)


def final_norm(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    return norm(x, w["norm.w"], spec.norm_eps)


def head(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    x = final_norm(spec, w, x)
    logits = linear(x, w["lm_head.w"] if "lm_head.w" in w else w["tok.w"])
    if spec.final_softcap > 0:  # logits / cap, tanh, * cap: the reference's three steps, in place
        logits.div_(spec.final_softcap).tanh_().mul_(spec.final_softcap)
    return logits


register(Family("gemma", layer_shapes=layer_shapes, embed_shapes=embed_shapes, head_shapes=head_shapes,
                hf_names=hf_names, embed=embed, layer_forward=layer_forward, head=head, final_norm=final_norm))
