"""The GGUF architectures the engine reads (llama.cpp's ``general.architecture`` names): which
family each computes as, which metadata keys it may carry, and, for Gemma 2 and Gemma 3,
what their files say beyond the shared keys, read as llama.cpp's loader reads it.

``models/gguf.py`` reads what every architecture shares and the tensors; this module is the
per-architecture table it consults, and the ``ModelSpec`` fields each architecture's keys and
tensors give (``llama_fields`` and the functions it calls; ``gemma_fields``, ``cohere_fields``;
the NeoX family's in ``gguf_neox.neox_fields``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import cohere, gemma, llama, neox
from .gguf_deepseek import mla_fields
from .gguf_file import decimal32
from .gguf_moe import moe_fields, nextn
from .spec import RopeScaling, alternating, every_nth

Names = Callable[..., dict[str, str]]
Key = Callable[..., Any]


@dataclass(frozen=True)
class GGUFArch:
    """What differs between the architectures llama.cpp writes.

    ``family``: the engine's family a file computes as; ``names``: that family's canonical
    name -> GGUF tensor name map.
    ``permuted``: the converter interleaved the rows of q and k for llama.cpp's own rotary
    convention (its ``llama`` architecture); they are put back on read. The others use the
    rotate-half convention the engine uses, and are written as the HF checkpoint has them.
    ``keys``: metadata keys (after ``{arch}.``) the architecture adds to the shared ones.
    ``norm_shift``: what the converter added to every norm weight. Gemma's RMSNorm multiplies
    by (1 + w); llama.cpp's multiplies by its weight, so the converter stores 1 + w, and the
    reader takes the 1 back off for the family's (1 + w) form.
    ``scalars``: (canonical weight, metadata key) of the learned scalars a layer the converter
    writes as metadata, one value per layer, not as tensors (Apertus's xIELU: ``layer_scalars``).
    """

    family: str
    names: Names
    permuted: bool = False
    keys: frozenset[str] = frozenset()
    norm_shift: float = 0.0
    scalars: tuple[tuple[str, str], ...] = ()


_GLM4MOE_KEYS = frozenset({"expert_feed_forward_length", "expert_shared_count", "leading_dense_block_count",
                           "expert_gating_func", "expert_weights_scale", "expert_weights_norm", "expert_group_count",
                           "expert_group_used_count", "nextn_predict_layers"})
_QWEN_NEXT_KEYS = frozenset({"expert_feed_forward_length", "expert_shared_feed_forward_length", "ssm.conv_kernel",
                             "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
                             "full_attention_interval"})
_QWEN35_KEYS = frozenset({"rope.dimension_sections", "nextn_predict_layers"})
QWEN_NEXT_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
_GEMMA_KEYS = frozenset({"final_logit_softcapping", "attention.sliding_window",
                         "attention.sliding_window_pattern", "rope.freq_base_swa"})
ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", llama.gguf_names, permuted=True),
    "qwen2": GGUFArch("llama", llama.gguf_names),
    "qwen3": GGUFArch("llama", llama.gguf_names),
    "qwen2moe": GGUFArch("llama", llama.gguf_names, keys=frozenset({"expert_feed_forward_length",
                                                                    "expert_shared_feed_forward_length"})),
    "qwen3moe": GGUFArch("llama", llama.gguf_names, keys=frozenset({"expert_feed_forward_length"})),
    "phi3": GGUFArch("llama", llama.gguf_names, keys=frozenset({"attention.sliding_window",
                                                                "rope.scaling.attn_factor"})),
    # OLMo 2 and 3 (llama.cpp writes both as olmo2): norms on the sublayers' outputs, q/k
    # normalised over all heads, OLMo 3's sliding layers as a per-layer pattern
    "olmo2": GGUFArch("llama", llama.gguf_names,
                      keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})),
    # Arcee AFM: llama's tensors (q/k permuted), an MLP of up and down only (relu squared)
    "arcee": GGUFArch("llama", llama.gguf_names, permuted=True),
    # Apertus: llama's tensor names with q/k as the checkpoint has them, its norms as attn_norm and
    # ffn_norm, per-head q/k norms, an MLP of up and down only (xIELU): its two learned scalars a
    # layer are the raw (before softplus) xielu.alpha_p / xielu.alpha_n arrays, not tensors
    "apertus": GGUFArch("llama", llama.gguf_names, scalars=(("act.alpha_p", "xielu.alpha_p"),
                                                            ("act.alpha_n", "xielu.alpha_n"))),
    # SmolLM3: llama's tensors (q/k permuted); every fourth layer without RoPE (llama.cpp's fixed step)
    "smollm3": GGUFArch("llama", llama.gguf_names, permuted=True),
    # IBM Granite: llama's tensors (q/k permuted), its four multipliers as keys
    "granite": GGUFArch("llama", llama.gguf_names, permuted=True,
                        keys=frozenset({"embedding_scale", "residual_scale", "logit_scale", "attention.scale"})),
    # Cohere: Command R / R+ / Aya (command-r) and Command R7B / A (cohere2): LayerNorm (its own
    # epsilon key), interleaved RoPE as the checkpoint has it, the logit scale
    "command-r": GGUFArch("cohere", cohere.gguf_names, keys=frozenset({"logit_scale", "attention.layer_norm_epsilon"})),
    "cohere2": GGUFArch("cohere", cohere.gguf_names, keys=frozenset({"logit_scale", "attention.layer_norm_epsilon",
                                                                     "attention.sliding_window"})),
    # GLM-4 (glm4): four norms a layer, gate|up fused (ffn_up), RoPE on interleaved pairs of
    # part of each head, as the checkpoint has it (llama.cpp's "normal" RoPE)
    "glm4": GGUFArch("llama", llama.gguf_names),
    # GLM-4.5 / 4.6 / 4.7 (glm4moe): sigmoid routing with a choice bias (exp_probs_b), shared
    # experts, the first layers dense, RoPE on halves of part of each head; the file's last
    # nextn_predict_layers blocks are multi-token-prediction layers generation never runs
    "glm4moe": GGUFArch("llama", llama.post_attention_gguf_names, keys=_GLM4MOE_KEYS),
    # gpt-oss: attention sinks, sliding layers alternating (llama.cpp's fixed pattern), YaRN;
    # every layer sparse, the router and experts with biases, gate and up apart (MXFP4 as
    # released); its norm before the MLP is post_attention_norm
    "gpt-oss": GGUFArch("llama", llama.post_attention_gguf_names,
                        keys=frozenset({"expert_feed_forward_length", "attention.sliding_window"})),
    # Llama 4: llama's names (q/k as the checkpoint has them), chunked layers, NoPE layers and the
    # temperature at llama.cpp's fixed values (llama4_gguf_fields)
    "llama4": GGUFArch("llama", llama.gguf_names, keys=frozenset({"expert_feed_forward_length",
                                                                  "interleave_moe_layer_step",
                                                                  "attention.sliding_window"})),
    # Seed-OSS: biases on q, k, v (and on o where the file has them), its norm before the MLP
    # post_attention_norm; HunYuan: q/k normalised per head after RoPE (its NTK-alpha base written
    # as the base), Hunyuan-A13B's float32 softmax router and one shared MLP; dots.llm1: Qwen3's
    # attention with GLM-4.5's (DeepSeek-V3's) routing
    "seed_oss": GGUFArch("llama", llama.post_attention_gguf_names),
    # ERNIE 4.5 (dense): RoPE on interleaved pairs in float32 (llama.cpp's NORM rotation; the
    # converter writes q and k as the checkpoint has them)
    "ernie4_5": GGUFArch("llama", llama.gguf_names),
    # ERNIE 4.5 MoE: its attention and RoPE; softmax scores with a choice bias (exp_probs_b),
    # renormalised, shared experts ungated (expert_shared_feed_forward_length wide), sparse
    # from leading_dense_block_count on every interleave_moe_layer_step-th layer
    "ernie4_5-moe": GGUFArch("llama", llama.gguf_names, keys=frozenset({
        "expert_feed_forward_length", "expert_shared_feed_forward_length", "expert_shared_count",
        "leading_dense_block_count", "interleave_moe_layer_step"})),
    "hunyuan-dense": GGUFArch("llama", llama.gguf_names),
    "hunyuan-moe": GGUFArch("llama", llama.gguf_names, keys=frozenset({"expert_feed_forward_length",
                                                                       "expert_shared_feed_forward_length",
                                                                       "expert_shared_count"})),
    "dots1": GGUFArch("llama", llama.gguf_names, keys=_GLM4MOE_KEYS | {"expert_shared_feed_forward_length"}),
    # OLMoE: Qwen's softmax routing, never renormalised (llama.cpp's), q/k normalised over all heads
    "olmoe": GGUFArch("llama", llama.gguf_names, keys=frozenset({"expert_feed_forward_length"})),
    # DeepSeek-V3 / R1 / V3.1 and Kimi K2 (deepseek2): latent attention (as one kv head of
    # kv_lora_rank + rope dims; kv_b split in two by newer converters), GLM-4.5's routing
    "deepseek2": GGUFArch("llama", llama.gguf_names, keys=_GLM4MOE_KEYS | {
        "attention.q_lora_rank", "attention.kv_lora_rank", "attention.key_length_mla", "attention.value_length_mla",
        "rope.scaling.yarn_log_multiplier"}),
    # MiniMax-M2: sigmoid routing with its choice bias (exp_probs_b), q/k normalised over all
    # heads, RoPE on part of each head
    "minimax-m2": GGUFArch("llama", llama.gguf_names, keys=frozenset({"expert_feed_forward_length",
                                                                      "expert_gating_func"})),
    # EXAONE 4: norms after the sublayers, q/k normalised per head, sliding layers by a per-layer
    # pattern, the global ones without RoPE
    "exaone4": GGUFArch("llama", llama.gguf_names,
                        keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})),
    # K-EXAONE: EXAONE 4's attention (q/k normalised per head, sliding layers by the per-layer
    # pattern, the global ones without RoPE) in pre-norm layers; GLM-4.5's routing (sigmoid scores,
    # groups, the choice bias exp_probs_b, shared experts ungated), the first leading_dense_block_count
    # layers dense; multi-token-prediction blocks after the last layer
    "exaone-moe": GGUFArch("llama", llama.gguf_names, keys=_GLM4MOE_KEYS | {
        "expert_shared_feed_forward_length", "attention.sliding_window", "attention.sliding_window_pattern"}),
    # Qwen3-Next: three linear-attention layers of four (ssm_*), gated attention on a quarter-
    # turned head, (1 + w) norms stored as 1 + w (but the linear layers' own, ssm_norm),
    # Qwen2-MoE's experts with the shared expert's gate
    "qwen3next": GGUFArch("llama", llama.qwen3next_gguf_names, norm_shift=1.0, keys=_QWEN_NEXT_KEYS),
    # Qwen3.5 (dense, MoE): Qwen3-Next's layers with b and a apart, the v heads tiled (the
    # converter reorders them for ggml's broadcasting: ``ModelSpec.lin_v_tiled``), multimodal
    # RoPE sections (one position for text: plain RoPE), multi-token-prediction blocks after the last
    "qwen35": GGUFArch("llama", llama.qwen35_gguf_names, norm_shift=1.0, keys=_QWEN_NEXT_KEYS | _QWEN35_KEYS),
    "qwen35moe": GGUFArch("llama", llama.qwen35_gguf_names, norm_shift=1.0, keys=_QWEN_NEXT_KEYS | _QWEN35_KEYS),
    # GPT-NeoX / Pythia (gptneox) and Phi-1/1.5/2 (phi2): LayerNorms with biases (their epsilon key),
    # biases everywhere, an ungated GELU MLP, RoPE (halves) on part of each head; GPT-NeoX's q|k|v
    # fused (reordered by the converter: neox.gguf_names), its residual parallel or not (a key)
    "gptneox": GGUFArch("neox", neox.gguf_names, keys=frozenset({"attention.layer_norm_epsilon",
                                                                 "use_parallel_residual"})),
    "phi2": GGUFArch("neox", neox.gguf_names, keys=frozenset({"attention.layer_norm_epsilon"})),
    # StarCoder2 (starcoder2): the converter's generic set (TextModel: the RoPE base, the kv heads,
    # the LayerNorm's epsilon; no window, no rotated dims: every dim turns), q, k and v apart with
    # every bias, RoPE on halves (llama.cpp's NEOX type), the head the embedding where the file has no
    # output.weight; no window (gguf_neox.neox_fields)
    "starcoder2": GGUFArch("neox", neox.starcoder2_gguf_names, keys=frozenset({"attention.layer_norm_epsilon"})),
    "gemma": GGUFArch("gemma", gemma.gguf_names, norm_shift=1.0),  # Gemma 1: norms before the sublayers only
    "gemma2": GGUFArch("gemma", gemma.gguf_names, keys=_GEMMA_KEYS | {"attn_logit_softcapping"}, norm_shift=1.0),
    "gemma3": GGUFArch("gemma", gemma.gguf_names, keys=_GEMMA_KEYS, norm_shift=1.0),
}
# the metadata keys (after "{arch}.") every architecture may carry; the inert ones cannot
# change the output once the scaling type is known (a type that would use them is refused)
USED = frozenset({"block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
                  "attention.head_count", "attention.head_count_kv", "attention.key_length",
                  "attention.value_length", "attention.layer_norm_rms_epsilon", "rope.freq_base",
                  "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "expert_count",
                  "expert_used_count", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                  "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor",
                  "pooling_type"})  # an embedding model's pooling (``models/pooling.py``)
INERT = frozenset({"rope.scaling.original_context_length", "rope.scaling.finetuned"})

# llama.cpp's loader tells the 27B models by their layer count; their attention is scaled by
# hidden // heads, every other size's by the head size
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}  # every n-th layer global, where the file gives no pattern


def cohere_fields(arch: str, key: Key, tensors: set[str], layers: int) -> dict[str, Any]:
    """A command-r / cohere2 file's ``ModelSpec`` fields beyond the shared ones, as llama.cpp
    reads it: the logit scale, q/k norms and biases where the tensors are, the head tied unless
    there is an output.weight; cohere2's window on three layers of four (llama.cpp's fixed
    pattern), the fourth global and without RoPE."""
    out: dict[str, Any] = dict(logit_scale=decimal32(key("logit_scale", 1.0)),
                               norm_eps=decimal32(key("attention.layer_norm_epsilon", 1e-5)),
                               qk_norm="blk.0.attn_q_norm.weight" in tensors,
                               attention_bias="blk.0.attn_q.bias" in tensors,
                               tie_word_embeddings="output.weight" not in tensors)
    if arch == "cohere2":
        window = int(key("attention.sliding_window"))
        types = alternating(layers, 4)
        out.update(sliding_window=window, layer_types=types,
                   nope_layers=tuple(t == "full_attention" for t in types))
    return out


def gemma_fields(arch: str, key: Key, pattern: Any, layers: int, hidden: int, heads: int, head_dim: int,
                 theta: float, scaling: RopeScaling | None, has_output: bool) -> dict[str, Any]:
    """The ``ModelSpec`` fields of a gemma / gemma2 / gemma3 file beyond the shared ones, as llama.cpp
    reads the file (a ValueError names what is not computed). ``key`` reads ``{arch}.*``
    keys; ``pattern``: the raw ``attention.sliding_window_pattern`` value (None: absent);
    ``theta`` and ``scaling``: the global layers' RoPE; ``has_output``: an ``output.weight``
    tensor is in the file."""
    if arch == "gemma":  # Gemma 1: its head is the embedding, q.k scaled by the head size, nothing slides
        return dict(head_dim_override=head_dim, attn_scale=float(head_dim) ** -0.5, norm_layout="pre",
                    tie_word_embeddings=True)
    # the file has no query_pre_attn_scalar; llama.cpp's rule gives what every published
    # config holds (256 = head_dim; the 27B models' 144 and 168 = hidden // heads)
    scalar = hidden // heads if layers == _LAYERS_27B[arch] else head_dim
    out: dict[str, Any] = dict(head_dim_override=head_dim, attn_scale=float(scalar) ** -0.5,
                               qk_norm=arch == "gemma3",
                               # llama.cpp's gemma2 always reads its head from token_embd (an
                               # output.weight is then refused as unread); gemma3 takes output.weight
                               tie_word_embeddings=arch == "gemma2" or not has_output)
    if arch == "gemma2":  # llama.cpp's defaults where a key is missing (its converter writes both)
        out["attn_softcap"] = decimal32(key("attn_logit_softcapping", 50.0))
        out["final_softcap"] = decimal32(key("final_logit_softcapping", 30.0))
        if min(out["attn_softcap"], out["final_softcap"]) <= 0:
            raise ValueError("gemma2 soft-caps must be > 0: the file is corrupt; convert the model again")
    else:
        out["final_softcap"] = decimal32(key("final_logit_softcapping", 0.0))
    # gemma2 slides 4096 positions where the file says nothing (llama.cpp); gemma3 without a
    # window has no sliding layers and one RoPE for every layer (llama.cpp)
    window = int(key("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    if window <= 0:
        if arch == "gemma2":
            raise ValueError("gemma2.attention.sliding_window 0 is not supported: every other Gemma 2 layer slides")
        return out
    out.update(sliding_window=window, layer_types=sliding_layer_types(arch, pattern, layers))
    swa_base = key("rope.freq_base_swa", None)
    if arch == "gemma2":  # its sliding layers rotate as the global ones unless the file gives them a base
        if swa_base is not None and decimal32(swa_base) != theta:
            out.update(local_rope_theta=decimal32(swa_base), local_rope_scaling=scaling)
    else:  # Gemma 3's sliding layers are never scaled; base 10000 where the file gives none (older
        # converters write none; llama.cpp's value, and every published rope_local_base_freq)
        out["local_rope_theta"] = decimal32(swa_base) if swa_base is not None else 10000.0
    return out


def sliding_layer_types(arch: str, pattern: Any, layers: int) -> tuple[str, ...]:
    """llama.cpp's sliding layers: ``pattern`` a period n (layer i slides unless i % n == n - 1;
    n = 0: every layer slides) or one flag per layer (true: sliding); absent, the
    architecture's own period (Gemma 2's 2, Gemma 3's 6, as their configs' defaults)."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} flags for {layers} "
                             "layers: corrupt file?")
        slides = [bool(p) for p in pattern]
    else:
        n = _SWA_PERIOD[arch] if pattern is None else int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in slides)


# xIELU's constants as the engine computes them (the reference's defaults, which every Apertus
# checkpoint keeps): beta 0.5, and eps -1e-6 as a checkpoint stores it (float32, bfloat16 or
# float16; the converter writes each value as float32)
XIELU_BETA = 0.5
XIELU_EPS = frozenset(float(torch.tensor(-1e-6, dtype=d)) for d in (torch.float32, torch.bfloat16, torch.float16))


def _per_layer(field: Callable[[str], Any], k: str, layers: int) -> list[float]:
    """A key llama.cpp reads with ``get_key_or_arr``: one value for every layer, or an array of
    exactly one value a layer."""
    v = field(k)
    if v is None:
        raise ValueError(f"GGUF key {k} is missing: the file is incomplete; convert the model again")
    values = [float(x) for x in v] if isinstance(v, list) else [float(v)] * layers
    if len(values) != layers:
        raise ValueError(f"GGUF key {k} has {len(values)} values for {layers} layers: corrupt file?")
    if not all(math.isfinite(x) for x in values):
        raise ValueError(f"GGUF key {k} holds a value that is not finite: corrupt file?")
    return values


def layer_scalars(a: GGUFArch, field: Callable[[str], Any], layers: int) -> dict[str, list[float]]:
    """The learned scalars a layer a file keeps as metadata (``GGUFArch.scalars``), canonical
    name -> one value a layer, as llama.cpp's loader reads them. For Apertus, also its xIELU
    constants, which must be the ones the engine computes with (a ValueError names another)."""
    out = {k: _per_layer(field, key, layers) for k, key in a.scalars}
    if any(key.startswith("xielu.") for _, key in a.scalars):
        beta, eps = _per_layer(field, "xielu.beta", layers), _per_layer(field, "xielu.eps", layers)
        if any(b != XIELU_BETA for b in beta):
            raise ValueError(f"GGUF key xielu.beta {beta}: not supported (xIELU's beta is computed as 0.5)")
        if any(e not in XIELU_EPS for e in eps):
            raise ValueError(f"GGUF key xielu.eps {eps}: not supported (xIELU's eps is computed as -1e-6)")
    return out


QWEN2_ARCHS = ("qwen2", "qwen2moe")  # q/k/v biases always, no output bias
HUNYUAN_ARCHS = ("hunyuan-dense", "hunyuan-moe")  # q/k normalised per head after RoPE
GLM_ARCHS = ("glm4", "glm4moe")  # q/k/v biases where the file has them, never an output bias
ERNIE_ARCHS = ("ernie4_5", "ernie4_5-moe")  # RoPE on interleaved pairs in float32


def llama_fields(arch: str, key: Any, tensors: dict[str, Any], head_dim_override: int, experts: int
                  ) -> dict[str, Any]:
    """The LLaMA family's ModelSpec fields of a file, beyond the shared ones."""
    fields = dict(
        head_dim_override=head_dim_override,
        sliding_window=int(key("attention.sliding_window", 0)),
        tie_word_embeddings="output.weight" not in tensors,
        # Qwen2's (and Qwen2-MoE's) q/k/v biases are part of the architecture; a llama file has
        # biases or not
        qkv_bias=arch in QWEN2_ARCHS or (arch in GLM_ARCHS and "blk.0.attn_q.bias" in tensors)
        or (arch == "seed_oss" and "blk.0.attn_q.bias" in tensors and "blk.0.attn_output.bias" not in tensors),
        attention_bias=arch not in (*QWEN2_ARCHS, *GLM_ARCHS) and "blk.0.attn_q.bias" in tensors
        and (arch != "seed_oss" or "blk.0.attn_output.bias" in tensors),
        qk_norm=arch in ("qwen3", "qwen3moe", "minimax-m2", "olmoe", "dots1", "apertus", "exaone-moe", *QWEN_NEXT_ARCHS,
                         *HUNYUAN_ARCHS)
        or (arch == "glm4moe" and "blk.0.attn_q_norm.weight" in tensors),
        qk_norm_after_rope=arch in HUNYUAN_ARCHS,
        qk_norm_whole=arch in ("minimax-m2", "olmoe"),
        fused_proj=arch == "phi3" and "blk.0.attn_qkv.weight" in tensors,
        **(dict(norm_layout="sandwich", fused_mlp=True, rope_interleaved=True) if arch == "glm4" else {}),
        **(dict(rope_interleaved=True, rope_fp32=True) if arch in ERNIE_ARCHS else {}),
        mlp_bias="blk.0.ffn_up.bias" in tensors, **moe_fields(arch, key, experts, tensors),
        **_granite_fields(arch, key),
        **({"nope_layers": every_nth(int(key("block_count")), 4)} if arch == "smollm3" else {}),
        **({"mlp_activation": {"arcee": "relu2", "apertus": "xielu"}[arch]} if arch in ("arcee", "apertus") else {}),
        **(_gpt_oss_fields(key) if arch == "gpt-oss" else {}))
    if arch == "llama4":
        fields.update(llama4_gguf_fields(key, experts))
    if arch in QWEN_NEXT_ARCHS:
        fields.update(qwen3next_gguf_fields(key, arch))
    return {**fields, **mla_fields(key)} if arch == "deepseek2" else fields


def qwen3next_gguf_fields(key: Any, arch: str) -> dict[str, Any]:
    """Qwen3-Next's (and Qwen3.5's) fields as llama.cpp's loader reads them: every
    ``full_attention_interval``-th layer attends, the others are linear (``ssm.group_count`` k
    heads of ``ssm.state_size``, ``ssm.time_step_rank`` v heads sharing ``ssm.inner_size``,
    ``ssm.conv_kernel`` taps); Qwen3.5's files hold the v heads tiled."""
    n, every = int(key("block_count")) - nextn(key, arch), int(key("full_attention_interval", 4))
    v_heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    if every < 1 or not v_heads or inner % v_heads:
        raise ValueError(f"qwen3next.full_attention_interval {every}, ssm.time_step_rank {v_heads} and "
                         f"ssm.inner_size {inner}: not a Qwen3-Next file's; corrupt file?")
    return dict(layer_types=tuple("full_attention" if (j + 1) % every == 0 else "linear_attention" for j in range(n)),
                lin_k_heads=int(key("ssm.group_count")), lin_v_heads=v_heads, lin_k_dim=int(key("ssm.state_size")),
                lin_v_dim=inner // v_heads, lin_conv_kernel=int(key("ssm.conv_kernel")), attn_output_gate=True,
                norm_unit_offset=True, lin_v_tiled=arch != "qwen3next")


def llama4_gguf_fields(key: Any, experts: int) -> dict[str, Any]:
    """Llama 4 as llama.cpp's loader fixes what the file does not say: chunks of 8192 on three
    layers of four, the fourth global without RoPE and with the attention temperature (floor
    8192, scale 0.1, positions from 1); q/k normalised after RoPE except on the 128-expert
    model (Maverick); RoPE on interleaved pairs. A file whose window is 0 has neither chunks
    nor NoPE layers (every layer turns)."""
    n = int(key("block_count"))
    out: dict[str, Any] = dict(rope_interleaved=True, qk_l2_norm=experts != 128)
    if int(key("attention.sliding_window", 8192)) == 0:
        return out
    out.update(nope_layers=every_nth(n, 4), sliding_window=8192,
               layer_types=tuple("full_attention" if g else "chunked_attention" for g in every_nth(n, 4)),
               attn_temp_nope=True, attn_temp_beta=0.1, attn_temp_len=8192)
    return out


def _gpt_oss_fields(key: Any) -> dict[str, Any]:
    """gpt-oss as llama.cpp runs it: sinks, the even-numbered layers sliding, norms multiplying
    their weights in float32, and its experts (a softmax over the top logits of a biased
    router, biased experts, the clamped gate at llama.cpp's fixed alpha 1.702 and limit 7)."""
    layers, window = int(key("block_count")), int(key("attention.sliding_window", 0))
    return dict(attn_sinks=True, norm_weight_fp32=True, router_scoring="topk_softmax", router_bias=True,
                expert_bias=True, swiglu_alpha=1.702, swiglu_limit=7.0, norm_topk_prob=True,
                **({"layer_types": alternating(layers, 2)} if window else {}))


def post_norm_fields(arch: str, key: Any, pattern: Any, layers: int) -> dict[str, Any]:
    """The fields of the files whose norms follow the sublayers: OLMo 2/3 (q/k normalised over
    all heads, OLMo 3's window on the layers the pattern marks, one flag per layer, True:
    sliding) and EXAONE 4 (q/k per head; with a window, the layers the pattern leaves global
    turn no RoPE, as the reference)."""
    if arch == "olmo2":
        out: dict[str, Any] = dict(norm_layout="post", norm_weight_fp32=True, qk_norm=True, qk_norm_whole=True)
    else:
        out = dict(norm_layout="post", qk_norm=True)
    if int(key("attention.sliding_window", 0)) and pattern is None and arch == "exaone4":
        raise ValueError("exaone4 file with a sliding window but no attention.sliding_window_pattern: which layers "
                         "slide is unknown; convert the model again")
    if int(key("attention.sliding_window", 0)) and pattern is not None:
        out["layer_types"] = sliding_layer_types(arch, pattern, layers)
        if arch == "exaone4":
            out["nope_layers"] = tuple(t == "full_attention" for t in out["layer_types"])
    return out


def _granite_fields(arch: str, key: Any) -> dict[str, Any]:
    """Granite's multipliers as llama.cpp reads them: a key the converter left out (it writes
    only non-zero ones) scales nothing, and the softmax scale is then head_dim ** -0.5."""
    if arch != "granite":
        return {}
    return {f: decimal32(float(key(k))) for f, k in (("embed_multiplier", "embedding_scale"),
                                                     ("residual_multiplier", "residual_scale"),
                                                     ("logits_divisor", "logit_scale"),
                                                     ("attn_scale", "attention.scale")) if key(k, 0.0)}


def exaone_moe_fields(key: Any, pattern: Any, layers: int) -> dict[str, Any]:
    """K-EXAONE's attention as llama.cpp's ``exaone-moe`` graph runs it: the window on the layers
    the per-layer pattern marks (one flag per layer; flags for the prediction blocks after the
    last layer, where the file has them, are never read), RoPE on those alone (the global layers
    without, as the reference). A file without a window or its pattern is refused: llama.cpp
    would turn RoPE on no layer, transformers (no window) on every one."""
    window = int(key("attention.sliding_window", 0))
    if not window or pattern is None:
        raise ValueError("exaone-moe file without attention.sliding_window and a per-layer "
                         "attention.sliding_window_pattern: which layers turn RoPE is unknown (llama.cpp turns it "
                         "on the sliding layers alone); not supported")
    if isinstance(pattern, list) and len(pattern) == int(key("block_count")) != layers:
        pattern = pattern[:layers]
    types = sliding_layer_types("exaone-moe", pattern, layers)
    return dict(sliding_window=window, layer_types=types, nope_layers=tuple(t == "full_attention" for t in types))
