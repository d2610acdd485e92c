"""The NeoX family (GPT-NeoX / Pythia ``gpt_neox``, Phi-1/1.5/2 ``phi``, StarCoder2
``starcoder2``): greedy tokens and
teacher-forced log-likelihoods equal transformers' in float32 for every placement the family
tests run; what each difference from Llama does (the parallel residual, the partial rotation,
the head's bias) is checked by turning it off and seeing the logits move, and each GELU is
transformers' to the bit; what is not computed is refused in one line."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import FAMILY_POLICIES, PROMPTS, TinyModel, engine_matches, reference_generate, saved
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models import neox
from flexgen_dist.models.loader import load_model

LONG = [p * 2 for p in PROMPTS]


def neox_model(kind: str, seed: int = 71, base: float = 500.0, **extra) -> torch.nn.Module:
    """A small random GPT-NeoX (``kind`` "gpt_neox") or Phi model, half of each head turned with
    RoPE base ``base``; ``extra`` overrides any config field."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=None,
                  tie_word_embeddings=False)
    if kind == "gpt_neox":
        m = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**{**common, "rotary_pct": 0.5, "rotary_emb_base": base,
                                                      **extra}))
        layers, qk = m.gpt_neox.layers, lambda layer: [layer.attention.query_key_value.weight]
    elif kind == "starcoder2":
        m = tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**{**common, "num_key_value_heads": 2,
                                                            "rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": base}, **extra}))
        layers, qk = m.model.layers, lambda layer: [layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight]
    else:
        m = tf.PhiForCausalLM(tf.PhiConfig(**{**common, "partial_rotary_factor": 0.5, "rope_theta": base,
                                              **extra}))
        layers, qk = m.model.layers, lambda layer: [layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight]
    with torch.no_grad():  # sharp attention, so that a wrong rotation would show; norms and biases away from 1, 0
        for layer in layers:
            for w in qk(layer):
                w.mul_(6)
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.input_layernorm.bias.normal_(0, 0.3)
        for n, p in m.named_parameters():
            if n.endswith(".bias") and "layernorm" not in n:
                p.normal_(0, 0.05)
    return m.eval()


CASES = {"pythia": ("gpt_neox", {}), "neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
         "neox-tied-gelu-new": ("gpt_neox", {"tie_word_embeddings": True, "hidden_act": "gelu_new"}),
         "phi-2": ("phi", {}), "phi-gqa": ("phi", {"num_key_value_heads": 2, "hidden_act": "gelu_fast"}),
         # every layer sliding over 5 positions (LONG reaches 18), GQA, tied; and without biases, untied
         # (weights drawn 5x wider than transformers' default, or the tiny tied model repeats one token)
         "starcoder2": ("starcoder2", {"sliding_window": 5, "tie_word_embeddings": True, "initializer_range": 0.1}),
         "starcoder2-no-bias": ("starcoder2", {"use_bias": False, "initializer_range": 0.1})}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    return {name: saved(tmp_path_factory, name, neox_model(kind, **extra)) for name, (kind, extra) in CASES.items()}


def _nll(m: torch.nn.Module, seqs: list[list[int]]) -> list[float]:
    with torch.no_grad():
        return [-torch.log_softmax(m(input_ids=torch.tensor([s])).logits[0].double(), -1)[
            torch.arange(len(s) - 1), torch.tensor(s[1:])].sum().item() for s in seqs]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("policy", range(len(FAMILY_POLICIES)))
def test_tokens_match_transformers_on_every_placement(name: str, policy: int, models: dict, tmp_path: Path) -> None:
    tm = models[name]
    engine_matches(tm, LONG, 6, reference_generate(tm, LONG, 6), tmp_path, **FAMILY_POLICIES[policy])


def _logits(spec, src, ids: list[int]) -> torch.Tensor:
    """The family's own functions run whole over one prompt (plain causal attention): the
    last position's logits, apart from the engine, for turning one difference off."""
    import torch.nn.functional as F

    pos = torch.arange(len(ids))[None]
    x = neox.embed(spec, src.get("embed"), torch.tensor([ids]), pos)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        rep = spec.num_heads // spec.num_kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)

    for j in range(spec.num_layers):
        x = neox.layer_forward(spec, src.get("layer", j), x, pos, attend, j)
    return neox.head(spec, src.get("head"), x)[0, -1]


@pytest.mark.parametrize("name", ["pythia", "phi-2"])
def test_scores_match_and_each_difference_matters(name: str, models: dict) -> None:
    tm = models[name]
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        spec = llm.model.spec
        assert [s.nll for s in llm.score(LONG, decode_tokens=3)] == pytest.approx(_nll(tm.model, LONG), rel=1e-4)
    assert spec.family == "neox" and spec.rotary_dim == 8 and spec.norm == "layernorm"
    assert (spec.norm_layout, spec.parallel_residual, spec.lm_head_bias) == \
        (("pre", True, False) if name == "pythia" else ("shared", False, True))
    lm = load_model(str(tm.path), load_tokenizer=False)
    with torch.no_grad():
        want = tm.model(torch.tensor([LONG[2]])).logits[0, -1]
    assert torch.allclose(_logits(lm.spec, lm.source, LONG[2]), want, atol=1e-5)
    # (the GELUs' formulas differ by less than this model's scale shows: test_the_gelus_are_transformers_own)
    changes = [dict(rotary_dim=0), dict(parallel_residual=False) if name == "pythia" else dict(lm_head_bias=False)]
    for change in changes:  # each one, undone, moves the logits
        wrong = dataclasses.replace(lm.spec, **change)
        got = _logits(wrong, type(lm.source)(wrong, torch.float32, tm.path), LONG[2])
        assert (got - want).abs().max() > 1e-4, change


def test_the_gelus_are_transformers_own() -> None:
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 1001)
    for kind in neox.ACTIVATIONS:
        assert torch.equal(neox.gelu(x, kind), ACT2FN[kind](x)), kind


@pytest.mark.parametrize("edit,match", [
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported for gpt_neox"),
    ({"rotary_pct": 0.01}, "a rotary part of 0 dims per head"),
])
def test_what_is_not_computed_is_refused_in_one_line(edit: dict, match: str, models: dict, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(models["pythia"].path, d)
    cfg = json.loads((d / "config.json").read_text())
    if "rotary_pct" in edit:
        cfg.setdefault("rope_parameters", {})["partial_rotary_factor"] = edit["rotary_pct"]
    else:
        cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(d), load_tokenizer=False)
    assert "\n" not in str(info.value)


def test_starcoder2_slides_every_layer(models: dict) -> None:
    """StarCoder2's window is on every layer: run without it, the tokens of the prompts longer
    than the window change."""
    from flexgen_dist.distributed.local import generate
    from flexgen_dist.engine.policy import Policy
    from flexgen_dist.engine.sampling import SamplingConfig
    from flexgen_dist.engine.stage import StageEngine

    tm = models["starcoder2"]
    lm = load_model(str(tm.path), load_tokenizer=False)
    assert [lm.spec.window(j) for j in range(lm.spec.num_layers)] == [5, 5, 5]
    ref = reference_generate(tm, LONG, 6)
    wrong = dataclasses.replace(lm.spec, sliding_window=0)
    eng = StageEngine(wrong, type(lm.source)(wrong, torch.float32, tm.path), (0, wrong.num_layers), has_embed=True,
                      has_head=True, policy=Policy(8, 1), device=torch.device("cpu"), dtype=torch.float32)
    outs, _ = generate(eng, LONG, 6, SamplingConfig(ignore_eos=True))
    eng.close()
    assert outs != ref
