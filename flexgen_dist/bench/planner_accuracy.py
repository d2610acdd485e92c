"""Planner accuracy: the cost model's predicted times against the engine's measured ones.

    python -m flexgen_dist.bench.planner_accuracy --json bench_results/planner_accuracy.json

One run: profile this machine with the planner's own profiler (full mode unless ``--quick``),
then for each policy predict one block's prefill and decode time with
``cost_model.estimate_stage`` (the stage is the whole model: all layers, embedding and head)
and measure the same block with ``StageEngine`` + ``generate`` (num_prompts = the block
size, so exactly one block runs). The page cache is dropped before each measurement (root),
though the engine's disk tier uses O_DIRECT anyway. Weight placement (writing the disk share)
happens before the clock starts; a short warm-up runs on each engine first.

The JSON has, per policy, predicted and measured prefill/decode/total seconds, the relative
error of each ((predicted - measured) / measured), the predicted per-channel times (which
channel the model thinks is the bottleneck) and the engine's compute / I/O-wait split.
Each policy is predicted twice: at its nominal weight fractions (what the planner would
answer) and at the split the engine realised by placing whole tensors (what the cost
model's time equations should match); both errors are reported. Policies with a 4-bit cache
Every policy is also predicted without the profile's figures for the host's decode attention
(``cpu_packed_flops``, ``cpu_att_peak``): ``predicted_without_attention_figures`` and its error,
the cost model's count before them (a compressed cache expanded, then attended; every
attention's FLOPs at ``cpu_flops``). ``--model`` and ``--dtype`` choose the shape (a
grouped-query one, e.g. smollm2-135m, shows the difference) and the engine's dtype.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

DEFAULT_POLICIES = {
    # name: (WG, WC, CG, CC, HG, HC) percent; disk gets the rest
    "w0-20_cache-compute": (0, 20, 100, 0, 100, 0),
    "w0-50_cache-compute": (0, 50, 100, 0, 100, 0),
    "w20-30_cache-compute": (20, 30, 100, 0, 100, 0),
    "w0-50_cache-disk": (0, 50, 0, 0, 100, 0),
    "all-in-ram": (100, 0, 100, 0, 100, 0),
    "all-in-ram_4bit-cache": (100, 0, 100, 0, 100, 0),
    "w0-50_cache-ram_4bit-cache": (0, 50, 0, 100, 100, 0),
}
# policies with a 4-bit compressed cache (groups of 64)
CACHE_4BIT = ("all-in-ram_4bit-cache", "w0-50_cache-ram_4bit-cache")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-350m", help="registry shape (dummy weights)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="the engine's dtype, and the profile's rates for it")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--num-gpu-batches", type=int, default=2)
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=list(DEFAULT_POLICIES),
                    help="which placements to compare (default: all)")
    ap.add_argument("--quick", action="store_true", help="quick profile (for tests; less accurate)")
    ap.add_argument("--hardware", default=None,
                    help="use this hardware YAML instead of profiling (the JSON says so)")
    ap.add_argument("--workdir", default=None, help="offload dir for the profiler and the engine")
    ap.add_argument("--json", default="bench_results/planner_accuracy.json")
    return ap.parse_args(argv)


def rel_err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas > 0 else float("inf")


def measure(lm: Any, policy: Any, prompts: list[list[int]], gen_len: int, offload: Path,
            dtype: Any = None) -> dict[str, Any]:
    import torch

    from ..distributed.local import generate
    from ..engine.sampling import SamplingConfig
    from ..engine.stage import StageEngine
    from ..memory.disk import DiskStore
    from ..memory.disk import drop_page_cache

    sc = SamplingConfig(ignore_eos=True)
    with DiskStore(offload) as disk:
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=policy, device=torch.device("cpu"), dtype=dtype or torch.float32, disk=disk)
        try:
            generate(eng, [p[:8] for p in prompts[:1]], 2, sc)  # warm-up: kernels, allocator
            eng.times.compute_s = eng.times.io_wait_s = 0.0
            read0 = disk.bytes_read
            drop_page_cache()
            t0 = time.perf_counter()
            _, tm = generate(eng, prompts, gen_len, sc)
            wall = time.perf_counter() - t0
            return {"prefill_s": tm.prefill_s, "decode_s": tm.decode_s, "total_s": tm.prefill_s + tm.decode_s,
                    "wall_s": wall, **eng.times.as_dict(), "disk_bytes_read": disk.bytes_read - read0,
                    "direct_io": disk.direct, "weight_bytes_per_tier": eng.weights.bytes_per_tier()}
        finally:
            eng.close()


def realised_policy(policy: Any, bytes_per_tier: dict[str, int]) -> Any:
    """The policy with the weight percentages the engine really placed.

    The engine puts each tensor whole on one tier (the one holding its middle byte), so a
    slot of a few large tensors splits far from the nominal fractions (opt-350m at 20 % RAM
    keeps 14 %, at 50 % keeps 43 %): what moves each step is the realised split.
    """
    total = sum(bytes_per_tier.values()) or 1
    g = math.floor(1e4 * 100 * bytes_per_tier["gpu"] / total) / 1e4
    c = math.floor(1e4 * 100 * bytes_per_tier["cpu"] / total) / 1e4
    return replace(policy, w_gpu_percent=g, w_cpu_percent=c)


def prediction(cost: Any) -> dict[str, float]:
    return {"prefill_s": cost.prefill_time_s, "decode_s": cost.decode_time_s,
            "total_s": cost.prefill_time_s + cost.decode_time_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from ..engine.policy import Policy
    from ..models.loader import load_model
    from ..planner.cost_model import WorkShape, estimate_stage
    from ..planner.hardware import HardwareSpec
    from ..planner.profiler import profile_hardware
    from .single import machine

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fg-planner-acc-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.hardware:
        hw, how = HardwareSpec.from_yaml(args.hardware), f"loaded from {args.hardware}"
    else:
        t0 = time.perf_counter()
        hw = profile_hardware(device="cpu", offload_dir=str(work), quick=args.quick)
        how = f"profiled in this run ({'quick' if args.quick else 'full'} mode, {time.perf_counter() - t0:.0f} s)"
    hw = hw.for_dtype(args.dtype)  # the engine's dtype: its rates, as a run's planner takes them
    dtype = getattr(torch, args.dtype)
    rate = lambda v: "-" if v is None else f"{v / 1e9:.1f}"  # noqa: E731 - a figure the profile may lack
    print(f"hardware {how}: mm {hw.mm_flops / 1e9:.1f} GFLOP/s (64-row products {rate(hw.decode_flops)}), "
          f"attention {hw.bmm_flops / 1e9:.2f} GFLOP/s (host, one / eight heads a key: {rate(hw.cpu_att_read)} / "
          f"{rate(hw.cpu_att_peak)}), skinny GEMM {(hw.gemm_bw or 0) / 1e9:.1f} GB/s, memcpy {hw.ctog_bw / 1e9:.1f} GB/s, "
          f"disk read {hw.dtoc_bw / 1e9:.2f} GB/s, write {hw.ctod_bw / 1e9:.2f} GB/s", flush=True)

    lm = load_model(args.model, dummy_weights=True, dtype=dtype)
    spec = lm.spec
    bls = args.gpu_batch_size * args.num_gpu_batches
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, spec.vocab_size, (bls, args.prompt_len), generator=g).tolist()
    wl = WorkShape(args.prompt_len, args.gen_len, dtype_bytes=dtype.itemsize)
    before = replace(hw, cpu_packed_flops=None, cpu_att_peak=None, cpu_att_peak_dtype=None)
    results: dict[str, Any] = {}
    for name in args.policies:
        pol = Policy(args.gpu_batch_size, args.num_gpu_batches, *DEFAULT_POLICIES[name],
                     compress_cache=name in CACHE_4BIT)
        cost = estimate_stage(spec, spec.num_layers, pol, hw, wl, has_embed=True, has_head=True)
        pred = prediction(cost)
        meas = measure(lm, pol, prompts, args.gen_len, work / "offload", dtype)
        real = realised_policy(pol, meas["weight_bytes_per_tier"])
        pred_real = prediction(estimate_stage(spec, spec.num_layers, real, hw, wl, has_embed=True, has_head=True))
        phases = ("prefill_s", "decode_s", "total_s")
        err = {k: rel_err(pred[k], meas[k]) for k in phases}
        err_real = {k: rel_err(pred_real[k], meas[k]) for k in phases}
        bottleneck = {ph: max(ch, key=ch.get) for ph, ch in cost.channels.items()}
        results[name] = {"policy": pol.to_dict(), "predicted": pred, "measured": meas, "rel_error": err,
                         "within_30pct": abs(err["total_s"]) <= 0.30,
                         "realised_weight_percent": [real.w_gpu_percent, real.w_cpu_percent, real.w_disk_percent],
                         "predicted_at_realised": pred_real, "rel_error_at_realised": err_real,
                         "within_30pct_at_realised": abs(err_real["total_s"]) <= 0.30,
                         "predicted_channels_s": cost.channels, "predicted_bottleneck": bottleneck}
        old = prediction(estimate_stage(spec, spec.num_layers, real, before, wl, has_embed=True, has_head=True))
        results[name]["predicted_without_attention_figures"] = old
        results[name]["rel_error_without_attention_figures"] = {k: rel_err(old[k], meas[k]) for k in phases}
        extra = f"; without the attention figures {100 * rel_err(old['total_s'], meas['total_s']):+.1f} %"
        print(f"{name:26s} predicted {pred['total_s']:6.2f} s (at realised split {pred_real['total_s']:6.2f} s) | "
              f"measured {meas['total_s']:6.2f} s | error {100 * err['total_s']:+6.1f} % "
              f"(realised {100 * err_real['total_s']:+6.1f} %; prefill {100 * err['prefill_s']:+.0f} %, "
              f"decode {100 * err['decode_s']:+.0f} %{extra})", flush=True)

    res = {
        "benchmark": "planner_accuracy", "machine": machine(), "model": spec.name,
        "workload": {"prompt_len": args.prompt_len, "gen_len": args.gen_len, "gpu_batch_size": args.gpu_batch_size,
                     "num_gpu_batches": args.num_gpu_batches, "block_size": bls, "dtype": args.dtype},
        "hardware": hw.to_dict(), "hardware_source": how, "policies": results,
        "max_abs_total_error": max(abs(r["rel_error"]["total_s"]) for r in results.values()),
        "all_within_30pct": all(r["within_30pct"] for r in results.values()),
        "max_abs_total_error_at_realised": max(abs(r["rel_error_at_realised"]["total_s"])
                                               for r in results.values()),
        "all_within_30pct_at_realised": all(r["within_30pct_at_realised"] for r in results.values()),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"max |total error| {100 * res['max_abs_total_error']:.1f} % -> {args.json}")
    return res


if __name__ == "__main__":
    main()
