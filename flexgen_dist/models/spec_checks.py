"""The checks a ``ModelSpec`` runs when it is made, in four named steps (``check_shape``,
``check_layers``, ``check_features``, ``check_experts``), and the values its enumerated
fields take: each field in range, and each family's features only where that family has
them. A spec that fails one is a ``ValueError`` naming the field (the loaders turn it into one
line naming the model)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .spec import ModelSpec

FAMILIES = ("opt", "llama", "gemma", "cohere")


# a chunked layer (Llama 4) attends within its chunk of sliding_window positions only
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# how a router scores its experts: a softmax over them (Mixtral, Qwen), a sigmoid each with a
# per-expert choice bias (GLM-4.5, DeepSeek-V3), a softmax over the top logits only
# (gpt-oss), or a sigmoid of the top logits scaling the expert's input (Llama 4)
ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "top_sigmoid")
NORM_LAYOUTS = {"llama": ("pre", "post", "sandwich"), "gemma": ("pre", "sandwich")}
DEFAULT_LAYOUT = {"llama": "pre", "gemma": "sandwich"}  # the other families' layouts are their own


def check_shape(spec: ModelSpec) -> None:
    """The family, the sizes, the heads, the multipliers."""
    if spec.family not in FAMILIES:
        raise ValueError(f"ModelSpec.family={spec.family!r}: use one of {FAMILIES}")
    for f in ("num_layers", "hidden_size", "ffn_size", "num_heads", "vocab_size", "max_positions"):
        if getattr(spec, f) < 1:
            raise ValueError(f"ModelSpec.{f}={getattr(spec, f)}: must be >= 1")
    if spec.num_kv_heads == 0:
        object.__setattr__(spec, "num_kv_heads", spec.num_heads)
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"ModelSpec.num_heads={spec.num_heads} is not a multiple of "
            f"num_kv_heads={spec.num_kv_heads}")
    if spec.head_dim_override == 0 and spec.hidden_size % spec.num_heads:
        raise ValueError(
            f"ModelSpec.hidden_size={spec.hidden_size} is not a multiple of num_heads={spec.num_heads}")
    if spec.rotary_dim and (spec.rotary_dim % 2 or not 0 < spec.rotary_dim <= spec.head_dim):
        raise ValueError(f"ModelSpec.rotary_dim={spec.rotary_dim}: must be even and at most "
                         f"head_dim={spec.head_dim}")
    for f in ("embed_multiplier", "residual_multiplier", "logits_divisor", "logit_scale"):
        if not getattr(spec, f) > 0:
            raise ValueError(f"ModelSpec.{f}={getattr(spec, f)}: must be > 0")
    if spec.family != "llama" and (spec.embed_multiplier, spec.residual_multiplier, spec.logits_divisor) != (1, 1, 1):
        raise ValueError(f"ModelSpec: the multipliers are the llama family's (Granite), not {spec.family}'s")
    if spec.family == "opt" and spec.num_kv_heads != spec.num_heads:
        raise ValueError("ModelSpec: OPT models have no grouped-query attention; set num_kv_heads=0")


def check_layers(spec: ModelSpec) -> None:
    """What is given per layer (types, layers without RoPE) and where the norms sit."""
    object.__setattr__(spec, "layer_types", tuple(spec.layer_types))
    if spec.layer_types:
        if len(spec.layer_types) != spec.num_layers:
            raise ValueError(f"ModelSpec.layer_types has {len(spec.layer_types)} entries for "
                             f"{spec.num_layers} layers: give one per layer")
        bad = set(spec.layer_types) - set(LAYER_TYPES)
        if bad:
            raise ValueError(f"ModelSpec.layer_types: {', '.join(sorted(bad))} not supported "
                             f"(use {' or '.join(LAYER_TYPES)})")
        if {"sliding_attention", "chunked_attention"} & set(spec.layer_types) and spec.sliding_window < 1:
            raise ValueError("ModelSpec.layer_types has sliding or chunked layers but sliding_window is 0")
    if (spec.qk_norm_whole and not spec.qk_norm) or (
            (spec.qk_norm_whole or spec.norm_weight_fp32) and spec.family != "llama"):
        raise ValueError("ModelSpec: qk_norm_whole needs qk_norm, and it and norm_weight_fp32 are the llama "
                         "family's (OLMo 2/3)")
    if spec.qk_norm_after_rope and (not spec.qk_norm or spec.qk_norm_whole or spec.family != "llama"):
        raise ValueError("ModelSpec: qk_norm_after_rope needs qk_norm per head in the llama family (HunYuan)")
    layouts = NORM_LAYOUTS.get(spec.family, ("",))
    object.__setattr__(spec, "norm_layout", spec.norm_layout or DEFAULT_LAYOUT.get(spec.family, ""))
    if spec.norm_layout not in layouts:
        raise ValueError(f"ModelSpec.norm_layout={spec.norm_layout!r}: the {spec.family} family takes "
                         f"{', '.join(map(repr, layouts))}")
    if spec.family == "llama" and spec.norm_layout != "pre" and (
            spec.num_experts or spec.residual_multiplier != 1.0 or spec.fused_proj):
        raise ValueError(f"ModelSpec.norm_layout={spec.norm_layout!r} with experts, a residual multiplier or "
                         "fused q|k|v is not computed (no such model exists yet)")
    object.__setattr__(spec, "nope_layers", tuple(bool(m) for m in spec.nope_layers))
    if spec.nope_layers and len(spec.nope_layers) != spec.num_layers:
        raise ValueError(f"ModelSpec.nope_layers has {len(spec.nope_layers)} entries for "
                         f"{spec.num_layers} layers: give one per layer")
    if any(spec.nope_layers) and spec.family not in ("llama", "cohere"):
        raise ValueError(f"ModelSpec: layers without RoPE are the llama and cohere families' (SmolLM3, "
                         f"Command R7B), not {spec.family}'s")


def check_features(spec: ModelSpec) -> None:
    """The attention and RoPE features each family alone has (temperature, float32 RoPE,
    latent attention, sinks, logit scale)."""
    if (spec.attn_temp_beta and spec.attn_temp_len < 1) or (
            (spec.attn_temp_beta or spec.qk_l2_norm) and spec.family != "llama"):
        raise ValueError(f"ModelSpec.attn_temp_beta needs attn_temp_len >= 1 (got {spec.attn_temp_len}); it and "
                         "qk_l2_norm are the llama family's")
    if spec.rope_fp32 and not (spec.rope_interleaved and spec.family == "llama"):
        raise ValueError("ModelSpec.rope_fp32 is for the llama family's interleaved RoPE (ERNIE 4.5)")
    if spec.kv_lora_rank and (spec.family != "llama" or spec.num_kv_heads != 1 or spec.norm_layout != "pre"
                              or spec.head_dim != spec.kv_lora_rank + spec.qk_rope_dim or spec.qk_rope_dim % 2
                              or min(spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim) < 1
                              or spec.attention_bias or spec.qkv_bias or spec.qk_norm):
        raise ValueError("ModelSpec: latent attention (kv_lora_rank) needs the llama family's pre-norm layer, "
                         "num_kv_heads 1, head_dim kv_lora_rank + qk_rope_dim, even qk_rope_dim, positive "
                         "head sizes and no q/k/v biases or norms")
    if spec.attn_sinks and spec.family != "llama":
        raise ValueError(f"ModelSpec.attn_sinks is the llama family's (gpt-oss), not {spec.family}'s")
    if spec.logit_scale != 1.0 and spec.family != "cohere":
        raise ValueError(f"ModelSpec.logit_scale is the cohere family's, not {spec.family}'s")


def check_experts(spec: ModelSpec) -> None:
    """A mixture of experts' fields: counts, routing, groups, the sparse layers."""
    object.__setattr__(spec, "moe_layers", tuple(bool(m) for m in spec.moe_layers))
    if spec.num_experts:
        if spec.family != "llama":
            raise ValueError(f"ModelSpec: experts are for the llama family, not {spec.family}")
        if not 1 <= spec.experts_per_tok <= spec.num_experts:
            raise ValueError(f"ModelSpec.experts_per_tok={spec.experts_per_tok}: must be between 1 and "
                             f"num_experts={spec.num_experts} (num_experts_per_tok > experts?)")
        if spec.expert_ffn_size < 1:
            raise ValueError(f"ModelSpec.expert_ffn_size={spec.expert_ffn_size}: must be >= 1")
        if spec.router_scoring not in ROUTER_SCORINGS:
            raise ValueError(f"ModelSpec.router_scoring={spec.router_scoring!r}: use one of {ROUTER_SCORINGS}")
        g, used = spec.expert_groups, spec.expert_groups_used
        if g < 1 or spec.num_experts % g or not 1 <= used <= g or (
                g > 1 and spec.router_scoring not in ("sigmoid", "softmax")):
            raise ValueError(f"ModelSpec.expert_groups={g}, expert_groups_used={used}: the groups must divide "
                             f"num_experts={spec.num_experts}, at least 1 of them used (sigmoid or softmax routing)")
        if used * (spec.num_experts // g) < spec.experts_per_tok:
            raise ValueError(f"ModelSpec: {used} expert groups of {spec.num_experts // g} hold fewer experts "
                             f"than experts_per_tok={spec.experts_per_tok}")
        if spec.swiglu_alpha < 0 or (spec.swiglu_alpha > 0) != (spec.swiglu_limit > 0):
            raise ValueError(f"ModelSpec.swiglu_alpha={spec.swiglu_alpha}, swiglu_limit={spec.swiglu_limit}: "
                             "both > 0 (gpt-oss's clamped gate) or both 0")
        if not spec.routed_scaling > 0:
            raise ValueError(f"ModelSpec.routed_scaling={spec.routed_scaling}: must be > 0")
        if spec.moe_layers and len(spec.moe_layers) != spec.num_layers:
            raise ValueError(f"ModelSpec.moe_layers has {len(spec.moe_layers)} entries for "
                             f"{spec.num_layers} layers: give one per layer")
    elif spec.moe_layers and any(spec.moe_layers):
        raise ValueError("ModelSpec.moe_layers marks sparse layers but num_experts is 0")
