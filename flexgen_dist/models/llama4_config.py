"""Llama 4 (Scout, Maverick) configs: ``llama4_text``, and the image-text ``llama4`` whose
``text_config`` it is (run on token ids), as the llama family's ``ModelSpec`` fields.

What Llama 4 adds to Llama, as transformers computes it:

- every ``no_rope_layer_interval``-th layer (4) has no RoPE (``no_rope_layers``: 1 where a
  layer turns); the others turn interleaved pairs (its complex-number form) and attend within
  chunks of ``attention_chunk_size`` positions (``chunked_attention``, counted from each
  sequence's first token), the global NoPE layers to everything;
- on the turning layers q and k of each head are RMS-normalised without a weight after the
  turn (``use_qk_norm``); on the NoPE layers q is scaled by the attention temperature
  1 + attn_scale · ln(1 + floor((p + 1) / floor_scale)) (``attn_temperature_tuning``);
- the sparse layers (every ``interleave_moe_layer_step``-th, or ``moe_layers``) route each
  token to its top ``num_experts_per_tok`` experts by logit, weight each by the sigmoid of
  its logit and scale the expert's *input* by it, and add an ungated shared expert; the
  experts and the shared one have ``intermediate_size``, the dense layers'
  MLP ``intermediate_size_mlp``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["llama4_fields", "llama4_text_config"]


def llama4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelSpec fields of a ``llama4_text`` config beyond Llama's."""
    n = cfg["num_hidden_layers"]
    every = cfg.get("no_rope_layer_interval") or 4
    rotates = cfg.get("no_rope_layers") or [int((j + 1) % every != 0) for j in range(n)]
    if len(rotates) < n:
        raise ValueError(f"llama4_text no_rope_layers has {len(rotates)} entries for {n} layers")
    chunk = cfg.get("attention_chunk_size")
    types = tuple(cfg.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention"
                                              for r in rotates[:n]])
    if set(types) - {"full_attention", "chunked_attention"} or ("chunked_attention" in types and not chunk):
        raise ValueError(f"llama4_text layer_types {sorted(set(types))} with attention_chunk_size {chunk}: "
                         "chunked layers need a chunk size, and no other kind is Llama 4's")
    step = cfg.get("interleave_moe_layer_step") or 1
    moe = cfg.get("moe_layers")
    sparse = tuple(j in (set(moe) if moe is not None else set(range(step - 1, n, step))) for j in range(n))
    width = cfg["intermediate_size"]
    fields: dict[str, Any] = dict(
        ffn_size=cfg.get("intermediate_size_mlp") or width, rope_interleaved=True,
        nope_layers=tuple(not r for r in rotates[:n]), qk_l2_norm=bool(cfg.get("use_qk_norm", True)))
    if any(sparse):
        fields.update(num_experts=cfg.get("num_local_experts", 16), experts_per_tok=cfg.get("num_experts_per_tok", 1),
                      expert_ffn_size=width, shared_expert_ffn_size=width, shared_expert_gated=False,
                      router_scoring="top_sigmoid", norm_topk_prob=False, moe_layers=() if all(sparse) else sparse)
    if "chunked_attention" in types:
        fields.update(sliding_window=int(chunk), layer_types=types)
    if cfg.get("attn_temperature_tuning", True):
        fields.update(attn_temp_nope=True, attn_temp_beta=float(cfg.get("attn_scale", 0.1)),
                      attn_temp_len=int(cfg.get("floor_scale", 8192)))
    return fields


def llama4_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``llama4_text`` config of an image-text ``llama4`` one: its ``text_config``, with the
    top level's head tying (transformers reads it there, default false) and token ids."""
    text = dict(cfg.get("text_config") or {})
    text["model_type"] = "llama4_text"
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)
    text.update({k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None})
    return text
