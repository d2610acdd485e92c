"""Accuracy of each compression mode, through ``eval ppl``, in one run.

    python -m flexgen_dist.bench.accuracy --json bench_results/accuracy.json

Every mode scores the same windows of the same text with the same model (default: the
bundled SmolLM2 on the bundled English sample): float32 weights (the GGUF's dequantized
values), the GGUF's own 4-bit blocks kept compressed, and the same weights re-quantized by
the engine's group-wise quantizer at several group sizes and bit widths. Prints a markdown
table (perplexity, its change against float32, next-token accuracy) and writes the JSON.

Scoring is teacher-forced prefill, whose attention runs over the fresh keys and values, so
cache compression and sparse attention (decode-only) do not change these figures.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..api import LLM
from ..eval import evaluate
from .single import machine

MODES: list[tuple[str, dict[str, Any]]] = [
    ("float32 (GGUF values expanded)", {}),
    ("4-bit weights, the GGUF's own blocks (native)", {"compress_weight": True}),
    ("4-bit weights re-quantized, group 32", {"compress_weight": True, "gguf_native": False, "comp_group_size": 32}),
    ("4-bit weights re-quantized, group 64 (default)", {"compress_weight": True, "gguf_native": False}),
    ("4-bit weights re-quantized, group 128", {"compress_weight": True, "gguf_native": False,
                                               "comp_group_size": 128}),
    ("8-bit weights re-quantized, group 64", {"compress_weight": True, "gguf_native": False, "comp_bits": 8}),
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--text", default=None, help="default: the bundled English sample")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--json", default="bench_results/accuracy.json")
    args = ap.parse_args(argv)
    ev = {"text": args.text, "window": args.window, "max_windows": args.max_windows}
    rows = []
    for name, opts in MODES:
        with LLM(args.model, dummy_weights=args.dummy_weights, progress=False, **opts) as llm:
            res = evaluate(llm, **ev)
        assert res is not None
        rows.append({"mode": name, "options": opts, "ppl": res["ppl"], "accuracy": res["accuracy"],
                     "tokens_scored": res["tokens_scored"], "weight_bytes": sum(
                         res["peak_bytes"][0][t] for t in ("gpu", "cpu", "disk"))})
        print(f"{name}: ppl {res['ppl']:.4f}, accuracy {100 * res['accuracy']:.2f} %", flush=True)
    base = rows[0]["ppl"]
    for r in rows:
        r["ppl_change"] = r["ppl"] / base - 1
    out = {"benchmark": "accuracy", "machine": machine(), "model": args.model or "bundled SmolLM2-135M-Instruct",
           "text": args.text or "bundled English sample", "window": args.window, "rows": rows}
    print("\n| mode | perplexity | vs float32 | next-token accuracy |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ppl']:.4f} | {100 * r['ppl_change']:+.2f} % | {100 * r['accuracy']:.2f} % |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
