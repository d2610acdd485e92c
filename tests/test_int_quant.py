"""GPTQ, AWQ and compressed-tensors checkpoints (``models/int_quant.py``): a linear layer's
integer codes, zero points and scales are expanded at load to the values they encode, so
greedy tokens equal transformers' on those values (float32), for GPTQ's original format (zeros
stored minus one) with act-order groups, ``gptq_v2`` symmetric, 8-, 3- and 2-bit GPTQ, AWQ's
GEMM and GEMV layouts, and compressed-tensors' pack-quantized (4- and 3-bit groups, symmetric and not,
act-ordered, 3 bits in both its layouts; 6 and 8 bits per channel) and naive-quantized (int8)
weights; the checkpoints here are packed as
AutoGPTQ's, AutoAWQ's and compressed-tensors' packers pack them, and a layout that is not
read is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, kept_codes_sized_as_stored, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.models.int_quant import IntQuant, dequantize

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i of a word holds column ORDER[i]


def _words(acc: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32, as the packers' int32 arithmetic wraps them."""
    return torch.where(acc >= 2 ** 31, acc - 2 ** 32, acc).to(torch.int32)


def quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes (in, out), zeros (groups, out), float16 scales (groups, out), the float32 values
    they encode (out, in)) of an (out, in) matrix, each input column in group g_idx[col]."""
    top = (1 << bits) - 1
    wt = w.t()
    scales = torch.empty(groups, w.shape[0])
    zeros = torch.empty(groups, w.shape[0], dtype=torch.long)
    for g in range(groups):
        cols = wt[g_idx == g]
        lo, hi = cols.min(0).values.clamp(max=0), cols.max(0).values.clamp(min=0)
        if sym:
            hi = torch.maximum(hi, -lo)
            scales[g] = (2 * hi / top).clamp(min=1e-6)
            zeros[g] = (top + 1) // 2
        else:
            scales[g] = ((hi - lo) / top).clamp(min=1e-6)
            zeros[g] = (-lo / scales[g]).round().clamp(0, top).long()
    scales = scales.half()
    s, z = scales.float()[g_idx], zeros[g_idx]
    codes = (wt / s).round().long().add(z).clamp(0, top)
    return codes, zeros, scales, ((codes - z).float() * s).t().contiguous()


def _gptq_3bit(x: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's 3-bit packing down the rows of x (n, c), n a multiple of 32: each 32 codes
    in three words, ten whole codes a word and the 11th and 22nd split across two (its loop,
    written out)."""
    out = torch.zeros(x.shape[0] // 32 * 3, x.shape[1], dtype=torch.long)
    i = row = 0
    while row < out.shape[0]:
        for j in range(10):
            out[row] |= x[i + j] << (3 * j)
        i += 10
        out[row] |= (x[i] << 30) & 0xFFFFFFFF
        row += 1
        out[row] |= (x[i] >> 2) & 1
        i += 1
        for j in range(10):
            out[row] |= x[i + j] << (3 * j + 1)
        i += 10
        out[row] |= (x[i] << 31) & 0xFFFFFFFF
        row += 1
        out[row] |= (x[i] >> 1) & 0x3
        i += 1
        for j in range(10):
            out[row] |= x[i + j] << (3 * j + 2)
        i += 10
        row += 1
    return out


def gptq_tensors(codes: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's packing: qweight[k] |= code[k * p + j] << (bits * j) over input rows, qzeros
    alike over output columns (3 bits: ``_gptq_3bit``), each zero minus 1 in the original
    format."""
    z = (zeros - 1) & ((1 << bits) - 1) if v1 else zeros
    if bits == 3:
        return _words(_gptq_3bit(codes)), _words(_gptq_3bit(z.t()).t().contiguous())
    p = 32 // bits
    qweight = torch.zeros(codes.shape[0] // p, codes.shape[1], dtype=torch.long)
    for j in range(p):
        qweight |= codes[j::p] << (bits * j)
    qzeros = torch.zeros(z.shape[0], z.shape[1] // p, dtype=torch.long)
    for j in range(p):
        qzeros |= z[:, j::p] << (bits * j)
    return _words(qweight), _words(qzeros)


def awq_tensors(codes: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's GEMM packing: word c of a row holds columns 8c + ORDER[i] at nibble i."""
    def pack(x: torch.Tensor) -> torch.Tensor:
        acc = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.long)
        for i, col in enumerate(AWQ_ORDER):
            acc |= x[:, col::8] << (4 * i)
        return _words(acc)
    return pack(codes), pack(zeros)


def zeros_width(cols: int, group: int) -> int:
    """AutoAWQ's ``calculate_zeros_width``: the GEMV layout's words of zero points a row (its
    groups, 8 a word, rounded up to a multiple of 1, 2 or 4 words for groups of 128+, 64, 32)."""
    mult = 1 if group >= 128 else {64: 2, 32: 4}[group]
    return -(-(-(-(cols // group) // 8)) // mult) * mult


def awq_gemv_tensors(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's GEMV packing (its from_linear loops): qweight (out, in / 8), word c of a row
    holding input columns 8c .. 8c + 7 from the lowest nibble; qzeros (out, zeros_width) the
    row's groups alike, padded with 0; scales (out, 8 x zeros_width) float16, padded with 0."""
    w = codes.t()  # (out, in)
    width = zeros_width(w.shape[1], group)
    qweight = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.long)
    for col in range(w.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= w[:, col * 8 + i] << (4 * i)
    z = zeros.t()  # (out, groups)
    qzeros = torch.zeros(z.shape[0], width, dtype=torch.long)
    for col in range(-(-z.shape[1] // 8)):
        for i in range(8):
            if col * 8 + i < z.shape[1]:
                qzeros[:, col] |= z[:, col * 8 + i] << (4 * i)
    qscales = torch.zeros(z.shape[0], width * 8, dtype=torch.float16)
    qscales[:, :z.shape[1]] = scales.t()
    return _words(qweight), _words(qzeros), qscales


def ct_words(codes: torch.Tensor, bits: int, dense: bool = True) -> torch.Tensor:
    """compressed-tensors' packing of signed codes (rows, cols): each stored plus 2^(bits-1),
    code i of a row at bit i x bits of its little-endian word stream (``dense``: the packer's
    current layout, codes split across words where the width does not divide 32; otherwise
    an older release's 32 // bits whole codes a word)."""
    per = 32 // bits
    u = codes + (1 << (bits - 1))
    if dense and 32 % bits:  # bit by bit: an int64 per bit of the stream
        stream = ((u.unsqueeze(-1) >> torch.arange(bits)) & 1).reshape(u.shape[0], -1)
        stream = torch.nn.functional.pad(stream, (0, -stream.shape[1] % 32))
        acc = (stream.view(u.shape[0], -1, 32) << torch.arange(32)).sum(-1)
        return _words(acc)
    acc = torch.zeros(u.shape[0], -(-u.shape[1] // per), dtype=torch.long)
    for j in range(per):
        part = u[:, j::per]
        acc[:, :part.shape[1]] |= part << (bits * j)
    return _words(acc)


def ct_quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' signed codes (out, in), zero points (out, groups), bfloat16 scales
    (out, groups) and the float32 values they encode (out, in)."""
    lo_q, hi_q = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.zeros(w.shape[0], groups, dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            scales[:, g] = (torch.maximum(hi, -lo) / hi_q).clamp(min=1e-6)
        else:
            scales[:, g] = ((hi - lo) / (hi_q - lo_q)).clamp(min=1e-6)
            zeros[:, g] = (lo_q - lo / scales[:, g]).round().clamp(lo_q, hi_q).long()
    scales = scales.bfloat16()
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    codes = (w / s).round().long().add(z).clamp(lo_q, hi_q)
    return codes, zeros, scales, (codes - z).float() * s


LAYOUTS = {
    "gptq-act-order": dict(method="gptq", bits=4, group=32, sym=False, act_order=True, fmt="gptq"),
    "gptq-v2-sym": dict(method="gptq", bits=4, group=32, sym=True, act_order=False, fmt="gptq_v2"),
    "gptq-8bit": dict(method="gptq", bits=8, group=64, sym=True, act_order=False, fmt="gptq"),
    "gptq-3bit": dict(method="gptq", bits=3, group=32, sym=False, act_order=False, fmt="gptq"),
    "gptq-3bit-act-order": dict(method="gptq", bits=3, group=32, sym=True, act_order=True, fmt="gptq_v2"),
    "gptq-2bit": dict(method="gptq", bits=2, group=64, sym=False, act_order=False, fmt="gptq"),
    "awq": dict(method="awq", bits=4, group=32, sym=False, act_order=False, fmt=None),
    "awq-gemv": dict(method="awq", bits=4, group=32, sym=False, act_order=False, fmt="gemv"),
    "ct-w4-sym": dict(method="ct", bits=4, group=32, sym=True, act_order=False, fmt="pack-quantized"),
    "ct-w4-asym-act-order": dict(method="ct", bits=4, group=32, sym=False, act_order=True, fmt="pack-quantized"),
    "ct-w8-channel": dict(method="ct", bits=8, group=0, sym=True, act_order=False, fmt="pack-quantized"),
    "ct-w3-asym": dict(method="ct", bits=3, group=32, sym=False, act_order=False, fmt="pack-quantized"),
    "ct-w3-older": dict(method="ct", bits=3, group=32, sym=True, act_order=False, fmt="pack-quantized", dense=False),
    "ct-w6-channel": dict(method="ct", bits=6, group=0, sym=True, act_order=False, fmt="pack-quantized"),
    "ct-naive-w8": dict(method="ct", bits=8, group=0, sym=False, act_order=False, fmt="naive-quantized"),
    # W8A8: int8 weights per output row, the inputs quantized per token at run time (not run)
    "ct-w8a8": dict(method="ct", bits=8, group=0, sym=True, act_order=False, fmt="int-quantized", acts=True),
}


def quantized_dir(kind: str, layout: str, path: Path) -> TinyModel:
    """A random tiny model saved as a GPTQ/AWQ checkpoint of ``layout`` (embedding, norms and
    head as they are), and given the values its codes encode, so that transformers computes
    with exactly the checkpoint's weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    lay = LAYOUTS[layout]
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None, tie_word_embeddings=False)  # no EOS: generate's min_new_tokens would
    # keep one from being chosen where the engine, ignoring EOS, chooses it
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)).eval()
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(5)
    out = {}
    for name, w in model.state_dict().items():
        w = w.detach().clone().contiguous()
        if not (name.endswith("_proj.weight") and ".layers." in name):
            out[name] = w
            continue
        cols = w.shape[1]
        size = lay["group"] or cols  # 0: one group per row (compressed-tensors' channel strategy)
        groups = cols // size
        g_idx = torch.arange(cols) // size
        if lay["act_order"]:
            g_idx = g_idx[torch.randperm(cols, generator=g)]
        stem = name.removesuffix("weight")
        if lay["method"] == "ct":
            codes, zeros, scales, values = ct_quantize(w, g_idx, groups, lay["bits"], lay["sym"])
            if lay["fmt"] in ("naive-quantized", "int-quantized"):
                out[stem + "weight"] = codes.to(torch.int8)
            else:
                out[stem + "weight_packed"] = ct_words(codes, lay["bits"], lay.get("dense", True))
                out[stem + "weight_shape"] = torch.tensor(list(w.shape))
            if not lay["sym"]:
                out[stem + "weight_zero_point"] = zeros.to(torch.int8) if lay["fmt"] == "naive-quantized" else \
                    ct_words(zeros.t().contiguous(), lay["bits"], lay.get("dense", True)).t().contiguous()
            if lay["act_order"]:
                out[stem + "weight_g_idx"] = g_idx.to(torch.int32)
            out[stem + "weight_scale"] = scales
            with torch.no_grad():
                model.get_parameter(name).copy_(values)
            continue
        codes, zeros, scales, values = quantize(w, g_idx, groups, lay["bits"], lay["sym"])
        if lay["method"] == "gptq":
            out[stem + "qweight"], out[stem + "qzeros"] = gptq_tensors(codes, zeros, lay["bits"], lay["fmt"] == "gptq")
            out[stem + "g_idx"] = g_idx.to(torch.int32)
        elif lay["fmt"] == "gemv":
            out[stem + "qweight"], out[stem + "qzeros"], scales = awq_gemv_tensors(codes, zeros, scales, lay["group"])
        else:
            out[stem + "qweight"], out[stem + "qzeros"] = awq_tensors(codes, zeros)
        out[stem + "scales"] = scales
        with torch.no_grad():
            model.get_parameter(name).copy_(values)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    if lay["method"] == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": lay["bits"], "group_size": lay["group"],
                                      "desc_act": lay["act_order"], "sym": lay["sym"], "checkpoint_format": lay["fmt"]}
    elif lay["method"] == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": lay["group"],
                                      "zero_point": True, "version": lay["fmt"] or "gemm"}
    else:
        weights = {"num_bits": lay["bits"], "type": "int", "symmetric": lay["sym"], "dynamic": False,
                   "strategy": "group" if lay["group"] else "channel", "group_size": lay["group"] or None,
                   "actorder": "group" if lay["act_order"] else None}
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": lay["fmt"],
                                      "quantization_status": "compressed", "ignore": ["lm_head"],
                                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                    "input_activations": {
                                                                        "num_bits": 8, "type": "int", "dynamic": True,
                                                                        "strategy": "token", "symmetric": True}
                                                                    if lay.get("acts") else None,
                                                                    "output_activations": None}}}
    (path / "config.json").write_text(json.dumps(cfg))
    return TinyModel(kind, path, model, 0)


@pytest.mark.parametrize("kind,layout", [("llama", "gptq-act-order"), ("llama", "gptq-v2-sym"),
                                         ("qwen2", "gptq-8bit"), ("llama", "gptq-3bit"),
                                         ("qwen2", "gptq-3bit-act-order"), ("llama", "gptq-2bit"),
                                         ("llama", "awq"), ("qwen2", "awq"), ("qwen2", "awq-gemv"),
                                         ("llama", "ct-w4-sym"), ("qwen2", "ct-w4-asym-act-order"),
                                         ("llama", "ct-w3-asym"), ("qwen2", "ct-w3-older"), ("llama", "ct-w6-channel"),
                                         ("llama", "ct-w8-channel"), ("llama", "ct-naive-w8"),
                                         ("qwen2", "ct-w8a8")])
def test_integer_checkpoints_match_transformers_on_their_values(kind: str, layout: str, tmp_path: Path) -> None:
    tm = quantized_dir(kind, layout, tmp_path / "m")
    ref = reference_generate(tm, PROMPTS, 6)
    with LLM(str(tm.path), percent=(0, 50, 100, 0, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref
    with LLM(str(tm.path), compress_weight=True, ignore_eos=True, progress=False) as llm:  # re-quantized: runs
        assert all(len(c.token_ids) == 6 for c in llm.generate(PROMPTS, gen_len=6))


def test_a_word_unpacks_to_its_codes_in_each_layout() -> None:
    """One hand-packed word per layout: 0x76543210 holds codes 0..7 from the lowest nibble up."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    ones = torch.ones(1, 8, dtype=torch.float16)

    def layer(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> dict:
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": None}

    # AWQ: nibble i is column ORDER[i] -> columns 0..7 hold 0 4 1 5 2 6 3 7; zeros 0
    awq = dequantize(IntQuant("awq", 4, -1, False), layer(word, torch.zeros(1, 1, dtype=torch.int32), ones), (8, 1),
                     "w")
    assert awq.flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    # GPTQ: nibble j is input row j; the original format stores a zero point of 1 as 0
    words = word.expand(1, 8).contiguous()  # eight output rows, each the same eight input columns
    gptq = dequantize(IntQuant("gptq", 4, -1, True), layer(words, torch.zeros(1, 1, dtype=torch.int32), ones),
                      (8, 8), "w")
    assert gptq.tolist() == [[-1, 0, 1, 2, 3, 4, 5, 6]] * 8
    v2 = dequantize(IntQuant("gptq", 4, -1, False), layer(words, torch.full((1, 1), 0x22222222, dtype=torch.int32),
                                                           torch.full((1, 8), 0.5, dtype=torch.float16)), (8, 8), "w")
    assert v2.tolist() == [[-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5]] * 8
    with pytest.raises(ModelLoadError, match="do not agree"):
        dequantize(IntQuant("awq", 4, -1, False), layer(word, torch.zeros(1, 1, dtype=torch.int32),
                                                        torch.ones(2, 8, dtype=torch.float16)), (8, 1), "w")


def test_streams_of_bits_unpack_as_the_packers_packed_them() -> None:
    """3-bit GPTQ words (AutoGPTQ's loop) and compressed-tensors' words of every width from 2 to
    8 bits, in the current stream layout and an older release's whole codes a word (told apart
    by the number of words), unpack to the codes packed; a count the words cannot hold is a
    one-line error."""
    from flexgen_dist.models.int_quant import _stream, _unpack_dense

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 8, (96, 5), generator=g)
    assert torch.equal(_stream(_words(_gptq_3bit(x)).t(), 3, 96), x.t().int())
    # hand-checked: codes 0..31 mod 8; word 0 ends with code 10's low bits (2 = 0b010 -> 0b10)
    first = _words(_gptq_3bit((torch.arange(32) % 8).unsqueeze(1)))[:, 0].tolist()
    assert first[0] & 0x3FFFFFFF == sum((j % 8) << (3 * j) for j in range(10)) and (first[0] >> 30) & 3 == 2
    for bits in range(2, 9):
        off = 1 << (bits - 1)
        for cols in (64, 96, 4096):
            c = torch.randint(-off, off, (3, cols), generator=g)
            for dense in (True, False):
                assert torch.equal(_unpack_dense(ct_words(c, bits, dense), bits, cols) - off, c.int()), (bits, dense)
    with pytest.raises(ModelLoadError, match="5 packed words do not hold 64 codes of 3 bits \\(that takes 6 or 7\\)"):
        _unpack_dense(torch.zeros(2, 5, dtype=torch.int32), 3, 64)


@pytest.mark.parametrize("edit,match", [
    ("5bit", "a 5-bit GPTQ checkpoint is not supported \\(2, 3, 4 and 8 bits are\\)"),
    ("3bit-words", "3-bit GPTQ qweight .* do not agree"),
    ("gemv-fast", "an AWQ checkpoint in the 'gemv_fast' layout is not supported \\(gemm and gemv are\\)"),
    ("marlin", "a GPTQ checkpoint in format 'marlin' is not supported"),
    ("no-scales", "has no model.layers.0.self_attn.q_proj.scales"),
    ("group", "do not agree|group_size does not fit"),
    ("outputs", "a compressed-tensors checkpoint that quantizes layer outputs is not supported"),
    ("float", "compressed-tensors checkpoint in format 'float-quantized' is not supported \\(pack-quantized"),
])
def test_what_is_not_read_is_refused_in_one_line(edit: str, match: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    layout = {"gemv-fast": "awq", "outputs": "ct-w4-sym", "float": "ct-w4-sym"}.get(edit, "gptq-v2-sym")
    tm = quantized_dir("llama", layout, tmp_path / "m")
    cfg = json.loads((tm.path / "config.json").read_text())
    q = cfg["quantization_config"]
    if edit == "outputs":
        q["config_groups"]["group_0"]["output_activations"] = {"num_bits": 8, "type": "int", "dynamic": True,
                                                               "strategy": "token", "symmetric": True}
    elif edit == "float":
        q["format"] = "float-quantized"
    elif edit == "5bit":
        q["bits"] = 5
    elif edit == "3bit-words":  # 4-bit words read as 3-bit: 64 columns would take 6 words a row, not 8
        q["bits"] = 3
    elif edit == "gemv-fast":
        q["version"] = "gemv_fast"
    elif edit == "marlin":
        q["checkpoint_format"] = "marlin"
    elif edit == "group":
        q["group_size"] = 16
    else:
        sd = load_file(str(tm.path / "model.safetensors"))
        del sd["model.layers.0.self_attn.q_proj.scales"]
        save_file(sd, str(tm.path / "model.safetensors"))
    if edit == "group":  # without g_idx the groups come from the config's group_size
        sd = load_file(str(tm.path / "model.safetensors"))
        save_file({k: v for k, v in sd.items() if not k.endswith("g_idx")}, str(tm.path / "model.safetensors"))
    (tm.path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match) as info:
        with LLM(str(tm.path), progress=False) as llm:
            llm.generate([[3, 4, 5]], gen_len=1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind,layout", [("llama", "gptq-v2-sym"), ("llama", "awq"), ("llama", "awq-gemv"),
                                         ("qwen2", "ct-w4-sym"),
                                         ("qwen2", "gptq-8bit"), ("llama", "gptq-act-order"), ("llama", "gptq-3bit"),
                                         ("qwen2", "ct-w6-channel")])
def test_compressed_weights_keep_the_checkpoints_codes(kind: str, layout: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --compress-weight a layer whose groups are contiguous keeps the checkpoint's own
    codes and groups (value = code x scale - zero x scale): its stored weight expands to the
    encoded values exactly (float32); the fused decode product on the stored codes and the
    product on their expansion give teacher-forced log-probabilities equal to float32
    rounding; the budget check sizes them as stored. Act-ordered groups cannot be kept so:
    those layers are re-quantized into the engine's groups, with the error that adds."""
    from flexgen_dist.memory.quant import QTensor
    from flexgen_dist.memory.quant import dequantize as dequantize_q
    from flexgen_dist.models.loader import load_model

    tm = quantized_dir(kind, layout, tmp_path / "m")
    lay = LAYOUTS[layout]
    native = not lay["act_order"]
    kept = 4 if lay["bits"] <= 4 else 8  # 2 and 3 bits kept as 4-bit codes, 5 to 7 as 8-bit: the same values
    want = (kept, lay["group"] or 64) if native else (4, 64)  # group 0: one group a row of 64
    seqs = [p + r for p, r in zip(PROMPTS, reference_generate(tm, PROMPTS, 6))]
    value = tm.model.get_parameter("model.layers.0.self_attn.q_proj.weight").detach()
    opts = dict(compress_weight=True, gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False)
    lps = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("FLEXGEN_FUSED_QLINEAR", fused)
        with LLM(str(tm.path), **opts) as llm:
            lps[fused] = [s.logprobs.token_logprobs for s in llm.score(seqs, decode_tokens=6, logprobs=0)]
            q = llm.engine.weights.placed[("layer", 0)]["q.w"].data
            assert isinstance(q, QTensor) and (q.dim, q.bits, q.group_size) == (1, *want)
            err = (dequantize_q(q) - value).abs().max().item()
            assert err == 0.0 if native else err > 1e-4
    diff = max(abs(a - b) for x, y in zip(lps["0"], lps["1"]) for a, b in zip(x, y))
    assert diff < 1e-4
    lm = load_model(str(tm.path), load_tokenizer=False)
    assert (lm.source.packed_formats("layer", 0).get("q.w")) == (want if native else None)
    predicted, stored = kept_codes_sized_as_stored(tm.path)
    assert predicted == stored > 0


def test_a_mixture_of_experts_with_quantized_experts(tmp_path: Path) -> None:
    """Qwen3-MoE as its GPTQ releases store it: every expert's gate, up and down a GPTQ layer of
    its own (``mlp.experts.E.gate_proj.qweight``, ...), the router kept in float. Greedy tokens
    equal transformers' on the encoded values, with the experts expanded, and with their codes
    kept (``--compress-weight``: the stored experts expand to the encoded values exactly)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from flexgen_dist.memory.quant import QTensor
    from flexgen_dist.memory.quant import dequantize as dequantize_q

    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                         bos_token_id=1, eos_token_id=None, tie_word_embeddings=False, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    torch.manual_seed(13)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path / "m"
    model.save_pretrained(path)
    out, group = {}, 32

    def put(stem: str, w: torch.Tensor) -> torch.Tensor:
        g_idx = torch.arange(w.shape[1]) // group
        codes, zeros, scales, values = quantize(w, g_idx, w.shape[1] // group, 4, False)
        out[stem + "qweight"], out[stem + "qzeros"] = gptq_tensors(codes, zeros, 4, True)
        out[stem + "scales"], out[stem + "g_idx"] = scales, g_idx.to(torch.int32)
        return values

    for name, w in model.state_dict().items():
        w = w.detach().clone().contiguous()
        at = name.rsplit(".", 2)[0]
        if name.endswith("experts.gate_up_proj"):
            f = w.shape[1] // 2
            with torch.no_grad():
                for e in range(w.shape[0]):
                    gate = put(f"{at}.experts.{e}.gate_proj.", w[e, :f])
                    up = put(f"{at}.experts.{e}.up_proj.", w[e, f:])
                    model.get_parameter(name)[e].copy_(torch.cat([gate, up]))
        elif name.endswith("experts.down_proj"):
            with torch.no_grad():
                for e in range(w.shape[0]):
                    model.get_parameter(name)[e].copy_(put(f"{at}.experts.{e}.down_proj.", w[e]))
        elif name.endswith("_proj.weight") and ".self_attn." in name:
            with torch.no_grad():
                model.get_parameter(name).copy_(put(name.removesuffix("weight"), w))
        else:
            out[name] = w
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((path / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                   "sym": False, "checkpoint_format": "gptq"}
    (path / "config.json").write_text(json.dumps(conf))
    tm = TinyModel("qwen3_moe", path, model, 0)
    ref = reference_generate(tm, PROMPTS, 6)
    with LLM(str(path), percent=(0, 50, 100, 0, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref
    with LLM(str(path), compress_weight=True, ignore_eos=True, progress=False) as llm:
        llm.generate(PROMPTS[:1], gen_len=1)
        placed = llm.engine.weights.placed[("layer", 0)]
        up = placed["experts.1.up.w"].data
        want = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")[1, 64:].detach()
        assert isinstance(up, QTensor) and up.group_size == group
        assert torch.equal(dequantize_q(up), want)
