"""A Gemma 1 / 2 / 3 ``config.json`` as a ``ModelSpec``, read as transformers 5 reads it.

``gemma``, ``gemma2`` and ``gemma3_text`` (Gemma3ForCausalLM) are read directly; ``gemma3``
(Gemma3ForConditionalGeneration) through its ``text_config``, whose weights the ``gemma``
family finds under ``language_model.model.*`` (the vision tower is not loaded: prompts are
token ids). A published ``gemma3`` config holds only the text fields that differ from
Gemma3TextConfig's defaults, so the defaults of each config class are filled in here
(``tests/test_gemma.py`` checks them against transformers').

What the engine does not compute is refused before anything is loaded, with a ValueError the
loader prefixes with the model's name.
"""
from __future__ import annotations

from typing import Any

from .config_fields import field_problem
from .rope_config import rope_scaling
from .spec import ModelSpec, alternating

GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text", "gemma3")
# the config classes' defaults of the fields read here (Gemma2Config, Gemma3TextConfig)
DEFAULTS: dict[str, dict[str, Any]] = {
    # Gemma 1: no soft-caps, no window, q.k scaled by head_dim ** -0.5
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, max_position_embeddings=8192,
                  rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
                  attention_bias=False),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
                   attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        max_position_embeddings=131072, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
                        bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
                        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None),
}
_THETA = {"gemma": 10000.0, "gemma2": 10000.0, "gemma3_global": 1_000_000.0, "gemma3_local": 10_000.0}
_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # every n-th layer global, the others sliding
_LAYER_TYPES = ("full_attention", "sliding_attention")

def gemma_spec(raw: dict[str, Any], name: str) -> ModelSpec:
    """The spec of a ``gemma2``, ``gemma3_text`` or ``gemma3`` config (``raw``, as parsed from
    config.json); its RoPE dicts read by every family's reader (``rope_config.rope_scaling``,
    which refuses a type it does not compute)."""
    mt = raw["model_type"]
    top: dict[str, Any] = {}
    if mt == "gemma3":
        top = raw
        raw = raw.get("text_config") or {}
        if raw.get("model_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"gemma3 text_config of model_type {raw['model_type']!r}: expected gemma3_text")
        problem = field_problem(raw, "gemma3_text")
        if problem:
            raise ValueError(f"text_config: {problem}")
        if raw.get("final_logit_softcapping") is not None:  # Gemma3ForConditionalGeneration never caps
            raise ValueError("text_config.final_logit_softcapping is not applied by Gemma3ForConditionalGeneration: "
                             "set it to null (or load the text model as gemma3_text)")
        kind = "gemma3_text"
    else:
        kind = mt
    cfg = {**DEFAULTS[kind], **raw}
    if kind == "gemma":  # transformers reads Gemma 1's legacy "gelu" as the tanh approximation it means
        if cfg.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"gemma with hidden_act={cfg['hidden_act']!r} is not supported (only gelu_pytorch_tanh)")
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    if top:  # a multimodal checkpoint runs with its own token ids and tying, not its text_config's
        cfg.update({k: top[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if top.get(k) is not None})
        cfg["tie_word_embeddings"] = top.get("tie_word_embeddings", True)
    global_rope, local_rope = _ropes(raw, kind)
    theta = float(global_rope.get("rope_theta") or 0)
    local_theta = float(local_rope.get("rope_theta") or 0) if local_rope is not None else 0.0
    for r in (global_rope, local_rope or {}):
        if (r.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {r['partial_rotary_factor']} is not supported")
    eos = cfg.get("eos_token_id")
    return ModelSpec(
        name=name, family="gemma", vocab_size=cfg["vocab_size"], num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"], ffn_size=cfg["intermediate_size"],
        num_heads=cfg["num_attention_heads"], num_kv_heads=cfg["num_key_value_heads"],
        head_dim_override=cfg["head_dim"], max_positions=cfg["max_position_embeddings"],
        norm_eps=float(cfg["rms_norm_eps"]), rope_theta=theta, rope_scaling=rope_scaling(global_rope, name),
        local_rope_theta=local_theta,
        local_rope_scaling=rope_scaling(local_rope, name) if local_rope is not None else None,
        # Gemma 1 never slides (its attention reads no window, whatever a config holds)
        sliding_window=0 if kind == "gemma" else int(cfg["sliding_window"] or 0), layer_types=_layer_types(cfg, kind),
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),  # pinned None for Gemma 3
        final_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]), attention_bias=bool(cfg["attention_bias"]),
        qk_norm=kind == "gemma3_text", norm_layout="pre" if kind == "gemma" else "sandwich", bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        pad_token_id=cfg.get("pad_token_id"))


def _layer_types(cfg: dict[str, Any], kind: str) -> tuple[str, ...]:
    """The config's ``layer_types``, or the default alternation its class computes: Gemma 2
    slides on even layers; Gemma 3 on all but every ``sliding_window_pattern``-th (6)."""
    n = cfg["num_hidden_layers"]
    if kind == "gemma":  # no sliding layers
        return ()
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    every = cfg.get("sliding_window_pattern", _PATTERN[kind]) if kind == "gemma3_text" else _PATTERN[kind]
    return alternating(n, every)


def _ropes(raw: dict[str, Any], kind: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global rope dict, sliding layers' rope dict or None: as the global), each with its
    ``rope_theta``, merged from ``rope_parameters``, the older ``rope_scaling``, ``rope_theta``
    and ``rope_local_base_freq`` with transformers' precedence."""
    params = raw.get("rope_parameters") or None
    legacy = raw.get("rope_scaling") or None
    nested = isinstance(params, dict) and any(k in params for k in _LAYER_TYPES)
    if kind in ("gemma", "gemma2"):
        if nested:
            raise ValueError("gemma2 rope_parameters per layer type are not supported: give one dict for every layer")
        rope = dict(legacy or params or {})  # transformers: rope_scaling, if given, replaces rope_parameters
        rope.setdefault("rope_theta", raw.get("rope_theta") or _THETA[kind])
        return rope, None
    if params is not None and not nested:
        raise ValueError("gemma3 rope_parameters must be a dict per layer type (full_attention, "
                         "sliding_attention), or use rope_scaling/rope_theta/rope_local_base_freq")
    params = params or {}
    glob = dict(params.get("full_attention") or {"rope_type": "default"})
    glob.update(legacy or {})  # an older config's rope_scaling is the global layers'
    glob.setdefault("rope_theta", raw.get("rope_theta") or _THETA["gemma3_global"])
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    local.setdefault("rope_theta", raw.get("rope_local_base_freq") or _THETA["gemma3_local"])
    return glob, local
