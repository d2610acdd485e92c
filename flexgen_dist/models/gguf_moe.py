"""The mixtures of experts in GGUF files: which architectures may hold experts, and the
``ModelSpec`` routing fields their keys and tensors give, as llama.cpp runs them (``moe_fields``,
called by ``gguf_arch.llama_fields``); the multi-token-prediction blocks some files append
(``nextn``). A layer is sparse where the file holds its router; where an architecture's keys say
which layers llama.cpp builds sparse, the two must agree (``_check_sparse``).
"""
from __future__ import annotations

from typing import Any

from .gguf_deepseek import deepseek_v2_fields
from .gguf_file import decimal32
from .source import ModelLoadError

# the architectures whose files may hold experts (Mixtral is written as llama with experts)
MOE_ARCHS = frozenset({"llama", "qwen2moe", "qwen3moe", "olmoe", "glm4moe", "gpt-oss", "minimax-m2", "deepseek2",
                       "llama4", "hunyuan-moe", "dots1", "qwen3next", "qwen35moe", "ernie4_5-moe", "exaone-moe"})
# GLM-4.5's routing: sigmoid scores, groups, a choice bias, shared experts
SIGMOID_ARCHS = ("glm4moe", "deepseek2", "dots1", "exaone-moe")


def nextn(key: Any, arch: str) -> int:
    """How many of the file's last blocks are multi-token-prediction layers (GLM-4.5's), which
    serve speculative decoding and which generation never runs."""
    n = int(key("nextn_predict_layers", 0)) if arch in (*SIGMOID_ARCHS, "qwen35", "qwen35moe") else 0
    if not 0 <= n < int(key("block_count")):
        raise ModelLoadError(f"{arch}.nextn_predict_layers {n} of {key('block_count')} blocks: corrupt file?")
    return n


def moe_fields(arch: str, key: Any, experts: int, tensors: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' ModelSpec fields from a GGUF file, as llama.cpp runs it: Mixtral
    (``llama`` with experts) renormalises the chosen experts' weights and keeps them in float32,
    Qwen2-MoE does not renormalise and has a shared expert, Qwen3-MoE renormalises. A layer is
    sparse where the file holds its router (a file from a config with dense layers keeps their
    plain MLP)."""
    if not experts:
        return {}
    fields: dict[str, Any] = dict(num_experts=experts, experts_per_tok=int(key("expert_used_count")),
                                  norm_topk_prob=arch != "qwen2moe",
                                  router_weights_fp32=arch in ("llama", "glm4moe", "exaone-moe"))
    fields["expert_ffn_size"] = int(key("expert_feed_forward_length") if arch not in ("llama", "olmoe")
                                    else key("expert_feed_forward_length", key("feed_forward_length")))
    if arch == "olmoe":  # llama.cpp never renormalises OLMoE's routing weights (its config's default)
        fields["norm_topk_prob"] = False
    if arch == "gpt-oss":  # its routing and expert fields come with the rest (_gpt_oss_fields)
        fields.pop("norm_topk_prob")
    if arch == "hunyuan-moe":  # a float32 router's softmax, renormalised; one ungated shared MLP
        if int(key("expert_shared_count", 1)) != 1:
            raise ValueError(f"hunyuan-moe.expert_shared_count {key('expert_shared_count')} is not supported (1)")
        fields.update(norm_topk_prob=True, router_fp32=True, router_weights_fp32=True, shared_expert_gated=False,
                      shared_expert_ffn_size=int(key("expert_shared_feed_forward_length")))
    if arch == "llama4":  # the top logits' sigmoids scaling the experts' inputs, one ungated shared expert
        fields.update(router_scoring="top_sigmoid", norm_topk_prob=False, shared_expert_gated=False,
                      shared_expert_ffn_size=fields["expert_ffn_size"])
    if arch in ("qwen2moe", "qwen3next", "qwen35moe"):  # a sigmoid-gated shared expert (Qwen3-Next, 3.5: renormalised)
        fields["shared_expert_ffn_size"] = int(key("expert_shared_feed_forward_length"))
    # the gating function (1: softmax, 2: sigmoid) where it is a key: llama.cpp's default for
    # deepseek2 is softmax (DeepSeek-V2), the others' sigmoid, and these compute no other
    gating = int(key("expert_gating_func", 1 if arch == "deepseek2" else 2))
    allowed = {"deepseek2": (1, 2), "glm4moe": (2,), "minimax-m2": (2,), "dots1": (2,),
               "exaone-moe": (2,)}.get(arch, (gating,))
    if gating not in allowed:
        raise ValueError(f"{arch}.expert_gating_func {gating} is not supported "
                         f"({', '.join({1: '1: softmax', 2: '2: sigmoid'}[g] for g in allowed)})")
    if arch == "minimax-m2":  # sigmoid scores, their choice bias, renormalised; the router in the model's dtype
        fields.update(router_scoring="sigmoid", router_weights_fp32=True)
    if arch == "deepseek2" and gating == 1:  # DeepSeek-V2 / V2-Lite
        fields.update(deepseek_v2_fields(key, fields))
    elif arch in SIGMOID_ARCHS:  # sigmoid scores (gating function 2), their choice bias, shared experts ungated
        fields.update(router_scoring="sigmoid", router_fp32=True,
                      norm_topk_prob=bool(key("expert_weights_norm", False)),
                      routed_scaling=decimal32(float(key("expert_weights_scale", 1.0))),
                      expert_groups=int(key("expert_group_count", 1)) or 1,
                      expert_groups_used=int(key("expert_group_used_count", 1)) or 1,
                      shared_expert_ffn_size=int(key("expert_shared_count", 0)) * fields["expert_ffn_size"],
                      shared_expert_gated=False)
        if arch == "exaone-moe":  # its converter writes the shared experts' width (llama.cpp's for their tensors)
            fields["shared_expert_ffn_size"] = int(key("expert_shared_feed_forward_length",
                                                       fields["shared_expert_ffn_size"]))
    layers = int(key("block_count")) - nextn(key, arch)
    sparse = tuple(f"blk.{j}.ffn_gate_inp.weight" in tensors for j in range(layers))
    if arch == "ernie4_5-moe":
        fields.update(_ernie_moe_fields(key, fields["expert_ffn_size"], sparse, tensors))
    if arch == "exaone-moe":
        lead = int(key("leading_dense_block_count", 0))
        _check_sparse(arch, sparse, tuple(j >= lead for j in range(layers)), f"leading_dense_block_count {lead} makes")
    if not all(sparse):
        fields["moe_layers"] = sparse
    return fields


def _ernie_moe_fields(key: Any, expert_ffn: int, sparse: tuple[bool, ...], tensors: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5 MoE's routing and layers from its file, as transformers computes the model: a
    float32 router's softmax, the choice made on the scores + ``exp_probs_b`` (where the file
    holds it, as llama.cpp), the chosen scores renormalised (the sum clamped at the reference's
    ``moe_norm_min``, 1e-12 in the released configs: the file does not carry it), the shared
    experts one ungated MLP of ``expert_shared_feed_forward_length`` (the converter writes it
    only for shared experts; without it, ``expert_shared_count`` times the experts' width);
    sparse the layers from ``leading_dense_block_count`` on whose number + 1
    ``interleave_moe_layer_step`` divides, which must be the layers holding a router (a config
    whose sparse layers end before the last, ``moe_layer_end_index``, has no key for it)."""
    lead, step = int(key("leading_dense_block_count")), int(key("interleave_moe_layer_step"))
    if step < 1:
        raise ValueError(f"ernie4_5-moe.interleave_moe_layer_step {step}: must be >= 1; corrupt file?")
    _check_sparse("ernie4_5-moe", sparse, tuple(j >= lead and (j + 1) % step == 0 for j in range(len(sparse))),
                  f"leading_dense_block_count {lead} and interleave_moe_layer_step {step} make")
    first = sparse.index(True) if any(sparse) else 0
    shared = int(key("expert_shared_feed_forward_length", 0)) or int(key("expert_shared_count", 0)) * expert_ffn
    return dict(norm_topk_prob=True, router_fp32=True, router_norm_min=1e-12,
                router_choice_bias=f"blk.{first}.exp_probs_b.bias" in tensors,
                shared_expert_ffn_size=shared, shared_expert_gated=False)


def _check_sparse(arch: str, sparse: tuple[bool, ...], want: tuple[bool, ...], rule: str) -> None:
    """A file whose routers (``ffn_gate_inp``) are not on the layers ``rule`` (the keys llama.cpp
    builds its sparse layers from) makes sparse is refused in one line: llama.cpp would run other
    layers sparse than the reference does (a config whose sparse layers end before the last, or
    whose per-layer types make later layers dense, has no key for it)."""
    if sparse != want:
        raise ValueError(f"{arch} file with routers (ffn_gate_inp) on layers {_layer_list(sparse)}, but {rule} "
                         f"layers {_layer_list(want)} sparse: not supported (its sparse layers are not what "
                         "llama.cpp runs)")


def _layer_list(flags: tuple[bool, ...]) -> str:
    return ", ".join(str(j) for j, f in enumerate(flags) if f) or "none"
