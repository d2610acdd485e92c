"""Gemma 2 and Gemma 3 (text, and the text part of the image-text model): greedy tokens equal
transformers' in float32 on left-padded prompts longer than the sliding window, with half the
weights and half the cache on disk and with everything in RAM; the spec counts the model's
parameters; the configs are read as transformers reads them; what the engine does not compute
is refused in one line."""
from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.gemma_config import DEFAULTS
from flexgen_dist.models.hf_config import spec_from_hf_config
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.registry import get_spec

WINDOW = 8
LONG = [p * 4 for p in PROMPTS]  # 8 to 36 tokens: most prompts exceed the window on their own
GEN = 10
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=128, sliding_window=WINDOW,
             query_pre_attn_scalar=20, initializer_range=0.1, pad_token_id=0, bos_token_id=2, eos_token_id=1)
# Gemma 3: its own RoPE per layer type, linear scaling on the global layers; two of the four
# layers slide (the pattern: every second layer global)
G3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
           "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}}
POLICIES = {
    "disk": dict(percent=(0, 50, 0, 50, 100, 0)),  # half the weights and half the cache on disk
    "ram": dict(percent=(0, 100, 0, 100, 100, 0)),
    "cache-disk": dict(percent=(0, 100, 0, 0, 100, 0), cpu_attention=False),  # the cache read back to attend
}


def _perturbed(m: torch.nn.Module) -> torch.nn.Module:
    """Norm weights away from 0 (the (1 + w) form's identity), so that a skipped or misread
    norm would show in the tokens."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(-0.6, 0.6)
    return m.eval()


def _gemma2(**over: object) -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(31)
    cfg = dict(SMALL, attn_logit_softcapping=3.0, final_logit_softcapping=2.0)
    return _perturbed(eager(Gemma2ForCausalLM(Gemma2Config(**{**cfg, **over}))))


def eager(m: torch.nn.Module) -> torch.nn.Module:
    """Gemma 2's reference with eager attention: transformers before 5.2x runs SDPA by default,
    which leaves out the attention logit softcap (a warning, and other tokens)."""
    m.config._attn_implementation = "eager"
    return m


def _gemma3(**over: object) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(32)
    cfg = dict(SMALL, final_logit_softcapping=2.0, sliding_window_pattern=2, rope_parameters=G3_ROPE)
    return _perturbed(Gemma3ForCausalLM(Gemma3TextConfig(**{**cfg, **over})))


def _gemma3_image_text(tied: bool = True) -> torch.nn.Module:
    """Gemma3ForConditionalGeneration with a tiny vision tower; only its text part runs here."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(33)
    text = {k: v for k, v in SMALL.items() if not k.endswith("token_id")}
    text.update(sliding_window_pattern=2, rope_theta=100000.0, rope_local_base_freq=300.0,  # the older form
                rope_scaling={"rope_type": "linear", "factor": 4.0})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=253,
                       eoi_token_index=254, image_token_index=255, tie_word_embeddings=tied,
                       pad_token_id=0, bos_token_id=2, eos_token_id=1)
    m = _perturbed(Gemma3ForConditionalGeneration(cfg))
    if not tied:
        with torch.no_grad():
            m.lm_head.weight.normal_(0, 0.1)
    return m


BUILD = {"gemma2": _gemma2, "gemma3_text": _gemma3, "gemma3": _gemma3_image_text}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TinyModel, list[list[int]]]]:
    """Each kind saved once, with transformers' greedy tokens on the long prompts."""
    out = {}
    for kind, build in BUILD.items():
        m = build()
        path = tmp_path_factory.mktemp(kind)
        m.save_pretrained(path)
        tm = TinyModel(kind, path, m, 0)
        out[kind] = (tm, reference_generate(tm, LONG, GEN))
    return out


def _generate(path: Path, tmp_path: Path, **policy: object) -> tuple[list[list[int]], object]:
    opts = dict(gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"), ignore_eos=True,
                progress=False, **policy)
    with LLM(str(path), **opts) as llm:
        return [c.token_ids for c in llm.generate(LONG, gen_len=GEN)], llm.model.spec


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("kind", sorted(BUILD))
def test_greedy_tokens_match_transformers(models: dict, kind: str, policy: str, tmp_path: Path) -> None:
    tm, ref = models[kind]
    tokens, spec = _generate(tm.path, tmp_path, **POLICIES[policy])
    assert tokens == ref
    assert [spec.window(j) for j in range(4)] == [WINDOW, 0, WINDOW, 0]
    text = [p for n, p in tm.model.named_parameters() if "vision" not in n and "multi_modal" not in n]
    assert spec.total_numel() == sum(p.numel() for p in text)


def test_the_image_text_model_with_its_own_lm_head(tmp_path: Path) -> None:
    m = _gemma3_image_text(tied=False)
    m.save_pretrained(tmp_path / "m")
    ref = reference_generate(TinyModel("g3", tmp_path / "m", m, 0), LONG, GEN)
    tokens, spec = _generate(tmp_path / "m", tmp_path, **POLICIES["disk"])
    assert not spec.tie_word_embeddings and tokens == ref


def test_the_spec_carries_what_the_config_says(models: dict) -> None:
    g2 = load_model(str(models["gemma2"][0].path), load_tokenizer=False).spec
    assert (g2.attn_softcap, g2.final_softcap, g2.softmax_scale) == (3.0, 2.0, 20 ** -0.5)
    assert g2.rope(0) == g2.rope(1) == (10000.0, None) and not g2.qk_norm
    g3 = load_model(str(models["gemma3_text"][0].path), load_tokenizer=False).spec
    assert g3.qk_norm and g3.attn_softcap == 0 and g3.final_softcap == 2.0
    assert g3.rope(0) == (300.0, None) and g3.rope(1)[0] == 100000.0 and g3.rope(1)[1].factor == 4.0
    mm = load_model(str(models["gemma3"][0].path), load_tokenizer=False).spec
    assert (mm.rope(0), mm.rope(1)) == (g3.rope(0), g3.rope(1)) and mm.final_softcap == 0


@pytest.mark.parametrize("kind,change", [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"sliding_window": 64}),
    ("gemma2", {"query_pre_attn_scalar": 32}),
    ("gemma3_text", {"rope_parameters": {**G3_ROPE, "sliding_attention": G3_ROPE["full_attention"]}}),
    ("gemma3_text", {"sliding_window": 64}),
])
def test_each_feature_changes_the_reference(models: dict, kind: str, change: dict) -> None:
    """The matches above would prove nothing if dropping a feature left these tokens as they are."""
    tm, ref = models[kind]
    other = BUILD[kind](**change)
    assert reference_generate(TinyModel(kind, tm.path, other, 0), LONG, GEN) != ref


def _nll(m: torch.nn.Module, seqs: list[list[int]]) -> list[float]:
    """transformers' -log p of every token after the first, summed per sequence (float64 sums)."""
    out = []
    with torch.no_grad():
        for seq in seqs:
            lp = torch.log_softmax(m(input_ids=torch.tensor([seq])).logits[0].double(), dim=-1)
            out.append(-lp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].sum().item())
    return out


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_scores_match_transformers_with_the_final_softcap(models: dict, kind: str, tmp_path: Path) -> None:
    """The final soft-cap never changes a greedy token (tanh is monotonic) but does change
    every log-probability: teacher-forced scores (prefill, and decode steps over the rings)
    equal transformers' with the cap and differ from them without it."""
    tm, _ = models[kind]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"),
             progress=False, **POLICIES["disk"]) as llm:
        ours = [s.nll for s in llm.score(LONG, decode_tokens=5)]
    assert ours == pytest.approx(_nll(tm.model, LONG), rel=1e-4)
    uncapped = _nll(BUILD[kind](final_logit_softcapping=None), LONG)
    assert ours != pytest.approx(uncapped, rel=1e-2)


def _edited(path: Path, tmp_path: Path, edit: dict, text: bool = False) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    for f in path.iterdir():
        (out / f.name).symlink_to(f)
    cfg = json.loads((path / "config.json").read_text())
    (cfg["text_config"] if text else cfg).update(edit)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("kind,edit,match", [
    ("gemma2", {"hidden_activation": "gelu"}, "gemma2 with hidden_activation='gelu' is not supported"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ("gemma2", {"rope_parameters": G3_ROPE}, "rope_parameters per layer type are not supported"),
    ("gemma3_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
     "must be a dict per layer type"),
    ("gemma3_text", {"rope_parameters": {**G3_ROPE, "sliding_attention": {"rope_type": "longrope", "factor": 2.0}}},
     "rope scaling 'longrope' needs long_factor, short_factor"),
    ("gemma3_text", {"rope_parameters": {**G3_ROPE, "sliding_attention": {"rope_type": "su", "factor": 2.0}}},
     "rope scaling type 'su' is not supported"),
    ("gemma2", {"quantization_config": {"quant_method": "hqq"}}, "'hqq'-quantized checkpoint is not supported"),
])
def test_what_is_not_computed_is_refused_in_one_line(models: dict, kind: str, edit: dict, match: str,
                                                     tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(_edited(models[kind][0].path, tmp_path, edit)), load_tokenizer=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit,match", [
    ({"hidden_activation": "gelu"}, "text_config: gemma3_text with hidden_activation='gelu' is not supported"),
    ({"final_logit_softcapping": 30.0}, "not applied by Gemma3ForConditionalGeneration"),
])
def test_the_image_text_models_text_config_is_checked_too(models: dict, edit: dict, match: str,
                                                          tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(_edited(models["gemma3"][0].path, tmp_path, edit, text=True)), load_tokenizer=False)
    assert "\n" not in str(info.value)


# the form of the published configs: an older transformers' fields, a sparse text_config
HUB_GEMMA2_9B = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "hidden_size": 3584,
                 "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16,
                 "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                 "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rope_theta": 10000.0,
                 "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                 "cache_implementation": "hybrid", "vocab_size": 256000, "max_position_embeddings": 8192}
HUB_GEMMA3_12B = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                  "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256,
                  "text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                                  "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
                                  "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
                  "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
HUB_GEMMA3_27B = {"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
    "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}


@pytest.mark.parametrize("raw,registry", [(HUB_GEMMA2_9B, "gemma-2-9b"), (HUB_GEMMA3_12B, "gemma-3-12b"),
                                          (HUB_GEMMA3_27B, "gemma-3-27b")])
def test_published_configs_read_as_transformers_reads_them(raw: dict, registry: str) -> None:
    """The spec of a published config is the registry's shape, and its layer types, windows,
    RoPE bases and scalings are those transformers' config class computes from it."""
    from transformers import AutoConfig

    spec = spec_from_hf_config(json.loads(json.dumps(raw)), registry)
    assert spec == get_spec(registry)
    hf = AutoConfig.for_model(**json.loads(json.dumps(raw))).get_text_config()
    assert spec.layer_types == tuple(hf.layer_types) and spec.sliding_window == hf.sliding_window
    assert spec.softmax_scale == hf.query_pre_attn_scalar ** -0.5
    rope = hf.rope_parameters
    glob, local = (rope["full_attention"], rope["sliding_attention"]) if "full_attention" in rope else (rope, rope)
    full, sliding = spec.layer_types.index("full_attention"), spec.layer_types.index("sliding_attention")
    for layer, r in ((full, glob), (sliding, local)):
        theta, scaling = spec.rope(layer)
        assert theta == r["rope_theta"] and (scaling.factor if scaling else None) == r.get("factor")


@pytest.mark.parametrize("kind", sorted(DEFAULTS))
def test_the_defaults_are_the_config_classes(kind: str) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.for_model(kind).to_dict()
    assert {k: hf[k] for k in DEFAULTS[kind]} == DEFAULTS[kind]


@pytest.mark.parametrize("name,billions", [("gemma-2-9b", 9.24), ("gemma-2-27b", 27.23), ("gemma-3-12b", 11.77),
                                           ("gemma-3-27b", 27.01)])
def test_registry_shapes_have_the_published_sizes(name: str, billions: float) -> None:
    """Gemma 2 as published; Gemma 3 without its 0.42B vision encoder (its report's embedding
    plus non-embedding parameters)."""
    assert get_spec(name).total_numel() == pytest.approx(billions * 1e9, rel=0.01)


def _gemma1(**over: object) -> torch.nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(33)
    cfg = {k: v for k, v in SMALL.items() if k not in ("sliding_window", "query_pre_attn_scalar")}
    return _perturbed(GemmaForCausalLM(GemmaConfig(**{**cfg, **over})))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_gemma1_matches_transformers(policy: str, tmp_path: Path) -> None:
    """Gemma 1 (``gemma``): a norm before attention and before the MLP only, head_dim ** -0.5,
    no soft-caps and no window; the legacy ``hidden_act: gelu`` means the tanh GELU, as
    transformers reads it."""
    import json

    m = _gemma1(hidden_act="gelu_pytorch_tanh")
    m.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    ref = reference_generate(TinyModel("gemma", tmp_path / "m", m, 0), LONG, GEN)
    tokens, spec = _generate(tmp_path / "m", tmp_path, **POLICIES[policy])
    assert tokens == ref
    assert spec.norm_layout == "pre" and spec.sliding_window == 0 and spec.softmax_scale == 32 ** -0.5
    assert spec.total_numel() == sum(p.numel() for p in m.parameters())


@pytest.mark.bundled
def test_gemma1_gguf_runs_as_its_directory(tmp_path: Path) -> None:
    """A Gemma 1 file (llama.cpp's ``gemma``: norm weights stored as 1 + w, the head the
    embedding): the spec equals the directory's, the tokens transformers'."""
    from gguf_convert import write_gguf

    m = _gemma1(vocab_size=49152)  # the bundled tokenizer's vocabulary, which the file carries
    m.save_pretrained(tmp_path / "hf")
    path = write_gguf(m, tmp_path / "g1.gguf")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    same = dict(name=ref.name, bos_token_id=ref.bos_token_id, eos_token_ids=ref.eos_token_ids,
                pad_token_id=ref.pad_token_id)  # the file's token ids are the bundled tokenizer's
    assert dataclasses.replace(ours, **same) == ref
    tokens, _ = _generate(path, tmp_path, **POLICIES["disk"])
    assert tokens == reference_generate(TinyModel("g1", path, m, 0), LONG, GEN)
