"""Linear attention beside attention: a Qwen3-Next-shaped model against the same shape with
every layer attending, side by side in one run.

    python -m flexgen_dist.bench.hybrid --json bench_results/hybrid.json

Two configs written by transformers' ``Qwen3NextConfig`` with dummy weights (default: hidden
1024, 16 layers, 8 heads of 128 (2 kv), 16 experts top 2 of width 512, a shared expert; linear
layers of 8 k heads and 16 v heads of 64): ``hybrid`` with Qwen3-Next's three linear-attention
layers of four, ``full`` with every layer ``full_attention`` (the same weights otherwise, the
linear layers' projections replaced by attention's). Each runs ``python -m flexgen_dist.run`` in
its own process at each ``--prompt-lens``, alternating, ``--rounds`` times; the JSON keeps every
run's throughputs and peak bytes, the table their medians. What the linear layers change: no
KV cache for them (a fixed state per sequence instead), so the cache and the decode step's
attention stop growing with the context on those layers. ``--state-percent SG SC`` adds the
hybrid with its states placed so (``0 0``: every linear layer's on disk, staged around its
layer), what moving them costs. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .single import machine, write_json


def _configs(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                          num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                          linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=8,
                          linear_num_value_heads=16, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                          shared_expert_intermediate_size=512, max_position_embeddings=max(args.prompt_lens) * 2 + 64
                          ).to_dict()
    out = {}
    for name, types in (("hybrid", cfg["layer_types"]), ("full", ["full_attention"] * args.layers)):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, "layer_types": types}))
        out[name] = d
    return out


def _run(model: Path, s: int, args: argparse.Namespace, metrics: Path, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "flexgen_dist.run", "--model", str(model), "--dummy-weights", "--dtype", args.dtype,
           "--num-prompts", str(args.num_prompts), "--prompt-len", str(s), "--gen-len", str(args.gen_len),
           "--gpu-batch-size", str(args.num_prompts), "--no-progress", "--metrics", str(metrics), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"hybrid bench: {model.name} at prompt {s} failed: {r.stderr.strip().splitlines()[-1]}")
    m = json.loads(metrics.read_text())
    return {"prefill": m["prefill_throughput"], "decode": m["decode_throughput"], "total": m["total_throughput"],
            "peak_bytes": m["peak_bytes"][0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--state-percent", type=float, nargs=2, metavar=("SG", "SC"),
                    help="also run the hybrid with its linear layers' states placed so")
    ap.add_argument("--json", default="bench_results/hybrid.json")
    args = ap.parse_args(argv)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fg-hybrid-") as tmp:
        models = {name: (path, []) for name, path in _configs(Path(tmp), args).items()}
        if args.state_percent:
            sg, sc = (f"{x:g}" for x in args.state_percent)
            models[f"hybrid-states-{sg}-{sc}"] = (models["hybrid"][0], ["--state-percent", sg, sc, "--offload-dir",
                                                                      str(Path(tmp) / "off")])
        for rnd in range(args.rounds):
            for s in args.prompt_lens:
                for name, (path, extra) in models.items():
                    r = _run(path, s, args, Path(tmp) / "m.json", extra)
                    runs.append({"model": name, "round": rnd, "prompt_len": s, **r})
                    print(f"round {rnd + 1} prompt {s} {name}: prefill {r['prefill']:.1f} decode {r['decode']:.1f} "
                          f"total {r['total']:.1f} tok/s", file=sys.stderr)
    rows = []
    for s in args.prompt_lens:
        for name in models:
            mine = [r for r in runs if r["model"] == name and r["prompt_len"] == s]
            rows.append({"model": name, "prompt_len": s,
                         **{k: statistics.median(r[k] for r in mine) for k in ("prefill", "decode", "total")},
                         "peak_gpu_bytes": max(r["peak_bytes"]["gpu"] for r in mine)})
    print(f"{'model':<20} {'prompt':>6} {'prefill':>9} {'decode':>8} {'total':>7} {'peak MB':>8}")
    for r in rows:
        print(f"{r['model']:<20} {r['prompt_len']:>6} {r['prefill']:>9.1f} {r['decode']:>8.1f} {r['total']:>7.1f} "
              f"{r['peak_gpu_bytes'] / 2**20:>8.0f}")
    write_json(args.json, {"machine": machine(), "args": vars(args), "medians": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
