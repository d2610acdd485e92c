"""GGUF files of every architecture the engine reads from GGUF (llama with Llama 3.1's
``rope_freqs``, qwen2, qwen3, phi3): small random transformers models, written as llama.cpp's
converter writes them (``gguf_convert.py``), load to the spec their HF directory gives and
generate transformers' greedy tokens in float32 with half the weights on disk; Q8_0 / Q4_0
files too, kept in their own blocks. What the engine does not compute is refused in one line."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.common import rope_inv_freq
from flexgen_dist.models.gguf import llama3_from_divisors
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.spec import RopeScaling
from gguf_convert import llama3_rope_freqs, rewrite, roundtrip_, write_gguf

KINDS = ["llama3", "qwen2", "qwen3", "phi3"]
# a small original context, so that this head size has frequencies in each band of the rule
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
HELLO = [19556, 905]  # "Hello world" in the bundled SmolLM2 tokenizer


def _hf_model(kind: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(KINDS.index(kind) + 21)
    # SmolLM2's vocabulary, so the tokenizer copied into the file is the model's own
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "llama3":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(rope_theta=5000.0, rope_scaling=dict(LLAMA3),
                                               tie_word_embeddings=False, **common))
    elif kind == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(tie_word_embeddings=True, **common))
        with torch.no_grad():  # random biases, so that a missing one would show
            for layer in m.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3":
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=32, tie_word_embeddings=True, **common))  # not 64 / 4
        with torch.no_grad():  # norms away from 1, so that a skipped one would show
            for layer in m.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        m = tf.Phi3ForCausalLM(tf.Phi3Config(original_max_position_embeddings=128, sliding_window=40,
                                             tie_word_embeddings=False, **common))
    with torch.no_grad():  # sharp attention: at random init it is near uniform, and a wrong
        for layer in m.model.layers:  # rotary (permutation, frequencies) would hardly show
            a = layer.self_attn
            if hasattr(a, "qkv_proj"):
                a.qkv_proj.weight[: -a.config.num_key_value_heads * a.head_dim] *= 12
            else:
                a.q_proj.weight *= 12
                a.k_proj.weight *= 12
    return m.eval()


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_cache_kept_clean():
    """The loader caches each GGUF's converted tokenizer (keyed by path and mtime); the
    files here are temporary, so their entries go with them."""
    cache = Path(os.environ.get("FLEXGEN_CACHE", "~/.cache/flexgen_dist")).expanduser() / "tokenizers"
    before = set(cache.iterdir()) if cache.is_dir() else set()
    yield
    for d in (set(cache.iterdir()) if cache.is_dir() else set()) - before:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """(kind, qtype) -> (the transformers model, its GGUF file, its HF directory), built once."""
    cache: dict[tuple[str, str | None], tuple[torch.nn.Module, Path, Path]] = {}

    def get(kind: str, qtype: str | None = None) -> tuple[torch.nn.Module, Path, Path]:
        if (kind, qtype) not in cache:
            d = tmp_path_factory.mktemp(f"{kind}-{qtype or 'f32'}")
            m = _hf_model(kind)
            if qtype:  # the reference computes with the values the file holds
                roundtrip_(m, qtype)
            m.save_pretrained(d / "hf")
            cache[kind, qtype] = m, write_gguf(m, d / f"{kind}.gguf", qtype), d / "hf"
        return cache[kind, qtype]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_spec_is_the_one_of_the_hf_directory(kind: str, built) -> None:
    _, path, hf = built(kind)
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(hf), load_tokenizer=False).spec
    assert dataclasses.replace(ours, name=ref.name) == ref
    assert (ours.qkv_bias, ours.qk_norm, ours.fused_proj) == (kind == "qwen2", kind == "qwen3", kind == "phi3")


@pytest.mark.parametrize("kind,qtype,compress", [
    ("llama3", None, False), ("qwen2", None, False), ("qwen3", None, False), ("phi3", None, False),
    ("phi3", "Q8_0", True),  # fused rows cut from the file's own blocks
    ("phi3", "Q8_0", False),  # ... and the same rows expanded
    ("llama3", "Q4_0", True),  # llama.cpp's row interleaving undone on packed rows
])
def test_greedy_tokens_match_transformers_offloaded(kind: str, qtype: str | None, compress: bool,
                                                    built, tmp_path: Path) -> None:
    from flexgen_dist.memory.quant import QTensor

    m, path, _ = built(kind, qtype)
    ref = reference_generate(TinyModel(kind, path, m, 0), PROMPTS, 6)
    with LLM(str(path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             compress_weight=compress, offload_dir=str(tmp_path / "off"), ignore_eos=True,
             progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref
        assert llm.model.tokenizer is not None and llm.model.tokenizer("Hello world").input_ids == HELLO
        if compress:
            q = llm.engine.weights.placed[("layer", 0)]["q.w"].data
            assert isinstance(q, QTensor) and (q.group_size, q.bits) == (32, 8 if qtype == "Q8_0" else 4)


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_reads_the_tokenizer_of_each_architecture(kind: str, built) -> None:
    from transformers import AutoTokenizer

    _, path, _ = built(kind)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok("Hello world").input_ids == HELLO


def test_a_tokenizer_is_built_where_transformers_lacks_the_architecture(built, tmp_path: Path) -> None:
    """transformers rebuilds a model config before a GGUF's tokenizer and refuses an
    architecture it has no config for; the loader builds the tokenizer alone then."""
    from flexgen_dist.models.loader import _load_tokenizer

    _, path, _ = built("llama3")
    other = rewrite(path, tmp_path / "other.gguf", arch="gemma", tokenizer=True)
    tok = _load_tokenizer(tmp_path, other.name)
    assert tok is not None and tok("Hello world").input_ids == HELLO


def test_a_tokenizer_that_cannot_be_built_is_one_warning(built, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    _, path, _ = built("qwen3")
    bare = rewrite(path, tmp_path / "bare.gguf")  # no tokenizer.* metadata
    with caplog.at_level(logging.WARNING, logger="flexgen_dist"):
        assert load_model(str(bare)).tokenizer is None
    [said] = [r.getMessage() for r in caplog.records if "tokenizer cannot be built" in r.getMessage()]
    assert said.startswith("bare.gguf: ") and "\n" not in said


@pytest.mark.parametrize("factor,old,head_dim,theta", [
    (8.0, 8192, 128, 500000.0), (32.0, 8192, 64, 500000.0),  # Llama 3.1 8B, 3.2 1B
    (4.0, 64, 16, 5000.0), (4.0, 16, 16, 5000.0),  # two / one interpolated frequencies
    (4.0, 700, 16, 500000.0), (2.5, 700, 16, 500000.0),  # none: only the bands are known
])
def test_llama3_parameters_are_recovered_from_rope_freqs(factor: float, old: int, head_dim: int,
                                                         theta: float) -> None:
    """The recovered scaling gives transformers' frequencies bit for bit."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": old}
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_theta=theta, rope_scaling=rope)
    divisors = llama3_rope_freqs(cfg.to_dict()).numpy()
    s = llama3_from_divisors(divisors, head_dim, theta, "m")
    assert s is not None and s.factor == factor
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert torch.equal(rope_inv_freq(head_dim, theta, s), ref)


def _one_line(path: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(path), load_tokenizer=False)
    assert "\n" not in str(info.value)


def test_a_missing_tensor_is_named(built, tmp_path: Path) -> None:
    _, path, _ = built("qwen2")
    _one_line(rewrite(path, tmp_path / "m.gguf", drop=("blk.1.attn_k.bias",)),
              r"tensor blk\.1\.attn_k\.bias missing from the GGUF file")
    _one_line(rewrite(path, tmp_path / "e.gguf", drop=("token_embd.weight",)), r"tensor token_embd\.weight missing")


def test_a_tensor_the_engine_would_not_read_is_refused(built, tmp_path: Path) -> None:
    _, path, _ = built("qwen2")
    bias = {"blk.0.attn_output.bias": np.zeros(64, np.float32)}
    _one_line(rewrite(path, tmp_path / "x.gguf", tensors=bias), r"tensor blk\.0\.attn_output\.bias is not read")
    _, phi, _ = built("phi3")
    longrope = {"rope_factors_long.weight": np.ones(8, np.float32), "rope_factors_short.weight": np.ones(8, np.float32)}
    _one_line(rewrite(phi, tmp_path / "p.gguf", tensors=longrope), "longrope")


@pytest.mark.parametrize("change,arch,match", [
    ({}, "gemma", r"GGUF architecture 'gemma' is not supported \(supported: llama, phi3, qwen2, qwen3"),
    ({}, "mistral3", "architecture 'mistral3' is not supported"),
    ({"llama.rope.scaling.type": "yarn"}, None, "rope scaling type 'yarn' is not supported"),
    ({"llama.rope.dimension_count": 8}, None, "partial rotary embeddings"),
    ({"llama.attention.sliding_window": 32}, None, "key llama.attention.sliding_window is not computed"),
    ({"llama.logit_scale": 2.0}, None, "key llama.logit_scale is not computed"),
    ({"llama.block_count": None}, None, "key llama.block_count is missing"),
    ({"llama.expert_count": 8}, None, "mixture-of-experts llama file is not supported"),
    ({"split.count": 3}, None, "split into 3 files: merge them"),
])
def test_what_the_engine_does_not_compute_is_refused(change: dict, arch: str | None, match: str, built,
                                                     tmp_path: Path) -> None:
    _, path, _ = built("llama3")
    _one_line(rewrite(path, tmp_path / "c.gguf", change, arch=arch), match)


def test_rope_freqs_off_llama3s_rule_are_refused(built, tmp_path: Path) -> None:
    m, path, _ = built("llama3")
    divisors = llama3_rope_freqs(m.config.to_dict()).numpy()
    assert 1 < divisors[1] < 4  # interpolated
    divisors[1] *= 1.01
    _one_line(rewrite(path, tmp_path / "r.gguf", tensors={"rope_freqs.weight": divisors}),
              "rope_freqs do not follow Llama 3.1's rule")


def test_linear_rope_scaling_is_read(built, tmp_path: Path) -> None:
    _, path, _ = built("llama3")
    linear = rewrite(path, tmp_path / "l.gguf", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
                     drop=("rope_freqs.weight",))
    assert load_model(str(linear), load_tokenizer=False).spec.rope_scaling == RopeScaling("linear", 2.0)
    plain = rewrite(path, tmp_path / "p.gguf", drop=("rope_freqs.weight",))
    spec = load_model(str(plain), load_tokenizer=False).spec
    assert spec.rope_scaling is None and (spec.rope_theta, spec.norm_eps) == (5000.0, 1e-6)
