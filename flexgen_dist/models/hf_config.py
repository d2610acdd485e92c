"""A Hugging Face ``config.json`` as a ``ModelSpec``: which model types are read, and how each
family's fields (RoPE scaling, sliding windows, experts, multipliers, layers without RoPE)
become the spec's; everything a config holds that the engine does not compute is refused
in one line naming it (``config_fields.py`` accounts for every field). Gemma's configs have
a reader of their own (``gemma_config.py``), given this module's RoPE reader.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .config_fields import USED, field_problem
from .gemma_config import GEMMA_TYPES, gemma_spec
from .llama4_config import llama4_fields, llama4_text_config
from .qwen_next_config import QWEN_NEXT_IMAGE_TEXT, QWEN_NEXT_TYPES, qwen_next_fields
from .moe_config import GRANITE_MOE_TYPES, MLA_TYPES, MOE_REFUSED, MOE_TYPES, moe_fields
from .source import ModelLoadError
from .rope_config import phimoe_rope, rope_scaling as _rope_scaling
from .spec_checks import NEOX_ACTIVATIONS
from .rope_scaling import mla_softmax_scale
from .spec import ModelSpec, RopeScaling, alternating, every_nth


def spec_from_hf_config(cfg: dict[str, Any], name: str) -> ModelSpec:
    """The spec of a parsed ``config.json``; what is not computed is a one-line ModelLoadError
    prefixed with ``name``."""
    mt = cfg.get("model_type", "")
    problem = field_problem(cfg, mt) if mt in USED else None
    if problem:
        raise ModelLoadError(f"{name}: {problem}")
    if mt in MOE_REFUSED:
        raise ModelLoadError(f"{name}: the mixture-of-experts family {mt!r} is not supported (supported: "
                             f"{', '.join(MOE_TYPES)})")
    if mt not in SUPPORTED:
        raise ModelLoadError(f"{name}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if "chunked_attention" in (cfg.get("layer_types") or ()) and mt != "llama4_text":
        raise ModelLoadError(f"{name}: layer_types chunked_attention not supported for {mt!r} (Llama 4's alone)")
    try:
        spec = _spec(cfg, mt, name)
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from None
    except KeyError as e:
        raise ModelLoadError(f"{name}: config.json has no {e.args[0]!r}, which a {mt} model needs: the config is "
                             "incomplete; take it from the model's own release") from None
    arch = (cfg.get("architectures") or [""])[0]
    if arch.endswith("ForSequenceClassification"):  # reward models, classifiers: a score head, no LM head
        if spec.family not in ("llama", "gemma", "cohere"):
            raise ModelLoadError(f"{name}: {arch}: sequence classifiers are read for the Llama, Gemma and Cohere "
                                 "families' architectures (Llama, Mistral, Qwen2/3, Gemma 2/3, ...): load the base "
                                 "language model")
        id2label = {str(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
        n = int(cfg.get("num_labels") or len(id2label) or 2)
        sep = cfg.get("use_sep_token", cfg.get("use_pad_token", True))  # vLLM's field (and its older name)
        spec = dataclasses.replace(spec, num_labels=n, labels=tuple(id2label.get(str(i), f"LABEL_{i}") for i in range(n)),
                                   pair_sep=bool(sep))
    if arch.endswith("Model") and not spec.tie_word_embeddings:  # a base model: no LM head in the checkpoint
        logging.getLogger("flexgen_dist").warning(
            "%s: a base model (%s, as embedding models ship): no LM head, so the embedding matrix stands in for one; "
            "embed() gives its vectors, generated text would mean nothing", name, arch)
        spec = dataclasses.replace(spec, tie_word_embeddings=True)
    return spec


def _spec(cfg: dict[str, Any], mt: str, name: str) -> ModelSpec:
    if mt == "mistral3":  # an image-text checkpoint: its language model, on token ids
        return _mistral3_text(cfg, name)
    if mt == "llama4":  # the same for Llama 4's
        text = llama4_text_config(cfg)
        problem = field_problem(text, "llama4_text")
        if problem:
            raise ModelLoadError(f"{name}: text_config: {problem}")
        return spec_from_hf_config(text, name)
    if mt in QWEN_NEXT_IMAGE_TEXT:  # Qwen3.5's image-text checkpoints: the language model
        text = dict(cfg["text_config"])
        text.setdefault("model_type", QWEN_NEXT_IMAGE_TEXT[mt])
        if text["model_type"] != QWEN_NEXT_IMAGE_TEXT[mt]:
            raise ValueError(f"text_config model_type {text['model_type']!r}: a {mt} model's is "
                             f"{QWEN_NEXT_IMAGE_TEXT[mt]!r}")
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return spec_from_hf_config(text, name)
    if mt in GEMMA_TYPES:  # its own reader: a nested text_config, RoPE per layer type
        return gemma_spec(cfg, name)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    common = dict(name=name, vocab_size=cfg["vocab_size"], num_layers=cfg["num_hidden_layers"],
                  hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"],
                  max_positions=cfg.get("max_position_embeddings", 2048),
                  bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
                  pad_token_id=cfg.get("pad_token_id"))
    if mt == "opt":
        if cfg.get("_remove_final_layer_norm") and cfg.get("do_layer_norm_before", True):
            raise ValueError("OPT with _remove_final_layer_norm is not supported")
        proj = cfg.get("word_embed_proj_dim") or cfg["hidden_size"]
        return ModelSpec(family="opt", ffn_size=cfg["ffn_dim"],
                         pre_layer_norm=cfg.get("do_layer_norm_before", True),
                         word_embed_proj_dim=0 if proj == cfg["hidden_size"] else proj, **common)
    if mt in COHERE_TYPES:
        return _cohere_spec(cfg, mt, name, common)
    if mt in NEOX_TYPES:
        return _neox_spec(cfg, mt, name, common)
    if mt in OLMO_TYPES:
        return _olmo_spec(cfg, mt, name, common)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    # GLM's configs turn half of each head unless they say otherwise (transformers' default)
    partial = (cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
               or (0.5 if mt in (*GLM_TYPES, "glm4_moe") else 1.0))
    if mt == "minimax_m2" and cfg.get("rotary_dim") and partial == 1.0:  # its released configs' legacy name
        partial = cfg["rotary_dim"] / (_head_dim(cfg) or cfg["hidden_size"] // cfg["num_attention_heads"])
    if partial != 1.0 and mt not in ("phi3", "glm4_moe", "minimax_m2", *GLM_TYPES, *QWEN_NEXT_TYPES):
        raise ValueError(f"partial_rotary_factor {partial} is not supported for {mt!r} (it is for phi3, glm, glm4, "
                         "glm4_moe and minimax_m2)")
    if mt in MLA_TYPES:
        return _mla_spec(cfg, mt, name, rope, common)
    if mt == "phi3":  # Phi-3's older names for longrope; its pretraining length lives beside rope_scaling
        if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
            rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings", 4096)
    head_dim = _head_dim(cfg)
    rotary = int((head_dim or cfg["hidden_size"] // cfg["num_attention_heads"]) * partial)
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    if mt in HUNYUAN_TYPES and rope.get("rope_type", rope.get("type")) == "dynamic" and rope.get("alpha"):
        # HunYuan's NTK-alpha RoPE: a fixed alpha only stretches the base (transformers' ntk_alpha)
        theta, rope = theta * rope["alpha"] ** (rotary / (rotary - 2)), {}
    scaling = _rope_scaling(rope, name, cfg.get("max_position_embeddings", 0), rotary)
    if mt == "llama4_text":  # chunked and NoPE layers, its own routing and temperature (llama4_config)
        common.update(llama4_fields(cfg))
    if mt in GRANITE_SWA_TYPES:
        common.update(_layer_thetas(cfg, float(theta), scaling))
    if mt in QWEN_NEXT_TYPES:  # linear-attention layers, the gated output, (1 + w) norms (qwen_next_config)
        common.update(qwen_next_fields(cfg))
    if mt == "phimoe":
        scaling = phimoe_rope(rope, scaling)
        common.update(layer_norm=True, lm_head_bias=bool(cfg.get("lm_head_bias", False)))
    return _llama_spec(cfg, mt, head_dim, theta, scaling, dict(common, rotary_dim=rotary * (partial != 1.0)))


ERNIE_TYPES = ("ernie4_5", "ernie4_5_moe")  # ERNIE 4.5: RoPE on interleaved pairs in float32, use_bias
# GLM-4 (glm4: a norm before and after attention and the MLP) and GLM-4-9B-chat-hf (glm: before
# only): gate|up fused, q/k/v biases, RoPE on interleaved pairs of half of each head
GLM_TYPES = ("glm", "glm4")
OLMO_TYPES = ("olmo2", "olmo3")
COHERE_TYPES = ("cohere", "cohere2")
# LayerNorms, biases, a GELU MLP, attention beside the MLP or before it (models/neox.py)
NEOX_TYPES = ("gpt_neox", "phi", "starcoder2")
HUNYUAN_TYPES = ("hunyuan_v1_dense", "hunyuan_v1_moe")  # q/k normalised per head after RoPE; NTK-alpha RoPE
# Granite with sliding layers, attention sinks and a RoPE base per layer (0: none)
GRANITE_SWA_TYPES = ("granite_swa", "granitemoe_swa")
# read as the llama family's, each with what differs from Llama (``_llama_spec``)
LLAMA_TYPES = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "phi3", "granite", "smollm3",
               "exaone4", "ernie4_5", "llama4_text", "internlm3", "seed_oss", "hunyuan_v1_dense", "granite_swa",
               "arcee", "apertus", "qwen3_5_text", *GLM_TYPES, *MOE_TYPES)
SUPPORTED = tuple(sorted({"opt", "mistral3", "llama4", *QWEN_NEXT_IMAGE_TEXT, *LLAMA_TYPES, *OLMO_TYPES,
                          *COHERE_TYPES, *NEOX_TYPES, *GEMMA_TYPES}))


def _mla_spec(cfg: dict[str, Any], mt: str, name: str, rope: dict[str, Any], common: dict[str, Any]) -> ModelSpec:
    """DeepSeek-V3: latent attention (its cache one kv head of kv_lora_rank + qk_rope_head_dim),
    RoPE on qk_rope_head_dim dims (on interleaved pairs with rope_interleave), the softmax scale
    qk_head_dim ** -0.5 times YaRN's mscale_all_dim factor squared, as the reference."""
    r, dr, dn = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
    scaling = _rope_scaling(rope, name, cfg.get("max_position_embeddings", 0), dr)
    m_all = rope.get("mscale_all_dim") if scaling is not None else 0
    scale = mla_softmax_scale(dn + dr, scaling.factor if scaling is not None else 1.0, 0.1 * m_all if m_all else 0.0)
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    return _llama_spec(cfg, mt, r + dr, float(theta), scaling,
                       dict(common, num_kv_heads=1, kv_lora_rank=r, q_lora_rank=cfg.get("q_lora_rank") or 0,
                            qk_nope_dim=dn, qk_rope_dim=dr, v_head_dim=cfg["v_head_dim"], attn_scale=scale,
                            rope_interleaved=bool(cfg.get("rope_interleave", True))))


def _cohere_spec(cfg: dict[str, Any], mt: str, name: str, common: dict[str, Any]) -> ModelSpec:
    """Command R / R+ / Aya (``cohere``) and Command R7B / A (``cohere2``: three sliding layers
    of four with RoPE, the global ones without)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    extra: dict[str, Any] = {}
    if mt == "cohere2":
        types = _layer_types(cfg, 4)
        extra = dict(sliding_window=int(cfg.get("sliding_window") or 0), layer_types=types,
                     nope_layers=tuple(t != "sliding_attention" for t in types))
        if not extra["sliding_window"]:
            raise ValueError("cohere2 without sliding_window: its sliding layers need one")
    return ModelSpec(family="cohere", head_dim_override=_head_dim(cfg), ffn_size=cfg["intermediate_size"],
                     num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                     norm_eps=cfg.get("layer_norm_eps") or 1e-5,
                     rope_theta=float(theta), rope_scaling=_rope_scaling(rope, name, cfg.get("max_position_embeddings", 0)),
                     qk_norm=bool(cfg.get("use_qk_norm")), logit_scale=float(cfg.get("logit_scale") or 1.0),
                     tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                     attention_bias=cfg.get("attention_bias", False), **extra, **common)


def _neox_spec(cfg: dict[str, Any], mt: str, name: str, common: dict[str, Any]) -> ModelSpec:
    """GPT-NeoX (Pythia: two LayerNorms, attention beside the MLP unless use_parallel_residual
    is false, q|k|v fused by head), Phi-1/1.5/2 (one LayerNorm for both, a biased head) and
    StarCoder2 (Llama's sequential layer with LayerNorms, ``use_bias``, a sliding window)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    # GPT-NeoX's own names: rotary_pct (default 0.25) and rotary_emb_base, as transformers reads them
    default_partial = cfg.get("rotary_pct", 0.25) if mt == "gpt_neox" else 0.5 if mt == "phi" else 1.0
    partial = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or default_partial
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or cfg.get("rotary_emb_base") or 10000.0
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = int(head_dim * partial)
    act = cfg.get("hidden_act", {"gpt_neox": "gelu", "phi": "gelu_new"}.get(mt, "gelu_pytorch_tanh"))
    if act not in NEOX_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported for {mt} ({', '.join(NEOX_ACTIVATIONS)} are)")
    if mt == "phi" and cfg.get("qk_layernorm"):
        raise ValueError("phi with qk_layernorm=True is not supported")
    if rotary % 2 or rotary < 2:
        raise ValueError(f"a rotary part of {rotary} dims per head (partial_rotary_factor {partial}): RoPE needs an "
                         "even number of at least 2")
    if _head_dim(cfg):
        raise ValueError(f"head_dim {cfg['head_dim']} other than hidden_size / num_attention_heads is not supported "
                         f"for {mt}")
    bias = {"gpt_neox": cfg.get("attention_bias", True), "phi": True}.get(mt, cfg.get("use_bias", True))
    return ModelSpec(family="neox", ffn_size=cfg["intermediate_size"],
                     num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                     norm_eps=cfg.get("layer_norm_eps") or cfg.get("norm_epsilon") or 1e-5, rope_theta=float(theta),
                     rope_scaling=_rope_scaling(rope, name, cfg.get("max_position_embeddings", 0), rotary),
                     rotary_dim=rotary if rotary != head_dim else 0,
                     tie_word_embeddings=cfg.get("tie_word_embeddings", mt == "starcoder2"),
                     attention_bias=bool(bias), mlp_bias=bool(bias) if mt == "starcoder2" else True,
                     norm_layout="shared" if mt == "phi" else "pre", mlp_activation=act,
                     parallel_residual=mt == "gpt_neox" and cfg.get("use_parallel_residual", True),
                     sliding_window=int(cfg.get("sliding_window") or 0) if mt == "starcoder2" else 0,
                     lm_head_bias=mt == "phi", **common)


def _olmo_spec(cfg: dict[str, Any], mt: str, name: str, common: dict[str, Any]) -> ModelSpec:
    """OLMo 2 and OLMo 3: Llama's layers with the norms on the sublayers' outputs and q/k
    normalised over all heads; OLMo 3 slides on three layers of four (``layer_types``), each
    layer type with its own RoPE (``rope_parameters`` per type, as Gemma 3's)."""
    params = cfg.get("rope_parameters") or {}
    nested = any(k in params for k in ("full_attention", "sliding_attention"))
    glob = dict(params.get("full_attention") or {}) if nested else dict(params or cfg.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    theta = glob.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    window = int(cfg.get("sliding_window") or 0) if mt == "olmo3" else 0
    extra: dict[str, Any] = {}
    if window:
        extra["layer_types"] = _layer_types(cfg, 4)
        if local:
            extra.update(local_rope_theta=float(local.get("rope_theta") or theta),
                         local_rope_scaling=_rope_scaling(local, name, cfg.get("max_position_embeddings", 0)))
    return ModelSpec(family="llama", ffn_size=cfg["intermediate_size"],
                     num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                     head_dim_override=_head_dim(cfg), norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(theta),
                     rope_scaling=_rope_scaling(glob, name, cfg.get("max_position_embeddings", 0)),
                     sliding_window=window, qk_norm=True, qk_norm_whole=True, norm_layout="post", norm_weight_fp32=True,
                     tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                     attention_bias=cfg.get("attention_bias", False), **extra, **common)


def _llama_spec(cfg: dict[str, Any], mt: str, head_dim: int, theta: float, scaling: RopeScaling | None,
                common: dict[str, Any]) -> ModelSpec:
    # Qwen3.5-MoE's layers are all sparse: it has no dense width (the experts' stands in)
    ffn = cfg["moe_intermediate_size"] if mt == "qwen3_5_moe_text" else cfg["intermediate_size"]
    kw = dict(family="llama", ffn_size=ffn, **moe_fields(cfg, mt),
                     num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                     head_dim_override=head_dim, norm_eps=cfg.get("rms_norm_eps", 1e-6),
                     rope_theta=float(theta), rope_scaling=scaling, **_windows(cfg, mt),
                     qk_norm=mt in ("qwen3", "qwen3_moe", "exaone4", "exaone_moe", "minimax_m2", "olmoe", "dots1",
                                    "apertus", *HUNYUAN_TYPES)
                     or (mt == "glm4_moe" and bool(cfg.get("use_qk_norm"))),
                     qk_norm_after_rope=mt in HUNYUAN_TYPES,
                     # Arcee AFM: relu squared, Apertus: xIELU, both ungated (their pinned hidden_act)
                     mlp_activation={"arcee": "relu2", "apertus": "xielu"}.get(mt, "swiglu"),
                     fused_proj=mt == "phi3",
                     fused_mlp=mt in GLM_TYPES, rope_interleaved=mt in (*GLM_TYPES, *ERNIE_TYPES),
                     rope_fp32=mt in ERNIE_TYPES,
                     norm_layout={"exaone4": "post", "glm4": "sandwich"}.get(mt, "pre"),
                     tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                     **_biases(cfg, mt), **_granite_fields(cfg, mt), **_nope(cfg, mt),
                     **_temperature(cfg, mt), **_attention_extras(mt))
    return ModelSpec(**{**kw, **common})  # common: the shared fields, and what a caller's reader decided (MLA)


def _biases(cfg: dict[str, Any], mt: str) -> dict[str, Any]:
    """Where the projections have biases: on q, k and v only (``qkv_bias``: Qwen2's always,
    GLM's by ``attention_bias``, Seed-OSS's unless ``attention_out_bias`` puts one on o too),
    on q, k, v and o (``attention_bias``; ERNIE's ``use_bias``), on the MLP."""
    bias = bool(cfg.get("attention_bias", False))
    if mt == "seed_oss":
        qkv, out = bool(cfg.get("attention_bias", True)), bool(cfg.get("attention_out_bias", False))
        if out and not qkv:
            raise ValueError("seed_oss with attention_out_bias but no attention_bias (a bias on o alone) is not "
                             "supported")
        return dict(qkv_bias=qkv and not out, attention_bias=qkv and out, mlp_bias=bool(cfg.get("mlp_bias", False)))
    ernie = mt in ERNIE_TYPES and bool(cfg.get("use_bias"))
    return dict(qkv_bias=mt == "qwen2" or (mt == "qwen2_moe" and cfg.get("qkv_bias", True))
                or (mt in GLM_TYPES and bool(cfg.get("attention_bias", True))) or (mt == "glm4_moe" and bias),
                attention_bias=(bias and mt not in (*GLM_TYPES, "glm4_moe")) or ernie,
                mlp_bias=bool(cfg.get("mlp_bias", False)) or ernie)


def _attention_extras(mt: str) -> dict[str, Any]:
    """gpt-oss's attention sinks, and its RMSNorm multiplying its weight in float32 (transformers
    keeps the norms' weights in float32 and casts after the product); MiniMax-M2's q/k norms."""
    if mt in ("minimax_m2", "olmoe"):  # q and k normalised over all heads (as OLMo, its weights in the model's dtype)
        return dict(qk_norm_whole=True)
    if mt in GRANITE_SWA_TYPES:  # sinks: a logit per head in each softmax's denominator, as gpt-oss's
        return dict(attn_sinks=True)
    return dict(attn_sinks=True, norm_weight_fp32=True) if mt == "gpt_oss" else {}


def _nope(cfg: dict[str, Any], mt: str) -> dict[str, Any]:
    """Layers without RoPE: SmolLM3's ``no_rope_layers`` (1: the layer rotates), by default
    every ``no_rope_layer_interval``-th layer (4); EXAONE 4's global layers, where it has
    sliding ones."""
    if mt in ("exaone4", "exaone_moe"):
        windows = _windows(cfg, mt)
        return {"nope_layers": tuple(t == "full_attention" for t in windows["layer_types"])} \
            if windows["sliding_window"] else {}
    if mt != "smollm3":
        return {}
    rotates = cfg.get("no_rope_layers")
    return {"nope_layers": tuple(not r for r in rotates) if rotates else
            every_nth(cfg["num_hidden_layers"], cfg.get("no_rope_layer_interval") or 4)}


def _mistral3_text(cfg: dict[str, Any], name: str) -> ModelSpec:
    """Mistral Small 3.x / Magistral / Ministral 3 image-text checkpoints (``mistral3``): the
    language model of ``text_config``, run on token ids (no images), with the checkpoint's
    own head tying (transformers ties by the top level's ``tie_word_embeddings``, default
    true) and token ids where it gives them."""
    text = dict(cfg.get("text_config") or {})
    tmt = text.setdefault("model_type", "mistral")
    if tmt not in ("mistral", "ministral", "ministral3"):
        raise ModelLoadError(f"{name}: mistral3 text_config of model_type {tmt!r}: supported are mistral, "
                             "ministral, ministral3")
    problem = field_problem(text, tmt)
    if problem:
        raise ModelLoadError(f"{name}: text_config: {problem}")
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
    text.update({k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None})
    return spec_from_hf_config(text, name)


def _head_dim(cfg: dict[str, Any]) -> int:
    """``head_dim_override``: the config's head size where it is not hidden / heads, else 0."""
    head_dim = cfg.get("head_dim") or 0
    return 0 if head_dim == cfg["hidden_size"] // cfg["num_attention_heads"] else head_dim


def _layer_types(cfg: dict[str, Any], every: int) -> tuple[str, ...]:
    """The config's ``layer_types``, or every ``sliding_window_pattern``-th layer global (by
    default every ``every``-th; a pattern written as letters, EXAONE 4's "LLLG", marks the
    global layers G)."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    pattern = cfg.get("sliding_window_pattern") or every
    if isinstance(pattern, str):
        return tuple("full_attention" if pattern[i % len(pattern)] == "G" else "sliding_attention"
                     for i in range(cfg["num_hidden_layers"]))
    return alternating(cfg["num_hidden_layers"], int(pattern))


def _temperature(cfg: dict[str, Any], mt: str) -> dict[str, Any]:
    """Ministral 3's attention temperature (Llama 4's), from its rope parameters."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = rope.get("llama_4_scaling_beta")
    if mt != "ministral3" or not beta:
        return {}
    return {"attn_temp_beta": float(beta), "attn_temp_len": int(rope["original_max_position_embeddings"])}


def _layer_thetas(cfg: dict[str, Any], theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """Granite SWA's ``layer_rope_theta`` (a RoPE base per layer, 0: no RoPE) as the spec's:
    the layers without RoPE, one base for the global layers and one for the sliding ones
    (``local_rope_theta``, scaled alike); more bases than that are refused."""
    n = cfg["num_hidden_layers"]
    thetas = cfg.get("layer_rope_theta") or [theta] * n
    types = _windows(cfg, "granite_swa").get("layer_types") or ("full_attention",) * n
    if len(thetas) != n:
        raise ValueError(f"layer_rope_theta has {len(thetas)} entries for {n} layers")
    full = {float(t) for t, k in zip(thetas, types) if t and k == "full_attention"}
    local = {float(t) for t, k in zip(thetas, types) if t and k == "sliding_attention"}
    if len(full) > 1 or len(local) > 1:
        raise ValueError(f"layer_rope_theta {sorted(full | local)}: one base for the global layers and one for the "
                         "sliding ones are supported")
    base = next(iter(full or local), theta)
    out: dict[str, Any] = dict(rope_theta=base, nope_layers=tuple(not t for t in thetas))
    if local and local != {base}:
        out.update(local_rope_theta=next(iter(local)), local_rope_scaling=scaling)
    return out


def _granite_fields(cfg: dict[str, Any], mt: str) -> dict[str, Any]:
    """Granite's four multipliers (the softmax scale is its attention_multiplier, not head_dim ** -0.5)."""
    if mt not in ("granite", "granite_swa", *GRANITE_MOE_TYPES):
        return {}
    return dict(embed_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                logits_divisor=float(cfg.get("logits_scaling", 1.0)),
                attn_scale=float(cfg.get("attention_multiplier", 1.0)))


def _windows(cfg: dict[str, Any], mt: str) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as the family's config means them: Mistral, Mixtral
    and Phi-3 slide on every layer; Qwen2/3 and their MoE only with ``use_sliding_window``, on
    the layers its ``layer_types`` name (by default Qwen2/3's from ``max_window_layers`` on,
    Qwen2-MoE's odd-numbered ones below it, every Qwen3-MoE layer)."""
    window = int(cfg.get("sliding_window") or 0)
    if mt == "smollm3":  # with use_sliding_window, by default on the layers without RoPE
        if not cfg.get("use_sliding_window") or not window:
            return {"sliding_window": 0}
        nope = _nope(cfg, mt)["nope_layers"]
        default = ["sliding_attention" if x else "full_attention" for x in nope]
        return {"sliding_window": window, "layer_types": tuple(cfg.get("layer_types") or default)}
    if mt in ("exaone4", "exaone_moe"):  # three sliding layers of four by default (sliding_window_pattern)
        if not window:
            return {"sliding_window": 0}
        return {"sliding_window": window, "layer_types": _layer_types(cfg, 4)}
    if mt in GRANITE_SWA_TYPES:  # layer_types name the sliding layers; by default all but every fourth from 0
        n = cfg["num_hidden_layers"]
        types = tuple(cfg.get("layer_types") or ["full_attention" if i % 4 == 0 else "sliding_attention"
                                                 for i in range(n)])
        return {"sliding_window": window, "layer_types": types} if window else {"sliding_window": 0}
    if mt == "gpt_oss":  # layer_types name the sliding layers; by default the even-numbered ones
        if not window:
            return {"sliding_window": 0}
        return {"sliding_window": window, "layer_types": tuple(cfg.get("layer_types") or _layer_types(cfg, 2))}
    if mt == "ministral":  # layer_types name the sliding layers; by default all of them, given a window
        if not window:
            return {"sliding_window": 0}
        return {"sliding_window": window,
                "layer_types": tuple(cfg.get("layer_types") or ["sliding_attention"] * cfg["num_hidden_layers"])}
    if mt == "dots1":  # Qwen3's attention: the layers its layer_types name, by default from max_window_layers on
        n = cfg["num_hidden_layers"]
        types = tuple(cfg.get("layer_types") or ["sliding_attention" if window and i >= cfg.get("max_window_layers", n)
                                                 else "full_attention" for i in range(n)])
        return {"sliding_window": window, "layer_types": types} if window and "sliding_attention" in types else \
            {"sliding_window": 0}
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not cfg.get("use_sliding_window") or not window:
            return {"sliding_window": 0}
        n = cfg["num_hidden_layers"]
        if mt == "qwen3_moe":  # every layer slides (its attention reads sliding_window alone)
            return {"sliding_window": window}
        if mt == "qwen2_moe":  # the odd-numbered layers below max_window_layers, by default
            default = ["sliding_attention" if (i + 1) % 2 and i < cfg.get("max_window_layers", n)
                       else "full_attention" for i in range(n)]
        else:
            default = ["sliding_attention" if i >= cfg.get("max_window_layers", n) else "full_attention"
                       for i in range(n)]
        return {"sliding_window": window, "layer_types": tuple(cfg.get("layer_types") or default)}
    return {"sliding_window": window if mt in ("mistral", "ministral3", "phi3", "mixtral", "phimoe") else 0}
