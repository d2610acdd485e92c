"""The sparse layers of the llama family's mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, Granite MoE, ERNIE 4.5, GLM-4.5, MiniMax-M2, gpt-oss, DeepSeek-V3): their weights' shapes
and checkpoint names, the routing, and the MLP that runs each chosen expert once over the
tokens that chose it.

A sparse layer's canonical weights are ``router.w`` (experts x hidden), ``experts.{e}.gate.w``,
``.up.w`` and ``.down.w`` for each routed expert e, and for Qwen2-MoE ``shared.{gate,up,down}.w``
and ``shared_gate.w`` (GLM-4.5 and ERNIE: the shared expert ungated; GLM-4.5, MiniMax-M2 and
ERNIE: ``router.choice_b``, the bias their routing adds to the scores to choose; gpt-oss:
``router.b`` and each expert's ``gate.b``, ``up.b``, ``down.b``). The math reads the experts
through an ``Experts`` (``common.py``): the engine passes one that reads only the experts the
tokens chose, when they choose them.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..kernels.qweight import QWeight
from .common import EXPERT_PARTS, EXPERTS, DictExperts, linear, silu_mul
from .families import INDEX, MXFP4, ROWS, TRANSPOSED, Weights
from .spec import ModelSpec


def moe_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MLP weights: the router, the shared expert, each routed expert's."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"router.w": (spec.num_experts, h)}
    if spec.router_bias:  # gpt-oss
        shapes["router.b"] = (spec.num_experts,)
    if spec.has_choice_bias:  # GLM-4.5, MiniMax-M2, ERNIE 4.5: the bias its choice adds to the scores
        shapes["router.choice_b"] = (spec.num_experts,)
    if spec.shared_expert_ffn_size:
        sf = spec.shared_expert_ffn_size
        shapes.update({"shared.gate.w": (sf, h), "shared.up.w": (sf, h), "shared.down.w": (h, sf)})
        if spec.shared_expert_gated:
            shapes["shared_gate.w"] = (1, h)
    ef = spec.expert_ffn_size
    for e in range(spec.num_experts):
        shapes.update({f"experts.{e}.{k}": s for k, s in zip(EXPERT_PARTS, ((ef, h), (ef, h), (h, ef)))})
        if spec.expert_bias:  # gpt-oss
            shapes.update({f"experts.{e}.gate.b": (ef,), f"experts.{e}.up.b": (ef,), f"experts.{e}.down.b": (h,)})
    return shapes


# Mixtral names its sparse block block_sparse_moe and its experts' matrices w1 (gate), w3 (up)
# and w2 (down); Qwen's is mlp, with gate_proj/up_proj/down_proj. Checkpoints written in
# transformers' fused layout hold all experts in 3-D tensors (experts x rows x cols).
_MIXTRAL_EXPERT = {"gate.w": "w1", "up.w": "w3", "down.w": "w2"}
_QWEN_EXPERT = {"gate.w": "gate_proj", "up.w": "up_proj", "down.w": "down_proj"}


def moe_hf_names(spec: ModelSpec, at: str, k: str) -> list[str]:
    """Candidate checkpoint names of a sparse layer's canonical weight ``k``."""
    if spec.router_scoring == "topk_softmax" and spec.expert_bias:
        return _gpt_oss_hf_names(spec, at, k)
    if spec.router_scoring == "top_sigmoid":
        return _llama4_hf_names(spec, at, k)
    if k == "router.w":  # Mixtral's, Qwen's; Granite's as released and as transformers saves it; HunYuan's
        return [f"{at}.block_sparse_moe.gate.weight", f"{at}.mlp.gate.weight",
                f"{at}.block_sparse_moe.router.layer.weight", f"{at}.block_sparse_moe.router.weight",
                f"{at}.mlp.gate.wg.weight"]
    if k == "router.choice_b":  # GLM-4.5's beside the router; MiniMax-M2's on the block; ERNIE's (1 x experts)
        return [f"{at}.mlp.gate.e_score_correction_bias", f"{at}.mlp.e_score_correction_bias",
                f"{at}.block_sparse_moe.e_score_correction_bias",
                f"{at}.mlp.moe_statics.e_score_correction_bias{INDEX}0"]
    if k == "shared_gate.w":
        return [f"{at}.mlp.shared_expert_gate.weight"]
    if k.startswith("shared."):  # Qwen2-MoE's one shared expert; GLM-4.5's n_shared_experts as one; Granite's
        sf = spec.shared_expert_ffn_size
        granite = {"gate.w": f"input_linear.weight{ROWS}0:{sf}", "up.w": f"input_linear.weight{ROWS}{sf}:{2 * sf}",
                   "down.w": "output_linear.weight"}[k[7:]]
        return [f"{at}.mlp.shared_expert.{_QWEN_EXPERT[k[7:]]}.weight",
                f"{at}.mlp.shared_experts.{_QWEN_EXPERT[k[7:]]}.weight", f"{at}.shared_mlp.{granite}",
                f"{at}.mlp.shared_mlp.{_QWEN_EXPERT[k[7:]]}.weight"]
    _, e, part = k.split(".", 2)
    f = spec.expert_ffn_size
    fused = {"gate.w": f"gate_up_proj{INDEX}{e}{ROWS}0:{f}", "up.w": f"gate_up_proj{INDEX}{e}{ROWS}{f}:{2 * f}",
             "down.w": f"down_proj{INDEX}{e}"}[part]
    released = {"gate.w": f"input_linear.weight{INDEX}{e}{ROWS}0:{f}",  # Granite's as released
                "up.w": f"input_linear.weight{INDEX}{e}{ROWS}{f}:{2 * f}",
                "down.w": f"output_linear.weight{INDEX}{e}"}[part]
    return [f"{at}.block_sparse_moe.experts.{e}.{_MIXTRAL_EXPERT[part]}.weight",
            f"{at}.mlp.experts.{e}.{_QWEN_EXPERT[part]}.weight", f"{at}.mlp.experts.{fused}",
            f"{at}.block_sparse_moe.experts.{fused}", f"{at}.block_sparse_moe.{released}"]


def _gpt_oss_hf_names(spec: ModelSpec, at: str, k: str) -> list[str]:
    """gpt-oss's names: ``mlp.router`` (with a bias); all experts in 3-D tensors stored
    transposed (experts x in x out), gate and up interleaved in the columns of
    ``gate_up_proj`` (gate the even ones), each with a bias."""
    if k.startswith("router."):
        return [f"{at}.mlp.router.{'weight' if k == 'router.w' else 'bias'}"]
    _, e, part = k.split(".", 2)
    f2 = 2 * spec.expert_ffn_size
    name = {"gate.w": f"gate_up_proj{INDEX}{e}{TRANSPOSED}{ROWS}0:{f2}:2",
            "up.w": f"gate_up_proj{INDEX}{e}{TRANSPOSED}{ROWS}1:{f2}:2",
            "down.w": f"down_proj{INDEX}{e}{TRANSPOSED}",
            "gate.b": f"gate_up_proj_bias{INDEX}{e}{ROWS}0:{f2}:2",
            "up.b": f"gate_up_proj_bias{INDEX}{e}{ROWS}1:{f2}:2",
            "down.b": f"down_proj_bias{INDEX}{e}"}[part]
    # OpenAI's own checkpoints: the matrices MXFP4, stored out x in (not transposed)
    packed = {"gate.w": f"gate_up_proj_blocks{MXFP4}{INDEX}{e}{ROWS}0:{f2}:2",
              "up.w": f"gate_up_proj_blocks{MXFP4}{INDEX}{e}{ROWS}1:{f2}:2",
              "down.w": f"down_proj_blocks{MXFP4}{INDEX}{e}"}.get(part)
    return [f"{at}.mlp.experts.{n}" for n in (name, packed) if n]


def _llama4_hf_names(spec: ModelSpec, at: str, k: str) -> list[str]:
    """Llama 4's names: ``feed_forward.router``, one ``shared_expert``, all experts in 3-D
    tensors stored transposed (experts x in x out), gate then up in the columns of
    ``gate_up_proj``."""
    if k == "router.w":
        return [f"{at}.feed_forward.router.weight"]
    if k.startswith("shared."):
        return [f"{at}.feed_forward.shared_expert.{_QWEN_EXPERT[k[7:]]}.weight"]
    _, e, part = k.split(".", 2)
    f = spec.expert_ffn_size
    name = {"gate.w": f"gate_up_proj{INDEX}{e}{TRANSPOSED}{ROWS}0:{f}",
            "up.w": f"gate_up_proj{INDEX}{e}{TRANSPOSED}{ROWS}{f}:{2 * f}",
            "down.w": f"down_proj{INDEX}{e}{TRANSPOSED}"}[part]
    return [f"{at}.feed_forward.experts.{name}"]


# llama.cpp keeps a sparse layer's experts as 3-D tensors (experts x rows x cols)
_MOE_GGUF = {"router.w": "ffn_gate_inp.weight", "router.b": "ffn_gate_inp.bias", "router.choice_b": "exp_probs_b.bias",
             "shared.gate.w": "ffn_gate_shexp.weight",
             "shared.up.w": "ffn_up_shexp.weight", "shared.down.w": "ffn_down_shexp.weight",
             "shared_gate.w": "ffn_gate_inp_shexp.weight"}
_EXPERT_GGUF = {"gate.w": "ffn_gate_exps.weight", "up.w": "ffn_up_exps.weight", "down.w": "ffn_down_exps.weight",
                "gate.b": "ffn_gate_exps.bias", "up.b": "ffn_up_exps.bias", "down.b": "ffn_down_exps.bias"}


def moe_gguf_name(k: str) -> str:
    if k in _MOE_GGUF:
        return _MOE_GGUF[k]
    _, e, part = k.split(".", 2)
    return f"{_EXPERT_GGUF[part]}{INDEX}{e}"


def route(spec: ModelSpec, logits: torch.Tensor, dtype: torch.dtype,
          choice_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights from the router's logits (tokens, experts): the
    softmax in float32, the top ``experts_per_tok`` kept (within the best groups, a group
    ranked by its best: DeepSeek-V2), renormalised to sum to 1 where the model does, times
    ``routed_scaling``, in float32 (Mixtral) or ``dtype`` (Qwen), as the reference. Sigmoid
    routing (GLM-4.5): ``_sigmoid_route``; the top logits' softmax or sigmoid (gpt-oss, Llama 4)."""
    if spec.router_scoring == "sigmoid":
        return _sigmoid_route(spec, logits, choice_bias)
    if spec.router_scoring == "topk_softmax":  # gpt-oss, Granite: the top logits, then their softmax
        top_l, top_i = torch.topk(logits, spec.experts_per_tok, dim=-1)
        return torch.softmax(top_l, dim=1, dtype=torch.float32).to(dtype), top_i
    if spec.router_scoring == "sparsemixer":
        return _sparsemixer(logits, spec.router_jitter)
    if spec.router_scoring == "top_sigmoid":  # Llama 4: the top logits' sigmoids (in float32, cast back)
        top_l, top_i = torch.topk(logits, spec.experts_per_tok, dim=-1)
        return torch.sigmoid(top_l.float()).to(dtype), top_i
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if spec.expert_groups > 1:  # DeepSeek-V2: within the best groups, a group ranked by its best
        probs = _in_best_groups(spec, probs, lambda grouped: grouped.max(dim=-1).values, 0.0)
    if choice_bias is not None:  # ERNIE 4.5: chosen by probability + bias, weighted by probability
        top_i = torch.topk(probs + choice_bias.float(), spec.experts_per_tok, dim=-1)[1]
        top_w = probs.gather(1, top_i)
    else:
        top_w, top_i = torch.topk(probs, spec.experts_per_tok, dim=-1)
    if spec.norm_topk_prob:
        total = top_w.sum(dim=-1, keepdim=True)
        top_w = top_w / total.clamp(min=spec.router_norm_min) if spec.router_norm_min else top_w.div_(total)
    if spec.routed_scaling != 1.0:  # DeepSeek-V2
        top_w = top_w * spec.routed_scaling
    return (top_w if spec.router_weights_fp32 else top_w.to(dtype)), top_i


def _sparsemixer(logits: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's two experts as transformers' inference computes them: the best logit's
    expert, weighted by the softmax over the logits within 2 * jitter of it (relatively, as
    (best - l) / max(|l|, best)); then, that expert left out, the best remaining one, weighted
    the same way against the second best. In the logits' dtype."""
    weights, chosen = [], []
    scores = logits
    for _ in range(2):
        best, idx = scores.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter
        w = torch.softmax(scores.masked_fill(far, float("-inf")), dim=-1).gather(-1, idx)
        weights.append(w)
        chosen.append(idx)
        scores = scores.scatter(-1, idx, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(chosen, dim=-1)


def _sigmoid_route(spec: ModelSpec, logits: torch.Tensor,
                   choice_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's (DeepSeek-V3's) routing of float32 logits: sigmoid scores; the choice made on
    the scores plus the per-expert bias, within the best ``expert_groups_used`` groups (a group
    ranked by the sum of its two best); the weights the chosen experts' scores, renormalised
    where the model does, times ``routed_scaling``; float32 throughout, as the reference."""
    scores = logits.float().sigmoid()  # MiniMax-M2's logits come in the model's dtype
    choice = scores if choice_bias is None else scores + choice_bias.float()
    if spec.expert_groups > 1:  # a group ranked by the sum of its two best
        choice = _in_best_groups(spec, choice, lambda grouped: grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0]
                                 .sum(dim=-1), float("-inf"))
    top_i = torch.topk(choice, spec.experts_per_tok, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_i)
    if spec.norm_topk_prob:
        top_w /= top_w.sum(dim=-1, keepdim=True) + 1e-20
    return top_w * spec.routed_scaling, top_i


def _in_best_groups(spec: ModelSpec, scores: torch.Tensor, rank: Any, fill: float) -> torch.Tensor:
    """``scores`` (tokens, experts) with every expert outside its token's best
    ``expert_groups_used`` of ``expert_groups`` groups set to ``fill``; ``rank`` gives each group
    its worth from its experts' scores (tokens, groups, per group) -> (tokens, groups)."""
    g = spec.expert_groups
    per = spec.num_experts // g
    worth = rank(scores.view(-1, g, per))
    keep = torch.zeros_like(worth).scatter_(1, worth.topk(spec.expert_groups_used, dim=-1, sorted=False)[1], 1)
    return scores.masked_fill(~keep.bool().repeat_interleave(per, dim=1), fill)


def moe_mlp(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """A sparse layer's MLP of normalised hidden states x (..., hidden): route, then each chosen
    expert once over the tokens that chose it (one product per expert, never per token), its
    weighted output added into the tokens' rows in ascending expert order (the reference's
    order of the sums), plus the shared expert's gated output where there is one."""
    shape, h = x.shape, x.shape[-1]
    x = x.reshape(-1, h)
    if spec.router_fp32:  # the router's product in float32, as the reference keeps it (GLM-4.5, ERNIE)
        r = w["router.w"]
        logits = F.linear(x.float(), (r.dense() if isinstance(r, QWeight) else r).float())
    else:
        logits = linear(x, w["router.w"], w.get("router.b"))
    top_w, top_i = route(spec, logits, x.dtype, w.get("router.choice_b"))
    experts = w.get(EXPERTS) or DictExperts(w)
    chosen = torch.unique(top_i).tolist()  # sorted
    experts.prefetch(chosen)
    if hasattr(experts, "note_routing"):  # the engine counts what was routed (metrics)
        experts.note_routing(x.shape[0], len(chosen), spec.experts_touched(x.shape[0]))
    out = torch.zeros_like(x)
    input_weighted = spec.router_scoring == "top_sigmoid"  # Llama 4: the weight scales the expert's input
    for e in chosen:
        slot, tok = torch.where(top_i.t() == e)  # the reference's row order: by top-k slot, then token
        ew = experts.get(e)
        xe = x[tok]
        if input_weighted:
            xe = xe * top_w[tok, slot, None]
        g = _expert_gate(spec, linear(xe, ew["gate.w"], ew.get("gate.b")), linear(xe, ew["up.w"], ew.get("up.b")))
        y = linear(g, ew["down.w"], ew.get("down.b"))
        if not input_weighted:
            y = y * top_w[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    if spec.shared_expert_ffn_size:  # Qwen2-MoE: sigmoid(gate(x)) * shared(x), added after the experts
        s = linear(silu_mul(linear(x, w["shared.gate.w"]), linear(x, w["shared.up.w"])), w["shared.down.w"])
        out = out + (torch.sigmoid(linear(x, w["shared_gate.w"])) * s if spec.shared_expert_gated else s)
    return out.view(shape)


def _expert_gate(spec: ModelSpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """An expert's gated activation: SwiGLU, or gpt-oss's clamped form (``swiglu_alpha``)."""
    if not spec.swiglu_alpha:
        return silu_mul(gate, up)
    limit = spec.swiglu_limit  # in place on the fresh products; each product as the reference's
    gate = gate.clamp_(max=limit)
    return torch.sigmoid(gate * spec.swiglu_alpha).mul_(gate).mul_(up.clamp_(-limit, limit).add_(1))
