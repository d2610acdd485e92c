"""Block-scaled FP8 checkpoints (DeepSeek-V3's format, as GLM-4.5-FP8, Qwen3-*-FP8 and others
ship: ``quant_method: fp8`` with ``weight_block_size``, each matrix in float8 e4m3 beside its
``weight_scale_inv`` grid of block scales): the matrices are expanded at load, the product in
float32 as transformers computes it, so greedy tokens equal transformers' on the expanded
weights; a grid that does not fit, missing scales and other quantizations are refused in one
line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.loader import dequantize_fp8, load_model

FP8_MAX = 448.0  # e4m3's largest finite value


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes, float32 scales) of a (..., rows, cols) matrix in blocks, the last ones
    partial where the block does not divide the shape (DeepSeek's reference quantizer)."""
    rows, cols = w.shape[-2:]
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    pad = torch.zeros(*w.shape[:-2], gr * block[0], gc * block[1])
    pad[..., :rows, :cols] = w
    blocks = pad.reshape(*w.shape[:-2], gr, block[0], gc, block[1])
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).reshape(pad.shape)[..., :rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def _expand(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The checkpoint's values, computed here apart from the engine: padded blocks times their
    scales (float32), cut back to the matrix."""
    rows, cols = q.shape[-2:]
    gr, gc = scale.shape[-2:]
    pad = torch.zeros(*q.shape[:-2], gr * block[0], gc * block[1])
    pad[..., :rows, :cols] = q.float()
    blocks = pad.reshape(*q.shape[:-2], gr, block[0], gc, block[1]) * scale[..., :, None, :, None]
    return blocks.reshape(pad.shape)[..., :rows, :cols]


def _fp8_dir(model: torch.nn.Module, path: Path, block: tuple[int, int], keep: tuple[str, ...]) -> None:
    """``model`` saved, then its matrices rewritten as FP8 with their scales (those named in
    ``keep`` stay as they are, as modules_to_not_convert); ``model`` given the expanded values,
    so that transformers computes with exactly the checkpoint's weights."""
    from safetensors.torch import save_file

    model.save_pretrained(path)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for name, w in sd.items():
        if w.dim() < 2 or any(k in name for k in keep):
            out[name] = w
            continue
        q, scale = quantize(w, block)
        out[name], out[name + "_scale_inv"] = q, scale
        with torch.no_grad():
            model.get_parameter(name).copy_(_expand(q, scale, block))
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": list(keep)}
    (path / "config.json").write_text(json.dumps(cfg))


def _tiny(kind: str, path: Path, block: tuple[int, int]) -> TinyModel:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=255, tie_word_embeddings=False)
    cfg = (LlamaConfig(**common) if kind == "llama" else
           Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64))
    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    _fp8_dir(m, path, block, keep=("lm_head", "embed_tokens", "mlp.gate.weight"))
    return TinyModel(kind, path, m, 0)


@pytest.mark.parametrize("kind,block", [("llama", (32, 32)), ("llama", (64, 64)), ("qwen3_moe", (32, 64))])
def test_fp8_checkpoints_match_transformers_on_their_expanded_weights(kind: str, block: tuple[int, int],
                                                                    tmp_path: Path) -> None:
    """Blocks of 64 leave the 96-wide MLP a partial last block; Qwen3-MoE's experts are 3-D
    tensors (experts x rows x cols) with a 3-D grid of scales."""
    tm = _tiny(kind, tmp_path / "m", block)
    ref = reference_generate(tm, PROMPTS, 6)
    with LLM(str(tm.path), percent=(0, 50, 100, 0, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref


def test_the_expansion_is_each_code_times_its_blocks_scale() -> None:
    q = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 10.0], [3.0, 100.0]])
    want = torch.tensor([[2.0, 4.0, 30.0], [8.0, 10.0, 60.0], [21.0, 24.0, 900.0]])
    assert torch.equal(dequantize_fp8(q, scale, (2, 2), "w"), want)
    e8m0 = torch.tensor([[128, 130], [127, 133]], dtype=torch.uint8)  # 2, 8, 1, 64
    assert torch.equal(dequantize_fp8(q, e8m0, (2, 2), "w"),
                       torch.tensor([[2.0, 4.0, 24.0], [8.0, 10.0, 48.0], [7.0, 8.0, 576.0]]))
    with pytest.raises(ModelLoadError, match=r"scale grid of \(2, 2\) does not fit blocks of 1x1"):
        dequantize_fp8(q, scale, (1, 1), "w")


@pytest.mark.parametrize("edit,match", [
    ("no-scale", "is FP8 but its scales model.layers.0.self_attn.q_proj.weight_scale_inv are missing"),
    ("per-channel", "per-tensor or per-channel 'fp8' \\(without weight_block_size\\)-quantized checkpoint is not "
                    "supported"),
    ("bnb", "a 'bitsandbytes'-quantized checkpoint is not supported"),
])
def test_what_is_not_read_is_refused_in_one_line(edit: str, match: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tm = _tiny("llama", tmp_path / "m", (32, 32))
    cfg = json.loads((tm.path / "config.json").read_text())
    if edit == "no-scale":
        sd = load_file(str(tm.path / "model.safetensors"))
        del sd["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        save_file(sd, str(tm.path / "model.safetensors"))
    elif edit == "per-channel":
        del cfg["quantization_config"]["weight_block_size"]
    else:
        cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tm.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as info:
        with LLM(str(tm.path), progress=False) as llm:
            llm.generate([[3, 4, 5]], gen_len=1)
    assert "\n" not in str(info.value)
    if edit != "no-scale":
        with pytest.raises(ModelLoadError, match=match):
            load_model(str(tm.path), load_tokenizer=False)
