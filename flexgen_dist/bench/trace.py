"""Where a run's time goes, op by op: any ``flexgen_dist.run`` job under torch's profiler.

    python -m flexgen_dist.bench.trace --json bench_results/trace.json -- \\
        --model opt-6.7b --dummy-weights --num-prompts 128 --prompt-len 512 --gen-len 2 \\
        --percent 100 0 100 0 100 0 --gpu-batch-size 32 --num-gpu-batches 4 --warmup --no-progress

The arguments after ``--`` are the job's, as ``python -m flexgen_dist.run`` takes them. With
``--warmup`` the profile starts after the warm-up (the weights placed, one token run), so it
holds the job alone. Prints the ``--rows`` ops that took most device time (on a GPU: the
kernels and copies; on a CPU: self CPU time), and those that took most host time, where a
host-side wait (``cudaStreamSynchronize``, ``aten::item``) shows; ``--json`` keeps both lists,
``--chrome`` a timeline for chrome://tracing or Perfetto. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from .single import machine, write_json


def _device_us(e: Any) -> float:
    return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)


def rows_of(events: Any, key: str, n: int) -> list[dict[str, Any]]:
    """The ``n`` ops with the most ``key`` time ("device" or "cpu"), self time in ms."""
    out = [{"op": e.key, "calls": e.count, "self_device_ms": round(_device_us(e) / 1e3, 3),
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)} for e in events]
    field = "self_device_ms" if key == "device" else "self_cpu_ms"
    return sorted(out, key=lambda r: -r[field])[:n]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    job = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=25, help="ops listed per table")
    ap.add_argument("--json", help="write both tables here")
    ap.add_argument("--chrome", help="also write a Chrome trace here")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not job:
        raise SystemExit("give the job after --, as python -m flexgen_dist.run takes it")
    from torch.profiler import ProfilerActivity, profile

    from .. import run as run_mod
    from ..api import LLM

    device = job[job.index("--device") + 1] if "--device" in job[:-1] else "auto"
    cuda = torch.cuda.is_available() and device != "cpu"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    started = False
    warmup = LLM.warmup

    def warmup_then_profile(self: LLM, *a: Any, **kw: Any) -> Any:
        nonlocal started
        out = warmup(self, *a, **kw)
        if not started:
            prof.start()
            started = True
        return out

    LLM.warmup = warmup_then_profile  # type: ignore[method-assign]
    try:
        if "--warmup" not in job:
            prof.start()
            started = True
        rc = run_mod.main(job)
    finally:
        LLM.warmup = warmup  # type: ignore[method-assign]
        if started:
            prof.stop()
    if rc != 0:
        raise SystemExit(f"the job failed (exit code {rc}): nothing to report")
    events = prof.key_averages()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=args.rows))
    if cuda:
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    result = {"benchmark": "trace", "machine": machine(), "job": job, "device_profiled": cuda,
              "by_device_time": rows_of(events, "device" if cuda else "cpu", args.rows),
              "by_host_time": rows_of(events, "cpu", args.rows)}
    if args.chrome:
        prof.export_chrome_trace(args.chrome)
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
