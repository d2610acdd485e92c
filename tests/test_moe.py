"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy tokens equal transformers' in
float32 from Hugging Face directories and GGUF files, at 1 rank and 2, with weights partly on
disk and the cache in RAM; only the experts a run's tokens choose are read (counted); the cost
model's expected count beside the measured one; bad configurations refused in one line."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PROMPTS, TinyModel, read_jsonl, reference_generate, write_jsonl
from flexgen_dist import LLM
from flexgen_dist.distributed.partition import partition_layers
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.gguf_file import GGUFFile
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.registry import get_spec
from flexgen_dist.models.spec import ModelSpec

GEN = 6
OFFLOAD = (0, 40, 0, 100, 100, 0)  # 40 % of the weights in RAM, the rest on disk; the cache in RAM
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
               eos_token_id=255)


def _configs() -> dict:
    from transformers import (DeepseekV2Config, DeepseekV3Config, Dots1Config, ExaoneMoeConfig, GraniteMoeSWAConfig,
                              HunYuanMoEV1Config, Ernie4_5_MoeConfig, Glm4MoeConfig, GraniteMoeConfig,
                              GraniteMoeSharedConfig, MiniMaxM2Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig,
                              Qwen3MoeConfig)

    deepseek = dict({**_COMMON, "num_key_value_heads": 4}, moe_intermediate_size=48, n_routed_experts=8,
                    num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                    routed_scaling_factor=2.5, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

    granite = dict(_COMMON, num_local_experts=8, num_experts_per_tok=2, embedding_multiplier=6.0,
                   residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.0)

    # experts 64 wide: every matrix splits into 32-element blocks, so a Q8_0 file holds them all packed
    glm = dict(_COMMON, head_dim=32, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
               n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True)

    return {
        "mixtral": MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2),
        "qwen2_moe": Qwen2MoeConfig(**_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                    shared_expert_intermediate_size=80),
        # dense MLPs on layer 0 (mlp_only_layers) and layer 2 (decoder_sparse_step 2 keeps 1 and 3)
        "qwen3_moe": Qwen3MoeConfig(**_COMMON, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0, 2]),
        "qwen3_moe-step": Qwen3MoeConfig(**_COMMON, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                         decoder_sparse_step=2),
        # GLM-4.5: sigmoid routing with a choice bias, shared experts, layer 0 dense, half of
        # each head turned; -groups: 4 groups of 2 experts, the best one kept; q/k normalised
        "glm4_moe": Glm4MoeConfig(**glm, n_group=1, topk_group=1),
        "glm4_moe-groups": Glm4MoeConfig(**{**glm, "num_experts_per_tok": 2, "norm_topk_prob": False},
                                         n_group=4, topk_group=1, use_qk_norm=True),
        # MiniMax-M2: sigmoid routing with a choice bias in the model's dtype, q/k normalised over
        # all heads, half of each head turned (its configs' legacy rotary_dim)
        # ERNIE 4.5: softmax scores with a choice bias, a shared expert, layer 0 dense, RoPE on
        # interleaved pairs in float32
        "ernie4_5_moe": Ernie4_5_MoeConfig(**{**_COMMON, "tie_word_embeddings": False}, moe_num_experts=8, moe_k=3,
                                           moe_intermediate_size=48, moe_num_shared_experts=1, moe_layer_start_index=1),
        # DeepSeek-V3: latent attention (q through a rank-24 bottleneck; RoPE on interleaved pairs),
        # GLM-4.5's grouped sigmoid routing; -yarn: q straight from x, RoPE on halves, YaRN with
        # mscale_all_dim (the softmax scale grows with it)
        "deepseek_v3": DeepseekV3Config(**deepseek, q_lora_rank=24),
        "deepseek_v3-yarn": DeepseekV3Config(**deepseek, q_lora_rank=None, rope_interleave=False, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}),
        # Granite 3.x MoE: a softmax over the top logits, Granite's multipliers; -shared: an
        # ungated shared expert
        # DeepSeek-V2: the same latent attention (q straight from x, as V2-Lite), softmax routing
        # never renormalised, times the scaling; -groups: within the best 2 of 4 groups, a group
        # ranked by its best score (group_limited_greedy), q through its bottleneck
        "deepseek_v2": DeepseekV2Config(**{k: v for k, v in deepseek.items() if k not in ("n_group", "topk_group")},
                                        q_lora_rank=None, topk_method="greedy"),
        "deepseek_v2-groups": DeepseekV2Config(**{**deepseek, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
                                               q_lora_rank=24, topk_method="group_limited_greedy"),
        # dots.llm1: Qwen3's attention (q/k norms) with DeepSeek-V3's routing, a dense first layer
        "dots1": Dots1Config(**{**_COMMON, "rms_norm_eps": 1e-6}, moe_intermediate_size=48, n_routed_experts=8,
                             num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                             first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True),
        # Hunyuan-A13B: a float32 router's softmax, renormalised, a shared MLP; q/k normalised
        # after RoPE, NTK-alpha RoPE
        "hunyuan_v1_moe": HunYuanMoEV1Config(**{**_COMMON, "head_dim": 16}, num_experts=8, moe_topk=2,
                                             rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                                              "rope_theta": 10000.0}),
        # K-EXAONE: EXAONE 4's attention (q/k norms, three sliding layers of four, the global
        # ones without RoPE) in pre-norm layers, DeepSeek-V3's routing
        "exaone_moe": ExaoneMoeConfig(**_COMMON, sliding_window=4, moe_intermediate_size=48, num_experts=8,
                                      num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                      topk_group=1, routed_scaling_factor=2.5),
        "granitemoe": GraniteMoeConfig(**granite),
        "granitemoeshared": GraniteMoeSharedConfig(**granite, shared_intermediate_size=80),
        # Granite MoE SWA: and sliding layers with sinks, the global layer without RoPE
        "granitemoe_swa": GraniteMoeSWAConfig(**granite, shared_intermediate_size=80, sliding_window=4,
                                              layer_rope_theta=[0, 10000.0, 10000.0, 10000.0]),
        # OLMoE: Qwen's routing not renormalised, q/k normalised over all heads
        "olmoe": OlmoeConfig(**{**_COMMON, "rms_norm_eps": 1e-5}, num_experts=8, num_experts_per_tok=2),
        # (its partial RoPE said both ways: transformers before 5.2x reads partial_rotary_factor
        # alone, the released checkpoints say rotary_dim, which later versions read too)
        "minimax_m2": MiniMaxM2Config(**{**_COMMON, "head_dim": 32}, num_local_experts=8, num_experts_per_tok=3,
                                      rotary_dim=16, partial_rotary_factor=0.5),
    }


def _sharpen_(m: torch.nn.Module, kind: str) -> torch.nn.Module:
    with torch.no_grad():  # the choice biases start at zero: give them values that change choices
        for name, b in [*m.named_buffers(), *m.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.3)
            if name.endswith(("q_b_proj.weight", "self_attn.q_proj.weight", "kv_b_proj.weight")) and "deepseek" in kind:
                b.mul_(4)  # sharp latent attention, so that positions and scales show
            if name.endswith("mlp.gate.weight") and "deepseek_v2" in kind:  # its router starts at zero
                b.normal_(0, 0.5)
            if name.endswith("self_attn.sinks"):  # zero-initialised: give them values
                b.normal_(0, 1.0)
    return m


def _model(kind: str, path: Path) -> TinyModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    m = _sharpen_(AutoModelForCausalLM.from_config(_configs()[kind]).eval(), kind)
    m.save_pretrained(path)
    return TinyModel(kind, path, m, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    return {k: _model(k, tmp_path_factory.mktemp(k)) for k in _configs()}


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe-step", "glm4_moe",
                                  "glm4_moe-groups", "minimax_m2", "olmoe", "ernie4_5_moe", "granitemoe",
                                  "granitemoeshared", "deepseek_v3", "deepseek_v3-yarn", "deepseek_v2",
                                  "deepseek_v2-groups", "dots1", "hunyuan_v1_moe", "granitemoe_swa", "exaone_moe"])
@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_greedy_tokens_match_transformers(models: dict, kind: str, placement: str, tmp_path: Path) -> None:
    tm = models[kind]
    ref = reference_generate(tm, PROMPTS, GEN)
    pct = (100, 0, 100, 0, 100, 0) if placement == "resident" else OFFLOAD
    with LLM(str(tm.path), percent=pct, gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"),
             ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] == ref
        spec = llm.model.spec
        experts = llm.metrics["experts"][0]
    bias = sum(b.numel() for n, b in tm.model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert spec.total_numel() == sum(p.numel() for p in tm.model.parameters()) + bias
    assert experts["routings"] > 0 and experts["experts_chosen"] > 0
    if placement == "offloaded":
        assert experts["bytes_moved"] > 0


def test_the_spec_carries_what_the_config_says(models: dict) -> None:
    mix = load_model(str(models["mixtral"].path), load_tokenizer=False).spec
    assert (mix.num_experts, mix.experts_per_tok, mix.expert_ffn_size) == (8, 2, 96)
    assert mix.norm_topk_prob and mix.router_weights_fp32 and not mix.shared_expert_ffn_size
    q2 = load_model(str(models["qwen2_moe"].path), load_tokenizer=False).spec
    assert (q2.expert_ffn_size, q2.shared_expert_ffn_size, q2.norm_topk_prob, q2.qkv_bias) == (48, 80, False, True)
    q3 = load_model(str(models["qwen3_moe"].path), load_tokenizer=False).spec
    assert q3.moe_layers == (False, True, False, True) and q3.qk_norm and q3.norm_topk_prob
    step = load_model(str(models["qwen3_moe-step"].path), load_tokenizer=False).spec
    assert step.moe_layers == (False, True, False, True)
    glm = load_model(str(models["glm4_moe-groups"].path), load_tokenizer=False).spec
    assert (glm.router_scoring, glm.router_fp32, glm.expert_groups, glm.expert_groups_used, glm.routed_scaling) == (
        "sigmoid", True, 4, 1, 2.5)
    assert (glm.shared_expert_ffn_size, glm.shared_expert_gated, glm.moe_layers, glm.rotary_dim, glm.qkv_bias) == (
        128, False, (False, True, True, True), 16, True) and glm.qk_norm and not glm.norm_topk_prob
    er = load_model(str(models["ernie4_5_moe"].path), load_tokenizer=False).spec
    assert (er.router_scoring, er.router_choice_bias, er.router_fp32, er.router_norm_min, er.moe_layers) == (
        "softmax", True, True, 1e-12, (False, True, True, True))
    assert er.rope_interleaved and er.rope_fp32 and (er.shared_expert_ffn_size, er.shared_expert_gated) == (48, False)
    ds = load_model(str(models["deepseek_v3-yarn"].path), load_tokenizer=False).spec
    assert (ds.kv_lora_rank, ds.q_lora_rank, ds.num_kv_heads, ds.head_dim, ds.rope_interleaved) == (32, 0, 1, 40, False)
    assert ds.attn_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(4.0) + 1) ** 2) and ds.expert_groups == 2
    mm = load_model(str(models["minimax_m2"].path), load_tokenizer=False).spec
    assert (mm.router_scoring, mm.router_fp32, mm.rotary_dim, mm.qk_norm_whole, mm.norm_topk_prob) == (
        "sigmoid", False, 16, True, True)


def test_a_small_batch_reads_only_the_chosen_experts(models: dict, tmp_path: Path) -> None:
    """One sequence, every expert on disk: each decode step reads the experts its token chose
    (2 of 8 per sparse layer), counted in bytes, near the cost model's expectation."""
    tm = models["mixtral"]
    ref = reference_generate(tm, PROMPTS[:1], 8)
    with LLM(str(tm.path), percent=(0, 0, 100, 0, 100, 0), gpu_batch_size=1, num_gpu_batches=1,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS[:1], gen_len=8)] == ref
        m = llm.metrics
    ex = m["experts"][0]
    assert 0 < ex["bytes_moved"] < 0.5 * ex["bytes_possible"], ex
    assert ex["experts_loaded_fraction"] < 0.5
    # decode steps route one token: exactly 2 experts each; the prefill routes the prompt's tokens
    assert ex["experts_chosen"] <= ex["experts_expected"] * 1.15 + 8, ex
    assert m["stage_times"][0]["disk_bytes_read"] < (8 * 4 + 1) * ex["bytes_possible"] / ex["loads"]


def test_cost_model_expected_experts() -> None:
    s = get_spec("mixtral-8x7b")
    assert s.experts_touched(1) == pytest.approx(2.0)
    assert s.experts_touched(0) == 0.0
    assert s.experts_touched(1000) == pytest.approx(8.0)
    assert s.experts_touched(4) == pytest.approx(8 * (1 - 0.75 ** 4))


@pytest.mark.parametrize("name,total,active", [("mixtral-8x7b", 46.7, 12.9), ("mixtral-8x22b", 140.6, 39.2),
                                               ("qwen2-57b-a14b", 57.4, 14.3), ("qwen3-30b-a3b", 30.5, 3.3),
                                               ("qwen3-235b-a22b", 235.1, 22.2), ("olmoe-1b-7b", 6.92, 1.28),
                                               ("deepseek-v3", 671.0, 37.6), ("kimi-k2", 1026.4, 32.9)])
def test_registry_shapes_have_the_published_sizes(name: str, total: float, active: float) -> None:
    s = get_spec(name)
    assert s.total_numel() / 1e9 == pytest.approx(total, abs=0.1)
    act = s.embed_numel() + s.head_numel() + sum(s.active_layer_numel(j) for j in range(s.num_layers))
    assert act / 1e9 == pytest.approx(active, abs=0.1)


@pytest.mark.parametrize("name,total,active", [("glm-4.5-air", 106, 12), ("glm-4.5", 355, 32), ("glm-4.6", 355, 32),
                                               ("minimax-m2", 230, 10)])
def test_sigmoid_routed_shapes_have_the_published_sizes(name: str, total: float, active: float) -> None:
    """GLM-4.5-Air: 106B parameters, 12B active; GLM-4.5 / 4.6: 355B, 32B active; MiniMax-M2:
    230B, 10B active (the model cards' rounded figures, within 1 %: the shapes leave out the
    multi-token-prediction layers, which generation never runs; the active count is without
    the embedding and head). GLM's first layers are dense."""
    s = get_spec(name)
    assert s.total_numel() / 1e9 == pytest.approx(total, rel=0.01)
    act = sum(s.active_layer_numel(j) for j in range(s.num_layers))
    assert act / 1e9 == pytest.approx(active, abs=0.5)
    assert s.router_scoring == "sigmoid" and s.is_moe(0) == name.startswith("minimax") and s.is_moe(s.num_layers - 1)


def test_ernie_shape_has_the_published_size() -> None:
    """ERNIE-4.5-21B-A3B: 21.8B parameters (the checkpoint's count), 3B active without the
    (tied) embedding."""
    s = get_spec("ernie-4.5-21b-a3b")
    assert s.total_numel() / 1e9 == pytest.approx(21.8, abs=0.05)
    assert sum(s.active_layer_numel(j) for j in range(s.num_layers)) / 1e9 == pytest.approx(3.0, abs=0.1)
    assert s.has_choice_bias and s.router_scoring == "softmax" and not s.is_moe(0)


def test_layers_are_split_by_what_they_weigh() -> None:
    """Dense and sparse layers weigh differently: the split balances bytes and compute; a model
    whose layers are alike keeps the equal split."""
    s = ModelSpec(name="m", family="llama", num_layers=6, hidden_size=64, ffn_size=64, num_heads=4,
                  vocab_size=100, max_positions=64, num_experts=8, experts_per_tok=2, expert_ffn_size=64,
                  moe_layers=(False, False, False, True, True, True))
    w = s.layer_weights()
    assert w is not None and w[3] > w[0]
    ranges = partition_layers(6, 2, None, w)
    assert ranges[0][1] > 3  # the dense layers go together, more of them on the first stage
    assert get_spec("mixtral-8x7b").layer_weights() is None
    assert partition_layers(32, 4, None, None) == partition_layers(32, 4)


@pytest.mark.parametrize("edit,match", [
    ({"model_type": "dbrx"}, "mixture-of-experts family 'dbrx' is not supported"),
    ({"model_type": "hunyuan_v1_moe", "num_experts": 8, "moe_topk": [2, 3, 2, 2]}, "moe_topk .2, 3, 2, 2.: one count"),
    ({"model_type": "hunyuan_v1_moe", "num_experts": 8, "moe_topk": 2, "moe_intermediate_size": [50] * 4},
     "moe_intermediate_size .50, 50, 50, 50. / num_shared_expert None other than intermediate_size 96"),
    ({"model_type": "deepseek_v2"}, "config.json has no 'kv_lora_rank', which a deepseek_v2 model needs"),
    ({"model_type": "jamba"}, "mixture-of-experts family 'jamba' is not supported"),
    ({"num_experts_per_tok": 9}, "experts_per_tok=9: must be between 1 and num_experts=8"),
    ({"hidden_act": "gelu"}, "mixtral with hidden_act='gelu' is not supported"),
])
def test_what_is_not_computed_is_refused_in_one_line(models: dict, edit: dict, match: str, tmp_path: Path) -> None:
    src = models["mixtral"].path
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(d), load_tokenizer=False)
    assert "\n" not in str(info.value)


def test_a_missing_expert_is_named(models: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = models["qwen2_moe"].path
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    del sd["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.experts.5.up_proj.weight missing") as info:
        with LLM(str(d), progress=False) as llm:
            llm.generate([[3, 4, 5]], gen_len=1)
    assert "\n" not in str(info.value)


def _gguf_model(kind: str, qtype: str | None, path: Path, **write) -> TinyModel:
    from gguf_convert import roundtrip_, write_gguf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    cfg = _configs()[kind]
    cfg.vocab_size = 49152  # the GGUF's tokenizer is the bundled one
    if kind.startswith("deepseek_v3"):  # llama.cpp turns interleaved pairs (its converter leaves the rows as they are)
        cfg.rope_interleave = True
    if kind == "dots1":  # one group, as dots.llm1 has it (its converter writes no group keys)
        cfg.n_group = cfg.topk_group = 1
    if kind == "ernie4_5_moe":  # two shared experts, as released: the converter writes their width as
        # intermediate_size // kv heads (192 // 2 = 2 x 48), which llama.cpp's loader requires of their tensors
        cfg.moe_num_shared_experts, cfg.intermediate_size = 2, 192
    if kind == "exaone_moe":  # one prediction layer, as K-EXAONE has it (the converter appends it; never read);
        # experts 64 wide: every matrix splits into 32-element blocks (a Q8_0 file holds them all packed)
        cfg.num_nextn_predict_layers, cfg.moe_intermediate_size = 1, 64
    path.mkdir(parents=True, exist_ok=True)
    m = _sharpen_(AutoModelForCausalLM.from_config(cfg).eval(), kind)
    if kind in ("ernie4_5_moe", "exaone_moe"):
        _vary_(m)
    if qtype:
        roundtrip_(m, qtype)
    return TinyModel(kind, write_gguf(m, path / f"{kind}.gguf", qtype, **write), m, 0)


@pytest.mark.bundled
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "glm4_moe-groups", "minimax_m2",
                                  "olmoe", "deepseek_v3", "deepseek_v3-yarn", "deepseek_v2", "dots1",
                                  "hunyuan_v1_moe"])
@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_gguf_files_match_transformers(kind: str, qtype: str | None, tmp_path: Path) -> None:
    """llama.cpp's layout (experts stacked in 3-D tensors, Mixtral as ``llama`` with experts;
    DeepSeek-V3's kv_b split in two), float32 or Q8_0 (kept packed under --compress-weight,
    transformers run on the same values; the tiny DeepSeek's q_b, whose rows of 24 are no
    Q8_0 blocks, stays float32 and would be compressed by the engine: its Q8_0 file runs
    without --compress-weight)."""
    tm = _gguf_model(kind, qtype, tmp_path)
    ref = reference_generate(tm, PROMPTS[:3], 4)
    with LLM(str(tm.path), percent=OFFLOAD, gpu_batch_size=1, num_gpu_batches=3, offload_dir=str(tmp_path / "off"),
             compress_weight=bool(qtype) and "deepseek" not in kind, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS[:3], gen_len=4)] == ref


def _vary_(m: torch.nn.Module) -> None:
    """Norms away from 1 (each one's weight then shows where it is read) and a router whose
    scores differ across experts as much as the choice bias (both then decide the choice)."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.1)


def _ernie_bias(m: torch.nn.Module, layer: int) -> torch.Tensor:
    return m.model.layers[layer].mlp.gate.moe_statics.e_score_correction_bias.detach()


@pytest.mark.bundled
@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_ernie_moe_gguf_files_run_as_their_directories(qtype: str | None, tmp_path: Path) -> None:
    """ERNIE 4.5 MoE as llama.cpp's converter writes it (``ernie4_5-moe``): the router as
    ``ffn_gate_inp``, the choice bias as ``exp_probs_b.bias`` (1 x experts, as the checkpoint
    holds it), the stacked experts, two shared experts as one ``*_shexp`` MLP, layer 0 dense
    (``leading_dense_block_count``), RoPE on interleaved pairs in float32. The file gives the
    HF directory's spec and transformers' tokens (weights partly on disk; Q8_0 kept packed);
    the bias as older converters wrote it (they squeezed every tensor: one dim) reads alike;
    and the bias decides choices here (zeroed, the tokens differ), so a misread one would show."""
    from gguf_convert import rewrite

    tm = _gguf_model("ernie4_5_moe", qtype, tmp_path)
    tm.model.save_pretrained(tmp_path / "hf")
    ours = load_model(str(tm.path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    # the stop and padding ids are the file's tokenizer's (the bundled SmolLM2's)
    assert replace(ours, name=ref.name, eos_token_ids=ref.eos_token_ids, pad_token_id=ref.pad_token_id) == ref
    assert (ref.moe_layers, ref.shared_expert_ffn_size, ref.router_choice_bias, ref.rope_interleaved) == (
        (False, True, True, True), 96, True, True)
    want = reference_generate(tm, PROMPTS, GEN)
    with LLM(str(tm.path), percent=OFFLOAD, gpu_batch_size=2, num_gpu_batches=3, offload_dir=str(tmp_path / "off"),
             compress_weight=bool(qtype), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] == want
        assert llm.model.spec.total_numel() == sum(p.numel() for p in tm.model.parameters())
    if qtype:
        return
    squeezed = rewrite(tm.path, tmp_path / "squeezed.gguf", tokenizer=True, tensors={
        f"blk.{j}.exp_probs_b.bias": _ernie_bias(tm.model, j).numpy().reshape(-1) for j in (1, 2, 3)})
    zeroed = rewrite(tm.path, tmp_path / "zeroed.gguf", tokenizer=True, tensors={
        f"blk.{j}.exp_probs_b.bias": np.zeros((1, 8), np.float32) for j in (1, 2, 3)})
    assert [len(t.shape) for t in GGUFFile(squeezed).tensors if t.name == "blk.1.exp_probs_b.bias"] == [1]
    for path, same in ((squeezed, True), (zeroed, False)):
        with LLM(str(path), ignore_eos=True, progress=False) as llm:
            assert ([c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] == want) == same, path.name


@pytest.mark.bundled
@pytest.mark.parametrize("change,match", [
    ({"ernie4_5-moe.leading_dense_block_count": 2}, r"routers \(ffn_gate_inp\) on layers 1, 2, 3, but "
     r"leading_dense_block_count 2 and interleave_moe_layer_step 1 make layers 2, 3 sparse"),
    ({"ernie4_5-moe.interleave_moe_layer_step": 2}, "interleave_moe_layer_step 2 make layers 1, 3 sparse"),
    ({"ernie4_5-moe.interleave_moe_layer_step": 0}, "interleave_moe_layer_step 0: must be >= 1"),
    ({"ernie4_5-moe.leading_dense_block_count": None}, "GGUF key ernie4_5-moe.leading_dense_block_count is missing"),
    ({"ernie4_5-moe.expert_gating_func": 2}, "GGUF key ernie4_5-moe.expert_gating_func is not computed"),
])
def test_ernie_moe_files_we_would_misread_are_refused(change: dict, match: str, tmp_path: Path) -> None:
    """Sparse layers that are not the ones llama.cpp runs from the file's keys (a config whose
    sparse range ends before the last layer has no key for it), a missing key, a key the
    engine does not compute: each refused in one line."""
    _refused("ernie4_5_moe", change, match, tmp_path)


@pytest.mark.bundled
@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_exaone_moe_gguf_files_run_as_their_directories(qtype: str | None, tmp_path: Path) -> None:
    """K-EXAONE as llama.cpp's converter writes it (``exaone-moe``): the router as
    ``ffn_gate_inp``, the choice bias as ``exp_probs_b.bias``, the stacked experts, the shared
    experts as one ``*_shexp`` MLP (``expert_shared_feed_forward_length`` wide), layer 0 dense
    (``leading_dense_block_count``), the routing keys (scale, renormalisation, groups), q/k
    norms, the sliding layers by the per-layer pattern with the global one turning no RoPE, a
    prediction block after the last layer. The file gives the HF directory's spec and
    transformers' tokens on prompts longer than the window (weights partly on disk; Q8_0 kept
    packed); the choice bias decides choices here (zeroed, the tokens differ)."""
    from gguf_convert import rewrite

    tm = _gguf_model("exaone_moe", qtype, tmp_path)
    tm.model.save_pretrained(tmp_path / "hf")
    f = GGUFFile(tm.path)
    assert f.fields["exaone-moe.block_count"].contents() == 5
    assert {"blk.4.nextn.eh_proj.weight", "blk.1.exp_probs_b.bias", "blk.1.ffn_up_shexp.weight",
            "blk.1.ffn_gate_exps.weight", "blk.0.ffn_gate.weight"} <= {t.name for t in f.tensors}
    ours = load_model(str(tm.path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    # the stop and padding ids are the file's tokenizer's (the bundled SmolLM2's)
    assert replace(ours, name=ref.name, eos_token_ids=ref.eos_token_ids, pad_token_id=ref.pad_token_id) == ref
    assert (ref.num_layers, ref.moe_layers, ref.shared_expert_ffn_size, ref.norm_layout, ref.qk_norm) == (
        4, (False, True, True, True), 64, "pre", True)
    assert (ref.sliding_window, ref.nope_layers, ref.routed_scaling, ref.expert_groups, ref.norm_topk_prob) == (
        4, (False, False, False, True), 2.5, 2, True)
    assert max(map(len, PROMPTS)) > ref.sliding_window
    want = reference_generate(tm, PROMPTS, GEN)
    with LLM(str(tm.path), percent=OFFLOAD, gpu_batch_size=2, num_gpu_batches=3, offload_dir=str(tmp_path / "off"),
             compress_weight=bool(qtype), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] == want
        bias = sum(b.numel() for n, b in tm.model.named_buffers() if n.endswith("e_score_correction_bias"))
        assert llm.model.spec.total_numel() == sum(p.numel() for p in tm.model.parameters()) + bias
    if qtype:
        return
    zeroed = rewrite(tm.path, tmp_path / "zeroed.gguf", tokenizer=True, tensors={
        f"blk.{j}.exp_probs_b.bias": np.zeros(8, np.float32) for j in (1, 2, 3, 4)})
    with LLM(str(zeroed), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] != want


@pytest.mark.bundled
@pytest.mark.parametrize("change,match", [
    ({"exaone-moe.leading_dense_block_count": 2}, r"routers \(ffn_gate_inp\) on layers 1, 2, 3, but "
     r"leading_dense_block_count 2 makes layers 2, 3 sparse"),
    ({"exaone-moe.expert_gating_func": 1}, r"exaone-moe.expert_gating_func 1 is not supported \(2: sigmoid\)"),
    ({"exaone-moe.attention.sliding_window": None}, "without attention.sliding_window and a per-layer"),
    ({"exaone-moe.attention.sliding_window_pattern": None}, "without attention.sliding_window and a per-layer"),
    ({"exaone-moe.attention.sliding_window_pattern": [True, True, False]}, "has 3 flags for 4 layers"),
    ({"exaone-moe.nextn_predict_layers": 5}, "nextn_predict_layers 5 of 5 blocks"),
    ({"exaone-moe.interleave_moe_layer_step": 1}, "GGUF key exaone-moe.interleave_moe_layer_step is not computed"),
])
def test_exaone_moe_files_we_would_misread_are_refused(change: dict, match: str, tmp_path: Path) -> None:
    """Sparse layers other than the ones llama.cpp builds from leading_dense_block_count, a
    gating function other than sigmoid, no window or no per-layer pattern (which layers turn
    RoPE is then unknown), a pattern of the wrong length, prediction blocks that leave no
    layer, a key the engine does not compute: each refused in one line."""
    _refused("exaone_moe", change, match, tmp_path)


def _refused(kind: str, change: dict, match: str, tmp_path: Path) -> None:
    """A ``kind`` file rewritten with ``change`` is refused in one line matching ``match``."""
    from gguf_convert import rewrite

    src = _gguf_model(kind, None, tmp_path)
    bad = rewrite(src.path, tmp_path / "bad.gguf", change, tokenizer=True)
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(bad), load_tokenizer=False)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "glm4_moe-groups", "deepseek_v3"])
def test_two_ranks_match_transformers(models: dict, kind: str, tmp_path: Path) -> None:
    from test_pipeline import torchrun

    tm = models[kind]
    out = tmp_path / "o.jsonl"
    r = torchrun(2, ["--model", str(tm.path), "--prompts", str(write_jsonl(tmp_path / "p.jsonl", PROMPTS)),
                     "--gen-len", str(GEN), "--ignore-eos", "--gpu-batch-size", "2", "--num-gpu-batches", "2",
                     "--percent", *map(str, OFFLOAD), "--offload-dir", str(tmp_path / "off"), "--output", str(out),
                     "--metrics", str(tmp_path / "m.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == reference_generate(tm, PROMPTS, GEN)
    experts = json.loads((tmp_path / "m.json").read_text())["experts"]
    assert len(experts) == 2 and all(e["routings"] > 0 for e in experts)


@pytest.mark.bundled
def test_an_older_deepseek2_file_with_kv_b_whole_reads_alike(tmp_path: Path) -> None:
    """Files from before llama.cpp's converter split kv_b: attn_kv_b whole, the heads' sizes in
    key/value_length, every head a kv head; the same spec, the same tokens."""
    old = _gguf_model("deepseek_v3-yarn", None, tmp_path / "old", mla_split=False)
    new = _gguf_model("deepseek_v3-yarn", None, tmp_path / "new")
    names = {t.name for t in GGUFFile(old.path).tensors}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    specs = [replace(load_model(str(t.path), load_tokenizer=False).spec, name="") for t in (old, new)]
    assert specs[0] == specs[1]
    assert (specs[0].kv_lora_rank, specs[0].num_kv_heads, specs[0].head_dim, specs[0].v_head_dim) == (32, 1, 40, 16)
    hf = load_model(str(_hf_dir(tmp_path)), load_tokenizer=False).spec  # the config's own YaRN and scale
    assert specs[0].attn_scale == pytest.approx(hf.attn_scale, rel=1e-6) and specs[0].attn_scale != 24 ** -0.5
    assert specs[0].rope_scaling == hf.rope_scaling
    with LLM(str(old.path), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS[:3], gen_len=4)] == reference_generate(old, PROMPTS[:3], 4)


def _hf_dir(tmp_path: Path) -> Path:
    """The yarn DeepSeek-V3 config as a directory, for the spec a config gives."""
    from transformers import AutoModelForCausalLM

    cfg = _configs()["deepseek_v3-yarn"]
    cfg.vocab_size, cfg.rope_interleave = 49152, True
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


@pytest.mark.bundled
@pytest.mark.parametrize("change,match", [
    ({"deepseek2.expert_gating_func": 1}, "softmax routing in 2 expert groups .DeepSeek-V2 / V2.5.: not supported"),
    ({"deepseek2.expert_gating_func": 3}, "deepseek2.expert_gating_func 3 is not supported"),
    ({"deepseek2.attention.value_length": 40}, "key/value_length 40/40 with kv_lora_rank 32"),
])
def test_deepseek2_files_we_would_misread_are_refused(tmp_path: Path, change: dict, match: str) -> None:
    from gguf_convert import rewrite

    src = _gguf_model("deepseek_v3", None, tmp_path)
    bad = rewrite(src.path, tmp_path / "bad.gguf", change, tokenizer=True)
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(bad), load_tokenizer=False)
    assert "\n" not in str(info.value)


@pytest.mark.bundled
def test_a_deepseek2_file_missing_half_of_kv_b_is_named(tmp_path: Path) -> None:
    from gguf_convert import rewrite

    src = _gguf_model("deepseek_v3", None, tmp_path)
    bad = rewrite(src.path, tmp_path / "bad.gguf", drop=("blk.2.attn_v_b.weight",), tokenizer=True)
    with pytest.raises(ModelLoadError, match="blk.2.attn_k_b.weight without blk.2.attn_v_b.weight"):
        load_model(str(bad), load_tokenizer=False)


@pytest.mark.parametrize("name,total,active", [("deepseek-v2-lite", 15.7, 2.66), ("deepseek-v2", 235.7, 21.4)])
def test_deepseek_v2_registry_shapes(name: str, total: float, active: float) -> None:
    """DeepSeek-V2-Lite: 15.7B parameters (2.4B active without the embedding and head);
    DeepSeek-V2: 236B, 21B active (the model cards)."""
    s = get_spec(name)
    assert s.total_numel() / 1e9 == pytest.approx(total, abs=0.1)
    act = s.embed_numel() + s.head_numel() + sum(s.active_layer_numel(j) for j in range(s.num_layers))
    assert act / 1e9 == pytest.approx(active, abs=0.1)


def test_the_deepseek_v2_lite_entry_is_what_its_config_gives() -> None:
    """The registry's DeepSeek-V2-Lite equals the spec its published config gives."""
    from transformers import DeepseekV2Config

    from flexgen_dist.models.hf_config import spec_from_hf_config

    cfg = DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                           num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                           n_shared_experts=2, moe_intermediate_size=1408, num_experts_per_tok=6,
                           first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy",
                           max_position_embeddings=163840, bos_token_id=100000, eos_token_id=100001,
                           rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                                            "rope_theta": 10000.0})
    got = spec_from_hf_config(cfg.to_dict(), "v2-lite")
    assert replace(got, name="") == replace(get_spec("deepseek-v2-lite"), name="")
