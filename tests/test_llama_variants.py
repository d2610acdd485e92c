"""Llama-family variants. RoPE frequency scaling (Llama 3.1+ ``llama3``, ``linear``): the same
frequencies as transformers, greedy tokens identical to it in float32 with an offloading
policy, every other scaling type refused in one line. Qwen2/3 and Phi-3 (sliding windows:
tests/test_sliding_window.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.common import rope_inv_freq
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.registry import get_spec
from flexgen_dist.models.spec import ModelSpec, RopeScaling

# a small original context, so that every band of llama3's rule (kept, interpolated, divided)
# has frequencies at this head size
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
}


def _model(tmp_path: Path, scaling: dict, tied: bool = False) -> TinyModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rope_theta=5000.0, rope_scaling=dict(scaling), tie_word_embeddings=tied,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path)
    return TinyModel(scaling["rope_type"], tmp_path, m, 0)


def test_dynamic_ntk_is_plain_rope_within_the_context(tmp_path: Path) -> None:
    """Dynamic NTK raises the base only past max_position_embeddings, which no run reaches
    (longer prompts are refused): the reference gives the plain frequencies, and so do we."""
    tm = _model(tmp_path / "m", {"rope_type": "dynamic", "factor": 2.0})
    prompts = [p * 3 for p in PROMPTS]
    ref = reference_generate(tm, prompts, 6)
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        assert llm.model.spec.rope_scaling.rope_type == "dynamic"
        assert [c.token_ids for c in llm.generate(prompts, gen_len=6)] == ref


def _matches_transformers_offloaded(m: torch.nn.Module, tmp_path: Path, count: bool = True) -> ModelSpec:
    """Save ``m`` and generate greedily with half the weights on disk and the cache in RAM:
    the tokens must equal transformers', and (``count``: a text model) the loaded spec count
    m's parameters."""
    m.save_pretrained(tmp_path / "m")
    tm = TinyModel(m.config.model_type, tmp_path / "m", m, 0)
    ref = reference_generate(tm, PROMPTS, 6)
    with LLM(str(tm.path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        spec = llm.model.spec
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref
    if count:
        assert spec.total_numel() == sum(p.numel() for p in m.parameters())
    return spec


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_inverse_frequencies_match_transformers(kind: str, tmp_path: Path) -> None:
    tm = _model(tmp_path, SCALINGS[kind])
    ref = tm.model.model.rotary_emb.inv_freq
    spec = load_model(str(tmp_path), load_tokenizer=False).spec
    assert spec.rope_scaling is not None and spec.rope_scaling.rope_type == kind.split("-")[0]
    ours = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert torch.equal(ours, ref)
    assert spec.rope_scaling.attention_factor == tm.model.model.rotary_emb.attention_scaling
    assert not torch.equal(ours, rope_inv_freq(spec.head_dim, spec.rope_theta))  # it does scale


@pytest.mark.parametrize("kind,tied", [("llama3", False), ("llama3", True), ("linear", False), ("yarn", False),
                                       ("yarn-mscale", True)])
def test_greedy_tokens_match_transformers_offloaded(kind: str, tied: bool, tmp_path: Path) -> None:
    tm = _model(tmp_path / "m", SCALINGS[kind], tied)
    prompts = [p * 3 for p in PROMPTS]  # past the original context of 16
    gen = 6
    ref = reference_generate(tm, prompts, gen)
    with LLM(str(tm.path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        outs = llm.generate(prompts, gen_len=gen)
    assert [c.token_ids for c in outs] == ref


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "su", "factor": 4.0}, "rope scaling type .su. is not supported"),
    ({"rope_type": "yarn", "factor": 4.0}, "'yarn' needs original_max_position_embeddings"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor"),
    ({"rope_type": "linear", "factor": 0.0}, "factor 0.0: must be > 0"),
])
def test_other_scalings_are_refused_in_one_line(rope: dict, match: str, tmp_path: Path) -> None:
    tm = _model(tmp_path / "m", SCALINGS["linear"])
    cfg = json.loads((tm.path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = rope
    (tm.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(tm.path), load_tokenizer=False)
    assert "\n" not in str(info.value)


def test_registry_has_the_llama_3_1_and_3_2_shapes() -> None:
    s = get_spec("llama-3.1-8b")
    assert s.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192) and not s.tie_word_embeddings
    assert s.total_numel() == pytest.approx(8.03e9, rel=0.01)
    small = get_spec("llama-3.2-1b")
    assert small.tie_word_embeddings and small.rope_scaling is not None and small.rope_scaling.factor == 32.0
    assert small.total_numel() == pytest.approx(1.24e9, rel=0.01)
    assert get_spec("llama-3.1-70b").total_numel() == pytest.approx(70.6e9, rel=0.01)
    assert get_spec("llama-3.2-3b").total_numel() == pytest.approx(3.21e9, rel=0.01)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_with_qkv_biases_matches_transformers(tied: bool, tmp_path: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(11)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rope_theta=10000.0, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases, so that a missing one would show
        for layer in m.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert spec.qkv_bias and not spec.attention_bias


def test_qwen3_with_qk_norms_and_its_own_head_dim_matches_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(12)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # not 64 / 4
                      max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=True,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so that a skipped one would show
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert spec.qk_norm and spec.head_dim == 32


@pytest.mark.parametrize("name,billions", [("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.7), ("qwen3-8b", 8.19),
                                           ("qwen3-32b", 32.8), ("mistral-7b", 7.25),
                                           ("phi-3-mini", 3.82), ("phi-3-medium", 13.96), ("granite-3.1-8b", 8.17),
                                           ("smollm3-3b", 3.08), ("olmo-2-7b", 7.30), ("olmo-2-13b", 13.7),
                                           ("command-r-35b", 35.0), ("command-r7b", 8.03),
                                           ("mistral-small-24b", 23.57), ("gemma-2b", 2.51), ("gemma-7b", 8.54),
                                           ("glm-4-9b", 9.40), ("glm-4-32b", 32.6)])
def test_registry_shapes_have_the_published_sizes(name: str, billions: float) -> None:
    spec = get_spec(name)
    assert spec.total_numel() == pytest.approx(billions * 1e9, rel=0.01)
    assert spec.qkv_bias == name.startswith(("qwen2", "glm")) and spec.qk_norm == name.startswith(("qwen3", "olmo"))


def test_phi3_fused_projections_match_transformers(tmp_path: Path) -> None:
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(13)
    cfg = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     original_max_position_embeddings=128, rope_theta=10000.0, sliding_window=5,
                     tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = Phi3ForCausalLM(cfg).eval()
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert spec.fused_proj and spec.sliding_window == 5  # shorter than most sequences here


def _needs_model_type(model_type: str) -> None:
    """Skip, saying so, where the installed transformers has no ``model_type`` to compare with
    (InternLM3 came in 5.2x; the engine reads its config without transformers' class)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r} model to compare with")


@pytest.mark.parametrize("model_type", ["opt", "llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", "olmo2", "olmo3", "cohere", "cohere2", "ministral", "ministral3",
                                        "mistral3", "exaone4", "glm", "glm4", "gemma", "gemma2", "gemma3_text",
                                        "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe",
                                        "minimax_m2", "gpt_oss", "ernie4_5", "ernie4_5_moe", "granitemoe",
                                        "granitemoeshared", "deepseek_v3", "deepseek_v2", "llama4_text",
                                        "llama4", "internlm3", "seed_oss", "hunyuan_v1_dense",
                                        "hunyuan_v1_moe", "dots1", "granite_swa", "granitemoe_swa",
                                        "exaone_moe", "arcee", "apertus"])
def test_every_config_field_is_used_inert_or_pinned(model_type: str) -> None:
    """transformers' config class of each supported model type has no field this engine has
    not accounted for: a new field that changes the output cannot slip through unnoticed."""
    from transformers import AutoConfig

    from flexgen_dist.models.config_fields import known_fields

    _needs_model_type(model_type)
    fields = set(AutoConfig.for_model(model_type).to_dict())
    assert fields - known_fields(model_type) == set()


@pytest.mark.parametrize("change,match", [
    ({"hidden_act": "gelu"}, "llama with hidden_act='gelu' is not supported"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "neither load_in_4bit nor load_in_8bit is not supported"),
    ({"quantization_config": {"quant_method": "hqq"}}, "'hqq'-quantized checkpoint is not supported"),
])
def test_a_pinned_field_with_another_value_is_refused(change: dict, match: str, tmp_path: Path) -> None:
    tm = _model(tmp_path / "m", SCALINGS["linear"])
    cfg = json.loads((tm.path / "config.json").read_text())
    cfg.update(change)
    (tm.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(tm.path), load_tokenizer=False)


def test_a_sharded_checkpoint_loads_whole(tmp_path: Path) -> None:
    """A checkpoint saved in several safetensors shards (as the large models are) reads every
    tensor from the shard that holds it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(14)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = Qwen2ForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path / "m", max_shard_size="60KB")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 3
    tm = TinyModel("qwen2", tmp_path / "m", m, 0)
    ref = reference_generate(tm, PROMPTS, 6)
    with LLM(str(tm.path), percent=(0, 50, 0, 100, 100, 0), offload_dir=str(tmp_path / "off"),
             ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref


def _phi3(tmp_path: Path, partial: float = 1.0, longrope: bool = True, legacy: bool = False) -> TinyModel:
    """A small Phi-3 with LongRoPE over an original context of 16 (factors of its own per
    frequency, long and short apart) and, below 1, a partial rotary embedding (Phi-4-mini's).
    ``legacy``: config.json rewritten the way the published checkpoints have it (``rope_scaling``
    of type "su", the original length and partial factor beside it)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(18)  # a seed where no greedy step's best token is eos (transformers' reference suppresses it)
    pairs = int(16 * partial) // 2
    rope = {"rope_type": "longrope", "long_factor": [1.0 + 0.9 * i for i in range(pairs)],
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)]} if longrope else None
    cfg = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     original_max_position_embeddings=16, rope_theta=5000.0, rope_scaling=rope,
                     partial_rotary_factor=partial, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False)
    m = Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp attention, so that the rotation (long or short, turned or passed) shows in the tokens
        for layer in m.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8)
    m.save_pretrained(tmp_path)
    if legacy:
        c = json.loads((tmp_path / "config.json").read_text())
        params = c.pop("rope_parameters")
        c.update(rope_theta=params["rope_theta"], partial_rotary_factor=partial)
        if longrope:
            c["rope_scaling"] = {"type": "su", "long_factor": params["long_factor"],
                                 "short_factor": params["short_factor"]}
        (tmp_path / "config.json").write_text(json.dumps(c))
    return TinyModel("phi3", tmp_path, m, 0)


@pytest.mark.parametrize("partial,legacy", [(1.0, False), (0.75, False), (0.75, True), (0.5, True)])
def test_longrope_and_partial_rotary_match_transformers_per_request(partial: float, legacy: bool,
                                                                    tmp_path: Path) -> None:
    """Phi-3 128k / Phi-3.5 (LongRoPE) and Phi-4-mini (LongRoPE over 3/4 of each head): rows
    within the original context of 16 throughout, and rows past it from the prompt on, give
    transformers' tokens for the request run alone (its choice of long or short frequencies is
    per forward over the batch; ours per row, so batching cannot change a request's tokens)."""
    tm = _phi3(tmp_path / "m", partial, legacy=legacy)
    prompts = [PROMPTS[1], PROMPTS[2] * 2, PROMPTS[0] + [7] * 5, PROMPTS[4] * 5]  # 3, 18, 11, 25 tokens
    gen = 6
    ref = [reference_generate(tm, [p], gen)[0] for p in prompts]
    with LLM(str(tm.path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        spec = llm.model.spec
        outs = llm.generate(prompts, gen_len=gen)
    assert [c.token_ids for c in outs] == ref
    assert spec.rope_scaling is not None and spec.rope_scaling.rope_type == "longrope"
    assert spec.rope_dim == int(16 * partial) and spec.rotary_dim == (0 if partial == 1.0 else int(16 * partial))
    rot = tm.model.model.rotary_emb
    assert spec.rope_scaling.attention_factor == rot.attention_scaling != 1.0
    short = rope_inv_freq(spec.rope_dim, spec.rope_theta, spec.rope_scaling)
    assert torch.equal(short, rot.original_inv_freq)
    assert not torch.equal(short, rope_inv_freq(spec.rope_dim, spec.rope_theta, spec.rope_scaling, long=True))


def test_longrope_long_and_short_rows_in_one_batch_match_each_alone(tmp_path: Path) -> None:
    """A batch holding a row past the original context and one within it: each row's tokens
    are its own run's (frequencies chosen per row; the choice over the batch would turn the
    short row with the long frequencies)."""
    tm = _phi3(tmp_path / "m", 0.75)
    prompts = [PROMPTS[1], PROMPTS[2] * 3]  # 3 and 27 tokens
    ref = [reference_generate(tm, [p], 5)[0] for p in prompts]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=1, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(prompts, gen_len=5)] == ref


def _greedy_with_cache(m: torch.nn.Module, prompt: list[int], gen: int) -> list[int]:
    """transformers' model run step by step over its own cache, never recomputed (its
    ``generate`` for Phi-3 instead drops the cache where the sequence crosses the original
    context)."""
    from transformers import DynamicCache

    cache, out = DynamicCache(config=m.config), []
    with torch.no_grad():
        logits = m(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        for n in range(len(prompt), len(prompt) + gen):
            out.append(int(logits[0, -1].argmax()))
            if len(out) < gen:
                logits = m(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[n]])).logits
    return out


def test_longrope_crossing_while_decoding_keeps_the_cache_and_warns(tmp_path: Path, caplog) -> None:
    """A request whose sequence grows past the original context while decoding: its new
    positions turn with the long frequencies from there on, over the cache it has (the
    model's own step-by-step result), and the run says so, once, naming the way to
    transformers' tokens exactly."""
    tm = _phi3(tmp_path / "m", 0.75)
    prompt, gen = PROMPTS[0] * 2 + [7], 6  # 13 tokens: steps 4 and 5 run at positions 16 and 17
    want = _greedy_with_cache(tm.model, prompt, gen)
    assert want[:4] == reference_generate(tm, [prompt], gen)[0][:4]  # before the crossing, generate's own
    with caplog.at_level("WARNING", logger="flexgen_dist"):
        with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
            got = llm.generate([prompt, PROMPTS[1]], gen_len=gen)
    assert got[0].token_ids == want
    said = [r.getMessage() for r in caplog.records if "original context" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("1 request(s) grow past the original context of 16")


def test_partial_rotary_without_scaling_matches_transformers(tmp_path: Path) -> None:
    tm = _phi3(tmp_path / "m", 0.5, longrope=False)
    ref = reference_generate(tm, PROMPTS, 6)
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        assert llm.model.spec.rope_scaling is None and llm.model.spec.rope_dim == 8
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref


@pytest.mark.parametrize("change,match", [
    ({"partial_rotary_factor": 0.5, "model_type": "llama"}, "partial_rotary_factor 0.5 is not supported for 'llama'"),
    ({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 3, "short_factor": [1.0] * 6}},
     "long_factor has 3 values for 12 rotated dims: expected 6"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6}}, "'longrope' needs long_factor"),
])
def test_bad_longrope_or_partial_configs_are_refused_in_one_line(change: dict, match: str, tmp_path: Path) -> None:
    tm = _phi3(tmp_path / "m", 0.75, legacy=True)
    cfg = json.loads((tm.path / "config.json").read_text())
    cfg.update(change)
    (tm.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(tm.path), load_tokenizer=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("tied", [True, False])
def test_granite_multipliers_match_transformers(tied: bool, tmp_path: Path) -> None:
    """IBM Granite 3.x: the embedding times embedding_multiplier, attention scaled by
    attention_multiplier, each sublayer's output times residual_multiplier, the logits divided
    by logits_scaling (values far from Granite's, so that each one shows)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(23)
    cfg = GraniteConfig(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        embedding_multiplier=12.0, attention_multiplier=0.5, residual_multiplier=0.22,
                        logits_scaling=0.125, tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1,
                        eos_token_id=None)
    m = GraniteForCausalLM(cfg).eval()
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert (spec.embed_multiplier, spec.residual_multiplier, spec.logits_divisor, spec.softmax_scale) == \
        (12.0, 0.22, 0.125, 0.5)
    # the logits' divisor never changes a greedy token, but it does every log-probability
    seqs = [p * 2 for p in PROMPTS]
    with torch.no_grad():
        want = []
        for seq in seqs:
            lp = torch.log_softmax(m(input_ids=torch.tensor([seq])).logits[0].double(), dim=-1)
            want.append(-lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].sum().item())
    with LLM(str(tmp_path / "m"), progress=False) as llm:
        assert [s.nll for s in llm.score(seqs, decode_tokens=3)] == pytest.approx(want, rel=1e-4)


def _smollm3(**extra) -> torch.nn.Module:
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(29)
    cfg = SmolLM3Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        rope_theta=5000.0, pad_token_id=0, bos_token_id=1, eos_token_id=None, **extra)
    m = SmolLM3ForCausalLM(cfg).eval()
    with torch.no_grad():  # sharp attention, so that a layer turned that should not be (or not turned) shows
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return m


@pytest.mark.parametrize("extra,nope", [
    ({}, (False, False, False, True)),  # every fourth layer without RoPE, by default
    ({"no_rope_layers": [0, 1, 0, 1], "tie_word_embeddings": False}, (True, False, True, False)),
    ({"use_sliding_window": True, "sliding_window": 5}, (False, False, False, True)),  # the NoPE layer slides
])
def test_smollm3_nope_layers_match_transformers(extra: dict, nope: tuple, tmp_path: Path) -> None:
    """SmolLM3: layers without position encoding (q and k not turned), where the config says;
    with use_sliding_window, the window on those layers (its default layer_types)."""
    spec = _matches_transformers_offloaded(_smollm3(**extra), tmp_path)
    assert spec.nope_layers == nope
    assert spec.sliding_window == extra.get("sliding_window", 0)
    if spec.sliding_window:
        assert [spec.window(j) for j in range(4)] == [0, 0, 0, 5]


def _olmo(kind: str, **extra) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(43)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None, **extra)
    m = (tf.Olmo2ForCausalLM(tf.Olmo2Config(**common)) if kind == "olmo2"
         else tf.Olmo3ForCausalLM(tf.Olmo3Config(**common))).eval()
    with torch.no_grad():  # norms away from 1, so that one skipped or misplaced would show
        for layer in m.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm, layer.post_attention_layernorm,
                         layer.post_feedforward_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("kind,extra", [
    ("olmo2", {}),
    ("olmo2", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 5000.0}}),
    ("olmo3", {"sliding_window": 4}),  # three sliding layers of four, their RoPE the global one
    ("olmo3", {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"] * 2,
               "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0,
                                                      "original_max_position_embeddings": 16},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}}}),
])
def test_olmo_matches_transformers(kind: str, extra: dict, tmp_path: Path) -> None:
    """OLMo 2 and 3: norms on the sublayers' outputs (none before), q and k normalised over all
    heads at once; OLMo 3's sliding layers with their own RoPE."""
    spec = _matches_transformers_offloaded(_olmo(kind, **extra), tmp_path)
    assert spec.norm_layout == "post" and spec.qk_norm_whole
    if kind == "olmo3":
        sliding, full = (1, 0) if "layer_types" in extra else (0, 3)
        assert (spec.window(sliding), spec.window(full)) == (4, 0)
    if "rope_parameters" in extra and kind == "olmo3":
        assert spec.rope(1) == (300.0, None) and spec.rope(0)[1].rope_type == "yarn"


def test_olmo_norms_round_as_the_reference_in_bfloat16() -> None:
    """OLMo's RMSNorm multiplies its weight in float32 and casts after (Llama's casts first):
    in bfloat16 the two differ in the last bit, and ours is the reference's, bit for bit."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from flexgen_dist.models.llama import _norm

    torch.manual_seed(5)
    ref = Olmo2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 64).to(torch.bfloat16)
    olmo = ModelSpec(name="o", family="llama", num_layers=1, hidden_size=64, ffn_size=64, num_heads=4,
                     vocab_size=8, max_positions=8, qk_norm=True, qk_norm_whole=True, norm_layout="post",
                     norm_weight_fp32=True)
    with torch.no_grad():
        assert torch.equal(_norm(olmo, x, ref.weight, 1e-6), ref(x))
        llama_order = _norm(dataclasses.replace(olmo, norm_weight_fp32=False), x, ref.weight, 1e-6)
    assert not torch.equal(llama_order, ref(x))  # the order matters here, so the test can tell


_MISTRAL_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                     eos_token_id=None, head_dim=16)


def test_ministral_sliding_layers_match_transformers(tmp_path: Path) -> None:
    """Ministral 8B: the window on the layers its layer_types name."""
    from transformers import MinistralConfig, MinistralForCausalLM

    torch.manual_seed(59)
    types = ["sliding_attention", "full_attention"] * 2
    m = MinistralForCausalLM(MinistralConfig(**_MISTRAL_TEXT, sliding_window=3, layer_types=types)).eval()
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert [spec.window(j) for j in range(4)] == [3, 0, 3, 0]


def test_ministral3_temperature_and_yarn_match_transformers(tmp_path: Path) -> None:
    """Ministral 3: YaRN, and q scaled by 1 + beta ln(1 + floor(p / original)) past each
    original length (16 here, so that the prompts of 18-27 tokens cross it)."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    torch.manual_seed(61)
    rope = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.8}
    m = Ministral3ForCausalLM(Ministral3Config(**_MISTRAL_TEXT, rope_parameters=rope, sliding_window=None)).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
    m.save_pretrained(tmp_path / "m")
    tm = TinyModel("ministral3", tmp_path / "m", m, 0)
    prompts = [p * 3 for p in PROMPTS]
    ref = reference_generate(tm, prompts, 6)
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        spec = llm.model.spec
        assert [c.token_ids for c in llm.generate(prompts, gen_len=6)] == ref
    assert (spec.attn_temp_beta, spec.attn_temp_len) == (0.8, 16) and spec.rope_scaling.rope_type == "yarn"


@pytest.mark.parametrize("text_type,tied", [("mistral", False), ("ministral3", True)])
def test_mistral3_image_text_checkpoint_runs_its_language_model(text_type: str, tied: bool, tmp_path: Path) -> None:
    """Mistral Small 3.x (``mistral3``): the language model of an image-text checkpoint, on
    token ids, with the weights under language_model.* as published, the head tied as the
    top-level config says; tokens equal transformers' generate on the whole model."""
    import transformers as tf

    torch.manual_seed(67)
    text = dict(_MISTRAL_TEXT, model_type=text_type, tie_word_embeddings=not tied, sliding_window=None)
    if text_type == "ministral3":
        text["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 16, "mscale_all_dim": 1.0, "mscale": 1.0,
                                   "llama_4_scaling_beta": 0.5}
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16, head_dim=16)
    m = tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(text_config=text, vision_config=vision,
                                                              tie_word_embeddings=tied)).eval()
    spec = _matches_transformers_offloaded(m, tmp_path, count=False)
    assert spec.tie_word_embeddings == tied and bool(spec.attn_temp_beta) == (text_type == "ministral3")


@pytest.mark.parametrize("extra", [{}, {"sliding_window": None, "layer_types": ["full_attention"] * 4},
                                   {"sliding_window": 3, "tie_word_embeddings": False}])
def test_exaone4_matches_transformers(extra: dict, tmp_path: Path) -> None:
    """EXAONE 4: norms after each sublayer, q/k RMSNorm per head; with a window, three sliding
    layers of four with RoPE and the global ones without (without one, RoPE everywhere)."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    torch.manual_seed(71)
    cfg = Exaone4Config(**{**_MISTRAL_TEXT, "sliding_window": 4, **extra})
    m = Exaone4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    window = cfg.sliding_window or 0
    assert spec.norm_layout == "post" and spec.qk_norm and not spec.qk_norm_whole and not spec.norm_weight_fp32
    assert [spec.window(j) for j in range(4)] == ([window] * 3 + [0] if window else [0] * 4)
    assert spec.nope_layers == ((False, False, False, True) if window else ())


@pytest.mark.parametrize("kind,extra", [("glm4", {}), ("glm4", {"partial_rotary_factor": 1.0}), ("glm", {}),
                                        ("glm4", {"attention_bias": False, "tie_word_embeddings": True})])
def test_glm_matches_transformers(kind: str, extra: dict, tmp_path: Path) -> None:
    """GLM-4 (``glm4``: a norm before and after attention and the MLP) and GLM-4-9B-chat-hf
    (``glm``: before only): gate|up fused, q/k/v biases, RoPE on interleaved pairs of the
    first half of each head (all of it at factor 1)."""
    import transformers as tf

    torch.manual_seed(73)
    common = {**_MISTRAL_TEXT, "head_dim": 16, **extra}
    m = (tf.Glm4ForCausalLM(tf.Glm4Config(**common)) if kind == "glm4" else tf.GlmForCausalLM(tf.GlmConfig(**common)))
    m = m.eval()
    with torch.no_grad():  # sharp attention, biases and norms away from their start
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
            if layer.self_attn.q_proj.bias is not None:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
            for n, p in layer.named_parameters():
                if "layernorm" in n:
                    p.uniform_(0.5, 1.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert spec.rope_interleaved and spec.fused_mlp and spec.norm_layout == ("sandwich" if kind == "glm4" else "pre")
    assert spec.rope_dim == (16 if extra.get("partial_rotary_factor") == 1.0 else 8)
    assert spec.qkv_bias == extra.get("attention_bias", True) and not spec.attention_bias


def test_a_head_the_file_holds_apart_stays_apart_as_in_transformers(tmp_path: Path, caplog) -> None:
    """A config that ties the head (the top level of Mistral Small 3.x's, by its default) over
    a checkpoint holding a head of other values: transformers keeps the file's head, and so
    does the engine (saying so); a file whose head equals the embedding stays tied."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(79)
    m = LlamaForCausalLM(LlamaConfig(**{**_MISTRAL_TEXT, "tie_word_embeddings": False})).eval()
    m.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert torch.equal(ref_model.lm_head.weight, m.lm_head.weight)  # the reference kept the file's head
    tm = TinyModel("llama", tmp_path / "m", ref_model, 0)
    with caplog.at_level("INFO", logger="flexgen_dist"):
        with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
            assert not llm.model.spec.tie_word_embeddings
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == reference_generate(tm, PROMPTS, 6)
    assert any("kept apart" in r.getMessage() for r in caplog.records)
    with torch.no_grad():  # the same head as the embedding: tied
        m.lm_head.weight.copy_(m.model.embed_tokens.weight)
    m.save_pretrained(tmp_path / "same")
    (tmp_path / "same" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    assert load_model(str(tmp_path / "same"), load_tokenizer=False).spec.tie_word_embeddings


@pytest.mark.parametrize("fields,match", [
    ({"norm_layout": "post", "num_experts": 2, "experts_per_tok": 1, "expert_ffn_size": 4}, "with experts"),
    ({"norm_layout": "sideways"}, "the llama family takes 'pre', 'post', 'sandwich'"),
    ({"family": "gemma", "norm_layout": "post"}, "the gemma family takes 'pre', 'sandwich'"),
    ({"qk_norm_whole": True}, "qk_norm_whole needs qk_norm"),
    ({"rotary_dim": 3}, "rotary_dim=3: must be even"),
    ({"nope_layers": (True,)}, "nope_layers has 1 entries for 2 layers"),
])
def test_spec_fields_no_model_combines_are_refused(fields: dict, match: str) -> None:
    """A spec the family's math would compute wrongly is refused where it is made."""
    base = dict(name="x", family="llama", num_layers=2, hidden_size=16, ffn_size=16, num_heads=2, vocab_size=8,
                max_positions=8)
    with pytest.raises(ValueError, match=match):
        ModelSpec(**{**base, **fields})


def test_exaone4_pattern_written_as_letters() -> None:
    """EXAONE 4.0's published configs write the pattern as letters ("LLLG": local, global)."""
    from flexgen_dist.models.hf_config import spec_from_hf_config

    cfg = {**_MISTRAL_TEXT, "model_type": "exaone4", "num_hidden_layers": 8, "sliding_window": 4,
           "sliding_window_pattern": "LLLG"}
    spec = spec_from_hf_config(cfg, "e")
    assert [spec.window(j) for j in range(8)] == [4, 4, 4, 0] * 2
    assert spec.nope_layers == (False, False, False, True) * 2


@pytest.mark.parametrize("use_bias", [False, True])
def test_ernie45_matches_transformers(use_bias: bool, tmp_path: Path) -> None:
    """ERNIE 4.5 (``ernie4_5``): RoPE on interleaved pairs, turned in float32 from float32
    tables, its own head size, biases on every projection with ``use_bias``, a tied head."""
    import transformers as tf

    torch.manual_seed(79)
    m = tf.Ernie4_5ForCausalLM(tf.Ernie4_5Config(**{**_MISTRAL_TEXT, "head_dim": 16, "use_bias": use_bias,
                                                    "tie_word_embeddings": True})).eval()
    with torch.no_grad():  # sharp attention, biases away from zero
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
            for n, p in layer.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert spec.rope_interleaved and spec.rope_fp32 and spec.head_dim == 16 and spec.tie_word_embeddings
    assert (spec.attention_bias, spec.mlp_bias) == (use_bias, use_bias)


@pytest.mark.parametrize("bias", [False, True])
def test_internlm3_matches_transformers(bias: bool, tmp_path: Path) -> None:
    """InternLM3 (``internlm3``): Llama's computation under its own model type, its qkv_bias
    and bias (one setting for both) on every projection."""
    import transformers as tf

    _needs_model_type("internlm3")
    torch.manual_seed(83)
    m = tf.AutoModelForCausalLM.from_config(tf.InternLM3Config(**{**_MISTRAL_TEXT, "head_dim": 16,
                                                                   "attention_bias": bias, "mlp_bias": bias})).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert (spec.attention_bias, spec.mlp_bias, spec.head_dim) == (bias, bias, 16)


@pytest.mark.parametrize("out_bias", [False, True])
def test_seed_oss_matches_transformers(out_bias: bool, tmp_path: Path) -> None:
    """Seed-OSS (``seed_oss``): biases on q, k and v (``attention_bias``), on o only with
    ``attention_out_bias`` (its released 36B has none there)."""
    import transformers as tf

    torch.manual_seed(89)
    m = tf.SeedOssForCausalLM(tf.SeedOssConfig(**{**_MISTRAL_TEXT, "head_dim": 16, "attention_bias": True,
                                                  "attention_out_bias": out_bias})).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert (spec.qkv_bias, spec.attention_bias) == (not out_bias, out_bias)


@pytest.mark.parametrize("alpha", [None, 1000.0])
def test_hunyuan_dense_matches_transformers(alpha: float | None, tmp_path: Path) -> None:
    """HunYuan dense (``hunyuan_v1_dense``): q and k normalised per head *after* RoPE, and its
    NTK-alpha RoPE (``rope_type`` dynamic with ``alpha``: a fixed stretch of the base)."""
    import transformers as tf

    torch.manual_seed(97)
    rope = {"rope_type": "default", "rope_theta": 10000.0} if alpha is None else \
        {"rope_type": "dynamic", "alpha": alpha, "factor": 1.0, "rope_theta": 10000.0}
    m = tf.HunYuanDenseV1ForCausalLM(tf.HunYuanDenseV1Config(**{**_MISTRAL_TEXT, "head_dim": 16,
                                                                "rope_parameters": rope})).eval()
    with torch.no_grad():  # the norms' weights away from one, so that where they act shows
        for n, p in m.named_parameters():
            if n.endswith(("query_layernorm.weight", "key_layernorm.weight")):
                p.normal_(1, 0.5)
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert spec.qk_norm and spec.qk_norm_after_rope and spec.rope_scaling is None
    assert torch.equal(rope_inv_freq(spec.head_dim, spec.rope_theta), m.model.rotary_emb.inv_freq)
    if alpha:
        assert spec.rope_theta == 10000.0 * alpha ** (16 / 14)


@pytest.mark.parametrize("thetas", [[0, 10000.0, 10000.0, 10000.0], [500000.0, 1000.0, 1000.0, 1000.0]])
def test_granite_swa_matches_transformers(thetas: list, tmp_path: Path) -> None:
    """Granite SWA (``granite_swa``): Granite's multipliers, three sliding layers of four with
    a 5-position window, attention sinks, and a RoPE base per layer (0: none; the global and
    the sliding layers' bases apart), on prompts longer than the window."""
    import transformers as tf

    torch.manual_seed(101)
    cfg = tf.GraniteSWAConfig(**{**_MISTRAL_TEXT, "head_dim": 16}, sliding_window=5, layer_rope_theta=thetas,
                              embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                              logits_scaling=2.0)
    m = tf.GraniteSWAForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    m.save_pretrained(tmp_path / "m")
    tm = TinyModel("granite_swa", tmp_path / "m", m, 0)
    long = [p * 3 for p in PROMPTS]
    ref = reference_generate(tm, long, 6)
    with LLM(str(tm.path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        spec = llm.model.spec
        assert [c.token_ids for c in llm.generate(long, gen_len=6)] == ref
    assert spec.attn_sinks and spec.sliding_window == 5 and spec.nope_layers == tuple(not t for t in thetas)
    assert spec.window(0) == 0 and spec.window(1) == 5
    assert spec.rope(1)[0] == thetas[1] and (spec.rope(0)[0] == thetas[0] or not thetas[0])


@pytest.mark.parametrize("kind", ["arcee", "apertus"])
def test_ungated_mlps_match_transformers(kind: str, tmp_path: Path) -> None:
    """Arcee AFM (``arcee``: down(relu(up(x))²)) and Apertus (``apertus``: xIELU with two learned
    scalars a layer, per-head q/k norms, Llama 3.1's RoPE scaling): MLPs without a gate."""
    import transformers as tf

    torch.manual_seed(107)
    if kind == "arcee":
        m = tf.ArceeForCausalLM(tf.ArceeConfig(**_MISTRAL_TEXT, mlp_bias=True)).eval()
    else:
        m = tf.ApertusForCausalLM(tf.ApertusConfig(**_MISTRAL_TEXT, rope_parameters={
            "rope_type": "llama3", "rope_theta": 12000.0, "factor": 8.0, "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0})).eval()
    with torch.no_grad():  # biases and the xIELU scalars away from their initial values
        for n, p in m.named_parameters():
            if n.endswith(("bias", "alpha_p", "alpha_n")):
                p.normal_(0, 0.5)
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            if n.endswith(("up_proj.weight", "down_proj.weight")):
                p.mul_(6)  # an MLP that weighs in the output, so that its activation shows
    spec = _matches_transformers_offloaded(m, tmp_path)
    assert spec.mlp_activation == {"arcee": "relu2", "apertus": "xielu"}[kind] and not spec.mlp_gated
    assert spec.qk_norm == (kind == "apertus")
