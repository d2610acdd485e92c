"""Llama 4 (``llama4_text``; the image-text ``llama4`` on token ids): chunked attention on the
layers with RoPE (chunks counted from each sequence's first token, in prefill and decode, on
every tier of the cache), NoPE layers with the attention temperature, the weightless q/k
norm after RoPE, and the sparse layers' top-logit sigmoid weighting each expert's input plus
the shared expert. Greedy tokens equal transformers' in float32, with chunks, windows and
the temperature's floor far shorter than the sequences so that each of them shows.

The reference runs each prompt on its own: transformers' temperature counts positions in
the padded batch (its chunked mask and RoPE do not), so a left-padded batch there gives a
prompt other tokens than it gets alone; the engine counts each sequence's own positions."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, engine_matches, reference_generate
from flexgen_dist import LLM
from flexgen_dist.models.loader import load_model

CHUNK = 4
LONG = [p * 3 for p in PROMPTS]  # 6 to 27 tokens: most prompts span several chunks
GEN = 8


def _config(**over):
    from transformers import Llama4TextConfig

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
                attention_chunk_size=CHUNK, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
                use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=255, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return Llama4TextConfig(**{**base, **over})


CONFIGS = {
    # dense and sparse layers alternating, every second layer without RoPE (global)
    "interleaved": {},
    # every layer sparse, two experts a token, Scout's RoPE scaling (Llama 3.1's with equal
    # low and high frequency factors: no band between), no q/k norm
    "scout-like": dict(interleave_moe_layer_step=1, num_experts_per_tok=2, no_rope_layer_interval=4,
                       use_qk_norm=False, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                           "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 1.0,
                                                           "original_max_position_embeddings": 16}),
}


def _model(kind: str, path: Path) -> TinyModel:
    from transformers import Llama4ForCausalLM

    torch.manual_seed(31)
    m = Llama4ForCausalLM(_config(**CONFIGS[kind])).eval()
    with torch.no_grad():  # zero-initialised experts: give them weights
        for name, p in m.named_parameters():
            if "experts." in name:
                p.normal_(0, 0.1)
    m.save_pretrained(path)
    return TinyModel(kind, path, m, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TinyModel, list[list[int]]]]:
    out = {}
    for kind in CONFIGS:
        tm = _model(kind, tmp_path_factory.mktemp(kind))
        out[kind] = (tm, [reference_generate(tm, [p], GEN)[0] for p in LONG])
    return out


POLICIES = [
    dict(percent=(100, 0, 100, 0, 100, 0)),                                  # all on the device
    dict(percent=(0, 50, 0, 50, 100, 0), cpu_attention=True),               # weights and cache half on disk
    dict(percent=(0, 100, 0, 0, 100, 0), cpu_attention=False),              # cache all on disk
    dict(percent=(0, 100, 0, 100, 100, 0), num_gpu_batches=3),              # merged decode
]


@pytest.mark.parametrize("kind", list(CONFIGS))
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_match_transformers(models: dict, kind: str, policy: dict, tmp_path: Path) -> None:
    tm, ref = models[kind]
    engine_matches(tm, LONG, GEN, ref, tmp_path, **{"num_gpu_batches": 2, **policy})


def test_the_spec_carries_what_the_config_says(models: dict) -> None:
    spec = load_model(str(models["interleaved"][0].path), load_tokenizer=False).spec
    assert spec.layer_types == ("chunked_attention", "full_attention") * 2 and spec.sliding_window == CHUNK
    assert spec.nope_layers == (False, True) * 2 and spec.moe_layers == (False, True) * 2
    assert (spec.ffn_size, spec.expert_ffn_size, spec.shared_expert_ffn_size, spec.router_scoring) == (
        96, 48, 48, "top_sigmoid")
    assert spec.qk_l2_norm and spec.rope_interleaved and spec.attn_temp_nope
    assert (spec.attn_temp_beta, spec.attn_temp_len) == (0.5, 4)
    assert [spec.window(j) for j in range(4)] == [CHUNK, 0, CHUNK, 0] and spec.chunked(0) and not spec.chunked(1)


@pytest.mark.parametrize("feature", ["chunks", "temperature", "qk_norm"])
def test_each_feature_changes_the_tokens(models: dict, feature: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parity above would prove nothing if a feature did not show at these lengths: with
    it left out of the spec, the tokens differ from the reference."""
    from flexgen_dist.models import llama4_config

    tm, ref = models["interleaved"]
    real = llama4_config.llama4_fields

    def without(cfg: dict) -> dict:
        f = real(cfg)
        if feature == "chunks":
            del f["layer_types"], f["sliding_window"]
        else:
            f.update({"temperature": {"attn_temp_nope": False}, "qk_norm": {"qk_l2_norm": False}}[feature])
        return f

    monkeypatch.setattr("flexgen_dist.models.hf_config.llama4_fields", without)
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=GEN)] != ref


def test_the_image_text_checkpoint_runs_its_language_model(models: dict, tmp_path: Path) -> None:
    """A ``llama4`` (Llama4ForConditionalGeneration) directory: its text_config, its weights
    under language_model., the vision tower's fields and tensors unused."""
    from safetensors.torch import load_file, save_file

    tm, ref = models["interleaved"]
    d = tmp_path / "mm"
    d.mkdir()
    text = json.loads((tm.path / "config.json").read_text())
    cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": text,
           "vision_config": {"model_type": "llama4_vision_model"}, "image_token_index": 200092,
           "boi_token_index": 200080, "eoi_token_index": 200081, "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(tm.path / "model.safetensors"))
    save_file({("language_model." + k): v for k, v in sd.items()} | {"vision_model.patch.weight": torch.zeros(2, 2)},
              str(d / "model.safetensors"))
    with LLM(str(d), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=GEN)] == ref


@pytest.mark.parametrize("name,total", [("llama-4-scout-17b-16e", 109), ("llama-4-maverick-17b-128e", 400)])
def test_registry_shapes_have_the_published_sizes(name: str, total: float) -> None:
    """Scout: 109B parameters, Maverick: 400B, both 17B active (the model cards' figures,
    which count the vision tower too: within 2 %)."""
    from flexgen_dist.models.registry import get_spec

    s = get_spec(name)
    assert s.total_numel() / 1e9 == pytest.approx(total, rel=0.02)
    act = s.embed_numel() + s.head_numel() + sum(s.active_layer_numel(j) for j in range(s.num_layers))
    assert act / 1e9 == pytest.approx(17, rel=0.02)


def test_the_scout_entry_is_what_its_config_gives() -> None:
    """The registry's Scout equals the spec its published text config gives (transformers'
    Llama4TextConfig defaults are Scout's; its tokens, context and RoPE scaling set here)."""
    from dataclasses import replace

    from transformers import Llama4TextConfig

    from flexgen_dist.models.hf_config import spec_from_hf_config
    from flexgen_dist.models.registry import get_spec

    cfg = Llama4TextConfig(max_position_embeddings=10485760, bos_token_id=200000, eos_token_id=[200001, 200007, 200008],
                           pad_token_id=200018, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                                 "factor": 16.0, "low_freq_factor": 1.0,
                                                                 "high_freq_factor": 1.0,
                                                                 "original_max_position_embeddings": 8192})
    got = spec_from_hf_config(cfg.to_dict(), "scout")
    assert replace(got, name="") == replace(get_spec("llama-4-scout-17b-16e"), name="")


@pytest.mark.bundled
@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_gguf_files_match_transformers(qtype: str | None, tmp_path: Path) -> None:
    """A ``llama4`` GGUF file as llama.cpp's converter writes it (experts split from gate_up,
    the dense width as the feed-forward length, Scout's RoPE scaling as ``rope_freqs``), read
    with what llama.cpp's loader fixes (chunks of 8192, every fourth layer NoPE with the
    temperature at floor 8192, q/k norms but on 128 experts): the same tokens as transformers
    with those values, float32 or Q8_0 kept packed under --compress-weight."""
    from gguf_convert import roundtrip_, write_gguf
    from transformers import Llama4ForCausalLM

    torch.manual_seed(37)
    cfg = _config(vocab_size=49152, intermediate_size=64, attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1,
                  no_rope_layer_interval=4, rope_parameters=CONFIGS["scout-like"]["rope_parameters"])
    m = Llama4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "experts." in name:
                p.normal_(0, 0.1)
    if qtype:
        roundtrip_(m, qtype)
    path = write_gguf(m, tmp_path / "l4.gguf", qtype)
    tm = TinyModel("llama4", path, m, 0)
    spec = load_model(str(path), load_tokenizer=False).spec
    hf = load_model(str(_saved(m, tmp_path / "hf")), load_tokenizer=False).spec
    from flexgen_dist.models.common import rope_inv_freq

    # the file keeps the divisors: any original length giving the same bands gives the same frequencies
    assert torch.equal(rope_inv_freq(16, spec.rope_theta, spec.rope_scaling), rope_inv_freq(16, hf.rope_theta,
                                                                                              hf.rope_scaling))
    assert spec.rope_scaling.high_freq_factor == 1.0 and spec.layer_types == hf.layer_types
    assert (spec.qk_l2_norm, spec.attn_temp_nope, spec.attn_temp_len, spec.moe_layers) == (True, True, 8192,
                                                                                            (False, True) * 2)
    ref = [reference_generate(tm, [p], 4)[0] for p in PROMPTS[:3]]
    with LLM(str(path), percent=(0, 50, 100, 0, 100, 0), gpu_batch_size=1, num_gpu_batches=3,
             offload_dir=str(tmp_path / "off"), compress_weight=bool(qtype), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS[:3], gen_len=4)] == ref


def _saved(m, path: Path) -> Path:
    m.save_pretrained(path)
    return path
