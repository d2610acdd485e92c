"""Mixed-length batch job: length-grouped blocks against blocks in input order, side by side.

    python -m flexgen_dist.bench.mixed --requests 512 --min-len 16 --max-len 2048 \\
        --min-tokens 16 --max-tokens 256 --json bench_results/mixed.json

Writes an OpenAI Batch file of completions requests with random prompt lengths and random
``max_tokens`` (token-id prompts, so a model without a tokenizer serves them), then runs
``python -m flexgen_dist.batch`` on it with ``--sort-window 0`` (input order) and with the
default windows, each in its own process, alternating A B A B for ``--repeat`` rounds, and
reports per side the wall time, useful tokens/s (completion tokens users asked for, per
second of the job), the padded fraction from the run's metrics, and whether the two sides'
outputs are identical. The model is a random Llama-shaped checkpoint that transformers
builds (``--hidden``, ``--layers``; dummy weights), with ``--percent`` placing part of its
weights on disk. A benchmark, not a test: it reports, it does not assert.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flexgen_dist.config import DEFAULT_SORT_WINDOW


def build_model(path: Path, hidden: int, layers: int, vocab: int, max_len: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                      max_position_embeddings=max_len, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)


def write_requests(path: Path, n: int, lens: tuple[int, int], tokens: tuple[int, int], vocab: int,
                   seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    plen = [rng.randint(*lens) for _ in range(n)]
    mt = [rng.randint(*tokens) for _ in range(n)]
    with path.open("w") as f:
        for i, (p, m) in enumerate(zip(plen, mt)):
            ids = [rng.randrange(3, vocab) for _ in range(p)]
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"prompt": ids, "max_tokens": m}}) + "\n")
    return {"prompt_tokens": sum(plen), "max_tokens": sum(mt)}


def run_side(model: Path, reqs: Path, out: Path, window: int, opts: list[str]) -> dict[str, Any]:
    met = out.with_suffix(".metrics.json")
    cmd = [sys.executable, "-m", "flexgen_dist.batch", "-i", str(reqs), "-o", str(out), "--overwrite",
           "--model", str(model), "--sort-window", str(window), "--no-progress", "--metrics", str(met), *opts]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"sort-window {window} failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    m = json.loads(met.read_text())
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    done = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in lines if x["error"] is None)
    return {"wall_s": wall, "job_s": m["batch"]["seconds"], "completion_tokens": done,
            "useful_tok_s": done / m["batch"]["seconds"], "padding_fraction": m["padding_fraction"],
            "finished_rows_fraction": m["finished_rows_fraction"],
            "prefill_s": m["prefill_time_s"], "decode_s": m["decode_time_s"],
            "token_steps": m["stage_times"][0]["token_steps"],
            "choices": [x["response"]["body"]["choices"][0].get("token_ids") for x in lines]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--num-gpu-batches", type=int, default=4)
    ap.add_argument("--percent", nargs=6, default=["0", "50", "100", "0", "100", "0"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_results/mixed.json")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fg-mixed-") as tmp:
        d = Path(tmp)
        build_model(d / "model", a.hidden, a.layers, a.vocab, a.max_len + a.max_tokens + 8)
        work = write_requests(d / "requests.jsonl", a.requests, (a.min_len, a.max_len),
                              (a.min_tokens, a.max_tokens), a.vocab, a.seed)
        opts = ["--gpu-batch-size", str(a.gpu_batch_size), "--num-gpu-batches", str(a.num_gpu_batches),
                "--percent", *a.percent, "--dtype", a.dtype, "--ignore-eos", "--offload-dir", str(d / "off")]
        sides: dict[str, list[dict[str, Any]]] = {"input order": [], "length-grouped": []}
        for r in range(a.repeat):
            for name, window in (("input order", 0), ("length-grouped", DEFAULT_SORT_WINDOW)):
                print(f"round {r + 1}: {name} ...", file=sys.stderr, flush=True)
                sides[name].append(run_side(d / "model", d / "requests.jsonl", d / f"out-{window}.jsonl", window, opts))
    same = [x["choices"] == y["choices"] for x, y in zip(sides["input order"], sides["length-grouped"])]
    best = {k: min(v, key=lambda s: s["job_s"]) for k, v in sides.items()}
    report = {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "processor": platform.processor()},
        "workload": {**vars(a), **work}, "identical_outputs": all(same),
        "sides": {k: [{kk: vv for kk, vv in s.items() if kk != "choices"} for s in v] for k, v in sides.items()},
        "speedup_useful": best["length-grouped"]["useful_tok_s"] / best["input order"]["useful_tok_s"],
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    print("| blocks | job s | prefill s | decode s | useful tok/s | prompt padding | rows of finished requests "
          "| token steps |")
    print("|---|---|---|---|---|---|---|---|")
    for k, s in best.items():
        print(f"| {k} | {s['job_s']:.1f} | {s['prefill_s']:.1f} | {s['decode_s']:.1f} | {s['useful_tok_s']:.1f} | "
              f"{100 * s['padding_fraction']:.1f} % | {100 * s['finished_rows_fraction']:.1f} % | {s['token_steps']} |")
    print(f"useful throughput x{report['speedup_useful']:.2f}; outputs identical: {all(same)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
