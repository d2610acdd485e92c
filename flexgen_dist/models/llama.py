"""LLaMA family (Llama 2/3, SmolLM2, Mistral-style dense, and the checkpoints that differ in
small ways: Qwen, Phi-3, Granite, SmolLM3, OLMo 2/3, EXAONE 4, GLM-4, ERNIE 4.5, DeepSeek-V3's
latent attention): RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, tied or
untied LM head. Its mixtures of experts' sparse layers (shapes, names, routing, the MLP) are
``experts.py``'s."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.qweight import QWeight
from .common import (ATTN_MLP_GGUF, ATTN_MLP_HF, LM_PREFIXES, Positions, apply_rope, apply_rope_interleaved,
                     as_positions, embed_shapes, embedding, head_shapes, linear, lm_gguf_names, lm_hf_names,
                     project_qkv, rms_norm, silu_mul)
from .deltanet import fused_rows, head_ranges, lin_hf_names, lin_shapes, linear_attention
from .experts import moe_gguf_name, moe_hf_names, moe_mlp, moe_shapes
from .families import ROWS, Attend, Family, Recurrent, Weights, register
from .spec import ModelSpec

_LAYER_HF = {
    **ATTN_MLP_HF, "attn_norm.w": "input_layernorm.weight", "mlp_norm.w": "post_attention_layernorm.weight",
    "attn_norm.b": "input_layernorm.bias", "mlp_norm.b": "post_attention_layernorm.bias",  # Phi-3.5-MoE
    # OLMo 2/3's norms on the sublayers' outputs (post_attention_layernorm names the one after
    # attention there, the one before the MLP in Llama)
    "post_attn_norm.w": "post_attention_layernorm.weight", "post_mlp_norm.w": "post_feedforward_layernorm.weight",
    "sinks": "self_attn.sinks",  # gpt-oss
    "act.alpha_p": "mlp.act_fn.alpha_p", "act.alpha_n": "mlp.act_fn.alpha_n",  # Apertus's xIELU
}
# GLM-4's four norms: post_self_attn_layernorm after attention, post_attention_layernorm
# before the MLP (as Llama's), post_mlp_layernorm after it
_LAYER_HF_SANDWICH = {**_LAYER_HF, "post_attn_norm.w": "post_self_attn_layernorm.weight",
                      "post_mlp_norm.w": "post_mlp_layernorm.weight"}
_LAYER_GGUF = {
    **ATTN_MLP_GGUF, "attn_norm.w": "attn_norm.weight", "mlp_norm.w": "ffn_norm.weight",
    "post_attn_norm.w": "post_attention_norm.weight", "post_mlp_norm.w": "post_ffw_norm.weight",
    "sinks": "attn_sinks.weight",  # gpt-oss
    # DeepSeek-V3's latent attention (deepseek2); kv_b is the file's attn_kv_b, or its attn_k_b
    # and attn_v_b joined back (``gguf_deepseek.join_kv_b``)
    "q_a.w": "attn_q_a.weight", "q_a_norm.w": "attn_q_a_norm.weight", "q_b.w": "attn_q_b.weight",
    "kv_a.w": "attn_kv_a_mqa.weight", "kv_a_norm.w": "attn_kv_a_norm.weight", "kv_b.w": "attn_kv_b.weight",
    # Qwen3-Next's linear-attention layers (qwen3next): q|k|v and z as the converter splits
    # in_proj_qkvz, b and a as rows of ssm_ba, A as -exp(A_log) (``GGUFSource`` takes the log back)
    "lin_qkv.w": "attn_qkv.weight", "lin_z.w": "attn_gate.weight", "lin_b.w": "ssm_ba.weight",
    "lin_a.w": "ssm_ba.weight", "lin_conv.w": "ssm_conv1d.weight", "lin_dt.b": "ssm_dt.bias", "lin_A_log": "ssm_a",
    "lin_norm.w": "ssm_norm.weight", "lin_o.w": "ssm_out.weight", "q_gate.w": "attn_q.weight",
}

_GGUF_METADATA = ("act.alpha_p", "act.alpha_n")  # in a GGUF file, metadata (xielu.alpha_p / alpha_n arrays)


def layer_shapes(spec: ModelSpec, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    h, f, qd, kvd = spec.hidden_size, spec.ffn_size, spec.q_dim, spec.kv_dim
    pre, post = spec.norm_layout != "post", spec.norm_layout != "pre"  # where the norms sit
    shapes: dict[str, tuple[int, ...]] = {"attn_norm.w": (h,)} if pre else {}
    linear = layer is not None and spec.linear(layer)
    if linear:  # Qwen3-Next's gated delta rule in place of attention
        shapes.update(lin_shapes(spec))
    else:
        shapes.update(_mla_shapes(spec) if spec.kv_lora_rank else
                      {"q.w": (qd, h), "k.w": (kvd, h), "v.w": (kvd, h), "o.w": (h, qd)})
    if spec.attn_output_gate and not linear:  # Qwen3-Next: q_proj's other half, a gate on the output
        shapes["q_gate.w"] = (qd, h)
    shapes.update({"post_attn_norm.w": (h,)} if post else {})
    shapes.update({"mlp_norm.w": (h,)} if pre else {})
    shapes.update({"post_mlp_norm.w": (h,)} if post else {})
    if not spec.is_moe(layer):
        shapes.update({"gate.w": (f, h), "up.w": (f, h), "down.w": (h, f)} if spec.mlp_gated else
                      {"up.w": (f, h), "down.w": (h, f)})
        if spec.mlp_activation == "xielu":  # its two learned scalars
            shapes.update({"act.alpha_p": (1,), "act.alpha_n": (1,)})
    else:  # the router, the shared expert, then each routed expert's (experts.py)
        shapes.update(moe_shapes(spec))
    if (spec.attention_bias or spec.qkv_bias) and not linear:
        shapes.update({"q.b": (qd,), "k.b": (kvd,), "v.b": (kvd,)})
    if spec.attention_bias and not linear:
        shapes["o.b"] = (h,)
    if spec.qk_norm and not linear:
        shapes.update({"q_norm.w": (qd,), "k_norm.w": (kvd,)} if spec.qk_norm_whole else
                      {"q_norm.w": (spec.head_dim,), "k_norm.w": (spec.head_dim,)})
    if spec.layer_norm:  # Phi-3.5-MoE's LayerNorms
        shapes.update({"attn_norm.b": (h,), "mlp_norm.b": (h,)})
    if spec.mlp_bias and not spec.is_moe(layer):
        shapes.update({"gate.b": (f,), "up.b": (f,), "down.b": (h,)} if spec.mlp_gated else {"up.b": (f,), "down.b": (h,)})
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


# other names of the same weights, tried after the usual ones: Llama 4's MLP (feed_forward),
# HunYuan's q/k norms, Apertus's layer norms
_HF_ALIASES = (("gate.w", ".mlp.", ".feed_forward."), ("up.w", ".mlp.", ".feed_forward."),
               ("down.w", ".mlp.", ".feed_forward."), ("q_norm.w", ".q_norm.", ".query_layernorm."),
               ("k_norm.w", ".k_norm.", ".key_layernorm."), ("attn_norm.w", ".input_layernorm.", ".attention_layernorm."),
               ("mlp_norm.w", ".post_attention_layernorm.", ".feedforward_layernorm."))
_MLA_HF = {"q_a.w": "self_attn.q_a_proj.weight", "q_a_norm.w": "self_attn.q_a_layernorm.weight",
           "q_b.w": "self_attn.q_b_proj.weight", "kv_a.w": "self_attn.kv_a_proj_with_mqa.weight",
           "kv_a_norm.w": "self_attn.kv_a_layernorm.weight", "kv_b.w": "self_attn.kv_b_proj.weight"}


def hf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, list[str]]:
    """Canonical name -> candidate checkpoint names (first found wins)."""
    if part == "layer":
        table = _LAYER_HF_SANDWICH if spec.norm_layout == "sandwich" else {**_LAYER_HF, **_MLA_HF}
        dense = lm_hf_names(spec, part, layer, table, [k for k in layer_shapes(spec, layer) if k in table])
        if spec.linear(layer):  # the gated delta rule's weights (deltanet.py)
            lin = [lin_hf_names(spec, f"{p}layers.{layer}.") for p in LM_PREFIXES]
            dense.update({k: [n for names in lin for n in names[k]] for k in lin[0]})
        elif spec.attn_output_gate:  # Qwen3-Next's q_proj: each head's q rows, then its gate's
            for k, rows in _gated_q_rows(spec).items():
                dense[k] = [f"{p}layers.{layer}.self_attn.q_proj.weight{ROWS}{rows}" for p in LM_PREFIXES]
        out = {k: dense[k] if k in dense else [n for p in LM_PREFIXES for n in moe_hf_names(spec, f"{p}layers.{layer}", k)]
               for k in layer_shapes(spec, layer)}
        qd, kvd, f = spec.q_dim, spec.kv_dim, spec.ffn_size
        fused = {}
        if spec.fused_proj:  # Phi-3 stores q|k|v as one matrix: its rows
            fused = {"q.w": ("self_attn.qkv_proj", 0, qd), "k.w": ("self_attn.qkv_proj", qd, qd + kvd),
                     "v.w": ("self_attn.qkv_proj", qd + kvd, qd + 2 * kvd)}
        if spec.fused_proj or spec.fused_mlp:  # ... and gate|up (Phi-3, GLM-4)
            fused.update({"gate.w": ("mlp.gate_up_proj", 0, f), "up.w": ("mlp.gate_up_proj", f, 2 * f)})
        for k, (name, r0, r1) in fused.items():
            out[k] = [f"{p}layers.{layer}.{name}.weight{ROWS}{r0}:{r1}" for p in LM_PREFIXES]
        for k, old, new in _HF_ALIASES:
            if k in out and k not in fused:
                out[k] = out[k] + [n.replace(old, new) for n in out[k]]
        return out
    out = lm_hf_names(spec, part, layer, _LAYER_HF, ())
    if part == "head" and spec.layer_norm:  # Phi-3.5-MoE: the final LayerNorm's bias, the head's
        out["norm.b"] = [n.replace(".weight", ".bias") for n in out["norm.w"]]
    if part == "head" and spec.lm_head_bias:
        out["lm_head.b"] = [n.replace(".weight", ".bias") for n in out["lm_head.w"]]
    return out


def gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """Canonical name -> GGUF tensor name (llama.cpp convention; ``name#rows=a:b`` as in
    ``hf_names`` for the rows of a fused tensor). Apertus's xIELU scalars are no tensors there:
    the converter writes them as metadata (``gguf_arch.GGUFArch.scalars``)."""
    if part == "layer":
        out = {k: f"blk.{layer}.{_LAYER_GGUF[k] if k in _LAYER_GGUF else moe_gguf_name(k)}"
               for k in layer_shapes(spec, layer) if k not in _GGUF_METADATA}
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


def qwen3next_gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """llama.cpp's ``qwen3next`` names: the norm before the MLP is post_attention_norm; a
    linear layer's b and a are the rows of ssm_ba interleaved by key head (``fused_rows``'s
    ranges, as in_proj_ba's), an attention layer's q and gate those of attn_q, each head's q
    then its gate (HF's q_proj as it is)."""
    return _qwen_next_gguf_names(spec, part, layer, split_ba=False)


def qwen35_gguf_names(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, str]:
    """llama.cpp's ``qwen35`` / ``qwen35moe`` names: ``qwen3next``'s, b and a in tensors of
    their own (ssm_beta, ssm_alpha)."""
    return _qwen_next_gguf_names(spec, part, layer, split_ba=True)


def _qwen_next_gguf_names(spec: ModelSpec, part: str, layer: int | None, split_ba: bool) -> dict[str, str]:
    out = post_attention_gguf_names(spec, part, layer)
    if part != "layer" or layer is None:
        return out
    if spec.linear(layer) and split_ba:
        out.update({"lin_b.w": f"blk.{layer}.ssm_beta.weight", "lin_a.w": f"blk.{layer}.ssm_alpha.weight"})
    elif spec.linear(layer):
        rows = fused_rows(spec)
        out.update({k: f"blk.{layer}.ssm_ba.weight{ROWS}{rows[k]}" for k in ("lin_b.w", "lin_a.w")})
    else:
        out.update({k: f"blk.{layer}.attn_q.weight{ROWS}{rows}" for k, rows in _gated_q_rows(spec).items()})
    return out


def _gated_q_rows(spec: ModelSpec) -> dict[str, str]:
    """The rows of Qwen3-Next's q_proj (each head's q, then its gate) that are ``q.w`` and
    ``q_gate.w``."""
    d = spec.head_dim
    return {"q.w": head_ranges(spec.num_heads, 2 * d, 0, d), "q_gate.w": head_ranges(spec.num_heads, 2 * d, d, d)}


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


def _norm(spec: ModelSpec, x: torch.Tensor, w: torch.Tensor, eps: float, b: torch.Tensor | None = None
          ) -> torch.Tensor:
    """RMSNorm; OLMo's multiplies its weight in float32 before the cast (Llama's after it),
    which differs in a half dtype only; Phi-3.5-MoE's is a LayerNorm with a bias ``b``."""
    if spec.layer_norm:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if spec.norm_unit_offset:  # Qwen3-Next: (1 + w) in float32, then the cast
        return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * (1.0 + w.float())).to(x.dtype)
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
    del a
    g = silu_mul(linear(x, w["gate.w"], w.get("gate.b")), linear(x, w["up.w"], w.get("up.b")))
    return _norm(spec, linear(g, w["down.w"], w.get("down.b")), w["post_mlp_norm.w"], eps).add_(x)


def _sandwich_layer(spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor | Positions,
                    attend: Attend, layer: int) -> torch.Tensor:
    """GLM-4: a norm before and after attention and the MLP each, the outputs' norms before
    the residual adds."""
    eps = spec.norm_eps
    a = attend(*_qkv(spec, w, rms_norm(x, w["attn_norm.w"], eps), pos, layer), *_sinks(spec, w))
    x = rms_norm(linear(a, w["o.w"], w.get("o.b")), w["post_attn_norm.w"], eps).add_(x)
    del a
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
    elif spec.qk_norm and not spec.qk_norm_after_rope:  # Qwen3: RMSNorm over each head's q and k, before the rotation
        q, k = _norm(spec, q, w["q_norm.w"], eps), _norm(spec, k, w["k_norm.w"], eps)
    if spec.rotates(layer):
        theta, scaling = spec.rope(layer)
        dt = torch.float32 if spec.rope_fp32 else x.dtype  # ERNIE 4.5: the tables and the turn in float32
        cos, sin = as_positions(pos).rope(spec.rope_dim, theta, dt, scaling, spec.rope_interleaved)
        if spec.rope_interleaved:
            q, k = (apply_rope_interleaved(t, cos, sin, spec.rope_fp32) for t in (q, k))
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if spec.qk_l2_norm:  # Llama 4: each turned head RMS-normalised in float32, without a weight
            q, k = (F.rms_norm(t.float(), (t.shape[-1],), None, eps).to(t.dtype) for t in (q, k))
    if spec.qk_norm_after_rope:  # HunYuan: each head's RMSNorm after the rotation
        q, k = rms_norm(q, w["q_norm.w"], eps), rms_norm(k, w["k_norm.w"], eps)
    if spec.attn_temp_nope and not spec.rotates(layer):  # Llama 4: positions counted from 1, q cast back
        ids = as_positions(pos).ids.float()
        temp = torch.log1p(torch.floor((ids + 1.0) / spec.attn_temp_len)) * spec.attn_temp_beta + 1.0
        q = (q * temp[:, :, None, None]).to(q.dtype)
    elif spec.attn_temp_beta and not spec.attn_temp_nope:
        # Ministral 3: a temperature on q growing past each attn_temp_len positions
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
    xn = None
    if isinstance(attend, Recurrent):  # a linear-attention layer (Qwen3-Next)
        h = linear_attention(spec, w, _norm(spec, x, w["attn_norm.w"], eps, w.get("attn_norm.b")), attend)
        return _mlp_block(spec, w, linear(h, w["lin_o.w"], None, residual), layer)
    if spec.kv_lora_rank:  # DeepSeek-V3
        a = _mla_attend(spec, w, _norm(spec, x, w["attn_norm.w"], eps, w.get("attn_norm.b")), pos, attend, layer)
    else:
        xn = _norm(spec, x, w["attn_norm.w"], eps, w.get("attn_norm.b"))
        a = attend(*_qkv(spec, w, xn, pos, layer), *_sinks(spec, w))
        if spec.attn_output_gate:  # Qwen3-Next: the output times sigmoid of q_proj's gate half
            a = a * torch.sigmoid(linear(xn, w["q_gate.w"]))
    # in-place adds and activations: these temporaries are the size of the whole batch, and
    # on the CPU every fresh one costs page faults
    scaled = spec.residual_multiplier != 1.0
    x = _residual(spec, linear(a, w["o.w"], w.get("o.b")), residual) if scaled else \
        linear(a, w["o.w"], w.get("o.b"), residual)
    del a, xn, residual  # not held through the MLP: a prefill's working set is what the footprint counts
    return _mlp_block(spec, w, x, layer)


def _mlp_block(spec: ModelSpec, w: Weights, x: torch.Tensor, layer: int) -> torch.Tensor:
    """The MLP half of a pre-norm layer: its norm, the dense MLP or the experts, the residual add."""
    eps, scaled = spec.norm_eps, spec.residual_multiplier != 1.0
    residual = x
    x = _norm(spec, x, w["mlp_norm.w"], eps, w.get("mlp_norm.b"))
    if spec.is_moe(layer):
        y = moe_mlp(spec, w, x)
        return _residual(spec, y, residual) if scaled else y.add_(residual)
    g = _mlp_hidden(spec, w, x)
    if scaled:
        return _residual(spec, linear(g, w["down.w"], w.get("down.b")), residual)
    return linear(g, w["down.w"], w.get("down.b"), residual)


def _mlp_hidden(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """A dense MLP's inner activations: silu(gate) * up, or the ungated act(up) (Arcee's relu
    squared; Apertus's xIELU, its scalars softplus'd as the reference, beta 0.5, eps -1e-6)."""
    if spec.mlp_gated:
        return silu_mul(linear(x, w["gate.w"], w.get("gate.b")), linear(x, w["up.w"], w.get("up.b")))
    u = linear(x, w["up.w"], w.get("up.b"))
    if spec.mlp_activation == "relu2":
        return torch.square(F.relu(u))
    beta, eps = torch.tensor(0.5, dtype=u.dtype), torch.tensor(-1e-6, dtype=u.dtype, device=u.device)
    alpha_p = F.softplus(w["act.alpha_p"])
    alpha_n = beta + F.softplus(w["act.alpha_n"])
    return torch.where(u > 0, alpha_p * u * u + beta * u, (torch.expm1(torch.min(u, eps)) - u) * alpha_n + beta * u)


def _head_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The final norm and the head, with Phi-3.5-MoE's biases where the model has them."""
    shapes = head_shapes(spec)
    if spec.layer_norm:
        shapes["norm.b"] = (spec.hidden_size,)
    if spec.lm_head_bias:
        shapes["lm_head.b"] = (spec.vocab_size,)
    return shapes


def final_norm(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    return _norm(spec, x, w["norm.w"], spec.norm_eps, w.get("norm.b"))


def head(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    x = final_norm(spec, w, x)
    logits = linear(x, w["lm_head.w"] if "lm_head.w" in w else w["tok.w"], w.get("lm_head.b"))
    return logits.div_(spec.logits_divisor) if spec.logits_divisor != 1.0 else logits  # Granite


register(Family("llama", layer_shapes=layer_shapes, embed_shapes=embed_shapes, head_shapes=_head_shapes,
                hf_names=hf_names, embed=embed, layer_forward=layer_forward, head=head, final_norm=final_norm))
