"""The mixtures of experts' fields of a Hugging Face config: which model types have experts,
and each one's routing, expert widths and sparse layers as ``ModelSpec`` fields
(``moe_fields``, which ``hf_config._llama_spec`` merges into the llama family's spec)."""
from __future__ import annotations

from typing import Any

# DeepSeek-V3 / R1, Kimi K2: latent attention, GLM-4.5's routing; DeepSeek-V2 / V2.5 / V2-Lite:
# the same attention, softmax routing (within groups ranked by their best score)
MLA_TYPES = ("deepseek_v3", "deepseek_v2")
# Granite 3.x MoE: its multipliers, top-k softmax routing (granitemoe_swa: with sliding layers and sinks)
GRANITE_MOE_TYPES = ("granitemoe", "granitemoeshared", "granitemoe_swa")
# dots.llm1 (dots1): Qwen3's attention with DeepSeek-V3's routing; Hunyuan-A13B (hunyuan_v1_moe):
# a float32 router's softmax, renormalised, one shared MLP
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "gpt_oss", "minimax_m2", "ernie4_5_moe",
             "dots1", "hunyuan_v1_moe", "exaone_moe", "qwen3_next", "qwen3_5_moe_text", "phimoe", *GRANITE_MOE_TYPES,
             *MLA_TYPES)

# mixtures of experts whose routing or layers the engine does not compute: refused by name
MOE_REFUSED = ("dbrx", "jamba", "granitemoehybrid", "jetmoe", "minimax", "switch_transformers", "nllb_moe")


def moe_fields(cfg: dict[str, Any], mt: str) -> dict[str, Any]:
    """A mixture of experts' ModelSpec fields: the experts, the routing, which layers are sparse."""
    if mt not in MOE_TYPES:
        return {}
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if mt == "mixtral":
        return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    expert_ffn_size=cfg["intermediate_size"], norm_topk_prob=True, router_weights_fp32=True)
    if mt == "phimoe":  # every layer sparse: sparsemixer's two experts (experts.route)
        return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    expert_ffn_size=cfg["intermediate_size"], router_scoring="sparsemixer", norm_topk_prob=False,
                    router_jitter=float(cfg.get("router_jitter_noise", 0.01)))
    if mt == "ernie4_5_moe":  # softmax scores with a choice bias, shared experts, sparse from a start layer
        n, step = cfg["num_hidden_layers"], cfg.get("moe_layer_interval", 1) or 1
        start, end = cfg.get("moe_layer_start_index", 1), cfg.get("moe_layer_end_index", -1)
        end = n - 1 if end is None or end == -1 else end
        sparse = tuple((j + 1) % step == 0 and start <= j <= end for j in range(n))
        ef = cfg.get("moe_intermediate_size", 1536)
        return dict(num_experts=cfg.get("moe_num_experts", 64), experts_per_tok=cfg.get("moe_k", 6),
                    expert_ffn_size=ef, norm_topk_prob=True, router_fp32=True, router_choice_bias=True,
                    router_norm_min=float(cfg.get("moe_norm_min", 1e-12)),
                    shared_expert_ffn_size=(cfg.get("moe_num_shared_experts", 2) or 0) * ef, shared_expert_gated=False,
                    moe_layers=() if all(sparse) else sparse)
    if mt in GRANITE_MOE_TYPES:  # every layer sparse: a softmax over the top logits; an ungated shared expert
        return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 2),
                    expert_ffn_size=cfg["intermediate_size"], router_scoring="topk_softmax",
                    shared_expert_ffn_size=cfg.get("shared_intermediate_size", 0) if mt != "granitemoe" else 0,
                    shared_expert_gated=False)
    if mt == "olmoe":  # every layer sparse: Qwen's softmax routing (by default not renormalised)
        return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 8),
                    expert_ffn_size=cfg["intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    if mt == "minimax_m2":  # every layer sparse: sigmoid scores, their choice bias, renormalised
        return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 8),
                    expert_ffn_size=cfg["intermediate_size"], router_scoring="sigmoid", router_weights_fp32=True)
    if mt == "gpt_oss":  # every layer sparse: the top logits' softmax, biases, the clamped gate
        return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 4),
                    expert_ffn_size=cfg["intermediate_size"], router_scoring="topk_softmax", router_bias=True,
                    expert_bias=True, swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    if mt == "deepseek_v2":
        return _deepseek_v2_moe(cfg)
    if mt == "hunyuan_v1_moe":
        return _hunyuan_moe(cfg)
    if mt in ("glm4_moe", "deepseek_v3", "dots1", "exaone_moe"):  # GLM-4.5 / 4.6 / 4.7, DeepSeek-V3, dots.llm1,
        # K-EXAONE: the first layers dense (EXAONE's mlp_layer_types name them)
        experts = cfg.get("n_routed_experts") or experts
        sparse = tuple(j >= cfg.get("first_k_dense_replace", 1) for j in range(cfg["num_hidden_layers"]))
        if cfg.get("mlp_layer_types"):
            sparse = tuple(t == "sparse" for t in cfg["mlp_layer_types"])
        shared = cfg.get("n_shared_experts", cfg.get("num_shared_experts", 1)) or 0
        return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 8),
                    expert_ffn_size=cfg.get("moe_intermediate_size", 1408),
                    norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), router_weights_fp32=True,
                    router_scoring="sigmoid", router_fp32=True, expert_groups=cfg.get("n_group", 1) or 1,
                    expert_groups_used=cfg.get("topk_group", 1) or 1,
                    routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                    shared_expert_ffn_size=shared * cfg.get("moe_intermediate_size", 1408), shared_expert_gated=False,
                    moe_layers=() if all(sparse) else sparse)
    n, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(j not in dense and experts > 0 and (j + 1) % step == 0 for j in range(n))
    # Qwen3-Next's and Qwen3.5-MoE's: Qwen2-MoE's sigmoid-gated shared expert, renormalised (3.5: always)
    shared = mt in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
    return dict(num_experts=experts, experts_per_tok=cfg.get("num_experts_per_tok", 0),
                expert_ffn_size=cfg.get("moe_intermediate_size", 0),
                norm_topk_prob=mt == "qwen3_5_moe_text"
                or bool(cfg.get("norm_topk_prob", mt in ("qwen3_moe", "qwen3_next"))),
                shared_expert_ffn_size=cfg.get("shared_expert_intermediate_size", 0) if shared else 0,
                moe_layers=() if all(sparse) else sparse)


def _deepseek_v2_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's routing as transformers computes it: a float32 router's softmax, the top
    ``num_experts_per_tok`` (``topk_method`` group_limited_greedy: within the best ``topk_group``
    of ``n_group`` groups, a group ranked by its best score), never renormalised (its router
    reads no norm_topk_prob), times ``routed_scaling_factor``; shared experts ungated; the first
    ``first_k_dense_replace`` layers dense."""
    method = cfg.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy" and (cfg.get("n_group") or 1) > 1
    n, ef = cfg["num_hidden_layers"], cfg.get("moe_intermediate_size", 1407)
    sparse = tuple(j >= (cfg.get("first_k_dense_replace") or 0) for j in range(n))
    return dict(num_experts=cfg.get("n_routed_experts", 64), experts_per_tok=cfg.get("num_experts_per_tok") or 6,
                expert_ffn_size=ef, norm_topk_prob=False, router_fp32=True, router_weights_fp32=True,
                expert_groups=cfg["n_group"] if grouped else 1, expert_groups_used=cfg["topk_group"] if grouped else 1,
                routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)),
                shared_expert_ffn_size=(cfg.get("n_shared_experts", 2) or 0) * ef, shared_expert_gated=False,
                moe_layers=() if all(sparse) else sparse)


def _hunyuan_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan-A13B's routing: a float32 router (``mlp.gate.wg``) and its softmax, the top
    ``moe_topk`` renormalised, in float32; the experts and the ungated shared MLP
    (``shared_mlp``) of ``intermediate_size``; every layer sparse. Its config may give the counts
    per layer; the engine takes one count for all."""
    counts = {}
    for key in ("num_experts", "moe_topk"):
        v = cfg.get(key)
        vals = set(v) if isinstance(v, list) else {v}
        if len(vals) != 1 or None in vals:
            raise ValueError(f"hunyuan_v1_moe {key} {v!r}: one count for every layer is supported")
        counts[key] = int(vals.pop())
    width = cfg["intermediate_size"]
    # the released configs also carry the experts' width and the shared experts per layer, which
    # transformers does not read (its experts and shared MLP take intermediate_size, one of it)
    widths, shared = cfg.get("moe_intermediate_size"), cfg.get("num_shared_expert")
    if any(w != width for w in (widths if isinstance(widths, list) else [widths] if widths else [])) or any(
            n != 1 for n in (shared if isinstance(shared, list) else [shared] if shared is not None else [])):
        raise ValueError(f"hunyuan_v1_moe with moe_intermediate_size {widths!r} / num_shared_expert {shared!r} "
                         f"other than intermediate_size {width} / 1: not what transformers computes; not supported")
    return dict(num_experts=counts["num_experts"], experts_per_tok=counts["moe_topk"], expert_ffn_size=width,
                norm_topk_prob=True, router_fp32=True, router_weights_fp32=True, shared_expert_ffn_size=width,
                shared_expert_gated=False)
