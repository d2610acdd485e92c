"""The Cohere family (Command R / R+ / Aya ``cohere``, Command R7B / A ``cohere2``): greedy
tokens and teacher-forced log-likelihoods equal transformers' in float32, with half the
weights on disk and the cache in RAM; what each difference from Llama does is checked by
turning it off and seeing the result change."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.models import cohere
from flexgen_dist.models.loader import load_model

LONG = [p * 3 for p in PROMPTS]  # 6 to 27 tokens: past the window of 5


def _model(kind: str, **extra) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(53)
    common = {**dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                     eos_token_id=None, logit_scale=0.25, rope_theta=500.0), **extra}
    m = (tf.CohereForCausalLM(tf.CohereConfig(**common)) if kind == "cohere"
         else tf.Cohere2ForCausalLM(tf.Cohere2Config(**common, sliding_window=5))).eval()
    with torch.no_grad():  # sharp attention, so that a wrong rotation would show; norms away from 1
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            if hasattr(layer.self_attn, "q_norm"):
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return m


def _nll(m: torch.nn.Module, seqs: list[list[int]]) -> list[float]:
    with torch.no_grad():
        return [-torch.log_softmax(m(input_ids=torch.tensor([s])).logits[0].double(), -1)[
            torch.arange(len(s) - 1), torch.tensor(s[1:])].sum().item() for s in seqs]


CASES = {"cohere": ("cohere", {}), "cohere-qk-norm": ("cohere", {"use_qk_norm": True, "tie_word_embeddings": False}),
         "cohere2": ("cohere2", {}), "cohere2-biases": ("cohere2", {"attention_bias": True})}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    out = {}
    for name, (kind, extra) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        m = _model(kind, **extra)
        if extra.get("attention_bias"):
            with torch.no_grad():
                for layer in m.model.layers:
                    layer.self_attn.q_proj.bias.normal_(0, 0.5)
                    layer.self_attn.o_proj.bias.normal_(0, 0.5)
        m.save_pretrained(d)
        out[name] = TinyModel(name, d, m, 0)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_tokens_and_scores_match_transformers(name: str, models: dict, tmp_path: Path) -> None:
    tm = models[name]
    ref = reference_generate(tm, LONG, 6)
    with LLM(str(tm.path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        spec = llm.model.spec
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] == ref
        # the logit scale never changes a greedy token, but it does every log-probability
        assert [s.nll for s in llm.score(LONG, decode_tokens=3)] == pytest.approx(_nll(tm.model, LONG), rel=1e-4)
    assert spec.family == "cohere" and spec.logit_scale == 0.25
    assert spec.total_numel() == sum(p.numel() for p in tm.model.parameters())
    if name.startswith("cohere2"):
        assert spec.nope_layers == (False, False, False, True) and [spec.window(j) for j in range(4)] == [5, 5, 5, 0]


def test_interleaved_rope_is_not_llamas(models: dict) -> None:
    """The pairs matter: Llama's rotation (i with i + d/2) on the same model gives other scores."""
    tm = models["cohere"]
    spec = load_model(str(tm.path), load_tokenizer=False).spec
    x = torch.randn(1, 3, 4, 16)
    pos = torch.arange(3)[None]
    from flexgen_dist.models.common import apply_rope, apply_rope_interleaved, as_positions

    cos, sin = as_positions(pos).rope(16, spec.rope_theta, torch.float32)
    ci, si = as_positions(pos).rope(16, spec.rope_theta, torch.float32, interleaved=True)
    assert not torch.allclose(apply_rope_interleaved(x, ci, si, True), apply_rope(x, cos, sin))
    # a pair (2i, 2i+1) turns by position x frequency i, its norm kept
    y = apply_rope_interleaved(x, ci, si, True)
    torch.testing.assert_close(y[..., 0::2] ** 2 + y[..., 1::2] ** 2, x[..., 0::2] ** 2 + x[..., 1::2] ** 2)


def test_layer_norm_is_the_references_in_bfloat16() -> None:
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    torch.manual_seed(3)
    ref = CohereLayerNorm((4, 16), eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        x = torch.randn(2, 5, 4, 16).to(torch.bfloat16)
        assert torch.equal(cohere.layer_norm(x, ref.weight, 1e-5), ref(x))


@pytest.mark.bundled
@pytest.mark.parametrize("name", ["cohere-qk-norm", "cohere2-biases"])
def test_gguf_files_run_as_their_directories(name: str, tmp_path: Path) -> None:
    """Command R(+) and R7B as llama.cpp writes them (``command-r``, ``cohere2``): q and k as the
    checkpoint has them, the LayerNorm's own epsilon key, the logit scale, cohere2's window on
    three layers of four: the spec equals the directory's, the tokens transformers'."""
    from gguf_convert import write_gguf

    kind, extra = CASES[name]
    m = _model(kind, **dict(extra, vocab_size=49152))  # the bundled tokenizer's vocabulary
    if extra.get("attention_bias"):
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
    m.save_pretrained(tmp_path / "hf")
    path = write_gguf(m, tmp_path / f"{name}.gguf")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    # the token ids are the bundled tokenizer's, copied into the file
    assert dataclasses.replace(ours, name=ref.name, eos_token_ids=(), pad_token_id=ref.pad_token_id) == ref
    want = reference_generate(TinyModel(name, path, m, 0), LONG, 6)
    with LLM(str(path), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] == want
