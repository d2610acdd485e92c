"""LLaMA family (Llama 2/3, SmolLM2, Mistral-style dense, and the checkpoints that differ in
small ways: Qwen, Phi-3, Granite, SmolLM3, OLMo 2/3, EXAONE 4, GLM-4, ERNIE 4.5): RMSNorm,
rotary positions, SwiGLU MLP, grouped-query attention, tied or untied LM head; and its mixtures
of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, ERNIE 4.5, GLM-4.5, MiniMax-M2, gpt-oss),
whose sparse layers route each token to a few SwiGLU experts.

A sparse layer's canonical weights are ``router.w`` (experts x hidden), ``experts.{e}.gate.w``,
``.up.w`` and ``.down.w`` for each routed expert e, and for Qwen2-MoE ``shared.{gate,up,down}.w``
and ``shared_gate.w`` (GLM-4.5 and ERNIE: the shared expert ungated; GLM-4.5, MiniMax-M2 and
ERNIE: ``router.choice_b``, the bias their routing adds to the scores to choose; gpt-oss:
``router.b`` and each expert's ``gate.b``, ``up.b``, ``down.b``). The math reads the experts through an
``Experts`` (``common.py``): the engine passes one that reads only the experts the tokens
chose, when they choose them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import (ATTN_MLP_GGUF, ATTN_MLP_HF, EXPERT_PARTS, EXPERTS, LM_PREFIXES, DictExperts, Positions,
                     apply_rope, apply_rope_interleaved, as_positions, embed_shapes, embedding, head_shapes, linear, lm_gguf_names, lm_hf_names,
                     project_qkv, rms_norm, silu_mul)
from ..kernels.qweight import QWeight
from .families import INDEX, MXFP4, ROWS, TRANSPOSED, Attend, Family, Weights, register
from .spec import ModelSpec

_LAYER_HF = {
    **ATTN_MLP_HF, "attn_norm.w": "input_layernorm.weight", "mlp_norm.w": "post_attention_layernorm.weight",
    # OLMo 2/3's norms on the sublayers' outputs (post_attention_layernorm names the one after
    # attention there, the one before the MLP in Llama)
    "post_attn_norm.w": "post_attention_layernorm.weight", "post_mlp_norm.w": "post_feedforward_layernorm.weight",
    "sinks": "self_attn.sinks",  # gpt-oss
}
# GLM-4's four norms: post_self_attn_layernorm after attention, post_attention_layernorm
# before the MLP (as Llama's), post_mlp_layernorm after it
_LAYER_HF_SANDWICH = {**_LAYER_HF, "post_attn_norm.w": "post_self_attn_layernorm.weight",
                      "post_mlp_norm.w": "post_mlp_layernorm.weight"}
_LAYER_GGUF = {
    **ATTN_MLP_GGUF, "attn_norm.w": "attn_norm.weight", "mlp_norm.w": "ffn_norm.weight",
    "post_attn_norm.w": "post_attention_norm.weight", "post_mlp_norm.w": "post_ffw_norm.weight",
    "sinks": "attn_sinks.weight",  # gpt-oss
}


def layer_shapes(spec: ModelSpec, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    h, f, qd, kvd = spec.hidden_size, spec.ffn_size, spec.q_dim, spec.kv_dim
    pre, post = spec.norm_layout != "post", spec.norm_layout != "pre"  # where the norms sit
    shapes: dict[str, tuple[int, ...]] = {"attn_norm.w": (h,)} if pre else {}
    shapes.update(_mla_shapes(spec) if spec.kv_lora_rank else
                  {"q.w": (qd, h), "k.w": (kvd, h), "v.w": (kvd, h), "o.w": (h, qd)})
    shapes.update({"post_attn_norm.w": (h,)} if post else {})
    shapes.update({"mlp_norm.w": (h,)} if pre else {})
    shapes.update({"post_mlp_norm.w": (h,)} if post else {})
    if not spec.is_moe(layer):
        shapes.update({"gate.w": (f, h), "up.w": (f, h), "down.w": (h, f)})
    else:  # the router, the shared expert, then each routed expert's three matrices
        shapes["router.w"] = (spec.num_experts, h)
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
    if spec.attention_bias or spec.qkv_bias:
        shapes.update({"q.b": (qd,), "k.b": (kvd,), "v.b": (kvd,)})
    if spec.attention_bias:
        shapes["o.b"] = (h,)
    if spec.qk_norm:
        shapes.update({"q_norm.w": (qd,), "k_norm.w": (kvd,)} if spec.qk_norm_whole else
                      {"q_norm.w": (spec.head_dim,), "k_norm.w": (spec.head_dim,)})
    if spec.mlp_bias and not spec.is_moe(layer):
        shapes.update({"gate.b": (f,), "up.b": (f,), "down.b": (h,)})
    if spec.attn_sinks:  # gpt-oss: one logit per query head
        shapes["sinks"] = (spec.num_heads,)
    return shapes


def _mla_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """A latent-attention layer's projections (DeepSeek-V3): q (through q_a, its norm and q_b
    where q_lora_rank > 0), kv_a (the latent and the shared key), its norm, kv_b (each head's
    key and value rows from the latent), o."""
    h, nh, r, dr = spec.hidden_size, spec.num_heads, spec.kv_lora_rank, spec.qk_rope_dim
    qk = nh * (spec.qk_nope_dim + dr)
    q = ({"q_a.w": (spec.q_lora_rank, h), "q_a_norm.w": (spec.q_lora_rank,), "q_b.w": (qk, spec.q_lora_rank)}
         if spec.q_lora_rank else {"q.w": (qk, h)})
    return {**q, "kv_a.w": (r + dr, h), "kv_a_norm.w": (r,), "kv_b.w": (nh * (spec.qk_nope_dim + spec.v_head_dim), r),
            "o.w": (h, nh * spec.v_head_dim)}


_MLA_HF = {"q_a.w": "self_attn.q_a_proj.weight", "q_a_norm.w": "self_attn.q_a_layernorm.weight",
           "q_b.w": "self_attn.q_b_proj.weight", "kv_a.w": "self_attn.kv_a_proj_with_mqa.weight",
           "kv_a_norm.w": "self_attn.kv_a_layernorm.weight", "kv_b.w": "self_attn.kv_b_proj.weight"}


def hf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, list[str]]:
    """Canonical name -> candidate checkpoint names (first found wins)."""
    if part == "layer":
        at = f"model.layers.{layer}"
        table = _LAYER_HF_SANDWICH if spec.norm_layout == "sandwich" else {**_LAYER_HF, **_MLA_HF}
        dense = lm_hf_names(spec, part, layer, table, [k for k in layer_shapes(spec, layer) if k in table])
        out = {k: dense[k] if k in dense else _moe_hf_names(spec, at, k) for k in layer_shapes(spec, layer)}
        qd, kvd, f = spec.q_dim, spec.kv_dim, spec.ffn_size
        fused = {}
        if spec.fused_proj:  # Phi-3 stores q|k|v as one matrix: its rows
            fused = {"q.w": ("self_attn.qkv_proj", 0, qd), "k.w": ("self_attn.qkv_proj", qd, qd + kvd),
                     "v.w": ("self_attn.qkv_proj", qd + kvd, qd + 2 * kvd)}
        if spec.fused_proj or spec.fused_mlp:  # ... and gate|up (Phi-3, GLM-4)
            fused.update({"gate.w": ("mlp.gate_up_proj", 0, f), "up.w": ("mlp.gate_up_proj", f, 2 * f)})
        for k, (name, r0, r1) in fused.items():
            out[k] = [f"{p}layers.{layer}.{name}.weight{ROWS}{r0}:{r1}" for p in LM_PREFIXES]
        return out
    return lm_hf_names(spec, part, layer, _LAYER_HF, ())

# Mixtral names its sparse block block_sparse_moe and its experts' matrices w1 (gate), w3 (up)
# and w2 (down); Qwen's is mlp, with gate_proj/up_proj/down_proj. Checkpoints written in
# transformers' fused layout hold all experts in 3-D tensors (experts x rows x cols).
_MIXTRAL_EXPERT = {"gate.w": "w1", "up.w": "w3", "down.w": "w2"}
_QWEN_EXPERT = {"gate.w": "gate_proj", "up.w": "up_proj", "down.w": "down_proj"}


def _moe_hf_names(spec: ModelSpec, at: str, k: str) -> list[str]:
    """Candidate checkpoint names of a sparse layer's canonical weight ``k``."""
    if spec.router_scoring == "topk_softmax" and spec.expert_bias:
        return _gpt_oss_hf_names(spec, at, k)
    if k == "router.w":  # Mixtral's, Qwen's; Granite's as released and as transformers saves it
        return [f"{at}.block_sparse_moe.gate.weight", f"{at}.mlp.gate.weight",
                f"{at}.block_sparse_moe.router.layer.weight", f"{at}.block_sparse_moe.router.weight"]
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
                f"{at}.mlp.shared_experts.{_QWEN_EXPERT[k[7:]]}.weight", f"{at}.shared_mlp.{granite}"]
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


# llama.cpp keeps a sparse layer's experts as 3-D tensors (experts x rows x cols)
_MOE_GGUF = {"router.w": "ffn_gate_inp.weight", "router.b": "ffn_gate_inp.bias", "router.choice_b": "exp_probs_b.bias",
             "shared.gate.w": "ffn_gate_shexp.weight",
             "shared.up.w": "ffn_up_shexp.weight", "shared.down.w": "ffn_down_shexp.weight",
             "shared_gate.w": "ffn_gate_inp_shexp.weight"}
_EXPERT_GGUF = {"gate.w": "ffn_gate_exps.weight", "up.w": "ffn_up_exps.weight", "down.w": "ffn_down_exps.weight",
                "gate.b": "ffn_gate_exps.bias", "up.b": "ffn_up_exps.bias", "down.b": "ffn_down_exps.bias"}


def _moe_gguf_name(k: str) -> str:
    if k in _MOE_GGUF:
        return _MOE_GGUF[k]
    _, e, part = k.split(".", 2)
    return f"{_EXPERT_GGUF[part]}{INDEX}{e}"


def gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """Canonical name -> GGUF tensor name (llama.cpp convention; ``name#rows=a:b`` as in
    ``hf_names`` for the rows of a fused tensor)."""
    if part == "layer":
        out = {k: f"blk.{layer}.{_LAYER_GGUF[k] if k in _LAYER_GGUF else _moe_gguf_name(k)}"
               for k in layer_shapes(spec, layer)}
        qd, kvd, f = spec.q_dim, spec.kv_dim, spec.ffn_size
        fused = {}
        if spec.fused_proj:  # Phi-3: llama.cpp keeps HF's qkv_proj as attn_qkv, gate_up_proj as ffn_up
            fused = {"q.w": ("attn_qkv", 0, qd), "k.w": ("attn_qkv", qd, qd + kvd),
                     "v.w": ("attn_qkv", qd + kvd, qd + 2 * kvd)}
        if (spec.fused_proj or spec.fused_mlp) and not spec.is_moe(layer):  # ... and GLM-4's gate|up
            fused.update({"gate.w": ("ffn_up", 0, f), "up.w": ("ffn_up", f, 2 * f)})
        for k, (name, r0, r1) in fused.items():
            out[k] = f"blk.{layer}.{name}.weight{ROWS}{r0}:{r1}"
        return out
    return lm_gguf_names(spec, part)


def post_attention_gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """llama.cpp's ``glm4moe`` and ``gpt-oss`` names: llama's, with the norm before the MLP
    called ``post_attention_norm`` (HF's post_attention_layernorm, mapped by name)."""
    out = gguf_names(spec, part, layer)
    if part == "layer":
        out["mlp_norm.w"] = f"blk.{layer}.post_attention_norm.weight"
    return out


def unpermute_gguf(name: str, w: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleaving of the q and k projections (its ``llama``
    architecture only: the others rotate halves, as here, and are written unpermuted)."""
    if name not in ("q.w", "k.w", "q.b", "k.b"):
        return w
    n = spec.num_heads if name.startswith("q") else spec.num_kv_heads
    rows = w.shape[0]
    return w.reshape(n, rows // n // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def embed(spec: ModelSpec, w: Weights, ids: torch.Tensor, pos: torch.Tensor | Positions) -> torch.Tensor:
    x = embedding(ids, w["tok.w"])
    return x.mul_(spec.embed_multiplier) if spec.embed_multiplier != 1.0 else x  # Granite


def _residual(spec: ModelSpec, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + y * residual_multiplier`` (Granite), rounded as the reference rounds it."""
    return y.mul_(spec.residual_multiplier).add_(residual)


def _norm(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm; OLMo's multiplies its weight in float32 before the cast (Llama's after it),
    which differs in a half dtype only."""
    if spec.norm_weight_fp32 and x.dtype != torch.float32:
        return (w * F.rms_norm(x.float(), (x.shape[-1],), None, eps)).to(x.dtype)
    return rms_norm(x, w, eps)


def _post_norm_layer(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                     attend: Attend, layer: int) -> torch.Tensor:
    """OLMo 2/3, EXAONE 4: attention and the MLP see the residual stream itself; each one's
    output is normalised, then added to it."""
    eps = spec.norm_eps
    a = attend(*_qkv(spec, w, x, pos, layer))
    x = _norm(spec, linear(a, w["o.w"], w.get("o.b")), w["post_attn_norm.w"], eps).add_(x)
    g = silu_mul(linear(x, w["gate.w"], w.get("gate.b")), linear(x, w["up.w"], w.get("up.b")))
    return _norm(spec, linear(g, w["down.w"], w.get("down.b")), w["post_mlp_norm.w"], eps).add_(x)


def _sandwich_layer(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                    attend: Attend, layer: int) -> torch.Tensor:
    """GLM-4: a norm before and after attention and the MLP each, the outputs' norms before
    the residual adds."""
    eps = spec.norm_eps
    a = attend(*_qkv(spec, w, rms_norm(x, w["attn_norm.w"], eps), pos, layer), *_sinks(spec, w))
    x = rms_norm(linear(a, w["o.w"], w.get("o.b")), w["post_attn_norm.w"], eps).add_(x)
    h = rms_norm(x, w["mlp_norm.w"], eps)
    g = silu_mul(linear(h, w["gate.w"], w.get("gate.b")), linear(h, w["up.w"], w.get("up.b")))
    return rms_norm(linear(g, w["down.w"], w.get("down.b")), w["post_mlp_norm.w"], eps).add_(x)


def _qkv(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
         layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the (normalised) input: projected, q/k normalised where the model does it
    (Qwen3 per head, OLMo over all heads), turned where the layer has RoPE."""
    q, k, v = project_qkv(spec, w, x)
    eps = spec.norm_eps
    if spec.qk_norm_whole:
        q = _norm(spec, q.flatten(2), w["q_norm.w"], eps).view(q.shape)
        k = _norm(spec, k.flatten(2), w["k_norm.w"], eps).view(k.shape)
    elif spec.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before the rotation
        q, k = rms_norm(q, w["q_norm.w"], eps), rms_norm(k, w["k_norm.w"], eps)
    if spec.rotates(layer):
        theta, scaling = spec.rope(layer)
        dt = torch.float32 if spec.rope_fp32 else x.dtype  # ERNIE 4.5: the tables and the turn in float32
        cos, sin = as_positions(pos).rope(spec.rope_dim, theta, dt, scaling, spec.rope_interleaved)
        if spec.rope_interleaved:
            q, k = (apply_rope_interleaved(t, cos, sin, spec.rope_fp32) for t in (q, k))
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if spec.attn_temp_beta:  # Ministral 3: a temperature on q growing past each attn_temp_len positions
        ids = as_positions(pos).ids
        temp = 1 + spec.attn_temp_beta * torch.log(1 + torch.floor(ids / spec.attn_temp_len))
        q = q * temp[:, :, None, None].to(q.dtype)
    return q, k, v


def _mla_attend(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                attend: Attend, layer: int) -> torch.Tensor:
    """DeepSeek-V3's latent attention of the normalised x (b, t, hidden) -> (b, t, heads *
    v_head_dim), for o_proj. The cache holds, per token, the normalised latent c and the
    turned shared key (one kv head); each head's q absorbs its key projection (q_nope . W_uk
    is a latent-sized query), so q'.k' = q_nope . (W_uk c) + q_rot . k_rot, the reference's
    score; the attention's latent output times each head's W_uv is its value. Those norms use
    transformers' fixed epsilon 1e-6."""
    b, t, _ = x.shape
    nh, dn, dr, dv, r = spec.num_heads, spec.qk_nope_dim, spec.qk_rope_dim, spec.v_head_dim, spec.kv_lora_rank
    if spec.q_lora_rank:
        q = linear(rms_norm(linear(x, w["q_a.w"]), w["q_a_norm.w"], 1e-6), w["q_b.w"])
    else:
        q = linear(x, w["q.w"])
    q_nope, q_rot = q.view(b, t, nh, dn + dr).split([dn, dr], dim=-1)
    c, k_rot = linear(x, w["kv_a.w"]).split([r, dr], dim=-1)
    c = rms_norm(c.contiguous(), w["kv_a_norm.w"], 1e-6)
    k_rot = k_rot.reshape(b, t, 1, dr)
    theta, scaling = spec.rope(layer)
    cos, sin = as_positions(pos).rope(dr, theta, x.dtype, scaling, spec.rope_interleaved)
    turn = apply_rope_interleaved if spec.rope_interleaved else apply_rope
    q_rot, k_rot = turn(q_rot.contiguous(), cos, sin), turn(k_rot, cos, sin)
    kv_b = w["kv_b.w"]
    kv_b = (kv_b.dense() if isinstance(kv_b, QWeight) else kv_b).view(nh, dn + dv, r)
    q_lat = torch.einsum("btnd,ndr->btnr", q_nope, kv_b[:, :dn])
    kv = torch.cat([c.view(b, t, 1, r), k_rot], dim=-1)
    a = attend(torch.cat([q_lat, q_rot], dim=-1), kv, kv)
    o = torch.einsum("btnr,nvr->btnv", a.view(b, t, nh, r + dr)[..., :r], kv_b[:, dn:])
    return o.reshape(b, t, nh * dv)


def _sinks(spec: ModelSpec, w: Weights) -> tuple[torch.Tensor, ...]:
    """``attend``'s extra argument: gpt-oss's sinks, where the model has them."""
    return (w["sinks"],) if spec.attn_sinks else ()


def layer_forward(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                  attend: Attend, layer: int = 0) -> torch.Tensor:
    """One decoder layer; ``attend`` writes k/v into the engine's cache and attends."""
    if spec.norm_layout == "post":
        return _post_norm_layer(spec, w, x, pos, attend, layer)
    if spec.norm_layout == "sandwich":
        return _sandwich_layer(spec, w, x, pos, attend, layer)
    eps = spec.norm_eps
    residual = x
    if spec.kv_lora_rank:  # DeepSeek-V3
        a = _mla_attend(spec, w, _norm(spec, x, w["attn_norm.w"], eps), pos, attend, layer)
    else:
        a = attend(*_qkv(spec, w, _norm(spec, x, w["attn_norm.w"], eps), pos, layer), *_sinks(spec, w))
    # in-place adds and activations: these temporaries are the size of the whole batch, and
    # on the CPU every fresh one costs page faults
    scaled = spec.residual_multiplier != 1.0
    x = _residual(spec, linear(a, w["o.w"], w.get("o.b")), residual) if scaled else \
        linear(a, w["o.w"], w.get("o.b"), residual)
    residual = x
    x = _norm(spec, x, w["mlp_norm.w"], eps)
    if spec.is_moe(layer):
        y = moe_mlp(spec, w, x)
        return _residual(spec, y, residual) if scaled else y.add_(residual)
    g = silu_mul(linear(x, w["gate.w"], w.get("gate.b")), linear(x, w["up.w"], w.get("up.b")))
    if scaled:
        return _residual(spec, linear(g, w["down.w"], w.get("down.b")), residual)
    return linear(g, w["down.w"], w.get("down.b"), residual)


def route(spec: ModelSpec, logits: torch.Tensor, dtype: torch.dtype,
          choice_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights from the router's logits (tokens, experts): the
    softmax in float32, the top ``experts_per_tok`` kept (renormalised to sum to 1 where the
    model does), the weights in float32 (Mixtral) or ``dtype`` (Qwen), as the reference.
    Sigmoid routing (GLM-4.5): ``_sigmoid_route``."""
    if spec.router_scoring == "sigmoid":
        return _sigmoid_route(spec, logits, choice_bias)
    if spec.router_scoring == "topk_softmax":  # gpt-oss, Granite: the top logits, then their softmax
        top_l, top_i = torch.topk(logits, spec.experts_per_tok, dim=-1)
        return torch.softmax(top_l, dim=1, dtype=torch.float32).to(dtype), top_i
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if choice_bias is not None:  # ERNIE 4.5: chosen by probability + bias, weighted by probability
        top_i = torch.topk(probs + choice_bias.float(), spec.experts_per_tok, dim=-1)[1]
        top_w = probs.gather(1, top_i)
    else:
        top_w, top_i = torch.topk(probs, spec.experts_per_tok, dim=-1)
    if spec.norm_topk_prob:
        total = top_w.sum(dim=-1, keepdim=True)
        top_w = top_w / total.clamp(min=spec.router_norm_min) if spec.router_norm_min else top_w.div_(total)
    return (top_w if spec.router_weights_fp32 else top_w.to(dtype)), top_i


def _sigmoid_route(spec: ModelSpec, logits: torch.Tensor,
                   choice_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5's (DeepSeek-V3's) routing of float32 logits: sigmoid scores; the choice made on
    the scores plus the per-expert bias, within the best ``expert_groups_used`` groups (a group
    ranked by the sum of its two best); the weights the chosen experts' scores, renormalised
    where the model does, times ``routed_scaling``; float32 throughout, as the reference."""
    scores = logits.sigmoid()
    choice = scores if choice_bias is None else scores + choice_bias.float()
    g = spec.expert_groups
    if g > 1:
        per = spec.num_experts // g
        best = choice.view(-1, g, per).topk(min(2, per), dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(spec.expert_groups_used, dim=-1, sorted=False)[1], 1)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(per, dim=1), float("-inf"))
    top_i = torch.topk(choice, spec.experts_per_tok, dim=-1, sorted=False)[1]
    top_w = scores.gather(1, top_i)
    if spec.norm_topk_prob:
        top_w /= top_w.sum(dim=-1, keepdim=True) + 1e-20
    return top_w * spec.routed_scaling, top_i


def moe_mlp(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """A sparse layer's MLP of normalised hidden states x (..., hidden): route, then each chosen
    expert once over the tokens that chose it (one product per expert, never per token), its
    weighted output added into the tokens' rows in ascending expert order (the reference's
    order of the sums), plus the shared expert's gated output where there is one."""
    shape, h = x.shape, x.shape[-1]
    x = x.reshape(-1, h)
    if spec.router_fp32:  # the router in float32, as the reference keeps it (GLM-4.5)
        r = w["router.w"]
        r = r.dense() if isinstance(r, QWeight) else r
        top_w, top_i = route(spec, F.linear(x.float(), r.float()), x.dtype, w.get("router.choice_b"))
    elif spec.router_scoring == "sigmoid":  # MiniMax-M2: in the model's dtype, scored in float32
        top_w, top_i = route(spec, linear(x, w["router.w"]).float(), x.dtype, w["router.choice_b"])
    else:
        top_w, top_i = route(spec, linear(x, w["router.w"], w.get("router.b")), x.dtype)
    experts = w.get(EXPERTS) or DictExperts(w)
    chosen = torch.unique(top_i).tolist()  # sorted
    experts.prefetch(chosen)
    if hasattr(experts, "note_routing"):  # the engine counts what was routed (metrics)
        experts.note_routing(x.shape[0], len(chosen), spec.experts_touched(x.shape[0]))
    out = torch.zeros_like(x)
    for e in chosen:
        slot, tok = torch.where(top_i.t() == e)  # the reference's row order: by top-k slot, then token
        ew = experts.get(e)
        xe = x[tok]
        g = _expert_gate(spec, linear(xe, ew["gate.w"], ew.get("gate.b")), linear(xe, ew["up.w"], ew.get("up.b")))
        y = linear(g, ew["down.w"], ew.get("down.b")) * top_w[tok, slot, None]
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


def head(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    x = _norm(spec, x, w["norm.w"], spec.norm_eps)
    logits = linear(x, w["lm_head.w"] if "lm_head.w" in w else w["tok.w"])
    return logits.div_(spec.logits_divisor) if spec.logits_divisor != 1.0 else logits  # Granite


register(Family("llama", layer_shapes=layer_shapes, embed_shapes=embed_shapes, head_shapes=head_shapes,
                hf_names=hf_names, embed=embed, layer_forward=layer_forward, head=head))
