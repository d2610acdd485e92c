"""GGUF files of llama.cpp's ``gptneox`` (GPT-NeoX / Pythia), ``phi2`` (Phi-1/1.5/2) and
``starcoder2`` architectures: small random transformers models, written as llama.cpp's converter
writes them (``gguf_convert.py``: GPTNeoXModel's and Phi2Model's keys, StarCoder2Model's generic
ones, GPT-NeoX's fused q|k|v reordered to all heads' q, then k, then v), load to the spec their HF
directory gives and generate transformers' greedy tokens in float32 and Q8_0 with half the weights
on disk. Reading the fused rows as the checkpoint interleaves them (the reorder not undone), or
StarCoder2's q and k as if the converter had interleaved their rotary halves (as for ``llama``),
gives other tokens; a phi2 file with q|k|v fused (a checkpoint that fused them) reads as
llama.cpp's graph reads it; a StarCoder2 checkpoint's window, which the file cannot hold, is not
applied, as llama.cpp applies none; what llama.cpp would not load is refused in one line."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models import neox
from flexgen_dist.models.families import ROWS
from flexgen_dist.models.gguf_arch import ARCHS
from flexgen_dist.models.gguf_file import GGUFFile
from flexgen_dist.models.loader import load_model
from gguf_convert import gguf_builder, rewrite, tokenizer_cache_kept_clean
from test_neox import neox_model

HELLO = [19556, 905]  # "Hello world" in the bundled SmolLM2 tokenizer the writer copies
LONG = [p * 2 for p in PROMPTS]
# (HF model_type, config changes): Pythia (attention beside the MLP), GPT-NeoX with the MLP after
# attention, Phi-2 (one norm for both, a biased head), StarCoder2 with its head tied (the default)
# and untied (grouped-query attention, biases everywhere; weights drawn 5x wider than transformers'
# default, or the tiny model repeats one token; a RoPE base of its own: the file holds it)
_STARCODER2 = {"initializer_range": 0.1, "base": 500.0}
CASES = {"pythia": ("gpt_neox", {}), "neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
         "phi-2": ("phi", {}), "starcoder2": ("starcoder2", {**_STARCODER2, "tie_word_embeddings": True}),
         "starcoder2-untied": ("starcoder2", _STARCODER2)}
# StarCoder2 checkpoints whose files are not read as their HF directory: one sliding over 5
# positions (the file cannot say it), one without biases (llama.cpp's loader requires them)
OTHERS = {"starcoder2-window": ("starcoder2", {**_STARCODER2, "tie_word_embeddings": True, "sliding_window": 5}),
          "starcoder2-no-bias": ("starcoder2", {**_STARCODER2, "use_bias": False})}


def _model(name: str) -> torch.nn.Module:
    """As tests/test_neox.py builds them, with what a file can say: SmolLM2's vocabulary (the
    tokenizer copied into the file), RoPE base 10000 for GPT-NeoX and Phi (their converters write
    none: llama.cpp's default, every released Pythia's and Phi's), an MLP 4 x hidden wide (Phi2Model
    writes that width) and each family's released GELU (Pythia's gelu, Phi's gelu_new, StarCoder2's
    gelu_pytorch_tanh: a file does not say)."""
    kind, extra = {**CASES, **OTHERS}[name]
    kw = {"base": 10000.0, "intermediate_size": 256, **extra}
    return neox_model(kind, seed=sorted({**CASES, **OTHERS}).index(name) + 81, vocab_size=49152, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, **kw)


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_cache_kept_clean():
    yield from tokenizer_cache_kept_clean()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    """(kind, qtype) -> (the transformers model, its GGUF file, its HF directory), built once."""
    return gguf_builder(tmp_path_factory, _model)


@pytest.mark.bundled
@pytest.mark.parametrize("name", sorted(CASES))
def test_spec_is_the_one_of_the_hf_directory(name: str, built) -> None:
    _, path, hf = built(name)
    arch = GGUFFile(path).fields["general.architecture"].contents()
    assert arch == {"phi-2": "phi2", "starcoder2": "starcoder2", "starcoder2-untied": "starcoder2"}.get(name, "gptneox")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(hf), load_tokenizer=False).spec
    assert dataclasses.replace(ours, name=ref.name) == ref
    assert (ours.family, ours.attention_bias, ours.mlp_bias, ours.fused_proj) == ("neox", True, True, False)
    assert (ours.rotary_dim, ours.norm_layout, ours.parallel_residual, ours.lm_head_bias, ours.mlp_activation,
            ours.tie_word_embeddings) == {
        "pythia": (8, "pre", True, False, "gelu", False), "neox-sequential": (8, "pre", False, False, "gelu", False),
        "phi-2": (8, "shared", False, True, "gelu_new", False),
        "starcoder2": (0, "pre", False, False, "gelu_pytorch_tanh", True),
        "starcoder2-untied": (0, "pre", False, False, "gelu_pytorch_tanh", False)}[name]
    if arch == "starcoder2":  # the converter's generic keys: the kv heads, the RoPE base
        assert (ours.num_kv_heads, ours.rope_theta, ours.sliding_window) == (2, 500.0, 0)


@pytest.mark.parametrize("name,qtype,compress", [
    ("pythia", None, False), ("neox-sequential", None, False), ("phi-2", None, False),
    ("pythia", "Q8_0", True),  # q, k, v cut from attn_qkv's own blocks
    ("pythia", "Q8_0", False),  # ... and the same rows expanded
    ("phi-2", "Q8_0", True),
    ("starcoder2", None, False), ("starcoder2-untied", None, False),
    ("starcoder2", "Q8_0", True), ("starcoder2-untied", "Q8_0", True),
])
@pytest.mark.bundled
def test_greedy_tokens_match_transformers_offloaded(name: str, qtype: str | None, compress: bool, built,
                                                    tmp_path: Path) -> None:
    from flexgen_dist.memory.quant import QTensor

    m, path, _ = built(name, qtype)
    ref = reference_generate(TinyModel(name, path, m, 0), LONG, 6)
    with LLM(str(path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             compress_weight=compress, offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] == ref
        assert llm.model.tokenizer is not None and llm.model.tokenizer("Hello world").input_ids == HELLO
        if compress:
            q = llm.engine.weights.placed[("layer", 0)]["q.w"].data
            assert isinstance(q, QTensor) and (q.group_size, q.bits) == (32, 8)


def _interleaved_names(spec, part: str, layer: int | None = None) -> dict[str, str]:
    """gptneox's names with attn_qkv read as the checkpoint interleaves it (head h's q, k, v
    rows after each other): the converter's reorder not undone."""
    out = neox.gguf_names(spec, part, layer)
    for k, v in list(out.items()):
        if "attn_qkv" in v:
            out[k] = v.split(ROWS)[0] + neox._fused_rows(spec, "qkv".index(k[0]))
    return out


# each misreading of a file, undone: (the case, its architecture, what changes in its ARCHS entry)
MISREADINGS = {
    # GPT-NeoX's attn_qkv read without undoing the converter's reorder (as the checkpoint interleaves it)
    "neox-fused-rows": ("pythia", "gptneox", {"names": _interleaved_names}),
    # StarCoder2's q and k read as a llama file's, whose rows the converter interleaves for llama.cpp's
    # pairwise rotation (starcoder2's converter writes them as the checkpoint has them: NEOX RoPE)
    "starcoder2-permuted": ("starcoder2", "starcoder2", {"permuted": True}),
}


@pytest.mark.bundled
@pytest.mark.parametrize("case", sorted(MISREADINGS))
def test_a_file_misread_gives_other_tokens(case: str, built, monkeypatch) -> None:
    """What the reader undoes is what makes the tokens transformers': the same file read the
    other way computes something else."""
    name, arch, change = MISREADINGS[case]
    m, path, _ = built(name)
    ref = reference_generate(TinyModel(name, path, m, 0), LONG, 6)
    monkeypatch.setitem(ARCHS, arch, dataclasses.replace(ARCHS[arch], **change))
    with LLM(str(path), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] != ref


@pytest.mark.bundled
def test_a_starcoder2_window_is_not_applied_as_llama_cpp_applies_none(built) -> None:
    """A checkpoint sliding over 5 positions: its file holds no window (StarCoder2Model writes
    TextModel's keys alone) and llama.cpp's starcoder2 graph attends over the whole context, so
    the spec is the HF directory's without the window, and the tokens are transformers' on the
    same weights without it, not those of the windowed model (the prompts reach 18 positions)."""
    m, path, hf = built("starcoder2-window")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(hf), load_tokenizer=False).spec
    assert ref.sliding_window == 5
    assert dataclasses.replace(ours, name=ref.name) == dataclasses.replace(ref, sliding_window=0)
    whole = copy.deepcopy(m)
    whole.config.sliding_window = None
    want = reference_generate(TinyModel("whole", path, whole, 0), LONG, 6)
    assert want != reference_generate(TinyModel("windowed", path, m, 0), LONG, 6)
    with LLM(str(path), percent=(0, 50, 0, 100, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] == want


@pytest.mark.bundled
def test_a_phi2_file_with_fused_qkv_reads_as_llama_cpp_reads_it(built, tmp_path: Path) -> None:
    """A phi2 file converted from a checkpoint that fused q|k|v (Phi2Model writes it unchanged
    as attn_qkv, weight and bias) is read as llama.cpp's phi2 graph reads it: q, k and v the
    rows [0, q_dim), [q_dim, q_dim + kv_dim) and the next kv_dim. Built here from a file with
    them apart, it gives transformers' tokens."""
    m, path, hf = built("phi-2")
    layers = m.config.num_hidden_layers
    src = {t.name: np.asarray(t.data) for t in GGUFFile(path).tensors}
    fused = {f"blk.{j}.attn_qkv.{s}": np.concatenate([src[f"blk.{j}.attn_{p}.{s}"] for p in "qkv"])
             for j in range(layers) for s in ("weight", "bias")}
    drop = tuple(f"blk.{j}.attn_{p}.{s}" for j in range(layers) for p in "qkv" for s in ("weight", "bias"))
    f = rewrite(path, tmp_path / "fused.gguf", drop=drop, tensors=fused, tokenizer=True)
    ours = load_model(str(f), load_tokenizer=False).spec
    ref = load_model(str(hf), load_tokenizer=False).spec
    assert ours.fused_proj and dataclasses.replace(ours, name=ref.name, fused_proj=False) == ref
    with LLM(str(f), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=6)] == reference_generate(
            TinyModel("phi-2", f, m, 0), LONG, 6)


@pytest.mark.parametrize("name,change,drop,extra,match", [
    ("pythia", {"gptneox.use_parallel_residual": None}, (), {}, "key gptneox.use_parallel_residual is missing"),
    ("phi-2", {"phi2.attention.layer_norm_epsilon": None}, (), {}, "key phi2.attention.layer_norm_epsilon is missing"),
    ("phi-2", {"phi2.attention.sliding_window": 32}, (), {}, "key phi2.attention.sliding_window is not computed"),
    ("pythia", {"gptneox.logit_scale": 2.0}, (), {}, "key gptneox.logit_scale is not computed"),
    ("phi-2", {"phi2.rope.dimension_count": 7}, (), {}, "rope.dimension_count 7 is not an even count"),
    # a checkpoint whose MLP is not 4 x hidden: Phi2Model still writes 4 x hidden (refused at load)
    ("phi-2", {"phi2.feed_forward_length": 100}, (), {}, r"feed_forward_length is 100 but blk\.0\.ffn_up\.weight has"),
    ("pythia", {}, (), {"output.bias": np.zeros(49152, np.float32)}, r"tensor output\.bias is not read"),
    ("phi-2", {}, ("output.bias",), {}, r"tensor output\.bias missing"),
    ("pythia", {}, ("blk.1.attn_qkv.bias",), {}, r"tensor blk\.1\.attn_qkv\.bias missing"),
    ("pythia", {}, ("output.weight",), {}, r"tensor output\.weight missing"),  # llama.cpp requires its own head
    # StarCoder2: a window (llama.cpp's graph applies none), its epsilon (required), part of each head
    # turned (llama.cpp asserts every dim turns), a bias (all required), a head's bias (never read)
    ("starcoder2", {"starcoder2.attention.sliding_window": 5}, (), {},
     "key starcoder2.attention.sliding_window is not computed"),
    ("starcoder2", {"starcoder2.attention.layer_norm_epsilon": None}, (), {},
     "key starcoder2.attention.layer_norm_epsilon is missing"),
    ("starcoder2", {"starcoder2.rope.dimension_count": 8}, (), {},
     "starcoder2.rope.dimension_count 8 differs from the head size 16"),
    ("starcoder2-untied", {}, ("blk.1.attn_output.bias",), {}, r"tensor blk\.1\.attn_output\.bias missing"),
    ("starcoder2-untied", {}, (), {"output.bias": np.zeros(49152, np.float32)}, r"tensor output\.bias is not read"),
    # converted from a use_bias false checkpoint: llama.cpp's loader requires every bias
    ("starcoder2-no-bias", {}, (), {}, "a starcoder2 file without biases .use_bias false. is not supported"),
])
@pytest.mark.bundled
def test_what_llama_cpp_would_not_load_is_refused_in_one_line(name: str, change: dict, drop: tuple, extra: dict,
                                                              match: str, built, tmp_path: Path) -> None:
    _, path, _ = built(name)
    bad = rewrite(path, tmp_path / "bad.gguf", change, drop=drop, tensors=extra)
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(str(bad), load_tokenizer=False)
    assert "\n" not in str(info.value)
