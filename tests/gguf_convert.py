"""A small Hugging Face -> GGUF writer for the tests, written as llama.cpp's converter writes
the families the engine reads from GGUF: its architecture names, metadata keys and tensor
names; q/k rows interleaved for its ``llama`` architecture only (the others rotate halves);
Phi-3's fused ``qkv_proj``/``gate_up_proj`` kept fused (``attn_qkv``, ``ffn_up``); GPT-NeoX's
``query_key_value`` (interleaved by head) reordered to all heads' q, k, v (``attn_qkv``); Llama 3.1's
RoPE scaling as the per-frequency divisors ``rope_freqs``, YaRN as its keys; Gemma's norm weights as 1 + w, with
Gemma 2's and Gemma 3's own keys (and none for what they do not carry: the attention scale,
the sliding pattern, Gemma 2's RoPE base); StarCoder2's generic keys (no window). Tensors are float32, or Q8_0 /
Q4_0 for the matrices whose rows split into 32-element blocks (1-D tensors stay float32, as
llama.cpp keeps them). The tokenizer is the bundled SmolLM2 file's (its ``tokenizer.*``
metadata, copied), so a model written here needs its vocabulary of 49152.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCH = {"gemma": "gemma", "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
        "qwen3_moe": "qwen3moe", "granite": "granite", "smollm3": "smollm3",
        "olmo2": "olmo2", "olmo3": "olmo2", "cohere": "command-r", "cohere2": "cohere2", "glm4": "glm4",
        "glm4_moe": "glm4moe", "exaone4": "exaone4", "gpt_oss": "gpt-oss", "minimax_m2": "minimax-m2",
        "olmoe": "olmoe", "deepseek_v3": "deepseek2",
        "deepseek_v2": "deepseek2", "llama4_text": "llama4", "seed_oss": "seed_oss", "hunyuan_v1_dense": "hunyuan-dense",
        "hunyuan_v1_moe": "hunyuan-moe", "dots1": "dots1", "arcee": "arcee", "qwen3_next": "qwen3next",
        "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "ernie4_5": "ernie4_5",
        "ernie4_5_moe": "ernie4_5-moe", "apertus": "apertus", "exaone_moe": "exaone-moe", "gpt_neox": "gptneox",
        "phi": "phi2", "starcoder2": "starcoder2"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Gemma's four norms a layer: the one after attention is post_attention_norm there
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


# GLM-4's four norms: post_self_attn_layernorm after attention, post_attention_layernorm before
# the MLP (ffn_norm), post_mlp_layernorm after it; GLM-4.5 names its norm before the MLP
# post_attention_norm (by the HF name), and its shared experts in the plural
_GLM4_LAYER = {**_LAYER, "post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm"}
_GLM4MOE_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                  "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                  "mlp.shared_experts.down_proj": "ffn_down_shexp"}
# gpt-oss: its sinks, its router (with a bias), its norm before the MLP as GLM-4.5's
_GPT_OSS_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks",
                  "mlp.router": "ffn_gate_inp"}
# DeepSeek-V3 (deepseek2): the latent attention's projections and norms, the shared experts
_DEEPSEEK2_LAYER = {**_LAYER, "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
                    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
                    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                    "mlp.shared_experts.down_proj": "ffn_down_shexp"}
# Llama 4: its MLPs under feed_forward (the router, the shared expert, a dense layer's)
_LLAMA4_LAYER = {**_LAYER, "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
                 "feed_forward.down_proj": "ffn_down", "feed_forward.router": "ffn_gate_inp",
                 "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
                 "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
                 "feed_forward.shared_expert.down_proj": "ffn_down_shexp"}
# HunYuan: its q/k norms, Hunyuan-A13B's router (gate.wg) and shared MLP; Seed-OSS: its norm
# before the MLP by the HF name; dots.llm1 and ERNIE 4.5 MoE: their shared experts in the plural
_HUNYUAN_LAYER = {**_LAYER, "self_attn.query_layernorm": "attn_q_norm", "self_attn.key_layernorm": "attn_k_norm",
                  "mlp.gate.wg": "ffn_gate_inp", "mlp.shared_mlp.gate_proj": "ffn_gate_shexp",
                  "mlp.shared_mlp.up_proj": "ffn_up_shexp", "mlp.shared_mlp.down_proj": "ffn_down_shexp"}
_SEED_OSS_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm"}
# Apertus: its norms by their own HF names, as llama's attn_norm and ffn_norm
_APERTUS_LAYER = {**_LAYER, "attention_layernorm": "attn_norm", "feedforward_layernorm": "ffn_norm"}
# Phi-1/1.5/2 (phi2): the output projection and the MLP by their HF names; GPT-NeoX (gptneox): its
# own names, q|k|v fused (attn_qkv, reordered by write_gguf as GPTNeoXModel.modify_tensors does)
_PHI2_LAYER = {**_LAYER, "self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}
_GPTNEOX_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
                  "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
# StarCoder2 (starcoder2): Llama's names for attention and the norms, its MLP's c_fc and c_proj
# (tensor_mapping.py's starcoder2 entries)
_STARCODER2_LAYER = {**_LAYER, "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_DOTS1_LAYER = {**_LAYER, "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                "mlp.shared_experts.down_proj": "ffn_down_shexp"}
# Qwen3-Next: its norm before the MLP by the HF name; the linear layers' tensors (write_gguf
# splits in_proj_qkvz into attn_qkv and attn_gate, as Qwen3NextModel's converter does)
_QWEN3NEXT_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "linear_attn.in_proj_ba": "ssm_ba",
                    "linear_attn.conv1d": "ssm_conv1d", "linear_attn.dt_proj": "ssm_dt", "linear_attn.norm": "ssm_norm",
                    "linear_attn.out_proj": "ssm_out", "linear_attn.in_proj_qkv": "attn_qkv",
                    "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
                    "linear_attn.in_proj_a": "ssm_alpha"}
QWEN_NEXT = ("qwen3next", "qwen35", "qwen35moe")
_TABLES = {"qwen3next": _QWEN3NEXT_LAYER, "qwen35": _QWEN3NEXT_LAYER, "qwen35moe": _QWEN3NEXT_LAYER,
           "gemma2": _GEMMA_LAYER, "gemma3": _GEMMA_LAYER, "olmo2": _GEMMA_LAYER, "exaone4": _GEMMA_LAYER,
           "glm4": _GLM4_LAYER, "glm4moe": _GLM4MOE_LAYER, "gpt-oss": _GPT_OSS_LAYER, "deepseek2": _DEEPSEEK2_LAYER,
           "llama4": _LLAMA4_LAYER, "hunyuan-dense": _HUNYUAN_LAYER, "hunyuan-moe": _HUNYUAN_LAYER,
           "seed_oss": _SEED_OSS_LAYER, "dots1": _DOTS1_LAYER, "ernie4_5-moe": _DOTS1_LAYER, "apertus": _APERTUS_LAYER,
           "exaone-moe": _DOTS1_LAYER, "phi2": _PHI2_LAYER, "gptneox": _GPTNEOX_LAYER,
           "starcoder2": _STARCODER2_LAYER}


# a sparse layer: the router, the shared expert (Qwen2-MoE), and every expert's matrices
# stacked into one 3-D tensor each (experts x rows x cols), as llama.cpp's converter writes them
_MOE = {"block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps", "gate_proj": "ffn_gate_exps",
           "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


NEXTN = 1  # GLM-4.5 files: one multi-token-prediction block after the last layer, as published


def _nextn(cfg: dict[str, Any], arch: str) -> int:
    """The multi-token-prediction blocks a file holds after the last layer: GLM-4.5's one;
    K-EXAONE's ``num_nextn_predict_layers`` (ExaoneMoEModel), none where the config has none."""
    return NEXTN if arch == "glm4moe" else (cfg.get("num_nextn_predict_layers") or 0) if arch == "exaone-moe" else 0


def gguf_name(hf: str, arch: str = "llama") -> str | None:
    """llama.cpp's name for an HF tensor name of architecture ``arch``."""
    if hf in ("model.embed_tokens.weight", "gpt_neox.embed_in.weight"):
        return "token_embd.weight"
    if hf in ("model.norm.weight", "model.norm.bias"):  # StarCoder2's final LayerNorm has a bias
        return "output_norm." + hf.rsplit(".", 1)[1]
    if hf.startswith(("model.final_layernorm.", "gpt_neox.final_layer_norm.")):  # Phi's, GPT-NeoX's (with a bias)
        return "output_norm." + hf.rsplit(".", 1)[1]
    if hf in ("lm_head.weight", "lm_head.bias", "embed_out.weight"):  # Phi's head has a bias
        return "output." + hf.rsplit(".", 1)[1]
    parts = hf.split(".")
    if parts[:2] in (["model", "layers"], ["gpt_neox", "layers"]):
        module, suffix = ".".join(parts[3:-1]), parts[-1]
        if suffix == "e_score_correction_bias":  # GLM-4.5's choice bias; ERNIE's (1 x experts, kept 2-D)
            return f"blk.{parts[2]}.exp_probs_b.bias"
        if suffix == "sinks":  # gpt-oss: the converter names it sinks.weight
            module, suffix = f"{module}.sinks", "weight"
        if module in _MOE:
            return f"blk.{parts[2]}.{_MOE[module]}.{suffix}"
        # Gemma 1's post_attention_layernorm is the norm before the MLP, as Llama's
        return f"blk.{parts[2]}.{_TABLES.get(arch, _LAYER)[module]}.{suffix}"
    raise KeyError(f"no GGUF name for {hf}")


def _tiled_v_heads(hf: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """Qwen3.5's converter: the v heads reordered from grouped by key head (h = g r + j) to tiled
    (j hk + g) in every tensor that has them (the v rows of in_proj_qkv and the conv taps, z, b,
    a, A_log, dt_bias, out_proj's columns)."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if hk == hv:
        return t
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], hv // hk

    def tile(x: torch.Tensor, dim: int, d: int) -> torch.Tensor:
        shape = list(x.shape)
        x = x.reshape(*shape[:dim], hk, r, d, *shape[dim + 1:]).transpose(dim, dim + 1)
        return x.reshape(shape)

    if hf.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([t[:2 * hk * dk], tile(t[2 * hk * dk:], 0, dv)])
    if hf.endswith("in_proj_z.weight"):
        return tile(t, 0, dv)
    if hf.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return tile(t, 0, 1)
    if hf.endswith("out_proj.weight"):
        return tile(t, 1, dv)
    return t


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved row by row."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def mxfp4_roundtrip_(model: torch.nn.Module) -> None:
    """gpt-oss's expert matrices replaced by their MXFP4 values (as ``write_gguf`` stores them
    with ``mxfp4_experts``: the rows of each expert's gate, up and down, in 32-element blocks)."""
    import gguf
    import gguf.quants as gq

    t = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = p.detach().float().transpose(1, 2).contiguous().numpy()  # out x in, as stored
                back = gq.dequantize(gq.quantize(rows, t), t).reshape(rows.shape)
                p.copy_(torch.from_numpy(back).transpose(1, 2))


K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # in rows of 256, written by gguf_blocks.encode_blocks
ENCODED = K_TYPES + ("IQ4_NL",)  # the types the gguf package reads but does not write
# llama.cpp's Q4_K_M mix, simplified: the value and down matrices and the head in Q6_K (it does so for
# half the layers' and the head), the rest in Q4_K
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K", (".v_proj.", ".down_proj.", "lm_head.", ".attn_v.", ".ffn_down."))}


def tensor_qtype(name: str, qtype: str) -> str:
    """The type a tensor named ``name`` (HF's name or the file's) is written in under ``qtype``."""
    if qtype not in MIXES:
        return qtype
    base, more, names = MIXES[qtype]
    return more if name == "output.weight" or any(n in name for n in names) else base


def quantizable(w: torch.Tensor, qtype: str | None = None) -> bool:
    block = 256 if qtype in K_TYPES or qtype in MIXES else 32
    return w.dim() in (2, 3) and w.shape[-1] % block == 0 and not (w.dim() == 2 and w.shape[0] == 1)


def quantize_rows(a: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of float32 values as ``qtype``'s blocks (rows of bytes)."""
    import gguf
    import gguf.quants as gq

    from flexgen_dist.models.gguf_blocks import encode_blocks

    if qtype in ENCODED:
        return encode_blocks(a.reshape(-1, a.shape[-1]), qtype).reshape(*a.shape[:-1], -1)
    return gq.quantize(a, getattr(gguf.GGMLQuantizationType, qtype))


def roundtrip_(model: torch.nn.Module, qtype: str) -> None:
    """Replace every matrix the writer quantizes by its quantized values, so that transformers
    on ``model`` computes with exactly the weights of the file (quantizing is idempotent)."""
    import gguf
    import gguf.quants as gq

    with torch.no_grad():
        for name, p in model.named_parameters():
            if quantizable(p, qtype):
                qt = tensor_qtype(name, qtype)
                t = getattr(gguf.GGMLQuantizationType, qt)
                p.copy_(torch.from_numpy(gq.dequantize(quantize_rows(p.float().numpy(), qt), t)))


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope.get("full_attention", rope)  # per layer type (OLMo 3): the global layers' (the file has one)


def llama3_rope_freqs(cfg: dict[str, Any]) -> torch.Tensor:
    """The converter's ``rope_freqs`` of a ``llama3``-scaled config (its per-frequency loop).
    It takes the original context from the scaling's own parameters, as Llama 3.1+ configs
    give it (the converter reads 8192, the value of every such published model)."""
    rope, dim = _rope(cfg), cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


@functools.lru_cache(maxsize=1)
def _tokenizer_fields() -> tuple[tuple[str, Any, Any, Any], ...]:
    from gguf import GGUFValueType

    from flexgen_dist.models.gguf_file import GGUFFile
    from flexgen_dist.models.loader import bundled_model_path

    reader = GGUFFile(bundled_model_path())
    return tuple((key, f.contents(), f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
                 for key, f in reader.fields.items() if key.startswith("tokenizer."))


def copy_tokenizer(writer: Any) -> None:
    """The bundled SmolLM2 file's ``tokenizer.*`` metadata, copied into ``writer``."""
    for key, value, vtype, sub in _tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub)


def _llama_keys(w: Any, cfg: dict[str, Any], arch: str, n_head: int, n_kv: int) -> None:
    """The metadata llama.cpp's LlamaModel, Qwen2Model, Qwen3Model and Phi3MiniModel write."""
    import gguf

    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = _rope(cfg)
    w.add_block_count(cfg["num_hidden_layers"] + _nextn(cfg, arch))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    # Llama4Model: the dense layers' width (intermediate_size_mlp); a config without a dense
    # width (Qwen3.5-MoE) gets none (TextModel writes it where the config has one)
    if arch == "llama4" or "intermediate_size" in cfg:
        w.add_feed_forward_length(cfg["intermediate_size_mlp"] if arch == "llama4" else cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    base = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if arch.startswith("hunyuan") and rope.get("rope_type") == "dynamic":  # HunYuanModel: the NTK-alpha base
        base = base * rope["alpha"] ** (head_dim / (head_dim - 2))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        w.add_rope_scaling_factor(1)
        w.add_rope_scaling_orig_ctx_len(256 * 1024)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "phi3":  # Phi3MiniModel writes its own set, with no key/value length
        old = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(old)
        w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or 1.0)))
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":  # with the factors as tensors (write_gguf)
            scale = cfg["max_position_embeddings"] / old
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(old)) if scale > 1 else 1.0)
    elif cfg.get("head_dim") is not None:  # TextModel: written when the config has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:  # LlamaModel (Mixtral), Qwen2MoeModel, Qwen3MoeModel
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.get("num_experts_per_tok") or cfg.get("moe_topk"))
        if arch not in ("llama", "glm4moe", "olmoe"):  # OlmoeModel: the feed-forward length is the experts'
            w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        if arch in ("qwen2moe", "qwen3next", "qwen35moe"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in ("qwen35", "qwen35moe"):  # _Qwen35MRopeMixin: the sections, the default where the config has none
        w.add_rope_dimension_sections(rope.get("mrope_section", [11, 11, 10]) + [0])
    if arch in QWEN_NEXT:  # Qwen3NextModel: the linear layers' sizes, the interval, the turned dims
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if arch == "olmo2" and "sliding_window" in cfg:  # Olmo2Model (also OLMo 3's): the window and its pattern
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch == "granite":  # GraniteModel: LlamaModel's set, then each non-zero multiplier
        for add, k in ((w.add_attention_scale, "attention_multiplier"), (w.add_embedding_scale, "embedding_multiplier"),
                       (w.add_residual_scale, "residual_multiplier"), (w.add_logit_scale, "logits_scaling")):
            if cfg.get(k):
                add(cfg[k])
    if arch in ("glm4", "glm4moe"):  # Glm4Model, Glm4MoeModel: the rotated dims of each head
        w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or 0.5)))
    if arch == "minimax-m2":  # MiniMaxM2Model: the rotated dims (its rotary_dim), sigmoid gating
        w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or 1.0)))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch == "glm4moe":  # and the experts' set, the dense layers, the prediction layers
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        if cfg.get("n_group", 1) > 1:  # not written by llama.cpp (its GLM-4.5 files have one group)
            w.add_expert_group_count(cfg["n_group"])
            w.add_expert_group_used_count(cfg["topk_group"])
        w.add_nextn_predict_layers(NEXTN)
    if rope.get("rope_type") == "yarn":  # TextModel: the type, factor, original context, betas where given
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "hunyuan-moe":  # HunYuanMoEModel: the shared MLP's width and count
        w.add_expert_shared_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_shared_count(1)
    if arch == "dots1":  # Dots1Model: DeepSeek-V3's routing keys
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if arch == "ernie4_5-moe":  # Ernie4_5MoeModel: the experts' set, the sparse layers' step and start, the
        # shared experts' count, and their width as the converter computes it (intermediate_size // kv heads:
        # ERNIE-4.5-21B-A3B's 12288 // 4 = 2 x 1536, its moe_num_shared_experts x moe_intermediate_size)
        w.add_expert_count(cfg["moe_num_experts"])
        w.add_expert_used_count(cfg["moe_k"])
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
        if cfg.get("moe_intermediate_size") is not None:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("moe_num_shared_experts") is not None:
            w.add_expert_shared_count(cfg["moe_num_shared_experts"])
            if cfg["moe_num_shared_experts"] > 0:
                w.add_expert_shared_feed_forward_length(cfg["intermediate_size"] // cfg["num_key_value_heads"])
    if arch == "gpt-oss":  # GptOssModel: and the window
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "exaone4":  # Exaone4Model: the vocabulary, the window and its per-layer pattern
        w.add_vocab_size(cfg["vocab_size"])
        if cfg.get("sliding_window") is not None:
            w.add_sliding_window(cfg["sliding_window"])
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch == "exaone-moe":  # ExaoneMoEModel: TextModel's groups (written wherever the config has them),
        # Exaone4Model's keys, then the experts' set, the dense layers, the prediction layers, no RoPE scaling
        # (no gating function: the config names none)
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_expert_shared_count(cfg["num_shared_experts"])
        w.add_expert_shared_feed_forward_length(cfg["moe_intermediate_size"] * cfg["num_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_nextn_predict_layers(_nextn(cfg, arch))
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if arch == "llama4":  # Llama4Model: the sparse layers' step
        w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
    if arch in ("llama", "granite", "smollm3", "llama4", "arcee", "apertus"):  # LlamaModel's own two
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])


def _deepseek2_keys(w: Any, cfg: dict[str, Any], split: bool) -> None:
    """The metadata llama.cpp's DeepseekV2Model writes for DeepSeek-V3 and V2: TextModel's set with
    one kv head, then the latent attention's sizes (``split``: as newer converters write them,
    the cache's sizes in key/value_length and the heads' in *_length_mla; else the heads' in
    key/value_length and every head a kv head, as older ones did), the experts' set, the
    rope dims, YaRN with its log multiplier (0.1 mscale_all_dim)."""
    import gguf

    r, dr, dn, dv = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    _shape_keys(w, {**cfg, "num_key_value_heads": 1 if split else cfg["num_attention_heads"]})
    rope = _rope(cfg)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg["model_type"] == "deepseek_v3":  # its scoring_func: DeepSeek-V2's configs name none (softmax)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.get("n_group"):
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(r)
    if split:
        w.add_key_length(r + dr)
        w.add_value_length(r)
        w.add_key_length_mla(dn + dr)
        w.add_value_length_mla(dv)
    else:
        w.add_key_length(dn + dr)
        w.add_value_length(dv)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(dr)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for add, k in ((w.add_rope_scaling_yarn_beta_fast, "beta_fast"), (w.add_rope_scaling_yarn_beta_slow, "beta_slow")):
            if rope.get(k) is not None:
                add(rope[k])
        if rope.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _shape_keys(w: Any, cfg: dict[str, Any]) -> None:
    """The keys every converter writes of a model's shape (TextModel's first ones)."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])


def _cohere_keys(w: Any, cfg: dict[str, Any], arch: str) -> None:
    """The metadata llama.cpp's CommandR2Model and Cohere2Model write: TextModel's set (with
    the LayerNorm's epsilon), the logit scale; Cohere2Model also the window, the vocabulary
    size and the rotated dims."""
    _shape_keys(w, cfg)
    w.add_rope_freq_base(float(_rope(cfg).get("rope_theta", 10000.0)))
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_logit_scale(cfg["logit_scale"])
    if arch == "cohere2":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])


def _neox_keys(w: Any, cfg: dict[str, Any], arch: str) -> None:
    """The metadata llama.cpp's Phi2Model and GPTNeoXModel write, each its own short set (neither
    calls TextModel's: no RoPE base, llama.cpp's 10000 being every released Phi's and Pythia's).
    Phi2Model: the feed-forward width as 4 x hidden (every released Phi's intermediate_size), the
    kv heads as the heads, the rotated dims as int(factor x hidden) // heads (and add_bos_token
    False: tokenizer metadata, for which the copied tokenizer's stands). GPTNeoXModel: no kv heads,
    the rotated dims from rotary_pct (a config transformers saves holds it as the RoPE parameters'
    partial_rotary_factor), the parallel residual (default true)."""
    rope, hidden, heads = _rope(cfg), cfg["hidden_size"], cfg["num_attention_heads"]
    factor = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or cfg.get("rotary_pct")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    if arch == "phi2":
        w.add_feed_forward_length(4 * hidden)
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_head_count(heads)
        w.add_head_count_kv(heads)
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        w.add_rope_dimension_count(int(factor * hidden) // heads)
        return
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(int(factor * (hidden // heads)))
    w.add_head_count(heads)
    w.add_parallel_residual(cfg.get("use_parallel_residual", True))
    w.add_layer_norm_eps(cfg["layer_norm_eps"])


def _starcoder2_keys(w: Any, cfg: dict[str, Any]) -> None:
    """The metadata llama.cpp's StarCoder2Model writes: TextModel's set alone (the class adds
    nothing), here the shape, the kv heads, the RoPE base, the LayerNorm's epsilon (norm_epsilon)
    and the head size where the config has head_dim; no window and no rotated dims."""
    rope = _rope(cfg)
    assert rope.get("rope_type", "default") == "default", "a scaled RoPE is not written here"
    _shape_keys(w, cfg)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_eps(cfg["norm_epsilon"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])


def neox_qkv_reordered(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GPTNeoXModel.modify_tensors: query_key_value's rows (or bias), interleaved by head (head
    h's q, k, v), as all heads' q, then k, then v."""
    per = t.reshape(heads, 3, t.shape[0] // heads // 3, *t.shape[1:])
    return torch.cat([per[:, i].reshape(-1, *t.shape[1:]) for i in range(3)])


def _gemma_keys(w: Any, cfg: dict[str, Any], arch: str) -> None:
    """The metadata llama.cpp's GemmaModel, Gemma2Model and Gemma3Model write. GemmaModel
    writes the shape, the norm's epsilon and the head size only. Gemma2Model writes its own
    short set (no RoPE base: llama.cpp's 10000 is Gemma 2's); Gemma3Model the shared set (the
    global layers' RoPE base and linear scaling, the sliding layers' base) and its own keys.
    Neither writes query_pre_attn_scalar nor the layer pattern: llama.cpp derives them."""
    import gguf

    _shape_keys(w, cfg)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if arch == "gemma":  # GemmaModel: nothing more (llama.cpp's RoPE base 10000 is Gemma's)
        return
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        return
    rope = cfg["rope_parameters"]
    glob = rope.get("full_attention", rope)
    if glob.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(glob["factor"])
    w.add_rope_freq_base(glob["rope_theta"])
    if "rope_theta" in rope.get("sliding_attention", {}):
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(cfg["sliding_window"])


def write_gguf(model: torch.nn.Module, path: Path, qtype: str | None = None, mxfp4_experts: bool = False,
               mla_split: bool = True) -> Path:
    """Write ``model`` (a transformers causal LM) to ``path`` as llama.cpp would; with
    ``mxfp4_experts``, the experts' matrices in MXFP4 (``mxfp4_roundtrip_`` first gives the
    model their values); DeepSeek-V3's kv_b split into attn_k_b (transposed) and attn_v_b as
    newer converters write it, or whole with ``mla_split=False``; GPT-NeoX's fused q|k|v as
    GPTNeoXModel reorders it."""
    import gguf
    import gguf.quants as gq

    cfg = model.config.to_dict()
    mt = cfg["model_type"]
    arch = ARCH[mt]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{mt}")
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if arch.startswith("gemma"):
        _gemma_keys(w, cfg, arch)
    elif arch in ("command-r", "cohere2"):
        _cohere_keys(w, cfg, arch)
    elif arch == "deepseek2":
        _deepseek2_keys(w, cfg, mla_split)
    elif arch in ("phi2", "gptneox"):
        _neox_keys(w, cfg, arch)
    elif arch == "starcoder2":
        _starcoder2_keys(w, cfg)
    else:
        _llama_keys(w, cfg, arch, n_head, n_kv)
    copy_tokenizer(w)

    tensors: dict[str, torch.Tensor] = {}
    if arch in ("llama", "llama4", "apertus") and _rope(cfg).get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(cfg)
    if arch == "phi3" and _rope(cfg).get("rope_type") == "longrope":  # Phi3MiniModel's extra tensors
        tensors["rope_factors_long.weight"] = torch.tensor(_rope(cfg)["long_factor"], dtype=torch.float32)
        tensors["rope_factors_short.weight"] = torch.tensor(_rope(cfg)["short_factor"], dtype=torch.float32)
    sd = dict(model.state_dict())
    if arch == "apertus":  # ApertusModel: each xIELU parameter's value a layer (raw: before softplus) as an array
        for k, add in (("alpha_n", w.add_xielu_alpha_n), ("alpha_p", w.add_xielu_alpha_p), ("beta", w.add_xielu_beta),
                       ("eps", w.add_xielu_eps)):
            add([sd.pop(f"model.layers.{i}.mlp.act_fn.{k}").float().item() for i in range(cfg["num_hidden_layers"])])
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (layer, GGUF name) -> expert -> matrix
    for hf in [k for k in sd if ".experts." in k and arch == "gpt-oss"]:  # stored in x out, gate|up interleaved
        layer, kind = hf.split(".")[2], hf.split(".")[-1]
        t = sd.pop(hf).detach().float()
        if kind in ("gate_up_proj", "down_proj"):
            t = t.transpose(1, 2)
        names = {"gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"), "down_proj": ("ffn_down_exps.weight",),
                 "gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
                 "down_proj_bias": ("ffn_down_exps.bias",)}[kind]
        parts_ = (t[:, ::2], t[:, 1::2]) if len(names) == 2 else (t,)
        for n, part in zip(names, parts_):
            tensors[f"blk.{layer}.{n}"] = part.contiguous()
    for hf in [k for k in sd if ".experts." in k]:
        parts = hf.split(".")
        i = parts.index("experts")
        if parts[i + 1] == "gate_up_proj":  # transformers' fused layout: (experts, 2 x width, hidden)
            t = sd.pop(hf)
            gate, up = (t.transpose(1, 2) if arch == "llama4" else t).chunk(2, dim=1)  # Llama 4's: in x out
            tensors[f"blk.{parts[2]}.ffn_gate_exps.weight"] = gate.detach().float()
            tensors[f"blk.{parts[2]}.ffn_up_exps.weight"] = up.detach().float()
        elif parts[i + 1] == "down_proj":
            t = sd.pop(hf).detach().float()
            tensors[f"blk.{parts[2]}.ffn_down_exps.weight"] = t.transpose(1, 2).contiguous() if arch == "llama4" else t
        else:  # model.layers.L.<block>.experts.E.<proj>.weight
            experts.setdefault((parts[2], _EXPERT[parts[i + 2]]), {})[int(parts[i + 1])] = sd.pop(hf)
    for (layer, name), by_e in experts.items():
        tensors[f"blk.{layer}.{name}.weight"] = torch.stack([by_e[e].detach().float() for e in sorted(by_e)])
    for hf, t in sd.items():
        # Gemma2Model never writes lm_head (llama.cpp's gemma2 reads token_embd)
        if hf == "lm_head.weight" and (cfg.get("tie_word_embeddings") or arch == "gemma2"):
            continue
        t = t.detach().float()
        if (arch.startswith("gemma") or arch in QWEN_NEXT) and hf.endswith("norm.weight") \
                and not hf.endswith("linear_attn.norm.weight"):
            t = t + 1  # Gemma's RMSNorm multiplies by (1 + w): the converter stores 1 + w
        if arch in ("qwen35", "qwen35moe") and ".linear_attn." in hf:
            t = _tiled_v_heads(hf, t, cfg)  # _LinearAttentionVReorderBase, before Qwen3NextModel's changes
        if arch in QWEN_NEXT and ".linear_attn." in hf:
            layer = hf.split(".")[2]
            if hf.endswith("in_proj_qkvz.weight"):  # [q, k, v, z] per key head -> q|k|v of all heads, and z
                dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
                hk, r = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
                q, k, v, z = t.view(hk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
                tensors[f"blk.{layer}.attn_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
                tensors[f"blk.{layer}.attn_gate.weight"] = z.reshape(-1, t.shape[1])
                continue
            if hf.endswith("A_log"):
                tensors[f"blk.{layer}.ssm_a"] = -torch.exp(t)
                continue
            if hf.endswith("dt_bias"):
                tensors[f"blk.{layer}.ssm_dt.bias"] = t
                continue
            if hf.endswith("conv1d.weight"):
                t = t.squeeze(1)
        if arch in ("llama", "granite", "smollm3", "arcee") and ".self_attn.q_proj." in hf:
            t = permute(t, n_head)
        elif arch in ("llama", "granite", "smollm3", "arcee") and ".self_attn.k_proj." in hf:
            t = permute(t, n_kv)
        if arch == "gptneox" and ".attention.query_key_value." in hf:
            t = neox_qkv_reordered(t, n_head)
        if arch == "deepseek2" and hf.endswith("kv_b_proj.weight") and mla_split:  # the converter's split
            nh, dn = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
            k_b, v_b = t.view(nh, dn + cfg["v_head_dim"], -1).split([dn, cfg["v_head_dim"]], dim=1)
            tensors[gguf_name(hf, arch).replace("attn_kv_b", "attn_k_b")] = k_b.transpose(1, 2)
            tensors[gguf_name(hf, arch).replace("attn_kv_b", "attn_v_b")] = v_b
            continue
        tensors[gguf_name(hf, arch)] = t
    last = cfg["num_hidden_layers"] - 1
    for b in range(last + 1, last + 1 + _nextn(cfg, arch)):  # the prediction layers after the last: their
        # tensors as a converted file holds them
        for name in [n for n in tensors if n.startswith(f"blk.{last}.")]:
            tensors[f"blk.{b}." + name.split(".", 2)[2]] = tensors[name].clone()
        h = cfg["hidden_size"]
        tensors.update({f"blk.{b}.nextn.eh_proj.weight": torch.zeros(h, 2 * h),
                        f"blk.{b}.nextn.enorm.weight": torch.ones(h),
                        f"blk.{b}.nextn.hnorm.weight": torch.ones(h),
                        f"blk.{b}.nextn.shared_head_norm.weight": torch.ones(h)})
    for name, t in tensors.items():
        a = t.contiguous().numpy()
        if mxfp4_experts and name.endswith("_exps.weight"):  # gpt-oss's experts as released: MXFP4
            mx = gguf.GGMLQuantizationType.MXFP4
            w.add_tensor(name, gq.quantize(a, mx), raw_dtype=mx)
        elif qtype and quantizable(t, qtype):
            qt = tensor_qtype(name, qtype)
            w.add_tensor(name, quantize_rows(a, qt), raw_dtype=getattr(gguf.GGMLQuantizationType, qt))  # rows of bytes
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rewrite(src: Path, dst: Path, changes: dict[str, Any] | None = None, arch: str | None = None,
            drop: tuple[str, ...] = (), tensors: dict[str, np.ndarray] | None = None,
            tokenizer: bool = False) -> Path:
    """A copy of the GGUF ``src`` with metadata keys changed (a value of None removes the key,
    a list is written as an array), the architecture renamed (its keys with it), tensors
    dropped, or float32 tensors added or replaced; without its tokenizer unless ``tokenizer``
    (copying it takes seconds)."""
    import gguf
    from gguf import GGUFValueType

    from flexgen_dist.models.gguf_file import GGUFFile

    changes, tensors = changes or {}, tensors or {}
    reader = GGUFFile(src)
    old = reader.fields["general.architecture"].contents()
    new = arch or old
    w = gguf.GGUFWriter(str(dst), new)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or (
                key.startswith("tokenizer.") and not tokenizer):
            continue
        if key.startswith(f"{old}."):
            key = f"{new}." + key[len(old) + 1:]
        if key in changes:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, value in changes.items():
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(key, value)
            continue
        vtype = (GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.FLOAT32
                 if isinstance(value, float) else GGUFValueType.UINT32)
        w.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name not in drop and t.name not in tensors:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # rows of bytes if packed
    for name, a in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def gguf_builder(factory: Any, make: Any) -> Any:
    """``get(kind, qtype=None) -> (model, its GGUF file, its HF directory)``, each built once
    by ``make(kind)`` (the reference computes with the values a quantized file holds)."""
    cache: dict[tuple[str, str | None], tuple[torch.nn.Module, Path, Path]] = {}

    def get(kind: str, qtype: str | None = None) -> tuple[torch.nn.Module, Path, Path]:
        if (kind, qtype) not in cache:
            d = factory.mktemp(f"{kind}-{qtype or 'f32'}")
            m = make(kind)
            if qtype:
                roundtrip_(m, qtype)
            m.save_pretrained(d / "hf")
            cache[kind, qtype] = m, write_gguf(m, d / f"{kind}.gguf", qtype), d / "hf"
        return cache[kind, qtype]

    return get


def tokenizer_cache_kept_clean() -> Any:
    """A generator for a fixture: the loader caches each GGUF's converted tokenizer (keyed by
    path and mtime); the files of a test module are temporary, so their entries go with them."""
    import shutil

    from flexgen_dist.kernels import cache_root

    cache = cache_root() / "tokenizers"
    before = set(cache.iterdir()) if cache.is_dir() else set()
    yield
    for d in (set(cache.iterdir()) if cache.is_dir() else set()) - before:
        shutil.rmtree(d, ignore_errors=True)
