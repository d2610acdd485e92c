"""The NeoX family: GPT-NeoX (Pythia, GPT-NeoX-20B: ``gpt_neox``), Phi-1/1.5/2 (``phi``) and
StarCoder2 (``starcoder2``).

What differs from Llama, each as transformers' ``modeling_gpt_neox.py`` / ``modeling_phi.py``
computes it:

- LayerNorms with biases; biases on the projections (q, k, v and o where ``attention_bias``,
  the MLP's where ``mlp_bias``: both for GPT-NeoX and Phi, StarCoder2's ``use_bias``; Phi's
  head too, ``lm_head_bias``);
- StarCoder2: Llama's sequential layer with these norms and biases, a GELU MLP
  (``c_fc``/``c_proj``), grouped-query attention and a sliding window on every layer;
- attention and the MLP side by side (``parallel_residual``): GPT-NeoX normalises the
  input once for each (``x + attn(ln1(x)) + mlp(ln2(x))``, added as ``mlp + attn + x``; with
  ``use_parallel_residual`` false the MLP follows attention: ``y = x + attn(ln1(x))``,
  ``mlp(ln2(y)) + y``), Phi once for both (``norm_layout`` "shared": ``attn + mlp + x``);
- an ungated MLP, ``down(act(up(x)))``, act a GELU (``mlp_activation``: "gelu" the exact one,
  "gelu_new" and "gelu_fast" transformers' tanh formulas, "gelu_pytorch_tanh" torch's);
- RoPE (rotate-half) on the leading ``rotary_dim`` dims of each head (Pythia: a quarter,
  Phi-2: 0.4);
- GPT-NeoX fuses q, k and v in one matrix interleaved by head (head h's q, k, v rows follow
  each other), read here as three row selections of it.

llama.cpp's files (``gguf_names``): ``gptneox``, ``phi2`` and ``starcoder2``. Its converter
reorders GPT-NeoX's fused matrix and bias to all heads' q, then k, then v (``attn_qkv``), which
its graph reads as three blocks of rows; ``phi2`` keeps q, k and v apart (``attn_q/k/v``), or,
converted from a checkpoint that fused them, as the same three blocks (``attn_qkv``:
``ModelSpec.fused_proj``); ``starcoder2`` keeps them apart (``starcoder2_gguf_names``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import Positions, apply_rope, as_positions, embedding, layer_norm, linear, project_qkv
from .families import ROWS, Attend, Family, Weights, register
from .spec import ModelSpec
from .spec_checks import NEOX_ACTIVATIONS

ACTIVATIONS = NEOX_ACTIVATIONS  # the GELUs ``gelu`` computes

_PHI = {"attn_norm.w": "input_layernorm.weight", "attn_norm.b": "input_layernorm.bias",
        "q.w": "self_attn.q_proj.weight", "q.b": "self_attn.q_proj.bias",
        "k.w": "self_attn.k_proj.weight", "k.b": "self_attn.k_proj.bias",
        "v.w": "self_attn.v_proj.weight", "v.b": "self_attn.v_proj.bias",
        "o.w": "self_attn.dense.weight", "o.b": "self_attn.dense.bias",
        "up.w": "mlp.fc1.weight", "up.b": "mlp.fc1.bias", "down.w": "mlp.fc2.weight", "down.b": "mlp.fc2.bias"}
# StarCoder2's names where they differ from Phi's (the norm before the MLP, o, the MLP)
_STARCODER2 = {"mlp_norm.w": "post_attention_layernorm.weight", "mlp_norm.b": "post_attention_layernorm.bias",
               "o.w": "self_attn.o_proj.weight", "o.b": "self_attn.o_proj.bias",
               "up.w": "mlp.c_fc.weight", "up.b": "mlp.c_fc.bias", "down.w": "mlp.c_proj.weight",
               "down.b": "mlp.c_proj.bias"}
_NEOX = {"attn_norm.w": "input_layernorm.weight", "attn_norm.b": "input_layernorm.bias",
         "mlp_norm.w": "post_attention_layernorm.weight", "mlp_norm.b": "post_attention_layernorm.bias",
         "q.w": "attention.query_key_value.weight", "q.b": "attention.query_key_value.bias",
         "o.w": "attention.dense.weight", "o.b": "attention.dense.bias",
         "up.w": "mlp.dense_h_to_4h.weight", "up.b": "mlp.dense_h_to_4h.bias",
         "down.w": "mlp.dense_4h_to_h.weight", "down.b": "mlp.dense_4h_to_h.bias"}


def _shared(spec: ModelSpec) -> bool:
    return spec.norm_layout == "shared"


def layer_shapes(spec: ModelSpec, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    h, f, qd, kvd = spec.hidden_size, spec.ffn_size, spec.q_dim, spec.kv_dim
    shapes: dict[str, tuple[int, ...]] = {"attn_norm.w": (h,), "attn_norm.b": (h,)}
    if not _shared(spec):
        shapes.update({"mlp_norm.w": (h,), "mlp_norm.b": (h,)})
    shapes.update({"q.w": (qd, h), "k.w": (kvd, h), "v.w": (kvd, h), "o.w": (h, qd)})
    if spec.attention_bias:
        shapes.update({"q.b": (qd,), "k.b": (kvd,), "v.b": (kvd,), "o.b": (h,)})
    shapes.update({"up.w": (f, h), "down.w": (h, f)})
    if spec.mlp_bias:
        shapes.update({"up.b": (f,), "down.b": (h,)})
    return shapes


def embed_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {"tok.w": (spec.vocab_size, spec.hidden_size)}


def head_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"norm.w": (h,), "norm.b": (h,)}
    shapes["tok.w" if spec.tie_word_embeddings else "lm_head.w"] = (spec.vocab_size, h)
    if spec.lm_head_bias:
        shapes["lm_head.b"] = (spec.vocab_size,)
    return shapes


def _fused_rows(spec: ModelSpec, which: int) -> str:
    """The rows of GPT-NeoX's fused q|k|v holding q (0), k (1) or v (2): per head, its d rows
    after the head's 3d start."""
    d = spec.head_dim
    return ROWS + ",".join(f"{(3 * h + which) * d}:{(3 * h + which + 1) * d}" for h in range(spec.num_heads))


def hf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, list[str]]:
    """Canonical name -> candidate checkpoint names (first found wins): Phi's, then GPT-NeoX's."""
    if part == "layer":
        out: dict[str, list[str]] = {}
        for k in layer_shapes(spec, layer):
            names = [f"model.layers.{layer}.{t[k]}" for t in (_PHI, _STARCODER2) if k in t]
            base, kind = k.split(".")
            if base in ("q", "k", "v"):
                fused = _NEOX[f"q.{kind}"]
                names.append(f"gpt_neox.layers.{layer}.{fused}{_fused_rows(spec, 'qkv'.index(base))}")
            elif k in _NEOX:
                names.append(f"gpt_neox.layers.{layer}.{_NEOX[k]}")
            out[k] = names
        return out
    if part == "embed":
        return {"tok.w": ["model.embed_tokens.weight", "gpt_neox.embed_in.weight"]}
    out = {"norm.w": ["model.final_layernorm.weight", "gpt_neox.final_layer_norm.weight", "model.norm.weight"],
           "norm.b": ["model.final_layernorm.bias", "gpt_neox.final_layer_norm.bias", "model.norm.bias"]}
    if spec.tie_word_embeddings:
        out["tok.w"] = ["model.embed_tokens.weight", "gpt_neox.embed_in.weight", "lm_head.weight", "embed_out.weight"]
    else:
        out["lm_head.w"] = ["lm_head.weight", "embed_out.weight"]
    if spec.lm_head_bias:
        out["lm_head.b"] = ["lm_head.bias"]
    return out


_GGUF = {"attn_norm.w": "attn_norm.weight", "attn_norm.b": "attn_norm.bias", "mlp_norm.w": "ffn_norm.weight",
         "mlp_norm.b": "ffn_norm.bias", "q.w": "attn_q.weight", "q.b": "attn_q.bias", "k.w": "attn_k.weight",
         "k.b": "attn_k.bias", "v.w": "attn_v.weight", "v.b": "attn_v.bias", "o.w": "attn_output.weight",
         "o.b": "attn_output.bias", "up.w": "ffn_up.weight", "up.b": "ffn_up.bias", "down.w": "ffn_down.weight",
         "down.b": "ffn_down.bias"}


def gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """Canonical name -> GGUF tensor name (llama.cpp's ``gptneox`` and ``phi2``): q, k and v as
    the rows [0, q_dim), [q_dim, q_dim + kv_dim) and the next kv_dim of ``attn_qkv`` (weight
    and bias) where the file fuses them (``gptneox`` always, a ``phi2`` file with ``fused_proj``),
    else ``attn_q/k/v``."""
    return _gguf_names(spec, part, layer, not _shared(spec) or spec.fused_proj)


def starcoder2_gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """Canonical name -> GGUF tensor name (llama.cpp's ``starcoder2``): ``gptneox``'s names with
    q, k and v apart (``attn_q/k/v``, each with its bias), as its converter writes them (the
    checkpoint's ``q_proj``/``k_proj``/``v_proj`` unchanged: its graph turns halves, as here)."""
    return _gguf_names(spec, part, layer, False)


def _gguf_names(spec: ModelSpec, part: str, layer: int | None, fused: bool) -> dict[str, str]:
    if part == "layer":
        out = {k: f"blk.{layer}.{_GGUF[k]}" for k in layer_shapes(spec, layer)}
        if fused:
            qd, kvd = spec.q_dim, spec.kv_dim
            for base, r0, r1 in (("q", 0, qd), ("k", qd, qd + kvd), ("v", qd + kvd, qd + 2 * kvd)):
                for kind, suffix in (("w", "weight"), ("b", "bias")):
                    if f"{base}.{kind}" in out:
                        out[f"{base}.{kind}"] = f"blk.{layer}.attn_qkv.{suffix}{ROWS}{r0}:{r1}"
        return out
    if part == "embed":
        return {"tok.w": "token_embd.weight"}
    out = {"norm.w": "output_norm.weight", "norm.b": "output_norm.bias"}
    if spec.tie_word_embeddings:
        out["tok.w"] = "token_embd.weight"
    else:
        out["lm_head.w"] = "output.weight"
    if spec.lm_head_bias:
        out["lm_head.b"] = "output.bias"
    return out


def gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The GELU ``kind`` names, as transformers' ``ACT2FN`` computes it."""
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "gelu_new":  # NewGELUActivation, its operations in order
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if kind == "gelu_fast":  # FastGELUActivation
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
    raise ValueError(f"activation {kind!r}: the NeoX family computes {', '.join(ACTIVATIONS)}")


def embed(spec: ModelSpec, w: Weights, ids: torch.Tensor, pos: torch.Tensor | Positions) -> torch.Tensor:
    return embedding(ids, w["tok.w"])


def _mlp(spec: ModelSpec, w: Weights, h: torch.Tensor) -> torch.Tensor:
    return linear(gelu(linear(h, w["up.w"], w.get("up.b")), spec.mlp_activation), w["down.w"], w.get("down.b"))


def layer_forward(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                  attend: Attend, layer: int = 0) -> torch.Tensor:
    """One decoder layer; ``attend`` writes k/v into the engine's cache and attends."""
    eps = spec.norm_eps
    h = layer_norm(x, w["attn_norm.w"], w["attn_norm.b"], eps)
    q, k, v = project_qkv(spec, w, h)
    cos, sin = as_positions(pos).rope(spec.rope_dim, spec.rope_theta, x.dtype, spec.rope_scaling)
    a = linear(attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v), w["o.w"], w.get("o.b"))
    del q, k, v  # not held through the MLP
    if _shared(spec):  # Phi: attn + mlp + x, both on the one normalised input
        return (a + _mlp(spec, w, h)).add_(x)
    if spec.parallel_residual:  # GPT-NeoX: mlp + attn + x
        return (_mlp(spec, w, layer_norm(x, w["mlp_norm.w"], w["mlp_norm.b"], eps)) + a).add_(x)
    y = a.add_(x)
    return _mlp(spec, w, layer_norm(y, w["mlp_norm.w"], w["mlp_norm.b"], eps)).add_(y)


def final_norm(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    return layer_norm(x, w["norm.w"], w["norm.b"], spec.norm_eps)


def head(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    x = final_norm(spec, w, x)
    return linear(x, w["lm_head.w"] if "lm_head.w" in w else w["tok.w"], w.get("lm_head.b"))


register(Family("neox", layer_shapes=layer_shapes, embed_shapes=embed_shapes, head_shapes=head_shapes,
                hf_names=hf_names, embed=embed, layer_forward=layer_forward, head=head, final_norm=final_norm))
