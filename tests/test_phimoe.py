"""Phi-3.5-MoE (``phimoe``): LayerNorms with biases, biases on q, k, v, o and the LM head, and
sparsemixer routing (two experts, each weighted by a softmax over the logits near the best
remaining one); its LongRoPE as transformers computes it (the short factors at every position,
cos and sin scaled by the mscale). Greedy tokens equal transformers' in float32."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FAMILY_POLICIES, TinyModel, engine_matches
from flexgen_dist import LLM
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.source import ModelLoadError

GEN = 6
_g = torch.Generator().manual_seed(2)
PROMPTS = [torch.randint(1, 256, (n,), generator=_g).tolist() for n in (5, 24, 13, 3)]
# LongRoPE with an original context of 16: the prompts reach past it
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
             "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
             "long_factor": [2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0], "short_mscale": 1.2, "long_mscale": 1.2}


def _model(path: Path, **over) -> TinyModel:
    from transformers import PhimoeConfig, PhimoeForCausalLM

    torch.manual_seed(11)
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, max_position_embeddings=256, attention_bias=True,
               lm_head_bias=True, pad_token_id=0, eos_token_id=255, router_jitter_noise=0.3)
    m = PhimoeForCausalLM(PhimoeConfig(**{**cfg, **over})).eval()
    with torch.no_grad():  # zero-initialised biases, unit norms: give them values
        for name, p in m.named_parameters():
            if name == "lm_head.bias":
                p.normal_(0, 1.0)
            elif "bias" in name:
                p.normal_(0, 0.05)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "lm_head" in name:  # logits that the hidden states decide, not the head's bias
                p.normal_(0, 0.5)
            elif "experts" in name or "gate" in name or "embed" in name or "self_attn" in name:
                p.normal_(0, 0.3)  # (attention that weighs: RoPE's scaling shows)
        m.lm_head.bias[255] = -100.0  # never the end of a sequence (the reference suppresses it)
    m.save_pretrained(path)
    return TinyModel("phimoe", path, m, 0)


def _reference(tm: TinyModel) -> list[list[int]]:
    """Greedy tokens of transformers' forward over each whole sequence, one prompt at a time.
    Not ``generate``: Phi's ``prepare_inputs_for_generation`` drops the cache where a sequence
    crosses the original context, and before 5.2x it then fed the model the last token alone
    (5.17 gave prompt 2, 13 tokens crossing 16, another fifth token than its own forward)."""
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            seq = list(p)
            for _ in range(GEN):
                seq.append(int(tm.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(p):])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TinyModel, list[list[int]]]]:
    out = {}
    for kind, over in (("default", {}), ("longrope", {"rope_parameters": _LONGROPE})):
        tm = _model(tmp_path_factory.mktemp(kind), **over)
        out[kind] = (tm, _reference(tm))
    return out


@pytest.mark.parametrize("kind", ["default", "longrope"])
@pytest.mark.parametrize("policy", FAMILY_POLICIES)
def test_greedy_tokens_match_transformers(models: dict, kind: str, policy: dict, tmp_path: Path) -> None:
    tm, ref = models[kind]
    engine_matches(tm, PROMPTS, GEN, ref, tmp_path, **policy)


def test_the_spec_carries_what_the_config_says(models: dict) -> None:
    spec = load_model(str(models["longrope"][0].path), load_tokenizer=False).spec
    assert spec.layer_norm and spec.lm_head_bias and spec.attention_bias and spec.norm == "layernorm"
    assert (spec.router_scoring, spec.router_jitter, spec.experts_per_tok, spec.num_experts) == (
        "sparsemixer", 0.3, 2, 4)
    sc = spec.rope_scaling
    assert sc.long_factor == sc.short_factor == tuple(_LONGROPE["short_factor"]) and sc.attention_factor == 1.2


@pytest.mark.parametrize("feature", ["sparsemixer", "layer_norm"])
def test_each_feature_changes_the_tokens(models: dict, feature: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With sparsemixer replaced by the usual top-2 softmax, or the LayerNorms' mean left in
    (an RMSNorm with the same weights and biases added), the tokens differ from the reference."""
    import torch.nn.functional as F

    from flexgen_dist.models import experts, llama

    tm, ref = models["default"]
    if feature == "sparsemixer":
        monkeypatch.setattr(experts, "_sparsemixer", lambda logits, jitter: [
            t.to(logits.dtype) if t.is_floating_point() else t
            for t in torch.topk(torch.softmax(logits.float(), dim=-1), 2, dim=-1)])
    else:
        monkeypatch.setattr(llama.F, "layer_norm", lambda x, shape, w, b, eps: F.rms_norm(x, shape, w, eps) + b)
    with LLM(str(tm.path), gpu_batch_size=2, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] != ref


def test_unequal_mscales_are_one_line(models: dict, tmp_path: Path) -> None:
    cfg = json.loads((models["longrope"][0].path / "config.json").read_text())
    cfg["rope_parameters"]["long_mscale"] = 1.5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="short_mscale 1.2 and long_mscale 1.5"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_the_registry_entry_is_what_its_config_gives() -> None:
    """phi-3.5-moe equals the spec transformers' PhimoeConfig defaults give (Phi-3.5-MoE's
    shapes) within its original 4096 positions (plain RoPE there); 41.9B parameters (the model
    card's 42B)."""
    from dataclasses import replace

    from transformers import PhimoeConfig

    from flexgen_dist.models.hf_config import spec_from_hf_config
    from flexgen_dist.models.registry import get_spec

    want = get_spec("phi-3.5-moe")
    got = spec_from_hf_config(PhimoeConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                           max_position_embeddings=4096, lm_head_bias=True, attention_bias=True,
                                           sliding_window=4096).to_dict(), "p")
    ids = dict(name="", bos_token_id=None, eos_token_ids=(), pad_token_id=None)
    assert replace(got, **ids) == replace(want, **ids)
    assert want.total_numel() / 1e9 == pytest.approx(41.9, rel=0.01)
