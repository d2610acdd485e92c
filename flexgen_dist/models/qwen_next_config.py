"""Qwen3-Next and Qwen3.5 configs (``qwen3_next``; ``qwen3_5_text`` and ``qwen3_5_moe_text``, and
the image-text ``qwen3_5`` / ``qwen3_5_moe`` whose ``text_config`` they are, run on token ids) as
the llama family's ``ModelSpec`` fields.

What they add to Qwen3, as transformers computes it:

- three layers of four (``layer_types``, by default every ``full_attention_interval``-th
  full) are ``linear_attention``: a gated delta rule (``deltanet.py``) of
  ``linear_num_key_heads`` q/k heads of ``linear_key_head_dim`` and ``linear_num_value_heads``
  v heads of ``linear_value_head_dim``, after a causal convolution of ``linear_conv_kernel_dim``;
- the full-attention layers' q_proj also gives a gate: their output times its sigmoid
  (``attn_output_gate``), q/k normalised per head, RoPE on ``partial_rotary_factor`` of each
  head (Qwen3.5's multimodal RoPE sections all see the same position on text: plain RoPE);
- every RMSNorm multiplies by (1 + w) in float32 (``norm_unit_offset``);
- the experts (Qwen3-Next, Qwen3.5-MoE) are Qwen2-MoE's: softmax top-k, renormalised, and a
  shared expert gated by a sigmoid.
"""
from __future__ import annotations

from typing import Any

__all__ = ["QWEN_NEXT_IMAGE_TEXT", "QWEN_NEXT_TYPES", "qwen_next_fields"]

QWEN_NEXT_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QWEN_NEXT_IMAGE_TEXT = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def qwen_next_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelSpec fields of a Qwen3-Next / Qwen3.5 text config beyond Qwen3's."""
    n = cfg["num_hidden_layers"]
    every = cfg.get("full_attention_interval") or 4
    types = tuple(cfg.get("layer_types") or ["linear_attention" if (j + 1) % every else "full_attention"
                                             for j in range(n)])
    if set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types {sorted(set(types))}: a Qwen3-Next / Qwen3.5 layer is linear_attention or "
                         "full_attention")
    out = dict(layer_types=types, attn_output_gate=True, norm_unit_offset=True, qk_norm=True)
    if "linear_attention" in types:  # (a config whose layers all attend has no use for these)
        out.update(lin_k_heads=cfg["linear_num_key_heads"], lin_v_heads=cfg["linear_num_value_heads"],
                   lin_k_dim=cfg["linear_key_head_dim"], lin_v_dim=cfg["linear_value_head_dim"],
                   lin_conv_kernel=cfg.get("linear_conv_kernel_dim") or 4)
    return out
