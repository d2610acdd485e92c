"""Every field of a supported Hugging Face config, accounted for: nothing that changes the
output is ignored.

Each field a family's config class has is either **used** (the loader turns it into the
``ModelSpec``), **inert** (it cannot change greedy output in inference: dropout, initialisation,
caching flags, bookkeeping), or **pinned**: the engine computes one value of it, and a config
with another is refused in one line naming the field, the value and the model type.
``tests/test_llama_variants.py`` walks the config classes of transformers and checks that this
table covers every field they have.
"""
from __future__ import annotations

from typing import Any

from .bnb_quant import bnb_problem
from .float_quant import fp8_problem
from .int_quant import int_quant_problem

# bookkeeping every config has (transformers' PretrainedConfig)
_BASE = {"_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
         "is_encoder_decoder", "label2id", "model_type", "output_attentions", "output_hidden_states",
         "problem_type", "return_dict", "transformers_version"}
_INERT = {"attention_dropout", "dropout", "embd_pdrop", "resid_pdrop", "layerdrop", "initializer_range",
          "init_std", "use_cache", "pretraining_tp"}
_TOKENS = {"bos_token_id", "eos_token_id", "pad_token_id", "vocab_size"}
# the shape and rotary fields of a decoder with RoPE, whatever else its family reads
_ROPE_DECODER = _TOKENS | {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "max_position_embeddings", "rope_parameters", "rope_scaling", "rope_theta",
                           "tie_word_embeddings"}
_LLAMA_USED = _ROPE_DECODER | {"num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias", "mlp_bias",
                               "partial_rotary_factor"}

_GEMMA_USED = _ROPE_DECODER | {"num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias",
                               "query_pre_attn_scalar", "sliding_window", "layer_types", "final_logit_softcapping"}

_LINEAR = {"layer_types", "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
           "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads"}

USED: dict[str, set[str]] = {
    "opt": _TOKENS | {"hidden_size", "ffn_dim", "num_hidden_layers", "num_attention_heads",
                      "max_position_embeddings", "do_layer_norm_before", "word_embed_proj_dim",
                      "_remove_final_layer_norm", "tie_word_embeddings"},
    "llama": _LLAMA_USED,
    "mistral": _LLAMA_USED | {"sliding_window"},
    "ministral": _LLAMA_USED | {"sliding_window", "layer_types"},
    "ministral3": _LLAMA_USED | {"sliding_window"},
    # the image-text model: its text_config is read as a mistral / ministral / ministral3 config
    "mistral3": {"text_config", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"},
    "qwen2": _LLAMA_USED | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen3": _LLAMA_USED | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "phi3": _LLAMA_USED | {"sliding_window", "original_max_position_embeddings"},
    "cohere": _ROPE_DECODER | {"num_key_value_heads", "layer_norm_eps", "attention_bias", "use_qk_norm",
                               "logit_scale"},
    "cohere2": _ROPE_DECODER | {"num_key_value_heads", "head_dim", "layer_norm_eps", "attention_bias", "logit_scale",
                                "sliding_window", "layer_types", "sliding_window_pattern"},
    "glm": _LLAMA_USED,
    "glm4": _LLAMA_USED,
    # the NeoX family (models/neox.py): GPT-NeoX's own names for its RoPE, and Phi's
    "gpt_neox": _ROPE_DECODER | {"layer_norm_eps", "rotary_pct", "rotary_emb_base", "partial_rotary_factor",
                                 "use_parallel_residual", "attention_bias", "hidden_act"},
    "phi": _ROPE_DECODER | {"num_key_value_heads", "layer_norm_eps", "partial_rotary_factor", "hidden_act",
                            "qk_layernorm"},
    "starcoder2": _ROPE_DECODER | {"num_key_value_heads", "head_dim", "norm_epsilon", "hidden_act", "sliding_window",
                                   "use_bias"},
    "exaone4": _LLAMA_USED | {"sliding_window", "sliding_window_pattern", "layer_types"},
    "olmo2": _LLAMA_USED,
    "olmo3": _LLAMA_USED | {"sliding_window", "layer_types"},
    "smollm3": _LLAMA_USED | {"use_sliding_window", "sliding_window", "no_rope_layers", "no_rope_layer_interval",
                              "layer_types"},
    "granite": _LLAMA_USED | {"embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier"},
    "granite_swa": _LLAMA_USED | {"embedding_multiplier", "logits_scaling", "residual_multiplier", "attention_multiplier",
                                  "sliding_window", "layer_types", "layer_rope_theta"},
    "granitemoe_swa": _LLAMA_USED | {"embedding_multiplier", "logits_scaling", "residual_multiplier",
                                     "attention_multiplier", "num_local_experts", "num_experts_per_tok",
                                     "shared_intermediate_size", "sliding_window", "layer_types", "layer_rope_theta"},
    "mixtral": _LLAMA_USED | {"sliding_window", "num_local_experts", "num_experts_per_tok"},
    "qwen2_moe": _LLAMA_USED | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
                                "qkv_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                "mlp_only_layers"},
    "qwen3_moe": _LLAMA_USED | {"use_sliding_window", "sliding_window", "num_experts", "num_local_experts",
                                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                "decoder_sparse_step", "mlp_only_layers"},
    # Qwen3-Next / Qwen3.5: linear-attention layers beside full ones (qwen_next_config.py)
    "qwen3_next": _LLAMA_USED | _LINEAR | {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                           "shared_expert_intermediate_size", "norm_topk_prob",
                                           "decoder_sparse_step", "mlp_only_layers"},
    "qwen3_5_text": _LLAMA_USED | _LINEAR,
    "qwen3_5_moe_text": _LLAMA_USED | _LINEAR | {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "shared_expert_intermediate_size"},
    # Phi-3.5-MoE: LayerNorms, biases on q, k, v, o and the head, sparsemixer routing
    "phimoe": _LLAMA_USED | {"sliding_window", "num_local_experts", "num_experts_per_tok", "router_jitter_noise",
                             "lm_head_bias"},
    # the image-text models: their text_config is read as the text model's config
    "qwen3_5": {"text_config", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"},
    "qwen3_5_moe": {"text_config", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"},
    "glm4_moe": _LLAMA_USED | {"use_qk_norm", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
                               "n_routed_experts", "num_local_experts", "routed_scaling_factor", "n_group",
                               "topk_group", "first_k_dense_replace", "norm_topk_prob"},
    "minimax_m2": _LLAMA_USED | {"num_local_experts", "num_experts_per_tok"},
    "olmoe": _LLAMA_USED | {"num_experts", "num_experts_per_tok", "norm_topk_prob"},
    "deepseek_v3": _LLAMA_USED | {"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                  "qk_head_dim", "rope_interleave", "moe_intermediate_size", "num_experts_per_tok",
                                  "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group",
                                  "topk_group", "first_k_dense_replace", "norm_topk_prob"},
    "deepseek_v2": _LLAMA_USED | {"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                  "qk_head_dim", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
                                  "n_routed_experts", "routed_scaling_factor", "n_group", "topk_group",
                                  "first_k_dense_replace", "topk_method"},
    "internlm3": _LLAMA_USED,
    "arcee": _LLAMA_USED, "apertus": _LLAMA_USED,
    "seed_oss": _LLAMA_USED | {"attention_out_bias"},
    "hunyuan_v1_dense": _LLAMA_USED,
    "hunyuan_v1_moe": _LLAMA_USED | {"num_experts", "moe_topk"},
    "dots1": _LLAMA_USED | {"sliding_window", "max_window_layers", "layer_types", "moe_intermediate_size",
                            "n_shared_experts", "n_routed_experts", "n_group", "topk_group", "num_experts_per_tok",
                            "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor"},
    "exaone_moe": _LLAMA_USED | {"sliding_window", "sliding_window_pattern", "layer_types", "mlp_layer_types",
                                 "first_k_dense_replace", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                 "num_shared_experts", "norm_topk_prob", "routed_scaling_factor", "n_group",
                                 "topk_group"},
    "granitemoe": _LLAMA_USED | {"embedding_multiplier", "logits_scaling", "residual_multiplier",
                                 "attention_multiplier", "num_local_experts", "num_experts_per_tok"},
    "granitemoeshared": _LLAMA_USED | {"embedding_multiplier", "logits_scaling", "residual_multiplier",
                                       "attention_multiplier", "num_local_experts", "num_experts_per_tok",
                                       "shared_intermediate_size"},
    "ernie4_5": _LLAMA_USED | {"use_bias"},
    "llama4_text": _LLAMA_USED | {"intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers",
                                  "interleave_moe_layer_step", "use_qk_norm", "no_rope_layers", "no_rope_layer_interval",
                                  "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale",
                                  "attn_scale"},
    # the image-text model: its text_config is read as a llama4_text config (models/llama4_config.py)
    "llama4": {"text_config", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"},
    "ernie4_5_moe": _LLAMA_USED | {"moe_intermediate_size", "moe_k", "moe_num_experts", "moe_num_shared_experts",
                                   "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval",
                                   "moe_norm_min"},
    "gpt_oss": _LLAMA_USED | {"num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                              "swiglu_alpha", "swiglu_limit"},
    # hidden_act: "gelu" (legacy) or "gelu_pytorch_tanh", both the tanh GELU
    "gemma": _ROPE_DECODER | {"num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias", "hidden_act"},
    "gemma2": _GEMMA_USED | {"attn_logit_softcapping"},
    "gemma3_text": _GEMMA_USED | {"rope_local_base_freq", "sliding_window_pattern"},
    # the image-text model: its text_config is read as a gemma3_text config (models/gemma_config.py)
    "gemma3": {"text_config", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"},
}
# the router's training-time terms (auxiliary loss, jitter noise, returning its logits) change
# nothing in inference
_ROUTER_TRAINING = {"router_aux_loss_coef", "output_router_logits", "router_jitter_noise"}
# inert for one model type only (field -> why, in the comments)
INERT: dict[str, set[str]] = {
    "mixtral": _ROUTER_TRAINING, "qwen2_moe": _ROUTER_TRAINING, "qwen3_moe": _ROUTER_TRAINING,
    # GLM-4.5's multi-token-prediction layers (stored after the last layer) serve speculative
    # decoding; transformers' generation never runs them
    "glm4_moe": _ROUTER_TRAINING | {"num_nextn_predict_layers", "num_mtp_layers"},
    "deepseek_v3": _ROUTER_TRAINING | {"num_nextn_predict_layers"},
    # its router never reads norm_topk_prob (the weights are not renormalised, whatever it says)
    "deepseek_v2": _ROUTER_TRAINING | {"norm_topk_prob"},
    "gpt_oss": _ROUTER_TRAINING, "minimax_m2": _ROUTER_TRAINING, "olmoe": _ROUTER_TRAINING,
    "ernie4_5_moe": _ROUTER_TRAINING, "granitemoe": _ROUTER_TRAINING, "granitemoeshared": _ROUTER_TRAINING,
    "llama4_text": _ROUTER_TRAINING, "dots1": _ROUTER_TRAINING, "granitemoe_swa": _ROUTER_TRAINING,
    "exaone_moe": _ROUTER_TRAINING,
    "seed_oss": {"residual_dropout"},  # dropout: nothing in inference
    # dropouts, a classification head's, and the encoder-decoder flag (GPT-NeoX is a decoder)
    "gpt_neox": {"hidden_dropout", "classifier_dropout", "is_decoder"},
    "starcoder2": {"residual_dropout", "embedding_dropout"},
    # HunYuan's end-of-document and separator ids: pretraining's markers, not generation's stop
    # (its eos_token_id is)
    "hunyuan_v1_dense": {"eod_token_id"}, "hunyuan_v1_moe": _ROUTER_TRAINING | {"eod_token_id", "sep_token_id"},
    "llama4": {"vision_config", "boi_token_index", "eoi_token_index", "image_token_index"},
    # cache_implementation: transformers' cache class ("hybrid"), not the math; hidden_act: older
    # configs carry it beside hidden_activation, which is the one transformers 5 reads
    "gemma2": {"cache_implementation", "hidden_act"},
    # _sliding_window_pattern: written by transformers beside the layer_types it computed, never
    # read back to compute them
    "gemma3_text": {"cache_implementation", "hidden_act", "_sliding_window_pattern"},
    # the vision tower and the image tokens' ids: unused by prompts of token ids
    "mistral3": {"vision_config", "image_token_index", "projector_hidden_act", "vision_feature_layer",
                 "multimodal_projector_bias", "spatial_merge_size"},
    "qwen3_next": _ROUTER_TRAINING, "qwen3_5_moe_text": _ROUTER_TRAINING,
    "phimoe": {"router_aux_loss_coef", "output_router_logits", "input_jitter_noise"},  # (input jitter: training only)
    **{mt: {"vision_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}
       for mt in ("qwen3_5", "qwen3_5_moe")},
    "gemma3": {"vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index",
               "cache_implementation"},
}
# field -> the one value computed (a config without the field, or with null, means that value too)
PINNED: dict[str, dict[str, Any]] = {
    "opt": {"activation_function": "relu", "enable_bias": True, "layer_norm_elementwise_affine": True},
    "mistral3": {}, "gpt_neox": {}, "phi": {}, "starcoder2": {},
    **{mt: {"hidden_act": "silu"} for mt in ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "phi3",
                                             "granite", "smollm3", "exaone4", "glm", "glm4", "olmo2", "olmo3", "cohere",
                                             "cohere2",
                                             "mixtral",
                                             "qwen2_moe", "qwen3_moe", "glm4_moe", "gpt_oss", "minimax_m2",
                                             "granitemoe", "granitemoeshared")},
    "olmoe": {"hidden_act": "silu", "clip_qkv": None},
    "deepseek_v3": {"hidden_act": "silu", "attention_bias": False},
    "deepseek_v2": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "ernie4_5": {"hidden_act": "silu"}, "llama4_text": {"hidden_act": "silu"}, "llama4": {},
    **{mt: {"hidden_act": "silu"} for mt in ("internlm3", "seed_oss", "hunyuan_v1_dense", "hunyuan_v1_moe", "dots1",
                                             "granite_swa", "granitemoe_swa", "exaone_moe")},
    **{mt: {"hidden_act": "silu"} for mt in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "phimoe")},
    "qwen3_5": {}, "qwen3_5_moe": {},
    "arcee": {"hidden_act": "relu2"}, "apertus": {"hidden_act": "xielu"},
    # use_bias would put biases on the shared experts too, which no released checkpoint has
    "ernie4_5_moe": {"hidden_act": "silu", "use_bias": False},  # clip_qkv: q, k, v clamped (no released OLMoE sets it)
    "gemma": {"use_bidirectional_attention": False},
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": False},
    # Gemma 3's attention never soft-caps in transformers, whatever this field says
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "use_bidirectional_attention": False,
                    "attn_logit_softcapping": None},
    "gemma3": {},
}


def known_fields(model_type: str) -> set[str]:
    """The fields of ``model_type`` this table accounts for."""
    return _BASE | _INERT | INERT.get(model_type, set()) | USED[model_type] | set(PINNED[model_type])


def field_problem(cfg: dict[str, Any], model_type: str) -> str | None:
    """What in ``cfg`` the engine does not compute (a pinned field with another value, a
    quantized checkpoint it would misread), in words; None: nothing."""
    for field, value in PINNED[model_type].items():
        if cfg.get(field) is not None and cfg[field] != value:
            return f"{model_type} with {field}={cfg[field]!r} is not supported (only {value!r})"
    q = cfg.get("quantization_config")
    if q:
        method = q.get("quant_method", "?")
        if method in ("fp8", "fbgemm_fp8"):  # FP8 weights: expanded at load (float_quant.py)
            problem = fp8_problem(q)
        elif method == "mxfp4" and model_type == "gpt_oss":
            return None  # gpt-oss's experts as OpenAI ships them: expanded at load
        elif method in ("gptq", "awq", "compressed-tensors"):  # integer codes per group: expanded at load (int_quant.py)
            problem = int_quant_problem(q)
        elif method == "bitsandbytes":  # NF4/FP4 and LLM.int8() weights: expanded at load (bnb_quant.py)
            problem = bnb_problem(q)
        else:
            problem = (f"a {method!r}-quantized checkpoint is not supported ('fp8' and 'fbgemm_fp8', 'gptq', 'awq', "
                       "'compressed-tensors' int and FP8 weights, 'bitsandbytes' and gpt-oss's 'mxfp4' are)")
        return None if problem is None else f"{problem}: use the full-precision weights or a .gguf file"
    return None
