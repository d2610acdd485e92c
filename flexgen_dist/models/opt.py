"""OPT: learned positions (offset 2), pre-LN or post-LN (opt-350m), ReLU MLP, biases,
optional project_in/project_out, LM head tied to the token embedding."""
from __future__ import annotations

import torch

from .common import Positions, as_positions, embedding, layer_norm, linear
from .families import Attend, Family, Weights, register
from .spec import ModelSpec

POS_OFFSET = 2
_PREFIXES = ("model.decoder.", "decoder.")

_LAYER_HF = {
    "attn_norm.w": "self_attn_layer_norm.weight", "attn_norm.b": "self_attn_layer_norm.bias",
    "q.w": "self_attn.q_proj.weight", "q.b": "self_attn.q_proj.bias",
    "k.w": "self_attn.k_proj.weight", "k.b": "self_attn.k_proj.bias",
    "v.w": "self_attn.v_proj.weight", "v.b": "self_attn.v_proj.bias",
    "o.w": "self_attn.out_proj.weight", "o.b": "self_attn.out_proj.bias",
    "mlp_norm.w": "final_layer_norm.weight", "mlp_norm.b": "final_layer_norm.bias",
    "fc1.w": "fc1.weight", "fc1.b": "fc1.bias", "fc2.w": "fc2.weight", "fc2.b": "fc2.bias",
}


def layer_shapes(spec: ModelSpec, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    h, f = spec.hidden_size, spec.ffn_size
    return {
        "attn_norm.w": (h,), "attn_norm.b": (h,),
        "q.w": (h, h), "q.b": (h,), "k.w": (h, h), "k.b": (h,), "v.w": (h, h), "v.b": (h,),
        "o.w": (h, h), "o.b": (h,),
        "mlp_norm.w": (h,), "mlp_norm.b": (h,),
        "fc1.w": (f, h), "fc1.b": (f,), "fc2.w": (h, f), "fc2.b": (h,),
    }


def embed_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "tok.w": (spec.vocab_size, spec.embed_dim),
        "pos.w": (spec.max_positions + POS_OFFSET, spec.hidden_size),
    }
    if spec.has_projection:
        shapes["proj_in.w"] = (spec.hidden_size, spec.embed_dim)
    return shapes


def head_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"tok.w": (spec.vocab_size, spec.embed_dim)}
    if spec.pre_layer_norm:
        shapes["norm.w"] = (spec.hidden_size,)
        shapes["norm.b"] = (spec.hidden_size,)
    if spec.has_projection:
        shapes["proj_out.w"] = (spec.embed_dim, spec.hidden_size)
    return shapes



def hf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, list[str]]:
    """Canonical name -> candidate checkpoint names (first found wins)."""
    if part == "layer":
        rel = {k: f"layers.{layer}.{v}" for k, v in _LAYER_HF.items()}
    else:
        table = {"tok.w": "embed_tokens.weight", "pos.w": "embed_positions.weight",
                 "proj_in.w": "project_in.weight", "proj_out.w": "project_out.weight",
                 "norm.w": "final_layer_norm.weight", "norm.b": "final_layer_norm.bias"}
        names = embed_shapes(spec) if part == "embed" else head_shapes(spec)
        rel = {k: table[k] for k in names}
    out = {k: [p + v for p in _PREFIXES] for k, v in rel.items()}
    if part == "head":
        out["tok.w"] = ["lm_head.weight"] + out["tok.w"]
    return out


def embed(spec: ModelSpec, w: Weights, ids: torch.Tensor, pos: torch.Tensor | Positions) -> torch.Tensor:
    x = embedding(ids, w["tok.w"])
    if spec.has_projection:
        x = linear(x, w["proj_in.w"])
    return x + embedding(as_positions(pos).ids + POS_OFFSET, w["pos.w"])


def layer_forward(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                  attend: Attend, layer: int = 0) -> torch.Tensor:
    """One decoder layer; ``attend`` writes k/v into the engine's cache and attends."""
    b, t, _ = x.shape
    nh, d, eps = spec.num_heads, spec.head_dim, spec.norm_eps
    residual = x
    if spec.pre_layer_norm:
        x = layer_norm(x, w["attn_norm.w"], w["attn_norm.b"], eps)
    q = linear(x, w["q.w"], w["q.b"]).view(b, t, nh, d)
    k = linear(x, w["k.w"], w["k.b"]).view(b, t, nh, d)
    v = linear(x, w["v.w"], w["v.b"]).view(b, t, nh, d)
    a = attend(q, k, v)
    del q, k, v  # not held through the MLP: a prefill's working set is what the footprint counts
    x = linear(a, w["o.w"], w["o.b"], residual)
    del a
    if not spec.pre_layer_norm:
        x = layer_norm(x, w["attn_norm.w"], w["attn_norm.b"], eps)
    residual = x
    if spec.pre_layer_norm:
        x = layer_norm(x, w["mlp_norm.w"], w["mlp_norm.b"], eps)
    h = torch.relu_(linear(x, w["fc1.w"], w["fc1.b"]))
    x = linear(h, w["fc2.w"], w["fc2.b"], residual)
    if not spec.pre_layer_norm:
        x = layer_norm(x, w["mlp_norm.w"], w["mlp_norm.b"], eps)
    return x


def final_norm(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    if spec.pre_layer_norm:
        x = layer_norm(x, w["norm.w"], w["norm.b"], spec.norm_eps)
    if spec.has_projection:
        x = linear(x, w["proj_out.w"])
    return x


def head(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    return linear(final_norm(spec, w, x), w["tok.w"])


register(Family("opt", layer_shapes=layer_shapes, embed_shapes=embed_shapes, head_shapes=head_shapes,
                hf_names=hf_names, embed=embed, layer_forward=layer_forward, head=head, final_norm=final_norm))
