"""Named model shapes, for dummy-weight runs and for the planner.

Shapes follow the published configs of each model; dummy weights are random, so only the
shape matters here.
"""
from __future__ import annotations

import math

from .rope_scaling import mla_softmax_scale
from .spec import ModelSpec, RopeScaling, alternating, every_nth

_OPT = dict(family="opt", vocab_size=50272, max_positions=2048, bos_token_id=2,
            eos_token_ids=(2,), pad_token_id=1)
_LLAMA2 = dict(family="llama", vocab_size=32000, max_positions=4096, bos_token_id=1,
               eos_token_ids=(2,), pad_token_id=0, tie_word_embeddings=False, norm_eps=1e-5)
_LLAMA3 = dict(family="llama", vocab_size=128256, max_positions=8192, bos_token_id=128000,
               eos_token_ids=(128001,), pad_token_id=None, tie_word_embeddings=False,
               norm_eps=1e-5, rope_theta=500000.0)
# Llama 3.1 / 3.2: 128k positions by the llama3 frequency scaling of the 8k original
_LLAMA31 = dict(_LLAMA3, max_positions=131072, eos_token_ids=(128001, 128008, 128009),
                rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
_LLAMA32 = dict(_LLAMA31, tie_word_embeddings=True, rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192))
_QWEN25 = dict(family="llama", vocab_size=152064, max_positions=32768, bos_token_id=151643,
               eos_token_ids=(151645, 151643), pad_token_id=151643, tie_word_embeddings=False,
               norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True)
_QWEN3 = dict(_QWEN25, vocab_size=151936, max_positions=40960, qkv_bias=False, qk_norm=True,
              head_dim_override=128)
_MISTRAL = dict(family="llama", vocab_size=32768, max_positions=32768, bos_token_id=1, eos_token_ids=(2,),
                pad_token_id=None, tie_word_embeddings=False, norm_eps=1e-5, rope_theta=1000000.0)
_PHI3 = dict(family="llama", vocab_size=32064, max_positions=4096, bos_token_id=1, eos_token_ids=(32000,),
             pad_token_id=32000, tie_word_embeddings=False, norm_eps=1e-5, rope_theta=10000.0,
             fused_proj=True, sliding_window=2047)
# IBM Granite 3.x: Llama's layers with four multipliers (embedding, residual, attention
# softmax scale, logits divisor)
_GRANITE = dict(family="llama", vocab_size=49155, max_positions=131072, bos_token_id=0, eos_token_ids=(0,),
                pad_token_id=0, tie_word_embeddings=True, norm_eps=1e-5, rope_theta=10_000_000.0,
                embed_multiplier=12.0, residual_multiplier=0.22)
# OLMo 2: norms after each sublayer, q/k normalised over all heads
_OLMO2 = dict(family="llama", vocab_size=100352, max_positions=4096, bos_token_id=100257, eos_token_ids=(100257,),
              pad_token_id=100277, tie_word_embeddings=False, norm_eps=1e-6, rope_theta=500000.0,
              qk_norm=True, qk_norm_whole=True, norm_layout="post", norm_weight_fp32=True)
# Cohere: one LayerNorm feeding attention and the MLP side by side, interleaved RoPE, scaled
# logits; Command R7B: three 4096-sliding layers of four, the global ones without RoPE
_COHERE = dict(family="cohere", vocab_size=256000, bos_token_id=5, eos_token_ids=(255001,), pad_token_id=0,
               tie_word_embeddings=True)
# GLM-4 (0414): norms before and after attention and the MLP, gate|up fused, q/k/v biases,
# interleaved RoPE on half of each head
_GLM4 = dict(family="llama", vocab_size=151552, max_positions=32768, bos_token_id=None,
             eos_token_ids=(151329, 151336, 151338), pad_token_id=151329, tie_word_embeddings=False,
             norm_eps=1e-5, rope_theta=10000.0, head_dim_override=128, rotary_dim=64, rope_interleaved=True,
             fused_mlp=True, qkv_bias=True, norm_layout="sandwich")
# Mixtures of experts: Mixtral (8 experts, top 2, routing weights kept in float32), Qwen2-MoE
# (64 experts, top 8, not renormalised, one shared expert), Qwen3-MoE (128 experts, top 8,
# renormalised), every layer sparse in the published configs
_MIXTRAL = dict(_MISTRAL, vocab_size=32000, router_weights_fp32=True, norm_topk_prob=True)
_QWEN2_MOE = dict(_QWEN25, vocab_size=151936, max_positions=32768, norm_topk_prob=False)
_QWEN3_MOE = dict(_QWEN3, norm_topk_prob=True)
_PYTHIA = dict(family="neox", vocab_size=50432, max_positions=2048, bos_token_id=0, eos_token_ids=(0,),
               pad_token_id=None, tie_word_embeddings=False, norm_eps=1e-5, attention_bias=True,
               parallel_residual=True, mlp_activation="gelu")


def _mla_scale(factor: float, mscale_all_dim: float) -> float:
    """DeepSeek's softmax scale (heads of 192 for q.k) as its config gives it."""
    return mla_softmax_scale(192, factor, 0.1 * mscale_all_dim)


_DEEPSEEK_V3 = dict(family="llama", vocab_size=129280, max_positions=163840, bos_token_id=0, eos_token_ids=(1,),
                    tie_word_embeddings=False, norm_eps=1e-6, rope_theta=10000.0, hidden_size=7168, ffn_size=18432,
                    num_heads=128, num_kv_heads=1, head_dim_override=576, kv_lora_rank=512, q_lora_rank=1536,
                    qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, rope_interleaved=True,
                    rope_scaling=RopeScaling("yarn", 40.0, original_max_position_embeddings=4096, attention_factor=1.0,
                                             truncate=True),
                    attn_scale=_mla_scale(40.0, 1.0), num_experts=256, experts_per_tok=8,
                    expert_ffn_size=2048, router_scoring="sigmoid", router_fp32=True, router_weights_fp32=True,
                    expert_groups=8, expert_groups_used=4, routed_scaling=2.5, shared_expert_ffn_size=2048,
                    shared_expert_gated=False)
# DeepSeek-V2 (deepseek_v2): V3's latent attention (YaRN with mscale 0.707), softmax routing
# never renormalised, times the scaling; layer 0 dense
_DEEPSEEK_V2 = dict(family="llama", vocab_size=102400, max_positions=163840, bos_token_id=100000,
                    eos_token_ids=(100001,), tie_word_embeddings=False, norm_eps=1e-6, rope_theta=10000.0,
                    num_kv_heads=1, head_dim_override=576, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                    v_head_dim=128, rope_interleaved=True,
                    rope_scaling=RopeScaling("yarn", 40.0, original_max_position_embeddings=4096, attention_factor=1.0,
                                             truncate=True),
                    attn_scale=_mla_scale(40.0, 0.707), experts_per_tok=6,
                    router_fp32=True, router_weights_fp32=True, norm_topk_prob=False, shared_expert_gated=False)
# gpt-oss: every layer sparse (softmax over the top 4 biased logits, biased experts with a
# clamped gate), attention sinks, 128-position sliding layers alternating with global ones, YaRN
_GPT_OSS = dict(family="llama", vocab_size=201088, max_positions=131072, bos_token_id=199998,
                eos_token_ids=(200002,), pad_token_id=199999, tie_word_embeddings=False, norm_eps=1e-5,
                rope_theta=150000.0, hidden_size=2880, ffn_size=2880, num_heads=64, num_kv_heads=8,
                head_dim_override=64, sliding_window=128, attention_bias=True, attn_sinks=True,
                norm_weight_fp32=True, experts_per_tok=4, expert_ffn_size=2880, router_scoring="topk_softmax",
                router_bias=True, expert_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0,
                rope_scaling=RopeScaling("yarn", 32.0, original_max_position_embeddings=4096,
                                         attention_factor=0.1 * math.log(32.0) + 1.0, truncate=False))
# GLM-4.5 / 4.6 (glm4_moe): DeepSeek-V3's sigmoid routing with a choice bias, one shared expert,
# the first layers dense, q/k/v biases, RoPE on the halves of half of each head
_GLM4_MOE = dict(family="llama", vocab_size=151552, max_positions=131072, bos_token_id=None,
                 eos_token_ids=(151329, 151336, 151338), pad_token_id=151329, tie_word_embeddings=False,
                 norm_eps=1e-5, rope_theta=1_000_000.0, head_dim_override=128, rotary_dim=64, qkv_bias=True,
                 num_heads=96, num_kv_heads=8, num_experts=128, experts_per_tok=8, expert_ffn_size=1408,
                 router_scoring="sigmoid", router_fp32=True, router_weights_fp32=True, shared_expert_gated=False)
_LLAMA4 = dict(family="llama", vocab_size=202048, bos_token_id=200000, eos_token_ids=(200001, 200007, 200008),
               pad_token_id=200018, tie_word_embeddings=False, norm_eps=1e-5, rope_theta=500000.0, num_layers=48,
               hidden_size=5120, ffn_size=16384, num_heads=40, num_kv_heads=8, rope_interleaved=True, nope_layers=every_nth(48, 4), sliding_window=8192,
               layer_types=tuple("full_attention" if g else "chunked_attention" for g in every_nth(48, 4)),
               attn_temp_nope=True, attn_temp_beta=0.1, attn_temp_len=8192, experts_per_tok=1,
               expert_ffn_size=8192, shared_expert_ffn_size=8192, shared_expert_gated=False,
               router_scoring="top_sigmoid", norm_topk_prob=False)
_SMOL = dict(family="llama", vocab_size=49152, max_positions=8192, bos_token_id=1,
             eos_token_ids=(2,), pad_token_id=2, tie_word_embeddings=True, norm_eps=1e-5)

# Gemma 2: global and 4096-sliding layers alternating (even layers slide), soft-capped
# attention scores (50) and logits (30); Gemma 3 (text): five 1024-sliding layers per global
# one, RoPE base 10000 locally, 1e6 with linear scaling x8 globally, q/k norms
_GEMMA2 = dict(family="gemma", vocab_size=256000, max_positions=8192, bos_token_id=2, eos_token_ids=(1,),
               pad_token_id=0, tie_word_embeddings=True, norm_eps=1e-6, rope_theta=10000.0,
               sliding_window=4096, attn_softcap=50.0, final_softcap=30.0)
_GEMMA3 = dict(family="gemma", vocab_size=262208, max_positions=131072, bos_token_id=2, eos_token_ids=(1, 106),
               pad_token_id=0, tie_word_embeddings=True, norm_eps=1e-6, rope_theta=1_000_000.0,
               rope_scaling=RopeScaling("linear", 8.0), local_rope_theta=10000.0, sliding_window=1024,
               qk_norm=True)


_SHAPES: dict[str, dict] = {
    # name: (layers, hidden, ffn, heads) + extras
    "opt-125m": dict(_OPT, num_layers=12, hidden_size=768, ffn_size=3072, num_heads=12),
    "opt-350m": dict(_OPT, num_layers=24, hidden_size=1024, ffn_size=4096, num_heads=16,
                     word_embed_proj_dim=512, pre_layer_norm=False),
    "opt-1.3b": dict(_OPT, num_layers=24, hidden_size=2048, ffn_size=8192, num_heads=32),
    "opt-2.7b": dict(_OPT, num_layers=32, hidden_size=2560, ffn_size=10240, num_heads=32),
    "opt-6.7b": dict(_OPT, num_layers=32, hidden_size=4096, ffn_size=16384, num_heads=32),
    "opt-13b": dict(_OPT, num_layers=40, hidden_size=5120, ffn_size=20480, num_heads=40),
    "opt-30b": dict(_OPT, num_layers=48, hidden_size=7168, ffn_size=28672, num_heads=56),
    "opt-66b": dict(_OPT, num_layers=64, hidden_size=9216, ffn_size=36864, num_heads=72),
    "opt-175b": dict(_OPT, num_layers=96, hidden_size=12288, ffn_size=49152, num_heads=96),
    "llama-2-7b": dict(_LLAMA2, num_layers=32, hidden_size=4096, ffn_size=11008, num_heads=32),
    "llama-2-13b": dict(_LLAMA2, num_layers=40, hidden_size=5120, ffn_size=13824, num_heads=40),
    "llama-2-70b": dict(_LLAMA2, num_layers=80, hidden_size=8192, ffn_size=28672, num_heads=64,
                        num_kv_heads=8),
    "llama-3-8b": dict(_LLAMA3, num_layers=32, hidden_size=4096, ffn_size=14336, num_heads=32,
                       num_kv_heads=8),
    "llama-3-70b": dict(_LLAMA3, num_layers=80, hidden_size=8192, ffn_size=28672, num_heads=64,
                        num_kv_heads=8),
    "llama-3.1-8b": dict(_LLAMA31, num_layers=32, hidden_size=4096, ffn_size=14336, num_heads=32,
                         num_kv_heads=8),
    "llama-3.1-70b": dict(_LLAMA31, num_layers=80, hidden_size=8192, ffn_size=28672, num_heads=64,
                          num_kv_heads=8),
    "llama-3.1-405b": dict(_LLAMA31, num_layers=126, hidden_size=16384, ffn_size=53248, num_heads=128,
                           num_kv_heads=8),
    "llama-3.2-1b": dict(_LLAMA32, num_layers=16, hidden_size=2048, ffn_size=8192, num_heads=32,
                         num_kv_heads=8),
    "llama-3.2-3b": dict(_LLAMA32, num_layers=28, hidden_size=3072, ffn_size=8192, num_heads=24,
                         num_kv_heads=8),
    "qwen2.5-7b": dict(_QWEN25, num_layers=28, hidden_size=3584, ffn_size=18944, num_heads=28,
                       num_kv_heads=4),
    "qwen2.5-14b": dict(_QWEN25, num_layers=48, hidden_size=5120, ffn_size=13824, num_heads=40,
                        num_kv_heads=8),
    "qwen2.5-32b": dict(_QWEN25, num_layers=64, hidden_size=5120, ffn_size=27648, num_heads=40,
                        num_kv_heads=8),
    "qwen2.5-72b": dict(_QWEN25, num_layers=80, hidden_size=8192, ffn_size=29568, num_heads=64,
                        num_kv_heads=8),
    "qwen3-8b": dict(_QWEN3, num_layers=36, hidden_size=4096, ffn_size=12288, num_heads=32, num_kv_heads=8),
    "qwen3-32b": dict(_QWEN3, num_layers=64, hidden_size=5120, ffn_size=25600, num_heads=64, num_kv_heads=8),
    "mistral-7b": dict(_MISTRAL, num_layers=32, hidden_size=4096, ffn_size=14336, num_heads=32,
                       num_kv_heads=8),
    "granite-3.1-8b": dict(_GRANITE, num_layers=40, hidden_size=4096, ffn_size=12800, num_heads=32, num_kv_heads=8,
                           attn_scale=0.0078125, logits_divisor=16.0),
    "olmo-2-7b": dict(_OLMO2, num_layers=32, hidden_size=4096, ffn_size=11008, num_heads=32),
    "olmo-2-13b": dict(_OLMO2, num_layers=40, hidden_size=5120, ffn_size=13824, num_heads=40),
    "command-r-35b": dict(_COHERE, max_positions=131072, num_layers=40, hidden_size=8192, ffn_size=22528,
                          num_heads=64, rope_theta=8_000_000.0, logit_scale=0.0625),
    "command-r7b": dict(_COHERE, max_positions=131072, num_layers=32, hidden_size=4096, ffn_size=14336, num_heads=32,
                        num_kv_heads=8, rope_theta=50000.0, logit_scale=0.25, sliding_window=4096,
                        layer_types=alternating(32, 4), nope_layers=every_nth(32, 4)),
    # Mistral Small 3.1 / 3.2 (24B): the language model of the image-text checkpoint
    "mistral-small-24b": dict(_MISTRAL, vocab_size=131072, max_positions=131072, rope_theta=1_000_000_000.0,
                              num_layers=40, hidden_size=5120, ffn_size=32768, num_heads=32, num_kv_heads=8,
                              head_dim_override=128),
    "glm-4-9b": dict(_GLM4, num_layers=40, hidden_size=4096, ffn_size=13696, num_heads=32, num_kv_heads=2),
    "glm-4-32b": dict(_GLM4, num_layers=61, hidden_size=6144, ffn_size=23040, num_heads=48, num_kv_heads=2),
    "phi-3-mini": dict(_PHI3, num_layers=32, hidden_size=3072, ffn_size=8192, num_heads=32),
    "phi-3-medium": dict(_PHI3, num_layers=40, hidden_size=5120, ffn_size=17920, num_heads=40,
                         num_kv_heads=10),
    "gemma-2b": dict(_GEMMA2, num_layers=18, hidden_size=2048, ffn_size=16384, num_heads=8, num_kv_heads=1,
                     head_dim_override=256, attn_scale=256 ** -0.5, norm_layout="pre", sliding_window=0,
                     attn_softcap=0.0, final_softcap=0.0),
    "gemma-7b": dict(_GEMMA2, num_layers=28, hidden_size=3072, ffn_size=24576, num_heads=16, head_dim_override=256,
                     attn_scale=256 ** -0.5, norm_layout="pre", sliding_window=0, attn_softcap=0.0,
                     final_softcap=0.0),
    "gemma-2-9b": dict(_GEMMA2, num_layers=42, hidden_size=3584, ffn_size=14336, num_heads=16, num_kv_heads=8,
                       head_dim_override=256, attn_scale=256 ** -0.5, layer_types=alternating(42, 2)),
    "gemma-2-27b": dict(_GEMMA2, num_layers=46, hidden_size=4608, ffn_size=36864, num_heads=32, num_kv_heads=16,
                        head_dim_override=128, attn_scale=144 ** -0.5, layer_types=alternating(46, 2)),
    "gemma-3-12b": dict(_GEMMA3, num_layers=48, hidden_size=3840, ffn_size=15360, num_heads=16, num_kv_heads=8,
                        head_dim_override=256, attn_scale=256 ** -0.5, layer_types=alternating(48, 6)),
    "gemma-3-27b": dict(_GEMMA3, num_layers=62, hidden_size=5376, ffn_size=21504, num_heads=32, num_kv_heads=16,
                        head_dim_override=128, attn_scale=168 ** -0.5, layer_types=alternating(62, 6)),
    "mixtral-8x7b": dict(_MIXTRAL, num_layers=32, hidden_size=4096, ffn_size=14336, num_heads=32, num_kv_heads=8,
                         num_experts=8, experts_per_tok=2, expert_ffn_size=14336),
    "mixtral-8x22b": dict(_MIXTRAL, vocab_size=32768, max_positions=65536, num_layers=56, hidden_size=6144,
                          ffn_size=16384, num_heads=48, num_kv_heads=8, num_experts=8, experts_per_tok=2,
                          expert_ffn_size=16384),
    "qwen2-57b-a14b": dict(_QWEN2_MOE, max_positions=131072, num_layers=28, hidden_size=3584, ffn_size=18944,
                           num_heads=28, num_kv_heads=4, num_experts=64, experts_per_tok=8, expert_ffn_size=2560,
                           shared_expert_ffn_size=20480),
    "qwen3-30b-a3b": dict(_QWEN3_MOE, num_layers=48, hidden_size=2048, ffn_size=6144, num_heads=32, num_kv_heads=4,
                          num_experts=128, experts_per_tok=8, expert_ffn_size=768),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, num_layers=94, hidden_size=4096, ffn_size=12288, num_heads=64,
                            num_kv_heads=4, num_experts=128, experts_per_tok=8, expert_ffn_size=1536),
    # Phi-3.5-MoE (phimoe): LayerNorms, biases on q/k/v/o and the head, 16 experts and sparsemixer's
    # two; the shape within its original 4096 positions (its LongRoPE factors are the checkpoint's)
    "phi-3.5-moe": dict(family="llama", vocab_size=32064, max_positions=4096, bos_token_id=1, eos_token_ids=(32000,),
                        pad_token_id=32000, tie_word_embeddings=False, norm_eps=1e-5, rope_theta=10000.0,
                        num_layers=32, hidden_size=4096, ffn_size=6400, num_heads=32, num_kv_heads=8,
                        attention_bias=True, layer_norm=True, lm_head_bias=True, num_experts=16, experts_per_tok=2,
                        expert_ffn_size=6400, router_scoring="sparsemixer", router_jitter=0.01, norm_topk_prob=False,
                        sliding_window=4096),
    # Qwen3-Next-80B-A3B (qwen3_next): three gated-delta-rule layers of four, 512 experts, top 10,
    # a gated shared expert; gated attention on a quarter-turned head of 256, (1 + w) norms
    "qwen3-next-80b-a3b": dict(_QWEN3_MOE, max_positions=262144, rope_theta=10000000.0, num_layers=48,
                               hidden_size=2048, ffn_size=5120, num_heads=16, num_kv_heads=2, head_dim_override=256,
                               rotary_dim=64, norm_eps=1e-6, num_experts=512, experts_per_tok=10, expert_ffn_size=512,
                               shared_expert_ffn_size=512, layer_types=tuple(
                                   "full_attention" if (j + 1) % 4 == 0 else "linear_attention" for j in range(48)),
                               lin_k_heads=16, lin_v_heads=32, lin_k_dim=128, lin_v_dim=128, lin_conv_kernel=4,
                               attn_output_gate=True, norm_unit_offset=True),
    "gpt-oss-20b": dict(_GPT_OSS, num_layers=24, num_experts=32, layer_types=alternating(24, 2)),
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36, num_experts=128, layer_types=alternating(36, 2)),
    # ERNIE-4.5-21B-A3B (ernie4_5_moe): softmax scores with a choice bias, 64 experts, top 6, two
    # shared, layer 0 dense, RoPE on interleaved pairs in float32
    "ernie-4.5-21b-a3b": dict(family="llama", vocab_size=103424, max_positions=131072, bos_token_id=1,
                              eos_token_ids=(2,), pad_token_id=0, tie_word_embeddings=True, norm_eps=1e-5,
                              rope_theta=500000.0, rope_interleaved=True, rope_fp32=True, num_layers=28,
                              hidden_size=2560, ffn_size=12288, num_heads=20, num_kv_heads=4, num_experts=64,
                              experts_per_tok=6, expert_ffn_size=1536, router_fp32=True, router_choice_bias=True,
                              router_norm_min=1e-12, shared_expert_ffn_size=3072, shared_expert_gated=False,
                              moe_layers=tuple(j >= 1 for j in range(28))),
    # OLMoE-1B-7B (olmoe): 64 experts, top 8, not renormalised; q/k normalised over all heads
    "olmoe-1b-7b": dict(family="llama", vocab_size=50304, max_positions=4096, bos_token_id=None,
                        eos_token_ids=(50279,), pad_token_id=1, tie_word_embeddings=False, norm_eps=1e-5,
                        num_layers=16, hidden_size=2048, ffn_size=1024, num_heads=16, qk_norm=True,
                        qk_norm_whole=True, num_experts=64, experts_per_tok=8, expert_ffn_size=1024,
                        norm_topk_prob=False),
    # DeepSeek-V3 / R1 and Kimi K2 (deepseek_v3): latent attention (the cache one kv head of 512 + 64),
    # GLM-4.5's grouped sigmoid routing, the first layers dense
    "deepseek-v2-lite": dict(_DEEPSEEK_V2, num_layers=27, hidden_size=2048, ffn_size=10944, num_heads=16,
                             num_experts=64, expert_ffn_size=1408, shared_expert_ffn_size=2816,
                             moe_layers=tuple(j >= 1 for j in range(27))),
    "deepseek-v2": dict(_DEEPSEEK_V2, num_layers=60, hidden_size=5120, ffn_size=12288, num_heads=128, q_lora_rank=1536,
                        num_experts=160, expert_ffn_size=1536, shared_expert_ffn_size=3072, expert_groups=8,
                        expert_groups_used=3, routed_scaling=16.0, moe_layers=tuple(j >= 1 for j in range(60))),
    "deepseek-v3": dict(_DEEPSEEK_V3, num_layers=61, moe_layers=tuple(j >= 3 for j in range(61))),
    "kimi-k2": dict(_DEEPSEEK_V3, vocab_size=163840, max_positions=131072, bos_token_id=163584,
                    eos_token_ids=(163585,), pad_token_id=163839, rope_theta=50000.0, num_layers=61, num_heads=64,
                    num_experts=384, expert_groups=1, expert_groups_used=1, routed_scaling=2.827,
                    moe_layers=tuple(j >= 1 for j in range(61)),
                    rope_scaling=RopeScaling("yarn", 32.0, original_max_position_embeddings=4096,
                                             attention_factor=1.0, truncate=True),
                    attn_scale=_mla_scale(32.0, 1.0)),
    # Llama 4 (llama4): chunks of 8192 positions on the layers with RoPE (interleaved pairs), every
    # fourth layer global without RoPE and with the attention temperature; the top expert by
    # logit scaling its input by its sigmoid, one shared expert; Scout every layer sparse with
    # q/k norms and Llama 3.1's scaling (equal factors), Maverick every second layer, no q/k norms
    "llama-4-scout-17b-16e": dict(_LLAMA4, num_experts=16, qk_l2_norm=True, max_positions=10485760,
                                  rope_scaling=RopeScaling("llama3", 16.0, 1.0, 1.0, 8192)),
    "llama-4-maverick-17b-128e": dict(_LLAMA4, num_experts=128, max_positions=1048576,
                                      moe_layers=tuple(j % 2 == 1 for j in range(48))),
    # MiniMax-M2 / M2.1 (minimax_m2): sigmoid routing with a choice bias over 256 experts, top 8,
    # q/k normalised over all heads, half of each head turned
    "minimax-m2": dict(family="llama", vocab_size=200064, max_positions=196608, bos_token_id=200034,
                       eos_token_ids=(200020,), tie_word_embeddings=False, norm_eps=1e-6, rope_theta=5_000_000.0,
                       num_layers=62, hidden_size=3072, ffn_size=1536, num_heads=48, num_kv_heads=8,
                       head_dim_override=128, rotary_dim=64, qk_norm=True, qk_norm_whole=True, num_experts=256,
                       experts_per_tok=8, expert_ffn_size=1536, router_scoring="sigmoid", router_weights_fp32=True),
    "glm-4.5-air": dict(_GLM4_MOE, num_layers=46, hidden_size=4096, ffn_size=10944, shared_expert_ffn_size=1408,
                        moe_layers=tuple(j >= 1 for j in range(46))),
    "glm-4.5": dict(_GLM4_MOE, num_layers=92, hidden_size=5120, ffn_size=12288, num_experts=160,
                    expert_ffn_size=1536, shared_expert_ffn_size=1536, routed_scaling=2.5, qk_norm=True,
                    moe_layers=tuple(j >= 3 for j in range(92))),
    "glm-4.6": dict(_GLM4_MOE, max_positions=202752, num_layers=92, hidden_size=5120, ffn_size=12288,
                    num_experts=160, expert_ffn_size=1536, shared_expert_ffn_size=1536, routed_scaling=2.5,
                    qk_norm=True, moe_layers=tuple(j >= 3 for j in range(92))),
    "smollm3-3b": dict(family="llama", vocab_size=128256, max_positions=65536, bos_token_id=128000,
                       eos_token_ids=(128001,), pad_token_id=128004, tie_word_embeddings=True, norm_eps=1e-6,
                       rope_theta=5_000_000.0, num_layers=36, hidden_size=2048, ffn_size=11008, num_heads=16,
                       num_kv_heads=4, nope_layers=every_nth(36, 4)),
    "smollm2-135m": dict(_SMOL, num_layers=30, hidden_size=576, ffn_size=1536, num_heads=9,
                         num_kv_heads=3, rope_theta=100000.0),
    "smollm2-360m": dict(_SMOL, num_layers=32, hidden_size=960, ffn_size=2560, num_heads=15,
                         num_kv_heads=5, rope_theta=100000.0),
    "smollm2-1.7b": dict(_SMOL, num_layers=24, hidden_size=2048, ffn_size=8192, num_heads=32,
                         rope_theta=130000.0),
    # the NeoX family: Pythia (GPT-NeoX's layers: a quarter of each head turned, attention beside
    # the MLP) and GPT-NeoX-20B; Phi-2 (one norm for both, 0.4 of each head turned, a biased head)
    "pythia-6.9b": dict(_PYTHIA, num_layers=32, hidden_size=4096, ffn_size=16384, num_heads=32, rotary_dim=32),
    "pythia-12b": dict(_PYTHIA, vocab_size=50688, num_layers=36, hidden_size=5120, ffn_size=20480, num_heads=40, rotary_dim=32),
    "gpt-neox-20b": dict(_PYTHIA, vocab_size=50432, num_layers=44, hidden_size=6144, ffn_size=24576, num_heads=64,
                         rotary_dim=24),
    "phi-2": dict(family="neox", vocab_size=51200, max_positions=2048, bos_token_id=50256, eos_token_ids=(50256,),
                  pad_token_id=None, tie_word_embeddings=False, norm_eps=1e-5, num_layers=32, hidden_size=2560,
                  ffn_size=10240, num_heads=32, rotary_dim=32, attention_bias=True, norm_layout="shared",
                  mlp_activation="gelu_new", lm_head_bias=True),
}


def registry_names() -> list[str]:
    return sorted(_SHAPES)


def get_spec(name: str) -> ModelSpec:
    """The registered shape called ``name`` (case-insensitive; ``facebook/`` prefix allowed)."""
    key = name.lower().split("/")[-1]
    if key not in _SHAPES:
        raise KeyError(
            f"unknown model name {name!r}: use a registry shape ({', '.join(registry_names())}), "
            "a Hugging Face model directory, or a .gguf file")
    return ModelSpec(name=key, **_SHAPES[key])
