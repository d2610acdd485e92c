"""GGUF files of every architecture the engine reads from GGUF (llama with Llama 3.1's
``rope_freqs``, qwen2, qwen3, phi3, gemma2, gemma3): small random transformers models, written
as llama.cpp's converter writes them (``gguf_convert.py``), load to the spec their HF directory
gives and generate transformers' greedy tokens in float32 with half the weights on disk; Q8_0 /
Q4_0 files too, kept in their own blocks. What the engine does not compute is refused in one
line."""
from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.common import rope_inv_freq
from flexgen_dist.models.gguf import llama3_from_divisors
from flexgen_dist.models.gguf_arch import ARCHS, gemma_fields
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.tokenizers import GGUF_TOKENIZER_SINCE, transformers_version
from flexgen_dist.models.registry import get_spec
from flexgen_dist.models.spec import RopeScaling
from gguf_convert import (gguf_builder, llama3_rope_freqs, rewrite, roundtrip_, tokenizer_cache_kept_clean,
                          write_gguf)
from test_gemma import eager

KINDS = ["llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]
# a small original context, so that this head size has frequencies in each band of the rule
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
HELLO = [19556, 905]  # "Hello world" in the bundled SmolLM2 tokenizer
# Gemma as tests/test_gemma.py builds it (every matrix in whole 32-element blocks, so that a
# quantized file keeps them all), with what a GGUF file carries: the attention scaled by
# the head size (llama.cpp derives it), Gemma 3 sliding on all but every sixth layer (its
# default pattern; the file has none), its sliding layers with their own RoPE base
WINDOW = 8
LONG = [p * 4 for p in PROMPTS]  # 8 to 36 tokens: most prompts exceed the window on their own
GEMMA = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=128,
             sliding_window=WINDOW, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2)
G3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
           "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}}


def _gemma(kind: str) -> torch.nn.Module:
    import transformers as tf

    if kind == "gemma2":
        m = eager(tf.Gemma2ForCausalLM(tf.Gemma2Config(num_hidden_layers=4, attn_logit_softcapping=3.0,
                                                       final_logit_softcapping=2.0, **GEMMA)))
    else:
        m = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(num_hidden_layers=7, final_logit_softcapping=2.0,
                                                     rope_parameters=G3_ROPE, **GEMMA))
    with torch.no_grad():  # norm weights away from 0 (the (1 + w) form's identity), so that a
        for name, p in m.named_parameters():  # norm read without taking the converter's 1 off would show
            if "norm" in name:
                p.uniform_(-0.6, 0.6)
    return m.eval()


def _hf_model(kind: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(KINDS.index(kind) + 21)
    if kind.startswith("gemma"):
        return _gemma(kind)
    # SmolLM2's vocabulary, so the tokenizer copied into the file is the model's own
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "llama3":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(rope_theta=5000.0, rope_scaling=dict(LLAMA3),
                                               tie_word_embeddings=False, **common))
    elif kind == "qwen2":  # with YaRN (Qwen2.5's long-context setting), read back from the file's keys
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(tie_word_embeddings=True, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, **common))
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
    yield from tokenizer_cache_kept_clean()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """(kind, qtype) -> (the transformers model, its GGUF file, its HF directory), built once."""
    return gguf_builder(tmp_path_factory, _hf_model)


@pytest.mark.bundled
@pytest.mark.parametrize("kind", KINDS)
def test_spec_is_the_one_of_the_hf_directory(kind: str, built) -> None:
    _, path, hf = built(kind)
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(hf), load_tokenizer=False).spec
    assert dataclasses.replace(ours, name=ref.name) == ref
    assert (ours.qkv_bias, ours.qk_norm, ours.fused_proj) == (kind == "qwen2", kind in ("qwen3", "gemma3"),
                                                              kind == "phi3")


@pytest.mark.parametrize("kind,qtype,compress", [
    ("llama3", None, False), ("qwen2", None, False), ("qwen3", None, False), ("phi3", None, False),
    ("phi3", "Q8_0", True),  # fused rows cut from the file's own blocks
    ("phi3", "Q8_0", False),  # ... and the same rows expanded
    ("llama3", "Q4_0", True),  # llama.cpp's row interleaving undone on packed rows
])
@pytest.mark.bundled
def test_greedy_tokens_match_transformers_offloaded(kind: str, qtype: str | None, compress: bool,
                                                    built, tmp_path: Path) -> None:
    from flexgen_dist.memory.quant import QTensor

    m, path, _ = built(kind, qtype)
    ref = reference_generate(TinyModel(kind, path, m, 0), PROMPTS, 6)
    with LLM(str(path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             compress_weight=compress, offload_dir=str(tmp_path / "off"), ignore_eos=True,
             progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref
        if transformers_version() >= GGUF_TOKENIZER_SINCE.get(kind, (0, 0)):  # else refused (a test below)
            assert llm.model.tokenizer is not None and llm.model.tokenizer("Hello world").input_ids == HELLO
        else:
            assert llm.model.tokenizer is None
        if compress:
            q = llm.engine.weights.placed[("layer", 0)]["q.w"].data
            assert isinstance(q, QTensor) and (q.group_size, q.bits) == (32, 8 if qtype == "Q8_0" else 4)


@pytest.mark.parametrize("kind,qtype,compress", [
    ("gemma2", None, False), ("gemma3", None, False),
    ("gemma3", "Q8_0", True),  # matrices in the file's own blocks, the norms float32 beside them
])
@pytest.mark.bundled
def test_gemma_greedy_tokens_match_transformers_offloaded(kind: str, qtype: str | None, compress: bool,
                                                          built, tmp_path: Path) -> None:
    """Prompts longer than the window, the norms read back from the file's 1 + w, the soft-caps,
    and Gemma 3's RoPE per layer type: transformers' tokens with half the weights on disk."""
    m, path, _ = built(kind, qtype)
    ref = reference_generate(TinyModel(kind, path, m, 0), LONG, 10)
    with LLM(str(path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             compress_weight=compress, offload_dir=str(tmp_path / "off"), ignore_eos=True,
             progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=10)] == ref
        spec = llm.model.spec
        if compress:
            from flexgen_dist.memory.quant import QTensor

            q = llm.engine.weights.placed[("layer", 0)]["q.w"].data
            assert isinstance(q, QTensor) and (q.group_size, q.bits) == (32, 8)
    full = {"gemma2": (1, 3), "gemma3": (5,)}[kind]
    assert [spec.window(j) for j in range(spec.num_layers)] == [0 if j in full else WINDOW
                                                               for j in range(spec.num_layers)]


@pytest.mark.bundled
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_norms_are_the_checkpoints(kind: str, built) -> None:
    """The file's 1 + w with the 1 taken off gives the family the scale transformers computes
    (1 + w in float32), bit for bit, for every norm."""
    m, path, _ = built(kind)
    loaded = load_model(str(path), load_tokenizer=False)
    hf = dict(m.named_parameters())
    ours = {**loaded.source.get("head"), **{f"{j}.{k}": v for j in range(loaded.spec.num_layers)
                                           for k, v in loaded.source.get("layer", j).items()}}
    names = {"attn_norm.w": "input_layernorm", "post_attn_norm.w": "post_attention_layernorm",
             "mlp_norm.w": "pre_feedforward_layernorm", "post_mlp_norm.w": "post_feedforward_layernorm",
             "q_norm.w": "self_attn.q_norm", "k_norm.w": "self_attn.k_norm"}
    pairs = [(ours["norm.w"], hf["model.norm.weight"])] + [
        (ours[f"{j}.{k}"], hf[f"model.layers.{j}.{n}.weight"]) for j in range(loaded.spec.num_layers)
        for k, n in names.items() if f"{j}.{k}" in ours]
    assert len(pairs) == 1 + loaded.spec.num_layers * (6 if kind == "gemma3" else 4)
    for w, ref in pairs:
        assert torch.equal(1 + w, 1 + ref.detach())


@pytest.mark.parametrize("name", ["gemma-2-9b", "gemma-2-27b", "gemma-3-12b", "gemma-3-27b"])
def test_published_gemmas_read_from_their_gguf_keys(name: str) -> None:
    """What a converted file of a published Gemma says (its window, soft-caps) read as llama.cpp
    reads it, with what the file leaves out derived as llama.cpp derives it (the attention
    scale, by the layer count for the 27B models; the layer pattern; Gemma 3's local RoPE),
    gives the published config's spec, which the registry holds."""
    s = get_spec(name)
    arch = "gemma2" if name.startswith("gemma-2") else "gemma3"
    keys = {"attention.sliding_window": s.sliding_window, "attn_logit_softcapping": s.attn_softcap,
            "final_logit_softcapping": s.final_softcap}
    fields = gemma_fields(arch, lambda k, d=None: keys.get(k, d), None, s.num_layers, s.hidden_size,
                          s.num_heads, s.head_dim, s.rope_theta, s.rope_scaling, False)
    assert {k: getattr(s, k) for k in fields} == fields


@pytest.mark.bundled
def test_gemma3_metadata_read_as_llama_cpp_reads_it(built, tmp_path: Path) -> None:
    """Without ``rope.freq_base_swa`` (older converters) the sliding layers' base is 10000;
    ``attention.sliding_window_pattern`` as a period or one flag per layer; no window: no
    sliding layers."""
    _, path, _ = built("gemma3")

    def spec(change: dict, name: str):
        return load_model(str(rewrite(path, tmp_path / name, change)), load_tokenizer=False).spec

    s = spec({"gemma3.rope.freq_base_swa": None}, "a.gguf")
    assert s.rope(0) == (10000.0, None) and s.rope(5) == (100000.0, RopeScaling("linear", 4.0))
    flags = [True, False, True, True, False, True, True]
    assert spec({"gemma3.attention.sliding_window_pattern": 2}, "b.gguf").layer_types == tuple(
        "full_attention" if j % 2 else "sliding_attention" for j in range(7))
    assert spec({"gemma3.attention.sliding_window_pattern": flags}, "c.gguf").layer_types == tuple(
        "sliding_attention" if f else "full_attention" for f in flags)
    s = spec({"gemma3.attention.sliding_window": None}, "d.gguf")
    assert s.sliding_window == 0 and s.rope(0) == s.rope(5) == (100000.0, RopeScaling("linear", 4.0))


@pytest.mark.parametrize("kind,change,drop,extra,match", [
    ("gemma3", {"gemma3.attn_logit_softcapping": 50.0}, (), {}, "key gemma3.attn_logit_softcapping is not computed"),
    ("gemma3", {"gemma3.attention.sliding_window_pattern": [True, False]}, (), {}, "2 flags for 7 layers"),
    ("gemma2", {"gemma2.attention.sliding_window": 0}, (), {}, "sliding_window 0 is not supported"),
    ("gemma2", {}, (), {"output.weight": np.zeros((49152, 64), np.float32)}, r"tensor output\.weight is not read"),
    ("gemma3", {}, (), {"rope_freqs.weight": np.ones(16, np.float32)}, r"tensor rope_freqs\.weight is not read"),
    ("gemma3", {}, ("blk.6.attn_k_norm.weight",), {}, r"tensor blk\.6\.attn_k_norm\.weight missing"),
])
@pytest.mark.bundled
def test_what_a_gemma_file_says_that_is_not_computed_is_refused(kind: str, change: dict, drop: tuple, extra: dict,
                                                                 match: str, built, tmp_path: Path) -> None:
    _, path, _ = built(kind)
    _one_line(rewrite(path, tmp_path / "g.gguf", change, drop=drop, tensors=extra), match)


def _needs_transformers(arch: str) -> None:
    need = GGUF_TOKENIZER_SINCE.get(arch, (0, 0))
    if transformers_version() < need:
        pytest.skip(f"transformers {'.'.join(map(str, transformers_version()))} converts no {arch} GGUF tokenizer "
                    f"right; the loader refuses it (test_an_old_transformers_is_refused_for_these_tokenizers)")


@pytest.mark.bundled
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_reads_the_tokenizer_of_each_architecture(kind: str, built) -> None:
    from transformers import AutoTokenizer

    _needs_transformers({"llama3": "llama"}.get(kind, kind))
    _, path, _ = built(kind)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok("Hello world").input_ids == HELLO


def test_a_tokenizer_is_built_where_transformers_lacks_the_architecture(built, tmp_path: Path) -> None:
    """transformers rebuilds a model config before a GGUF's tokenizer and refuses an
    architecture it has no config for; the loader builds the tokenizer alone then."""
    from flexgen_dist.models.tokenizers import load_tokenizer

    _needs_transformers("gemma")  # before 5.18 no GGUF tokenizer of an unknown architecture converts
    _, path, _ = built("llama3")
    other = rewrite(path, tmp_path / "other.gguf", arch="gemma", tokenizer=True)
    tok = load_tokenizer(tmp_path, other.name)
    assert tok is not None and tok("Hello world").input_ids == HELLO


@pytest.mark.bundled
@pytest.mark.parametrize("kind", sorted({"phi3", "gemma2", "gemma3"} & set(KINDS)))
def test_an_old_transformers_is_refused_for_these_tokenizers(kind: str, built, monkeypatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """transformers 5.17 builds Phi-3's GGUF tokenizer with other ids for the same text and has
    none for Gemma's: below 5.18 the loader runs the model on ids and says which to install."""
    from flexgen_dist.models import tokenizers

    _, path, _ = built(kind)
    monkeypatch.setattr(tokenizers, "transformers_version", lambda: (5, 17))
    with caplog.at_level(logging.WARNING, logger="flexgen_dist"):
        assert load_model(str(path)).tokenizer is None
    [said] = [r.getMessage() for r in caplog.records if "tokenizer cannot be built" in r.getMessage()]
    assert "pip install 'transformers>=5.18'" in said and "\n" not in said


@pytest.mark.bundled
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


@pytest.mark.bundled
def test_a_missing_tensor_is_named(built, tmp_path: Path) -> None:
    _, path, _ = built("qwen2")
    _one_line(rewrite(path, tmp_path / "m.gguf", drop=("blk.1.attn_k.bias",)),
              r"tensor blk\.1\.attn_k\.bias missing from the GGUF file")
    _one_line(rewrite(path, tmp_path / "e.gguf", drop=("token_embd.weight",)), r"tensor token_embd\.weight missing")


@pytest.mark.bundled
def test_a_tensor_the_engine_would_not_read_is_refused(built, tmp_path: Path) -> None:
    _, path, _ = built("qwen2")
    bias = {"blk.0.attn_output.bias": np.zeros(64, np.float32)}
    _one_line(rewrite(path, tmp_path / "x.gguf", tensors=bias), r"tensor blk\.0\.attn_output\.bias is not read")
    _, phi, _ = built("phi3")
    longrope = {"rope_factors_long.weight": np.ones(5, np.float32), "rope_factors_short.weight": np.ones(5, np.float32)}
    _one_line(rewrite(phi, tmp_path / "p.gguf", tensors=longrope), "have 5/5 values for 16 rotated dims: expected 8")


@pytest.mark.parametrize("change,arch,match", [
    ({}, "falcon", r"GGUF architecture 'falcon' is not supported \(supported: " + re.escape(", ".join(sorted(ARCHS)))
     + r"; Mistral"),
    ({}, "mistral3", "architecture 'mistral3' is not supported"),
    ({"llama.rope.scaling.type": "longrope"}, None, "rope scaling type 'longrope' is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.original_context_length": 32, "llama.rope.scaling.yarn_ext_factor": 0.5}, None,
     "yarn_ext_factor 0.5 is not supported"),
    ({"llama.rope.dimension_count": 8}, None, "partial rotary embeddings"),
    ({"llama.attention.sliding_window": 32}, None, "key llama.attention.sliding_window is not computed"),
    ({"llama.logit_scale": 2.0}, None, "key llama.logit_scale is not computed"),
    ({"llama.block_count": None}, None, "key llama.block_count is missing"),
    ({"llama.expert_count": 8}, None, "key llama.expert_used_count is missing"),
    ({"split.count": 3}, None, "split into 3 files: merge them"),
])
@pytest.mark.bundled
def test_what_the_engine_does_not_compute_is_refused(change: dict, arch: str | None, match: str, built,
                                                     tmp_path: Path) -> None:
    _, path, _ = built("llama3")
    _one_line(rewrite(path, tmp_path / "c.gguf", change, arch=arch), match)


@pytest.mark.bundled
def test_rope_freqs_off_llama3s_rule_are_refused(built, tmp_path: Path) -> None:
    m, path, _ = built("llama3")
    divisors = llama3_rope_freqs(m.config.to_dict()).numpy()
    assert 1 < divisors[1] < 4  # interpolated
    divisors[1] *= 1.01
    _one_line(rewrite(path, tmp_path / "r.gguf", tensors={"rope_freqs.weight": divisors}),
              "rope_freqs do not follow Llama 3.1's rule")


@pytest.mark.bundled
def test_linear_rope_scaling_is_read(built, tmp_path: Path) -> None:
    _, path, _ = built("llama3")
    linear = rewrite(path, tmp_path / "l.gguf", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
                     drop=("rope_freqs.weight",))
    assert load_model(str(linear), load_tokenizer=False).spec.rope_scaling == RopeScaling("linear", 2.0)
    plain = rewrite(path, tmp_path / "p.gguf", drop=("rope_freqs.weight",))
    spec = load_model(str(plain), load_tokenizer=False).spec
    assert spec.rope_scaling is None and (spec.rope_theta, spec.norm_eps) == (5000.0, 1e-6)


@pytest.mark.bundled
@pytest.mark.parametrize("kind,qtype", [("qwen3", "Q4_0"), ("gemma3", "Q8_0"), ("bundled", None)])
def test_the_header_reader_reads_what_gguf_reads(kind: str, qtype: str | None, built) -> None:
    """``GGUFFile`` (one struct pass) gives every key, type, value and tensor view that the
    ``gguf`` package's reader gives, for files with tokenizers, packed and plain tensors."""
    from gguf import GGUFReader

    from flexgen_dist.models.gguf_file import GGUFFile
    from flexgen_dist.models.loader import bundled_model_path

    path = bundled_model_path() if kind == "bundled" else built(kind, qtype)[1]
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, f in theirs.fields.items():
        got, want = ours.fields[key].contents(), f.contents()
        assert got == want and type(got) is type(want), key
        assert ours.fields[key].types == f.types, key
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert list(a.shape) == list(b.shape)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.bundled
def test_a_file_that_is_not_whole_gguf_is_one_line(built, tmp_path: Path) -> None:
    _, path, _ = built("llama3")
    data = path.read_bytes()
    cases = {"empty.gguf": b"", "text.gguf": b"not a model at all, just some text here",
             "header.gguf": data[:2000], "tensors.gguf": data[:len(data) - 100]}
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ModelLoadError, match="cannot read GGUF .*the file is corrupt or not GGUF") as info:
            load_model(str(tmp_path / name), load_tokenizer=False)
        assert "\n" not in str(info.value), name


@pytest.mark.bundled
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_phi3_longrope_and_partial_rotary_files_run_as_their_directories(partial: float, tmp_path: Path) -> None:
    """Phi-3 128k / Phi-3.5 and Phi-4-mini as llama.cpp writes them (``rope_factors_long/short``,
    the original context and attention factor as keys, ``rope.dimension_count`` below the head
    size): the spec equals the Hugging Face directory's, and greedy tokens equal transformers',
    within the original context of 16 and past it."""
    import transformers as tf

    torch.manual_seed(31)
    pairs = int(16 * partial) // 2
    rope = {"rope_type": "longrope", "long_factor": [1.0 + 0.9 * i for i in range(pairs)],
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)]}
    m = tf.Phi3ForCausalLM(tf.Phi3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=16,
        rope_scaling=rope, partial_rotary_factor=partial, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8)
    m.save_pretrained(tmp_path / "hf")
    path = write_gguf(m, tmp_path / "phi.gguf")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    assert dataclasses.replace(ours, name=ref.name) == ref
    assert ours.rope_scaling.rope_type == "longrope" and ours.rope_dim == int(16 * partial)
    prompts = [PROMPTS[1], PROMPTS[2] * 2, PROMPTS[4] * 5]  # 3, 18 and 25 tokens
    want = [reference_generate(TinyModel("phi3", path, m, 2), [p], 6)[0] for p in prompts]
    with LLM(str(path), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(prompts, gen_len=6)] == want


@pytest.mark.bundled
def test_longrope_factors_outside_phi3_or_unpaired_are_refused(built, tmp_path: Path) -> None:
    _, llama, _ = built("llama3")
    bad = rewrite(llama, tmp_path / "l.gguf", tensors={"rope_factors_long.weight": np.ones(4, np.float32),
                                                       "rope_factors_short.weight": np.ones(4, np.float32)})
    with pytest.raises(ModelLoadError, match="LongRoPE.* in a llama file: supported for phi3 only"):
        load_model(str(bad), load_tokenizer=False)
    _, phi, _ = built("phi3")
    half = rewrite(phi, tmp_path / "p.gguf", tensors={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(ModelLoadError, match="rope_factors_long.weight without its pair"):
        load_model(str(half), load_tokenizer=False)


@pytest.mark.bundled
def test_granite_files_run_as_their_directories(tmp_path: Path) -> None:
    """IBM Granite as llama.cpp writes it (architecture ``granite``: llama's tensors with q/k
    permuted, the multipliers as ``embedding_scale``, ``residual_scale``, ``logit_scale`` and
    ``attention.scale``): the spec equals the directory's, tokens and scores transformers'."""
    import transformers as tf

    torch.manual_seed(37)
    m = tf.GraniteForCausalLM(tf.GraniteConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, embedding_multiplier=12.0, attention_multiplier=0.5,
        residual_multiplier=0.22, logits_scaling=0.125, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True)).eval()
    m.save_pretrained(tmp_path / "hf")
    path = write_gguf(m, tmp_path / "granite.gguf")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    assert dataclasses.replace(ours, name=ref.name) == ref
    want = reference_generate(TinyModel("granite", path, m, 2), PROMPTS, 6)
    seqs = [p * 2 for p in PROMPTS]
    with torch.no_grad():
        nll = [-torch.log_softmax(m(input_ids=torch.tensor([q])).logits[0].double(), -1)[
            torch.arange(len(q) - 1), torch.tensor(q[1:])].sum().item() for q in seqs]
    with LLM(str(path), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == want
        assert [s.nll for s in llm.score(seqs)] == pytest.approx(nll, rel=1e-4)
        assert llm.model.tokenizer is not None and llm.model.tokenizer("Hello world").input_ids == HELLO


@pytest.mark.bundled
def test_smollm3_files_run_as_their_directories(tmp_path: Path) -> None:
    """SmolLM3 as llama.cpp writes it (architecture ``smollm3``: llama's tensors, q/k permuted;
    every fourth layer without RoPE, which llama.cpp fixes for the architecture): the spec
    equals the directory's and greedy tokens transformers'."""
    import transformers as tf

    torch.manual_seed(41)
    m = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    m.save_pretrained(tmp_path / "hf")
    path = write_gguf(m, tmp_path / "smollm3.gguf")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    assert dataclasses.replace(ours, name=ref.name) == ref and ours.nope_layers == (False, False, False, True)
    want = reference_generate(TinyModel("smollm3", path, m, 2), LONG, 6)
    with LLM(str(path), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] == want


def _norm_layout_model(kind: str) -> torch.nn.Module:
    import transformers as tf

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return {"olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**common)),
            "olmo3": lambda: tf.Olmo3ForCausalLM(tf.Olmo3Config(**common, sliding_window=5)),
            "glm4": lambda: tf.Glm4ForCausalLM(tf.Glm4Config(**common, head_dim=32)),
            "exaone4": lambda: tf.Exaone4ForCausalLM(tf.Exaone4Config(**common, sliding_window=5,
                                                                      sliding_window_pattern=4))}[kind]().eval()


# what each file's spec must say beyond equalling its directory's
_NORM_LAYOUT_FACTS = {
    "olmo2": dict(norm_layout="post", qk_norm_whole=True), "olmo3": dict(norm_layout="post", qk_norm_whole=True),
    "glm4": dict(norm_layout="sandwich", rotary_dim=16, rope_interleaved=True, fused_mlp=True),
    "exaone4": dict(norm_layout="post", qk_norm_whole=False, nope_layers=(False, False, False, True)),
}


@pytest.mark.bundled
@pytest.mark.parametrize("kind", ["olmo2", "olmo3", "glm4", "exaone4"])
def test_files_with_norms_after_the_sublayers_run_as_their_directories(kind: str, tmp_path: Path) -> None:
    """OLMo 2 and 3 as llama.cpp writes them (both as ``olmo2``: q/k not permuted, the norms
    after each sublayer as post_attention_norm and post_ffw_norm, q/k norms over all heads;
    OLMo 3's window and its per-layer pattern), EXAONE 4 (``exaone4``: the same norms, q/k norms
    per head, the window's per-layer pattern, the global layers without RoPE) and GLM-4
    (``glm4``: four norms a layer, gate|up fused as ffn_up, q/k not permuted, RoPE on
    interleaved pairs of half of each head): spec and greedy tokens as the directory's."""
    torch.manual_seed(47)
    m = _norm_layout_model(kind)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    m.save_pretrained(tmp_path / "hf")
    path = write_gguf(m, tmp_path / f"{kind}.gguf")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    if kind == "olmo3":  # the file has one RoPE for every layer: the same here, both layer types at the default
        assert ref.local_rope_theta in (0.0, ref.rope_theta)
        ref = dataclasses.replace(ref, local_rope_theta=ours.local_rope_theta)
    assert dataclasses.replace(ours, name=ref.name) == ref
    assert {k: getattr(ours, k) for k in _NORM_LAYOUT_FACTS[kind]} == _NORM_LAYOUT_FACTS[kind]
    want = reference_generate(TinyModel(kind, path, m, 2), LONG, 6)
    with LLM(str(path), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] == want


@pytest.mark.bundled
def test_every_end_of_generation_id_stops(tmp_path: Path) -> None:
    """A file's end-of-turn and end-of-message ids stop generation beside its end-of-sequence
    id, as llama.cpp stops at each (an instruct model's turn ends at its eot token)."""
    from gguf_convert import rewrite

    from flexgen_dist.models.loader import bundled_model_path

    src = bundled_model_path()
    assert load_model(str(src), load_tokenizer=False).spec.eos_token_ids == (2,)
    f = rewrite(src, tmp_path / "eot.gguf", {"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2},
                tokenizer=True)
    assert load_model(str(f), load_tokenizer=False).spec.eos_token_ids == (2, 7)


@pytest.mark.bundled
@pytest.mark.parametrize("kind", ["seed_oss", "seed_oss-out-bias", "hunyuan_v1_dense", "arcee", "ernie4_5",
                                  "apertus", "apertus-Q8_0"])
def test_newer_dense_files_match_transformers(kind: str, tmp_path: Path) -> None:
    """``seed_oss`` (q/k/v biases, an o bias where the file has one, its norm before the MLP
    as post_attention_norm), ``hunyuan-dense`` (q/k norms after RoPE, the NTK-alpha base as
    the converter writes it), ``arcee``, ``ernie4_5`` (RoPE on interleaved pairs in float32,
    q and k as the checkpoint has them) and ``apertus`` (q and k as the checkpoint has them, per-head
    q/k norms, Llama 3.1's rope_freqs, an ungated xIELU MLP whose learned scalars are the per-layer
    xielu.* arrays; also as Q8_0): the HF directory's spec and transformers' tokens."""
    import transformers as tf

    torch.manual_seed(43)
    qtype = kind.partition("-")[2] if kind.startswith("apertus") else None  # "": float32
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                  pad_token_id=2, tie_word_embeddings=False)
    if kind.startswith("seed_oss"):
        m = tf.SeedOssForCausalLM(tf.SeedOssConfig(attention_bias=True, attention_out_bias=kind.endswith("bias"),
                                                   **common))
    elif kind == "arcee":  # llama's layout (q/k rows permuted by the converter), an ungated relu² MLP
        m = tf.ArceeForCausalLM(tf.ArceeConfig(**common))
    elif kind == "ernie4_5":
        m = tf.Ernie4_5ForCausalLM(tf.Ernie4_5Config(**common))
    elif kind.startswith("apertus"):  # Llama 3.1's scaling with frequencies in each band of the rule (head size 16)
        m = tf.ApertusForCausalLM(tf.ApertusConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 12000000.0, "factor": 8.0, "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0}))
    else:
        m = tf.HunYuanDenseV1ForCausalLM(tf.HunYuanDenseV1Config(rope_parameters={
            "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}, **common))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
            if n.endswith(("query_layernorm.weight", "key_layernorm.weight", "q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(12)  # sharp attention, so that where the norms and RoPE act shows
            if qtype is not None and n.endswith(("norm.weight", "alpha_p", "alpha_n")):
                # Apertus's norms away from 1 and its xIELU scalars away from the initial values every
                # layer shares, so that a swapped, skipped or mis-transformed one shows
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.normal_(0, 0.5)
            if kind in ("arcee", "apertus", "apertus-Q8_0") and n.endswith(("up_proj.weight", "down_proj.weight")):
                p.mul_(6)  # an MLP that weighs in the output
    if qtype:  # the reference computes with the values the file holds
        roundtrip_(m, qtype)
    m.eval().save_pretrained(tmp_path / "hf")
    path = write_gguf(m, tmp_path / f"{kind}.gguf", qtype or None)
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    # the file holds the base in float32: the same frequencies (float32 tables) from the rounded base
    from flexgen_dist.models.common import rope_inv_freq

    assert torch.equal(rope_inv_freq(16, ours.rope_theta), rope_inv_freq(16, ref.rope_theta))
    assert dataclasses.replace(ours, name=ref.name, max_positions=ref.max_positions, rope_theta=ref.rope_theta) == ref
    if qtype is not None:
        assert ours.mlp_activation == "xielu" and ours.qk_norm and ours.rope_scaling.rope_type == "llama3"
    with LLM(str(path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == reference_generate(
            TinyModel(kind, path, m, 0), PROMPTS, 6)


@pytest.mark.bundled
def test_apertus_xielu_keys_are_read_as_llama_cpp_reads_them(tmp_path: Path) -> None:
    """Apertus's xIELU parameters are metadata, not tensors: the unprefixed ``xielu.alpha_p``,
    ``xielu.alpha_n``, ``xielu.beta`` and ``xielu.eps``, one value a layer, alpha_p and alpha_n
    as the checkpoint stores them (before softplus). Each layer's weights carry its own values; one
    value stands for every layer (llama.cpp's loader broadcasts it); a key missing, an array of
    another length, a beta or an eps other than the ones computed (0.5; -1e-6 as a float32,
    bfloat16 or float16 checkpoint holds it) are refused in one line."""
    import transformers as tf

    torch.manual_seed(53)
    m = tf.ApertusForCausalLM(tf.ApertusConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("alpha_p", "alpha_n")):
                p.normal_(0, 0.5)
    path = write_gguf(m, tmp_path / "apertus.gguf")
    loaded = load_model(str(path), load_tokenizer=False)
    for j, layer in enumerate(m.model.layers):
        w = loaded.source.get("layer", j)
        assert torch.equal(w["act.alpha_p"], layer.mlp.act_fn.alpha_p) and torch.equal(
            w["act.alpha_n"], layer.mlp.act_fn.alpha_n)
    # one value for every layer; eps as a bfloat16 checkpoint stores it
    one = rewrite(path, tmp_path / "one.gguf", {"xielu.alpha_p": 0.25, "xielu.beta": 0.5,
                                                "xielu.eps": float(torch.tensor(-1e-6, dtype=torch.bfloat16))})
    assert [load_model(str(one), load_tokenizer=False).source.get("layer", j)["act.alpha_p"].item()
            for j in range(3)] == [0.25] * 3
    for change, match in (({"xielu.alpha_n": None}, "key xielu.alpha_n is missing"),
                          ({"xielu.alpha_p": [0.1, 0.2]}, "key xielu.alpha_p has 2 values for 3 layers"),
                          ({"xielu.beta": [0.5, 0.5, 0.25]}, r"key xielu\.beta .* not supported"),
                          ({"xielu.eps": -1e-5}, r"key xielu\.eps .* not supported")):
        _one_line(rewrite(path, tmp_path / "c.gguf", change), match)
