"""A config's RoPE scaling (``rope_scaling`` / ``rope_parameters``) as a ``RopeScaling``, resolved
as transformers resolves it: the readers of Hugging Face configs (``hf_config``, ``gemma_config``)
and of GGUF files' YaRN keys (``gguf``) share them."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .rope_scaling import ROPE_TYPES, RopeScaling
from .source import ModelLoadError

__all__ = ["phimoe_rope", "rope_scaling"]


def rope_scaling(rope: dict[str, Any], name: str, max_positions: int = 0,
                  rotary_dim: int = 0) -> RopeScaling | None:
    """A config's ``rope_scaling``/``rope_parameters`` as a ``RopeScaling`` (None: plain RoPE);
    a type or field this engine does not compute is refused in one line naming it.
    ``max_positions``: the config's max_position_embeddings (yarn and longrope derive a
    missing factor from it, as the reference does); ``rotary_dim``: the dims RoPE turns
    (longrope has a factor per pair of them)."""
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{name}: rope scaling type {rope_type!r} is not supported "
                             f"(supported: default, {', '.join(ROPE_TYPES)})")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    need = {"llama3": keys, "yarn": keys[3:], "longrope": ("long_factor", "short_factor", keys[3])}.get(
        rope_type, keys[:1])
    missing = [k for k in need if rope.get(k) is None]
    if missing:
        raise ModelLoadError(f"{name}: rope scaling {rope_type!r} needs {', '.join(missing)} in the config")
    args = {k: rope[k] for k in need}
    if rope_type == "yarn":
        args.update(_yarn_args(rope, max_positions))
    if rope_type == "longrope":
        args.update(_longrope_args(rope, max_positions, rotary_dim, name))
    try:
        return RopeScaling(rope_type, **args)
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None


def _yarn_args(rope: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """YaRN's factor and attention factor resolved as the reference resolves them."""
    factor = rope.get("factor") or max_positions / rope["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = rope.get("attention_factor")
    if att is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        att = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    return {"factor": factor, "attention_factor": att, "beta_fast": rope.get("beta_fast") or 32,
            "beta_slow": rope.get("beta_slow") or 1, "truncate": rope.get("truncate", True)}


def _longrope_args(rope: dict[str, Any], max_positions: int, rotary_dim: int, name: str) -> dict[str, Any]:
    """LongRoPE's factor and attention factor resolved as the reference resolves them (the
    factor, where absent, is the context's growth over the original; the attention factor
    sqrt(1 + ln factor / ln original)), its per-frequency factors checked for length."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / original
    att = rope.get("attention_factor")
    if att is None:
        att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for k in ("long_factor", "short_factor"):
        if rotary_dim and len(rope[k]) != rotary_dim // 2:
            raise ModelLoadError(f"{name}: rope scaling {k} has {len(rope[k])} values for {rotary_dim} rotated "
                                 f"dims: expected {rotary_dim // 2}")
    return {"factor": factor, "attention_factor": float(att), "long_factor": tuple(rope["long_factor"]),
            "short_factor": tuple(rope["short_factor"])}


def phimoe_rope(rope: dict[str, Any], scaling: RopeScaling | None) -> RopeScaling | None:
    """Phi-3.5-MoE's LongRoPE as transformers computes it: its rotary embedding asks for the
    frequencies without a length, which gives the short factors at every position, and scales
    cos and sin by ``short_mscale`` within the original context, ``long_mscale`` past it (over the
    whole batch). Read as LongRoPE whose long factors are its short ones, scaled by the one
    mscale; two different mscales are refused (the switch depends on the batch there)."""
    if scaling is None:
        return None
    short, long = rope.get("short_mscale"), rope.get("long_mscale")
    if short is None or long is None or short != long:
        raise ValueError(f"phimoe rope short_mscale {short} and long_mscale {long}: supported where both are "
                         "given and equal (transformers switches between them by the batch's longest sequence)")
    return replace(scaling, long_factor=scaling.short_factor, attention_factor=float(short))
