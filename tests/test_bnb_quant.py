"""bitsandbytes checkpoints (``models/bnb_quant.py``), written by transformers + bitsandbytes
themselves (a random model quantized on load with ``BitsAndBytesConfig``, then saved): NF4 with
double quantization, FP4 without, and LLM.int8(); each matrix expands to what bitsandbytes'
own ``dequantize_4bit`` / ``int8_vectorwise_dequant`` give, and greedy tokens equal
transformers' on those values (float32), with weights offloaded, and for 4 bits also with the
codes kept under --compress-weight (the engine's ``nf4`` / ``fp4`` table formats, sized as
stored); what is not read is refused in one line."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import os

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError

try:
    import bitsandbytes as bnb  # a dev dependency: the packer and the reference
    _MISSING = None
except ImportError as e:  # a GPU machine it is not carried to
    bnb, _MISSING = None, str(e)


@pytest.fixture(autouse=True)
def _bitsandbytes() -> None:
    """bitsandbytes is a dev dependency: without it these tests fail in one line naming the fix,
    or, where it is not installed on purpose (FLEXGEN_TESTS_WITHOUT_BITSANDBYTES=1, set by the
    GPU suite), are skipped saying so."""
    if _MISSING is None:
        return
    if os.environ.get("FLEXGEN_TESTS_WITHOUT_BITSANDBYTES") == "1":
        pytest.skip(f"no bitsandbytes on this machine (FLEXGEN_TESTS_WITHOUT_BITSANDBYTES=1): {_MISSING}")
    pytest.fail(f"{_MISSING}: pip install -e '.[dev]' (bitsandbytes writes and expands the checkpoints)",
                pytrace=False)


def bnb_dir(kind: str, path: Path) -> TinyModel:
    """A random Llama (``kind`` "llama") or Qwen2 saved, quantized by transformers with
    bitsandbytes (``kind`` suffix nf4-dq / fp4 / int8), saved again; the returned model is
    the float one holding the values bitsandbytes expands the saved matrices to."""
    import bitsandbytes.functional as bf
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, Qwen2Config

    family, scheme = kind.split("-", 1)
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(17)
    cfg = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path / "float")
    if scheme == "int8":
        qc = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=scheme[:3], bnb_4bit_compute_dtype=torch.float32,
                                bnb_4bit_use_double_quant=scheme.endswith("-dq"))
    q = AutoModelForCausalLM.from_pretrained(path / "float", quantization_config=qc, device_map="cpu",
                                             dtype=torch.float32)
    q.save_pretrained(path / "q")
    with torch.no_grad():
        for name, mod in q.named_modules():
            if isinstance(mod, bnb.nn.Linear4bit):
                w = bf.dequantize_4bit(mod.weight.data, mod.weight.quant_state)
            elif isinstance(mod, bnb.nn.Linear8bitLt):
                w = bf.int8_vectorwise_dequant(mod.weight.data, mod.weight.SCB)
            else:
                continue
            model.get_submodule(name).weight.copy_(w.float())
    return TinyModel(family, path / "q", model, 0)


@pytest.mark.parametrize("kind", ["llama-nf4-dq", "qwen2-fp4", "llama-int8"])
def test_bitsandbytes_checkpoints_match_transformers_on_their_values(kind: str, tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    tm = bnb_dir(kind, tmp_path)
    cfg = json.loads((tm.path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "bitsandbytes"
    ref = reference_generate(tm, PROMPTS, 6)
    with caplog.at_level(logging.INFO, logger="flexgen_dist"):
        with LLM(str(tm.path), percent=(0, 50, 100, 0, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
                 offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref
    said = caplog.text
    assert "bitsandbytes" in said and ("LLM.int8()" in said) == (kind.endswith("int8"))
    from flexgen_dist.models.loader import load_model

    lm = load_model(str(tm.path), load_tokenizer=False)
    got = lm.source.get("layer", 1)
    want = tm.model.model.layers[1]
    assert torch.equal(got["q.w"], want.self_attn.q_proj.weight.detach())  # bitsandbytes' values exactly
    assert torch.equal(got["down.w"], want.mlp.down_proj.weight.detach())
    from flexgen_dist.memory.quant import QTensor, dequantize

    with LLM(str(tm.path), compress_weight=True, gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True,
             progress=False) as llm:
        tokens = [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)]  # the embedding and head 4-bit too
        placed = {j: llm.engine.weights.placed[("layer", j)] for j in (0, 1)}
    assert all(len(t) == 6 for t in tokens)
    for j in (0, 1):
        layer = tm.model.model.layers[j]
        for key, mod in (("q.w", layer.self_attn.q_proj), ("o.w", layer.self_attn.o_proj),
                         ("down.w", layer.mlp.down_proj)):
            q = placed[j][key].data
            assert isinstance(q, QTensor)
            if kind.endswith("int8"):  # 8-bit: expanded, then quantized by the engine
                assert (q.fmt, q.bits, q.group_size) == ("int", 4, 64)
            else:  # 4-bit: the codes and block scales kept in the table format, the values exactly
                assert (q.fmt, q.bits, q.group_size) == (kind.split("-")[1], 4, 64)
                assert torch.equal(dequantize(q), mod.weight.detach()), (j, key)
    if not kind.endswith("int8"):
        from conftest import kept_codes_sized_as_stored

        predicted, stored = kept_codes_sized_as_stored(tm.path)
        assert predicted == stored > 0


@pytest.mark.parametrize("edit,match", [
    ("neither", "neither load_in_4bit nor load_in_8bit"),
    ("type", "of type 'int4' is not supported \\(nf4 and fp4 are\\)"),
    ("record", "quant_state record does not parse"),
    ("absmax", "do not agree"),
])
def test_what_is_not_read_is_refused_in_one_line(edit: str, match: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tm = bnb_dir("llama-nf4-dq", tmp_path)
    cfg_file = tm.path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    q = cfg["quantization_config"]
    if edit == "neither":
        q["load_in_4bit"] = q["_load_in_4bit"] = False
    elif edit == "type":
        q["bnb_4bit_quant_type"] = "int4"
    else:
        f = tm.path / "model.safetensors"
        sd = load_file(str(f))
        stem = "model.layers.0.self_attn.q_proj.weight"
        if edit == "record":
            sd[stem + ".quant_state.bitsandbytes__nf4"] = torch.tensor(list(b"{not json"), dtype=torch.uint8)
        else:
            sd[stem + ".absmax"] = sd[stem + ".absmax"][:-3].clone()
        save_file(sd, str(f), metadata={"format": "pt"})
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as info:
        with LLM(str(tm.path), progress=False) as llm:
            llm.generate([[3, 4, 5]], gen_len=1)
    assert "\n" not in str(info.value)
