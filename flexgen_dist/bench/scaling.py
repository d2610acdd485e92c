"""Pipeline scaling benchmark: the real CLI on 1, 2, ... ranks under a fixed per-rank RAM budget.

    python -m flexgen_dist.bench.scaling --stages 1 2 --json bench_results/scaling.json
    python -m flexgen_dist.bench.scaling --dry-run          # print the commands, run nothing

The claim under test (DESIGN.md): each stage holds 1/m of the weights, so under the same
per-rank RAM budget it offloads less to disk, and decode throughput can grow faster than m.

Budget: every rank may keep ``--weight-budget`` bytes of weights in RAM (default 512 MiB);
the rest of its stage's weights go to disk. With W_s the weight bytes stage s owns (its
layers, plus the embedding on stage 0 and the final norm + LM head on the last stage), the
stage's policy keeps ``w_cpu = min(100, 100 * B / W_s)`` percent in RAM and the rest on disk;
KV cache and activations stay on the compute tier. For opt-350m fp32 (W = 1.3 GB): one
stage keeps ~40 % of its weights in RAM, each of two stages ~75-90 %. Every m runs
``python -m torch.distributed.run --standalone --nproc-per-node m -m flexgen_dist.run``
with a per-stage ``--policy`` YAML, the same prompts and block size, and the default
G = m micro-batch groups; rank 0's merged metrics give prefill/decode/total throughput.

On one machine the ranks share its cores and its disk: compute does not scale with m (each
of m ranks gets cores/m threads), and the disk reads of all ranks queue on one device. What
can scale is only the bytes read from disk, which the budget shrinks per stage.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml


def stage_weight_bytes(model: str, num_stages: int, dtype_bytes: int = 4) -> list[int]:
    """Weight bytes each stage holds (the engine's slots: embed, layers, head)."""
    import math

    import torch

    from ..distributed.partition import partition_layers
    from ..models.loader import DummySource
    from ..models.registry import get_spec

    spec = get_spec(model)
    src = DummySource(spec, torch.float32)

    def part(name: str) -> int:
        return sum(math.prod(s) for s in src.shapes(name).values()) * dtype_bytes

    out = []
    ranges = partition_layers(spec.num_layers, num_stages)
    for s, (lo, hi) in enumerate(ranges):
        b = (hi - lo) * part("layer")
        b += part("embed") if s == 0 else 0
        b += part("head") if s == num_stages - 1 else 0
        out.append(b)
    return out


def stage_policies(stage_bytes: list[int], budget: int, gbs: int, num_gb: int) -> list[dict[str, Any]]:
    """One policy per stage: as many weight bytes in RAM as the budget allows, the rest on disk."""
    pols = []
    for w in stage_bytes:
        wc = round(min(100.0, 100.0 * budget / w), 1)
        pols.append({"gpu_batch_size": gbs, "num_gpu_batches": num_gb,
                     "percent": [0, wc, 100, 0, 100, 0], "cpu_attention": True})
    return pols


def command(args: argparse.Namespace, m: int, policy_file: Path, metrics: Path, offload: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(m),
            "-m", "flexgen_dist.run", "--model", args.model, "--dummy-weights",
            "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
            "--gen-len", str(args.gen_len), "--ignore-eos", "--device", "cpu", "--dtype", "float32",
            "--policy", str(policy_file), "--offload-dir", str(offload), "--metrics", str(metrics),
            "--print-outputs", "0", "--no-progress"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ..memory.tiers import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-350m", help="registry shape (dummy weights)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2],
                    help="pipeline sizes to run (ranks on this machine); 4 on 2 cores is allowed but meaningless")
    ap.add_argument("--weight-budget", default="512MiB", type=parse_size,
                    help="RAM each rank may hold for weights; the rest of its stage goes to disk")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--num-gpu-batches", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="policy files, metrics and offload files go here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and policies, run nothing")
    ap.add_argument("--json", default="bench_results/scaling.json")
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.stages):
        ap.error("--stages: every pipeline size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fg-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    plans: dict[int, dict[str, Any]] = {}
    for m in args.stages:
        sb = stage_weight_bytes(args.model, m)
        pols = stage_policies(sb, args.weight_budget, args.gpu_batch_size, args.num_gpu_batches)
        pf = work / f"policy-{m}.yaml"
        pf.write_text(yaml.safe_dump({"stages": pols}, sort_keys=False))
        cmd = command(args, m, pf, work / f"metrics-{m}.json", work / f"offload-{m}")
        threads = max(1, cores // m)
        plans[m] = {"stage_weight_bytes": sb, "policies": pols, "omp_num_threads_per_rank": threads,
                    "command": f"OMP_NUM_THREADS={threads} " + shlex.join(cmd), "argv": cmd}
    res: dict[str, Any] = {
        "benchmark": "scaling", "model": args.model, "dry_run": args.dry_run, "cores": cores,
        "weight_budget_bytes_per_rank": args.weight_budget,
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                     "gpu_batch_size": args.gpu_batch_size, "num_gpu_batches": args.num_gpu_batches,
                     "dtype": "float32"},
        "runs": {},
    }
    for m, plan in plans.items():
        print(f"# {m} stage(s): weights per stage {[f'{b / 2**20:.0f} MiB' for b in plan['stage_weight_bytes']]}, "
              f"RAM share {[p['percent'][1] for p in plan['policies']]} %", flush=True)
        print(plan["command"], flush=True)
        res["runs"][str(m)] = {k: v for k, v in plan.items() if k != "argv"}
    if not args.dry_run:
        from ..memory.disk import drop_page_cache

        for m, plan in plans.items():
            run = res["runs"][str(m)]
            env = {**os.environ, "OMP_NUM_THREADS": str(plan["omp_num_threads_per_rank"])}
            run["page_cache_dropped"] = drop_page_cache()
            t0 = time.perf_counter()
            p = subprocess.run(plan["argv"], env=env, capture_output=True, text=True, timeout=args.timeout)
            run["wall_s"] = time.perf_counter() - t0
            if p.returncode != 0:
                raise SystemExit(f"{m} stage(s) failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
            met = json.loads((work / f"metrics-{m}.json").read_text())
            run["metrics"] = {k: met[k] for k in ("prefill_throughput", "decode_throughput", "total_throughput",
                                                  "prefill_time_s", "decode_time_s", "world_size")}
            run["metrics"].update({k: met.get(k) for k in ("num_micro_batches", "stage_times", "peak_bytes")})
            print(f"{m} stage(s): prefill {met['prefill_throughput']:.1f} | decode {met['decode_throughput']:.2f} | "
                  f"total {met['total_throughput']:.2f} tok/s ({run['wall_s']:.0f} s wall)", flush=True)
        base = res["runs"].get("1", {}).get("metrics")
        if base:
            res["scaling_vs_1_stage"] = {
                m: {k: r["metrics"][k] / base[k] for k in ("prefill_throughput", "decode_throughput",
                                                             "total_throughput")}
                for m, r in res["runs"].items()}
            print(json.dumps(res["scaling_vs_1_stage"]), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print("->", args.json)
    return res


if __name__ == "__main__":
    main()
