"""FP8 checkpoints: block-scaled (DeepSeek-V3's format, as GLM-4.5-FP8, Qwen3-*-FP8 and others
ship: ``quant_method: fp8`` with ``weight_block_size``, each matrix in float8 e4m3 beside its
``weight_scale_inv`` grid of block scales), one scale per matrix (``fp8`` without a block
size), per output row (``fbgemm_fp8``, Meta's FP8 releases) and llm-compressor's
compressed-tensors FP8 / FP8-dynamic (``weight_scale`` per tensor, row or block): the matrices
are expanded at load, the product in float32 as transformers computes it, so greedy tokens
equal transformers' on the expanded weights; a grid that does not fit, missing scales and
other quantizations are refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, kept_codes_sized_as_stored, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.float_quant import dequantize_fp8
from flexgen_dist.models.loader import load_model

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


def _scheme(layout: str, block: tuple[int, int]) -> tuple[dict, str]:
    """The quantization_config of an FP8 ``layout`` and its scales' suffix."""
    if layout == "fp8":
        return ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": list(block) if block[0] else None}, "_scale_inv")
    if layout == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "_scale"
    strategy = "block" if block[0] else "channel" if block[1] else "tensor"
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": list(block) if block[0] else None}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    return ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
             "kv_cache_scheme": None, "config_groups": {"group_0": {
                 "targets": ["Linear"], "weights": weights, "input_activations": acts if layout == "ct-dynamic" else None,
                 "output_activations": None}}}, "_scale")


def _fp8_dir(model: torch.nn.Module, path: Path, block: tuple[int, int], keep: tuple[str, ...],
             layout: str = "fp8") -> None:
    """``model`` saved, then its matrices rewritten as FP8 with their scales (those named in
    ``keep`` stay as they are, as modules_to_not_convert); ``model`` given the expanded values,
    so that transformers computes with exactly the checkpoint's weights. ``block`` (0, 0): one
    scale per matrix; (0, 1): one per output row (fbgemm, compressed-tensors' channel)."""
    from safetensors.torch import save_file

    qc, suffix = _scheme(layout, block)
    model.save_pretrained(path)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for name, w in sd.items():
        if w.dim() < 2 or any(k in name for k in keep):
            out[name] = w
            continue
        cut = block if block[0] else (w.shape[-2], w.shape[-1]) if not block[1] else (1, w.shape[-1])
        q, scale = quantize(w, cut)
        stored = scale if block[0] else scale.reshape(-1) if not block[1] else scale  # per tensor: (1,)
        out[name], out[name + suffix] = q, stored
        with torch.no_grad():
            model.get_parameter(name).copy_(_expand(q, scale, cut))
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {**qc, "modules_to_not_convert": list(keep)} if layout in ("fp8", "fbgemm") else \
        {**qc, "ignore": list(keep)}
    (path / "config.json").write_text(json.dumps(cfg))


def _tiny(kind: str, path: Path, block: tuple[int, int], layout: str = "fp8") -> TinyModel:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=255, tie_word_embeddings=False)
    cfg = (LlamaConfig(**common) if kind == "llama" else
           Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64))
    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    _fp8_dir(m, path, block, keep=("lm_head", "embed_tokens", "mlp.gate.weight"), layout=layout)
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


@pytest.mark.parametrize("kind,layout,block", [
    ("llama", "fp8", (0, 0)),          # fine-grained FP8 without a block size: one scale a matrix
    ("llama", "fbgemm", (0, 1)),       # Meta's FP8 releases: one scale an output row
    ("llama", "ct", (0, 0)),           # llm-compressor FP8, per tensor
    ("qwen3_moe", "ct-dynamic", (0, 1)),  # FP8-dynamic: per row, inputs quantized per token (not run)
    ("llama", "ct-dynamic", (32, 64)),    # FP8 block, the 96-wide MLP's last block partial
])
def test_fp8_scales_per_tensor_row_and_block_match_transformers(kind: str, layout: str, block: tuple[int, int],
                                                                tmp_path: Path, caplog) -> None:
    """Each layout's codes times their scales, on two placements (weights on disk and in RAM),
    greedy tokens equal to transformers' on the expanded weights; a scheme that quantizes the
    inputs at run time says in one warning that the engine does not."""
    tm = _tiny(kind, tmp_path / "m", block, layout)
    ref = reference_generate(tm, PROMPTS, 6)
    with caplog.at_level("WARNING", logger="flexgen_dist"):
        with LLM(str(tm.path), percent=(0, 50, 100, 0, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
                 offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref
    noted = "inputs are not quantized at run time" in caplog.text
    assert noted == (layout in ("fp8", "fbgemm", "ct-dynamic")), caplog.text
    with LLM(str(tm.path), percent=(100, 0, 100, 0, 100, 0), ignore_eos=True, progress=False) as llm:
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
    assert torch.equal(dequantize_fp8(q, torch.tensor([0.5]), (0, 0), "w"), q.float() * 0.5)  # per tensor
    rows = torch.tensor([[1.0], [2.0], [4.0]])  # per output row
    assert torch.equal(dequantize_fp8(q, rows, (0, 0), "w"), q.float() * rows)
    with pytest.raises(ModelLoadError, match=r"scale grid of \(3,\) does not fit"):
        dequantize_fp8(q, torch.ones(3), (0, 0), "w")  # a vector: rows or columns, unsaid


@pytest.mark.parametrize("edit,match", [
    ("no-scale", "is FP8 but its scales model.layers.0.self_attn.q_proj.weight_scale_inv are missing"),
    ("e5m2", "an 'fp8' checkpoint in format 'e5m2' is not supported \\(e4m3 is\\)"),
    ("ct-fp4", "compressed-tensors float weights of 4 bits are not supported \\(FP8 is\\)"),
    ("ct-group", "compressed-tensors FP8 weights with strategy 'group' are not supported"),
    ("hqq", "a 'hqq'-quantized checkpoint is not supported"),
])
def test_what_is_not_read_is_refused_in_one_line(edit: str, match: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tm = _tiny("llama", tmp_path / "m", (32, 32))
    cfg = json.loads((tm.path / "config.json").read_text())
    if edit == "no-scale":
        sd = load_file(str(tm.path / "model.safetensors"))
        del sd["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        save_file(sd, str(tm.path / "model.safetensors"))
    elif edit == "e5m2":
        cfg["quantization_config"]["fmt"] = "e5m2"
    elif edit.startswith("ct-"):
        cfg["quantization_config"] = _scheme("ct", (0, 0))[0]
        w = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
        w.update({"num_bits": 4} if edit == "ct-fp4" else {"strategy": "group", "group_size": 16})
    else:
        cfg["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (tm.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as info:
        with LLM(str(tm.path), progress=False) as llm:
            llm.generate([[3, 4, 5]], gen_len=1)
    assert "\n" not in str(info.value)
    if edit != "no-scale":
        with pytest.raises(ModelLoadError, match=match):
            load_model(str(tm.path), load_tokenizer=False)


def _codes(rows: int, cols: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes padded to whole groups, float32 scales) with the special bytes in the first row:
    NaN (0x7f, 0xff), -0, the smallest subnormals."""
    torch.manual_seed(seed)
    codes = (torch.randn(rows, cols) * 50).to(torch.float8_e4m3fn).view(torch.uint8)
    codes[0, :5] = torch.tensor([0x7F, 0xFF, 0x80, 0x01, 0x81], dtype=torch.uint8)
    groups = -(-cols // group)
    return torch.nn.functional.pad(codes, (0, groups * group - cols)), torch.rand(rows, groups) * 3


def _reference(codes: torch.Tensor, scales: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    rows, groups = scales.shape
    vals = codes.view(torch.float8_e4m3fn).float().reshape(rows, groups, -1) * scales[..., None]
    return vals.reshape(rows, -1)[:, :cols].to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols,group", [(96, 200, 64), (64, 96, 96), (33, 128, 128)])
def test_kept_fp8_codes_expand_to_each_code_times_its_scale(rows: int, cols: int, group: int,
                                                          dtype: torch.dtype, monkeypatch) -> None:
    """The native one-pass expansion and the torch one (a GPU's, here with the native kernel
    turned off, in chunks of a few rows) give torch's float8 values times their group's scale,
    rounded to the dtype, bit for bit: NaN bytes NaN, subnormals and a partial last group
    included."""
    import flexgen_dist.kernels as kernels
    from flexgen_dist.kernels import dequant_fp8, library
    from flexgen_dist.memory import quant
    from flexgen_dist.memory.quant import E4M3, QTensor, dequantize

    codes, scales = _codes(rows, cols, group)
    want = _reference(codes, scales, cols, dtype)
    q = QTensor(codes, torch.empty(rows, 0), scales, torch.Size((rows, cols)), dtype, 1, group, 8, E4M3)
    got = [dequantize(q), dequantize(q, out=torch.empty(rows, cols, dtype=dtype))]
    monkeypatch.setattr(kernels, "dequant_fp8", lambda *a, **k: None)
    monkeypatch.setattr(quant, "E4M3_CHUNK", 5 * group * -(-cols // group))  # five rows at a time
    got += [dequantize(q), dequantize(q, out=torch.empty(rows, cols, dtype=dtype))]
    for g in got:
        assert g.dtype == dtype and g.shape == (rows, cols) and torch.equal(g.isnan(), want.isnan())
        assert torch.equal(g.nan_to_num(), want.nan_to_num())
    if library() is not None:  # the native kernel was built: it is the one dequantize used first
        native = dequant_fp8(codes, scales, cols, group, dtype)
        assert native is not None and torch.equal(native.nan_to_num(), want.nan_to_num())
        assert torch.equal(native.isnan(), want.isnan())


@pytest.mark.parametrize("layout,block", [("fp8", (32, 64)), ("fbgemm", (0, 1)), ("ct", (0, 0))])
def test_compressed_weights_keep_the_fp8_codes(layout: str, block: tuple[int, int], tmp_path: Path) -> None:
    """Under --compress-weight an FP8 matrix keeps its codes (one byte a value) and its scales
    per row and group of the block's width, on every tier, and expands to exactly the
    checkpoint's values: greedy tokens equal transformers' on the expanded weights, with the
    matrices that are not FP8 (embedding, head) compressed to 4 bits in both; the budget check
    sizes the kept codes as they are stored."""
    from flexgen_dist.memory.quant import E4M3, QTensor, dequantize, quantize

    tm = _tiny("llama", tmp_path / "m", block, layout)
    value = tm.model.get_parameter("model.layers.0.mlp.down_proj.weight").detach().clone()  # 64 x 96
    with torch.no_grad():  # what the engine's 4-bit compression makes of the dense matrices
        for w in (tm.model.model.embed_tokens.weight, tm.model.lm_head.weight):
            w.copy_(dequantize(quantize(w, 4, 64, dim=1)))
    ref = reference_generate(tm, PROMPTS, 6)
    group = {"fp8": 64, "fbgemm": 96, "ct": 96}[layout]
    for pct in ((100, 0, 100, 0, 100, 0), (0, 50, 100, 0, 100, 0), (0, 0, 100, 0, 100, 0)):
        with LLM(str(tm.path), percent=pct, compress_weight=True, gpu_batch_size=2, num_gpu_batches=2,
                 offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref, pct
            q = llm.engine.weights.placed[("layer", 0)]["down.w"].data
            assert isinstance(q, QTensor) and (q.fmt, q.bits, q.group_size, q.dim) == (E4M3, 8, group, 1)
            if pct[0] == 100:
                assert torch.equal(dequantize(q), value)
                assert q.nbytes == 64 * (-(-96 // group) * group) + 4 * 64 * -(-96 // group)
    assert load_model(str(tm.path), load_tokenizer=False).source.packed_formats("layer", 0)["down.w"] == \
        (8, group, "e4m3")
    predicted, stored = kept_codes_sized_as_stored(tm.path)
    assert predicted == stored > 0


@pytest.mark.gpu
def test_kept_fp8_codes_on_the_gpu_expand_to_the_cpu_values(gpu_device) -> None:
    """FP8 codes copied to the compute device expand (torch's float8 there) to exactly the
    values the CPU gives, in every compute dtype."""
    from flexgen_dist.memory.quant import E4M3, QTensor, dequantize

    codes, scales = _codes(96, 200, 64, seed=1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = QTensor(codes, torch.empty(96, 0), scales, torch.Size((96, 200)), dtype, 1, 64, 8, E4M3)
        cpu = dequantize(q)
        dev = dequantize(q, gpu_device)
        assert dev.device.type == gpu_device.type
        assert torch.equal(dev.cpu().nan_to_num(), cpu.nan_to_num()) and torch.equal(dev.cpu().isnan(), cpu.isnan())
