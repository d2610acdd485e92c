"""A K-quant GGUF file's blocks kept under ``--compress-weight``, against re-quantizing them,
measured with the project's eval and timed side by side.

    python -m flexgen_dist.bench.gguf_kquants --json bench_results/gguf-kquants.json

The bundled SmolLM2-135M (a Q4_1 file) is written again as llama.cpp's ``Q4_K_M`` recipe
would write it from these values (``q4_k_m_type``; ``--recipes`` also writes an IQ4_XS file,
``iq4_xs_type``, whose 576-wide rows fall back to IQ4_NL): Q4_K, with Q6_K for the head and for the
value and down matrices of the layers llama.cpp gives more bits (the first and last eighth
and every third between); a matrix whose rows are not whole 256-element super-blocks takes
llama.cpp's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0), which at this model's width of 576 is all
but the down matrices. The K-quant blocks are rounded to nearest (``gguf_blocks.encode_blocks``),
not searched as llama.cpp's quantizer does, so the loss against the Q4_1 values is larger
than a real file's; what the rows compare is how the same file is run. ``eval ppl`` then runs
the file expanded (float32), with its blocks kept (``--compress-weight``) and re-quantized
into the engine's 4-bit groups (``--no-gguf-native``), beside the Q4_1 file; and, in bfloat16
with every weight on disk (``--prompts`` x ``--prompt-len``, ``--gen-len`` new), kept against
re-quantized. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .accuracy import ppl_rows
from .int_checkpoints import print_tables, timed_run
from .single import machine, write_json

FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}  # llama.cpp's, for rows not of 256


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose value and down matrices get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, cols: int, layers: int) -> str:
    """The type llama.cpp's Q4_K_M writes tensor ``name`` (rows of ``cols``) in, from this model's
    tensors (the embedding, tied to the head, as the head: Q6_K)."""
    want = "Q4_K"
    if name in ("token_embd.weight", "output.weight"):
        want = "Q6_K"
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits(int(name.split(".")[1]), layers):
        want = "Q6_K"
    return want if cols % 256 == 0 else FALLBACK[want]


def iq4_xs_type(name: str, cols: int, layers: int) -> str:
    """The type of tensor ``name`` in an IQ4_XS file (simplified: IQ4_XS everywhere but the
    embedding/head, Q6_K), with llama.cpp's fallbacks for rows not of 256 (IQ4_NL, Q8_0)."""
    want = "Q6_K" if name in ("token_embd.weight", "output.weight") else "IQ4_XS"
    return want if cols % 256 == 0 else FALLBACK[want]


RECIPES = {"q4_k_m": q4_k_m_type, "iq4_xs": iq4_xs_type}


def write_q4_k_m(src: Path, dst: Path, recipe: str = "q4_k_m") -> dict[str, int]:
    """``src`` (a GGUF file) written to ``dst`` with every quantized matrix re-encoded from its
    values by ``recipe``'s types (``RECIPES``; metadata, tokenizer and float tensors as they
    are); the count of tensors per type written."""
    import gguf
    import gguf.quants as gq

    from ..models.gguf_blocks import encode_blocks
    from ..models.gguf_file import GGUFFile

    reader = GGUFFile(src)
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.asarray(t.data))
            continue
        values = gq.dequantize(t.data, t.tensor_type)  # (rows, cols) float32
        kind = RECIPES[recipe](t.name, values.shape[-1], layers)
        qt = getattr(gguf.GGMLQuantizationType, kind)
        raw = encode_blocks(values, kind) if kind.endswith("_K") or kind.startswith("IQ4") else gq.quantize(values, qt)
        w.add_tensor(t.name, raw, raw_dtype=qt)
        counts[kind] = counts.get(kind, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16, help="the timed pair: prompts")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--recipes", default="q4_k_m,iq4_xs", help=f"files to write (of {', '.join(RECIPES)})")
    ap.add_argument("--json", default="bench_results/gguf-kquants.json")
    args = ap.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    if any(r not in RECIPES for r in recipes):
        ap.error(f"--recipes {args.recipes}: choose from {', '.join(RECIPES)}")
    from ..models.loader import bundled_model_path

    src = bundled_model_path()
    ev: dict[str, Any] = {"window": args.window, "max_windows": args.max_windows}
    counts: dict[str, dict[str, int]] = {}
    timed = []
    with tempfile.TemporaryDirectory() as tmp:
        rows = ppl_rows(str(src), False, [("the bundled Q4_1 file, expanded (float32)", {})], ev)
        for recipe in recipes:
            path = Path(tmp) / f"{recipe}.gguf"
            counts[recipe] = write_q4_k_m(src, path, recipe)
            print(f"written: {path.name}, tensors by type {counts[recipe]}", flush=True)
            name = recipe.upper()
            rows += ppl_rows(str(path), False, [
                (f"{name}, expanded (float32)", {}),
                (f"{name}, blocks kept (`--compress-weight`)", {"compress_weight": True}),
                (f"{name}, re-quantized 4-bit g64 (`--compress-weight --no-gguf-native`)",
                 {"compress_weight": True, "gguf_native": False}),
            ], ev)
            timed += [timed_run(str(path), mode, opts, args, str(Path(tmp) / "off")) for mode, opts in (
                (f"{name} blocks kept", {"compress_weight": True}),
                (f"{name} re-quantized 4-bit g64", {"compress_weight": True, "gguf_native": False}))]
    print_tables(rows, timed, "the Q4_1 file")
    write_json(args.json, {"machine": machine(), "eval": ev, "types": counts, "rows": rows, "timed": timed,
                           "timed_shape": {"prompts": args.prompts, "prompt_len": args.prompt_len,
                                           "gen_len": args.gen_len}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
