"""What a GPTQ or FP8 checkpoint's codes are worth kept as they are, measured with the
project's eval.

    python -m flexgen_dist.bench.int_checkpoints --json bench_results/int-checkpoints.json

The bundled SmolLM2-135M (its GGUF's values, float32) is written as a Hugging Face directory,
then as a GPTQ checkpoint of it for each of ``--gptq-bits`` (4 and 3 by default; round to
nearest, groups of ``--group`` input columns, asymmetric, AutoGPTQ's original format: the
layout of the ``-GPTQ-Int4`` releases and the 3-bit branches, without GPTQ's error feedback). ``eval ppl`` (every token scored in prefill, the bundled English
sample) then runs the float directory, the GPTQ one expanded (``scale x (code - zero)`` in
float32), the GPTQ one under ``--compress-weight`` with its codes kept (native) and
re-quantized into the engine's groups (``--no-gguf-native``), and the float directory under
``--compress-weight`` (the engine's own 4-bit quantizer on the float values), side by side in
one run; and the directory quantized by transformers with bitsandbytes (NF4, double
quantization: the ``-bnb-4bit`` releases), expanded, with its codes kept (the ``nf4`` table
format) and re-quantized, and timed kept against re-quantized (``--no-bnb`` leaves it out). The same directory as a block-scaled FP8 checkpoint (DeepSeek-V3's format, blocks of
``--fp8-block``; the embedding, tied to the head, kept in float) runs expanded, with its codes
kept under ``--compress-weight`` (the head then compressed by the engine: 4 and 8 bits) and
re-quantized (``--no-gguf-native``); and, timed side by side in bfloat16 with every weight on
disk (``--prompts`` x ``--prompt-len``, ``--gen-len`` new), expanded against its codes kept
with 8-bit for the rest. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .accuracy import ppl_rows
from .single import machine, write_json


def export_hf(path: Path) -> None:
    """The bundled model (its GGUF's values, float32) as a Hugging Face Llama directory."""
    from safetensors.torch import save_file

    from ..models.loader import load_model

    lm = load_model(None)
    spec, src, fam = lm.spec, lm.source, lm.source.family
    out: dict[str, torch.Tensor] = {}
    parts = [("embed", None)] + [("layer", j) for j in range(spec.num_layers)] + [("head", None)]
    for part, layer in parts:
        names = fam.hf_names(spec, part, layer)
        for k, t in src.get(part, layer).items():
            name = names[k][0]
            if name not in out:  # a tied head is the embedding
                out[name] = t.float().contiguous()
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": spec.vocab_size,
           "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_size, "num_hidden_layers": spec.num_layers,
           "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
           "max_position_embeddings": spec.max_positions, "rms_norm_eps": spec.norm_eps,
           "rope_theta": spec.rope_theta, "tie_word_embeddings": spec.tie_word_embeddings,
           "bos_token_id": spec.bos_token_id, "eos_token_id": list(spec.eos_token_ids),
           "pad_token_id": spec.pad_token_id, "hidden_act": "silu", "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(cfg))
    lm.tokenizer.save_pretrained(str(path))


def _words(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes of ``bits`` packed into int32 words along ``dim`` as GPTQ's packers do: one stream
    of bits, the first code in the lowest bits (3 bits: 32 codes in three words)."""
    c = codes.long() if dim == 0 else codes.long().t()
    stream = ((c.unsqueeze(1) >> torch.arange(bits)[:, None]) & 1).reshape(-1, c.shape[1])  # a row per bit
    acc = (stream.view(-1, 32, c.shape[1]) << torch.arange(32)[:, None]).sum(1)
    acc = torch.where(acc >= 2 ** 31, acc - 2 ** 32, acc).to(torch.int32)
    return acc if dim == 0 else acc.t().contiguous()


def _quantized_copy(src: Path, dst: Path, layer: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
                    quant: dict[str, Any]) -> None:
    """``src`` written to ``dst`` with each decoder-layer matrix replaced by what ``layer`` makes
    of it (tensors under their checkpoint names), everything else as it is, beside ``src``'s
    config (its ``quantization_config`` ``quant``) and tokenizer."""
    from safetensors.torch import load_file, save_file

    out: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        out.update(layer(name, w) if name.endswith("_proj.weight") and ".layers." in name else {name: w})
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja"):
            (dst / f.name).write_bytes(f.read_bytes())


def gptq_rtn(src: Path, dst: Path, group: int, bits: int = 4) -> None:
    """``src``'s decoder-layer matrices as GPTQ layers of ``bits`` (round to nearest,
    asymmetric, zeros stored minus 1); everything else as it is."""
    top = (1 << bits) - 1

    def layer(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, cols = w.shape
        g = w.t().reshape(cols // group, group, rows)  # (groups, group, out)
        lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-8).half()
        zero = (-lo / scale.float()).round().clamp(0, top).long()
        codes = ((g / scale.float()[:, None]).round().long() + zero[:, None]).clamp(0, top).reshape(cols, rows)
        stem = name.removesuffix("weight")
        return {stem + "qweight": _words(codes, bits, 0), stem + "qzeros": _words((zero - 1) & top, bits, 1),
                stem + "scales": scale, stem + "g_idx": (torch.arange(cols) // group).to(torch.int32)}

    _quantized_copy(src, dst, layer, {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
                                      "sym": False, "checkpoint_format": "gptq"})


def bnb_nf4(src: Path, dst: Path) -> None:
    """``src`` quantized by transformers with bitsandbytes (NF4, double quantization, blocks of
    64: the ``-bnb-4bit`` releases' settings) and saved to ``dst``, as those releases are made."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=qc, device_map="cpu", dtype=torch.float32)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja"):
            (dst / f.name).write_bytes(f.read_bytes())


def fp8_blocks(src: Path, dst: Path, block: int) -> None:
    """``src``'s decoder-layer matrices as FP8 e4m3 in blocks of ``block`` x ``block`` (the
    last ones partial), each beside its ``weight_scale_inv`` grid (amax / 448, float32):
    ``quant_method: fp8`` as DeepSeek-V3, Qwen3-*-FP8 and GLM-4.5-FP8 ship; the rest as it is."""
    def layer(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, cols = w.shape
        gr, gc = -(-rows // block), -(-cols // block)
        pad = torch.zeros(gr * block, gc * block)
        pad[:rows, :cols] = w
        blocks = pad.reshape(gr, block, gc, block)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:rows, :cols]
        return {name: q.to(torch.float8_e4m3fn).contiguous(), name + "_scale_inv": scale}

    _quantized_copy(src, dst, layer, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [block, block]})


def throughput(model: str, opts: dict[str, Any], prompts: int, prompt_len: int, gen_len: int,
               offload: str) -> dict[str, Any]:
    """bfloat16, every weight on disk, greedy over synthetic prompts: the run's report."""
    from .. import LLM

    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (prompts, prompt_len)).tolist()
    with LLM(model, dtype="bfloat16", percent=(0, 0, 100, 0, 100, 0), gpu_batch_size=prompts // 2,
             num_gpu_batches=2, offload_dir=offload, ignore_eos=True, progress=False, **opts) as llm:
        llm.generate(ids[:2], gen_len=2)  # warm-up: the kernels, the read buffers
        llm.generate(ids, gen_len=gen_len)
        m, stored = llm.metrics, llm.engine.weights.bytes_per_tier()
    keys = ("prefill_throughput", "decode_throughput", "total_throughput")
    return {"options": opts, **{k: m.get(k) for k in keys}, "weight_bytes": stored}


def timed_run(model: str, mode: str, opts: dict[str, Any], args: Any, offload: str) -> dict[str, Any]:
    """``throughput`` of one mode (``args``: prompts, prompt_len, gen_len), said in one line."""
    t = throughput(model, opts, args.prompts, args.prompt_len, args.gen_len, offload)
    print(f"{mode}: prefill {t['prefill_throughput']:.1f}, decode {t['decode_throughput']:.1f}, "
          f"total {t['total_throughput']:.1f} tok/s; weights {t['weight_bytes']}", flush=True)
    return {"mode": mode, **t}


def print_tables(rows: list[dict[str, Any]], timed: list[dict[str, Any]], versus: str) -> None:
    """The perplexity rows (each's change against the first, ``versus``) and the timed ones as
    Markdown tables."""
    for r in rows:
        r["ppl_change"] = r["ppl"] / rows[0]["ppl"] - 1
    print(f"| mode | perplexity | vs {versus} | next-token accuracy | weight bytes |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ppl']:.4f} | {100 * r['ppl_change']:+.2f} % | {100 * r['accuracy']:.2f} % | "
              f"{r['weight_bytes'] / 2 ** 20:.1f} MiB |")
    print("\n| weights on disk, bfloat16 | prefill tok/s | decode tok/s | total tok/s | stored weight bytes |")
    print("|---|---|---|---|---|")
    for t in timed:
        print(f"| {t['mode']} | {t['prefill_throughput']:.1f} | {t['decode_throughput']:.1f} | "
              f"{t['total_throughput']:.1f} | {sum(t['weight_bytes'].values()) / 2 ** 20:.1f} MiB |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=64, help="GPTQ group size (input columns; divides 576 and 1536)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--gptq-bits", default="4,3", help="GPTQ widths to write and evaluate (of 2, 3, 4, 8)")
    ap.add_argument("--fp8-block", type=int, default=128, help="FP8 block (rows and columns)")
    ap.add_argument("--no-bnb", dest="bnb", action="store_false",
                    help="leave out the bitsandbytes NF4 rows (they need the bitsandbytes package)")
    ap.add_argument("--prompts", type=int, default=16, help="the timed pair: prompts")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--json", default="bench_results/int-checkpoints.json")
    args = ap.parse_args(argv)
    widths = [int(b) for b in args.gptq_bits.split(",") if b]
    if any(b not in (2, 3, 4, 8) for b in widths):
        ap.error(f"--gptq-bits {args.gptq_bits}: GPTQ writes 2, 3, 4 or 8 bits")
    ev: dict[str, Any] = {"window": args.window, "max_windows": args.max_windows}
    with tempfile.TemporaryDirectory() as tmp:
        dense, fp8 = Path(tmp) / "hf", Path(tmp) / "fp8"
        dense.mkdir()
        export_hf(dense)
        fp8_blocks(dense, fp8, args.fp8_block)
        rows = ppl_rows(str(dense), False, [("float32 (the GGUF's values, as a HF directory)", {})], ev)
        for bits in widths:
            gptq = Path(tmp) / f"gptq{bits}"
            gptq_rtn(dense, gptq, args.group, bits)
            name = f"GPTQ {bits}-bit g{args.group}"
            rows += ppl_rows(str(gptq), False, [
                (f"{name}, expanded (float32)", {}),
                (f"{name}, codes kept (`--compress-weight`)", {"compress_weight": True}),
                (f"{name}, re-quantized (`--compress-weight --no-gguf-native`)",
                 {"compress_weight": True, "gguf_native": False}),
            ], ev)
        rows += ppl_rows(str(dense), False, [("float32 directory, the engine's 4-bit g64 (`--compress-weight`)",
                                              {"compress_weight": True})], ev)
        if args.bnb:
            nf4 = Path(tmp) / "nf4"
            bnb_nf4(dense, nf4)
            rows += ppl_rows(str(nf4), False, [
                ("bitsandbytes NF4 (double quantization, blocks of 64), expanded (float32)", {}),
                ("bitsandbytes NF4, codes kept (`--compress-weight`)", {"compress_weight": True}),
                ("bitsandbytes NF4, codes kept, the rest 8-bit (`--compress-weight --comp-bits 8`)",
                 {"compress_weight": True, "comp_bits": 8}),
                ("bitsandbytes NF4, re-quantized 4-bit g64 (`--compress-weight --no-gguf-native`)",
                 {"compress_weight": True, "gguf_native": False}),
            ], ev)
        b = args.fp8_block
        rows += ppl_rows(str(fp8), False, [
            (f"FP8 e4m3 {b}x{b} blocks, expanded (float32)", {}),
            (f"FP8 {b}x{b}, codes kept, head 4-bit (`--compress-weight`)", {"compress_weight": True}),
            (f"FP8 {b}x{b}, codes kept, head 8-bit (`--compress-weight --comp-bits 8`)",
             {"compress_weight": True, "comp_bits": 8}),
            (f"FP8 {b}x{b}, re-quantized 4-bit (`--compress-weight --no-gguf-native`)",
             {"compress_weight": True, "gguf_native": False}),
        ], ev)
        off = str(Path(tmp) / "off")
        timed = [timed_run(str(fp8), name, opts, args, off) for name, opts in (
            (f"FP8 {b}x{b} expanded (bfloat16 on disk)", {}),
            (f"FP8 {b}x{b} codes kept, the rest 8-bit", {"compress_weight": True, "comp_bits": 8}))]
        if args.bnb:
            timed += [timed_run(str(nf4), name, opts, args, off) for name, opts in (
                ("NF4 codes kept", {"compress_weight": True}),
                ("NF4 re-quantized 4-bit g64", {"compress_weight": True, "gguf_native": False}))]
    print_tables(rows, timed, "float32")
    write_json(args.json, {"benchmark": "int-checkpoints", "machine": machine(), "group": args.group, "eval": ev,
                           "rows": rows, "fp8_block": args.fp8_block, "timed": timed,
                           "timed_shape": [args.prompts, args.prompt_len, args.gen_len]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
