"""The checks a ``ModelSpec`` runs when it is made, in four named steps (``SpecChecks``:
shape, per-layer fields, family features, experts), and the values its enumerated
fields take: each field in range, and each family's features only where that family has
them. A spec that fails one is a ``ValueError`` naming the field (the loaders turn it into one
line naming the model)."""
from __future__ import annotations

FAMILIES = ("opt", "llama", "gemma", "cohere", "neox")


# a chunked layer (Llama 4) attends within its chunk of sliding_window positions only
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")
# how a router scores its experts: a softmax over them (Mixtral, Qwen), a sigmoid each with a
# per-expert choice bias (GLM-4.5, DeepSeek-V3), a softmax over the top logits only
# (gpt-oss), or a sigmoid of the top logits scaling the expert's input (Llama 4)
ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "top_sigmoid", "sparsemixer")
MLP_ACTIVATIONS = ("swiglu", "relu2", "xielu")  # a dense MLP's: gated SiLU, or ungated relu² / xIELU
NEOX_ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")  # the NeoX family's (neox.py)
# the NeoX family: "pre" a norm before attention and one before the MLP (GPT-NeoX), "shared" one
# for both (Phi)
NORM_LAYOUTS = {"llama": ("pre", "post", "sandwich"), "gemma": ("pre", "sandwich"), "neox": ("pre", "shared")}
DEFAULT_LAYOUT = {"llama": "pre", "gemma": "sandwich", "neox": "pre"}  # the other families' layouts are their own


class SpecChecks:
    """``ModelSpec``'s checks as a base class (the spec's fields are ``self``'s), run by its
    ``__post_init__`` in four named steps."""

    def _check_shape(self) -> None:
        """The family, the sizes, the heads, the multipliers."""
        if self.family not in FAMILIES:
            raise ValueError(f"ModelSpec.family={self.family!r}: use one of {FAMILIES}")
        for f in ("num_layers", "hidden_size", "ffn_size", "num_heads", "vocab_size", "max_positions"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelSpec.{f}={getattr(self, f)}: must be >= 1")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim_override == 0 and self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelSpec.hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.rotary_dim and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"ModelSpec.rotary_dim={self.rotary_dim}: must be even and at most "
                             f"head_dim={self.head_dim}")
        for f in ("embed_multiplier", "residual_multiplier", "logits_divisor", "logit_scale"):
            if not getattr(self, f) > 0:
                raise ValueError(f"ModelSpec.{f}={getattr(self, f)}: must be > 0")
        if self.family != "llama" and (self.embed_multiplier, self.residual_multiplier, self.logits_divisor) != (1, 1, 1):
            raise ValueError(f"ModelSpec: the multipliers are the llama family's (Granite), not {self.family}'s")
        if self.family == "opt" and self.num_kv_heads != self.num_heads:
            raise ValueError("ModelSpec: OPT models have no grouped-query attention; set num_kv_heads=0")

    def _check_layers(self) -> None:
        """What is given per layer (types, layers without RoPE) and where the norms sit."""
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelSpec.layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers: give one per layer")
            bad = set(self.layer_types) - set(LAYER_TYPES)
            if bad:
                raise ValueError(f"ModelSpec.layer_types: {', '.join(sorted(bad))} not supported "
                                 f"(use {' or '.join(LAYER_TYPES)})")
            if {"sliding_attention", "chunked_attention"} & set(self.layer_types) and self.sliding_window < 1:
                raise ValueError("ModelSpec.layer_types has sliding or chunked layers but sliding_window is 0")
        if (self.qk_norm_whole and not self.qk_norm) or (
                (self.qk_norm_whole or self.norm_weight_fp32) and self.family != "llama"):
            raise ValueError("ModelSpec: qk_norm_whole needs qk_norm, and it and norm_weight_fp32 are the llama "
                             "family's (OLMo 2/3)")
        if self.qk_norm_after_rope and (not self.qk_norm or self.qk_norm_whole or self.family != "llama"):
            raise ValueError("ModelSpec: qk_norm_after_rope needs qk_norm per head in the llama family (HunYuan)")
        layouts = NORM_LAYOUTS.get(self.family, ("",))
        object.__setattr__(self, "norm_layout", self.norm_layout or DEFAULT_LAYOUT.get(self.family, ""))
        if self.norm_layout not in layouts:
            raise ValueError(f"ModelSpec.norm_layout={self.norm_layout!r}: the {self.family} family takes "
                             f"{', '.join(map(repr, layouts))}")
        if self.family == "llama" and self.norm_layout != "pre" and (
                self.num_experts or self.residual_multiplier != 1.0 or self.fused_proj):
            raise ValueError(f"ModelSpec.norm_layout={self.norm_layout!r} with experts, a residual multiplier or "
                             "fused q|k|v is not computed (no such model exists yet)")
        object.__setattr__(self, "nope_layers", tuple(bool(m) for m in self.nope_layers))
        if self.nope_layers and len(self.nope_layers) != self.num_layers:
            raise ValueError(f"ModelSpec.nope_layers has {len(self.nope_layers)} entries for "
                             f"{self.num_layers} layers: give one per layer")
        if any(self.nope_layers) and self.family not in ("llama", "cohere"):
            raise ValueError(f"ModelSpec: layers without RoPE are the llama and cohere families' (SmolLM3, "
                             f"Command R7B), not {self.family}'s")

    def _check_features(self) -> None:
        """The attention and RoPE features each family alone has (temperature, float32 RoPE,
        latent attention, sinks, logit scale)."""
        if (self.attn_temp_beta and self.attn_temp_len < 1) or (
                (self.attn_temp_beta or self.qk_l2_norm) and self.family != "llama"):
            raise ValueError(f"ModelSpec.attn_temp_beta needs attn_temp_len >= 1 (got {self.attn_temp_len}); it and "
                             "qk_l2_norm are the llama family's")
        if self.rope_fp32 and not (self.rope_interleaved and self.family == "llama"):
            raise ValueError("ModelSpec.rope_fp32 is for the llama family's interleaved RoPE (ERNIE 4.5)")
        if self.kv_lora_rank and (self.family != "llama" or self.num_kv_heads != 1 or self.norm_layout != "pre"
                                  or self.head_dim != self.kv_lora_rank + self.qk_rope_dim or self.qk_rope_dim % 2
                                  or min(self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim) < 1
                                  or self.attention_bias or self.qkv_bias or self.qk_norm):
            raise ValueError("ModelSpec: latent attention (kv_lora_rank) needs the llama family's pre-norm layer, "
                             "num_kv_heads 1, head_dim kv_lora_rank + qk_rope_dim, even qk_rope_dim, positive "
                             "head sizes and no q/k/v biases or norms")
        if self.family == "neox":
            if self.mlp_activation not in NEOX_ACTIVATIONS:
                raise ValueError(f"ModelSpec.mlp_activation={self.mlp_activation!r}: the neox family's are "
                                 f"{NEOX_ACTIVATIONS}")
        elif self.mlp_activation not in MLP_ACTIVATIONS or (self.mlp_activation != "swiglu" and (
                self.family != "llama" or self.norm_layout != "pre")):
            raise ValueError(f"ModelSpec.mlp_activation={self.mlp_activation!r}: one of {MLP_ACTIVATIONS}, the "
                             "ungated ones in the llama family's pre-norm layer")
        if self.parallel_residual and self.family != "neox":
            raise ValueError(f"ModelSpec.parallel_residual is the neox family's (GPT-NeoX), not {self.family}'s")
        if self.attn_sinks and self.family != "llama":
            raise ValueError(f"ModelSpec.attn_sinks is the llama family's (gpt-oss), not {self.family}'s")
        if self.logit_scale != 1.0 and self.family != "cohere":
            raise ValueError(f"ModelSpec.logit_scale is the cohere family's, not {self.family}'s")
        self._check_linear()
        if (self.layer_norm or self.lm_head_bias) and self.family != "neox" and (
                self.family != "llama" or self.norm_layout != "pre" or self.norm_unit_offset
                or self.tie_word_embeddings):
            raise ValueError("ModelSpec: layer_norm and lm_head_bias are the llama family's pre-norm layer's with an "
                             "untied head (Phi-3.5-MoE)")

    def _check_linear(self) -> None:
        """Linear-attention layers (Qwen3-Next) and the features that come with them."""
        sizes = (self.lin_k_heads, self.lin_v_heads, self.lin_k_dim, self.lin_v_dim)
        linear = "linear_attention" in self.layer_types
        if linear and (min(sizes) < 1 or self.lin_conv_kernel < 2 or self.lin_v_heads % self.lin_k_heads):
            raise ValueError(f"ModelSpec: linear_attention layers need lin_k_heads, lin_v_heads (a multiple of "
                             f"lin_k_heads), lin_k_dim, lin_v_dim >= 1 and lin_conv_kernel >= 2, got {sizes} and "
                             f"{self.lin_conv_kernel}")
        if not linear and (max(sizes) or self.lin_conv_kernel or self.lin_v_tiled):
            raise ValueError("ModelSpec: lin_* sizes are given but no layer_types entry is linear_attention")
        if (linear or self.attn_output_gate or self.norm_unit_offset) and (
                self.family != "llama" or self.norm_layout != "pre" or self.kv_lora_rank
                or self.residual_multiplier != 1.0):
            raise ValueError("ModelSpec: linear_attention layers, attn_output_gate and norm_unit_offset are the "
                             "llama family's pre-norm layer's (Qwen3-Next)")

    def _check_experts(self) -> None:
        """A mixture of experts' fields: counts, routing, groups, the sparse layers."""
        object.__setattr__(self, "moe_layers", tuple(bool(m) for m in self.moe_layers))
        if self.num_experts:
            if self.family != "llama":
                raise ValueError(f"ModelSpec: experts are for the llama family, not {self.family}")
            if not 1 <= self.experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelSpec.experts_per_tok={self.experts_per_tok}: must be between 1 and "
                                 f"num_experts={self.num_experts} (num_experts_per_tok > experts?)")
            if self.expert_ffn_size < 1:
                raise ValueError(f"ModelSpec.expert_ffn_size={self.expert_ffn_size}: must be >= 1")
            if self.router_scoring not in ROUTER_SCORINGS:
                raise ValueError(f"ModelSpec.router_scoring={self.router_scoring!r}: use one of {ROUTER_SCORINGS}")
            g, used = self.expert_groups, self.expert_groups_used
            if g < 1 or self.num_experts % g or not 1 <= used <= g or (
                    g > 1 and self.router_scoring not in ("sigmoid", "softmax")):
                raise ValueError(f"ModelSpec.expert_groups={g}, expert_groups_used={used}: the groups must divide "
                                 f"num_experts={self.num_experts}, at least 1 of them used (sigmoid or softmax routing)")
            if used * (self.num_experts // g) < self.experts_per_tok:
                raise ValueError(f"ModelSpec: {used} expert groups of {self.num_experts // g} hold fewer experts "
                                 f"than experts_per_tok={self.experts_per_tok}")
            if self.swiglu_alpha < 0 or (self.swiglu_alpha > 0) != (self.swiglu_limit > 0):
                raise ValueError(f"ModelSpec.swiglu_alpha={self.swiglu_alpha}, swiglu_limit={self.swiglu_limit}: "
                                 "both > 0 (gpt-oss's clamped gate) or both 0")
            if self.router_scoring == "sparsemixer" and (self.experts_per_tok != 2 or self.router_jitter < 0):
                raise ValueError(f"ModelSpec: sparsemixer routing picks 2 experts (experts_per_tok="
                                 f"{self.experts_per_tok}) with router_jitter >= 0 (got {self.router_jitter})")
            if not self.routed_scaling > 0:
                raise ValueError(f"ModelSpec.routed_scaling={self.routed_scaling}: must be > 0")
            if self.moe_layers and len(self.moe_layers) != self.num_layers:
                raise ValueError(f"ModelSpec.moe_layers has {len(self.moe_layers)} entries for "
                                 f"{self.num_layers} layers: give one per layer")
        elif self.moe_layers and any(self.moe_layers):
            raise ValueError("ModelSpec.moe_layers marks sparse layers but num_experts is 0")
