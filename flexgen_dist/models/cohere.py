"""Cohere family (Command R, Command R+, Aya: ``cohere``; Command R7B, Command A: ``cohere2``).

What differs from Llama, each as transformers' ``modeling_cohere.py`` / ``modeling_cohere2.py``
computes it:

- one LayerNorm per layer (mean subtracted, no bias, in float32 with the weight applied before
  the cast), feeding attention and the MLP side by side: ``x + attn(ln(x)) + mlp(ln(x))``;
- RoPE on interleaved pairs (dims 2i and 2i+1 turn together; Llama turns i and i + d/2), in
  float32, with cos/sin first rounded to the model's dtype as the reference rounds them;
- Command R+: a LayerNorm over each head of q and k with weights of its own per head;
- Command R7B / A: three sliding-window layers of four with RoPE, the fourth global and
  without any position encoding (``ModelSpec.nope_layers``);
- the logits multiplied by ``logit_scale``.
"""
from __future__ import annotations

import torch

from .common import (ATTN_MLP_GGUF, ATTN_MLP_HF, Positions, apply_rope_interleaved, as_positions, embed_shapes, embedding, head_shapes,
                     linear, lm_gguf_names, lm_hf_names, project_qkv, silu_mul)
from .families import Attend, Family, Weights, register
from .spec import ModelSpec

_LAYER_HF = {**ATTN_MLP_HF, "attn_norm.w": "input_layernorm.weight"}
_LAYER_GGUF = {**ATTN_MLP_GGUF, "attn_norm.w": "attn_norm.weight"}


def layer_shapes(spec: ModelSpec, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    h, f, qd, kvd = spec.hidden_size, spec.ffn_size, spec.q_dim, spec.kv_dim
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.w": (h,), "q.w": (qd, h), "k.w": (kvd, h), "v.w": (kvd, h), "o.w": (h, qd),
        "gate.w": (f, h), "up.w": (f, h), "down.w": (h, f),
    }
    if spec.attention_bias:
        shapes.update({"q.b": (qd,), "k.b": (kvd,), "v.b": (kvd,), "o.b": (h,)})
    if spec.qk_norm:  # a weight per head and dim
        shapes.update({"q_norm.w": (spec.num_heads, spec.head_dim), "k_norm.w": (spec.num_kv_heads, spec.head_dim)})
    return shapes


def hf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, list[str]]:
    """Canonical name -> candidate checkpoint names (first found wins)."""
    return lm_hf_names(spec, part, layer, _LAYER_HF, layer_shapes(spec, layer) if part == "layer" else ())


def gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """Canonical name -> GGUF tensor name (llama.cpp's ``command-r`` and ``cohere2``; q and k
    as the checkpoint has them: llama.cpp turns interleaved pairs for these too)."""
    if part == "layer":
        return {k: f"blk.{layer}.{_LAYER_GGUF[k]}" for k in layer_shapes(spec, layer)}
    return lm_gguf_names(spec, part)


def layer_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm over the last dim: float32, mean subtracted, no bias, the weight
    (broadcast: per head for q/k) multiplied before the cast; the reference's operations in
    order, so that float32 results are its own to the bit."""
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    var = centred.pow(2).mean(-1, keepdim=True)
    return (w.float() * (centred * torch.rsqrt(var + eps))).to(x.dtype)


def embed(spec: ModelSpec, w: Weights, ids: torch.Tensor, pos: torch.Tensor | Positions) -> torch.Tensor:
    return embedding(ids, w["tok.w"])


def layer_forward(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                  attend: Attend, layer: int = 0) -> torch.Tensor:
    """One decoder layer: attention and the MLP side by side on one normalised input."""
    eps = spec.norm_eps
    h = layer_norm(x, w["attn_norm.w"], eps)
    q, k, v = project_qkv(spec, w, h)
    if spec.qk_norm:
        q, k = layer_norm(q, w["q_norm.w"], eps), layer_norm(k, w["k_norm.w"], eps)
    if spec.rotates(layer):
        cos, sin = as_positions(pos).rope(spec.head_dim, spec.rope_theta, x.dtype, spec.rope_scaling, interleaved=True)
        q, k = apply_rope_interleaved(q, cos, sin, True), apply_rope_interleaved(k, cos, sin, True)
    a = attend(q, k, v)
    del q, k, v  # not held through the MLP
    mlp = linear(silu_mul(linear(h, w["gate.w"]), linear(h, w["up.w"])), w["down.w"])
    return linear(a, w["o.w"], w.get("o.b"), x).add_(mlp)  # (x + attention) + MLP, the reference's order


def final_norm(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    return layer_norm(x, w["norm.w"], spec.norm_eps)


def head(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    logits = linear(final_norm(spec, w, x), w["lm_head.w"] if "lm_head.w" in w else w["tok.w"])
    return logits.mul_(spec.logit_scale) if spec.logit_scale != 1.0 else logits


register(Family("cohere", layer_shapes=layer_shapes, embed_shapes=embed_shapes, head_shapes=head_shapes,
                hf_names=hf_names, embed=embed, layer_forward=layer_forward, head=head, final_norm=final_norm))
