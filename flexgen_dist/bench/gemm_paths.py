"""A prefill's products on this CPU: every torch path against the engine's, per dtype.

    python -m flexgen_dist.bench.gemm_paths --json bench_results/gemm-paths.json
    python -m flexgen_dist.bench.gemm_paths --rows 4096 --in 2048 --out 8192 --dtypes bfloat16 float16

Times one product of ``--rows`` x ``--in`` activations by an (``--out``, ``--in``) weight (by
default the shape of an opt-1.3b MLP product over 8 x 512 prompt tokens) in each dtype through
``F.linear``, ``torch.mm`` with the weight transposed, ``torch.matmul``, oneDNN's linear where
this torch build has it (``torch.ops.mkldnn._linear_pointwise`` over a prepacked weight),
float32 (both operands widened, the output rounded back) and the engine's own
``models.common.linear`` (which runs the form its GEMM policy stored for this machine), the
paths alternating over ``--rounds`` rounds after a warm-up; best and median TFLOP/s of each.
Reports, never asserts; the engine's path should be as fast as the fastest of the others.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .single import machine, write_json


def paths(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    from ..models.common import linear

    out: dict[str, Callable[[], torch.Tensor]] = {
        "F.linear": lambda: F.linear(x, w),
        "mm(x, w.T)": lambda: torch.mm(x, w.t()),
        "matmul": lambda: torch.matmul(x, w.t()),
    }
    if x.dtype != torch.float32:
        out["float32 (widened)"] = lambda: F.linear(x.float(), w.float()).to(x.dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        out["oneDNN prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, TypeError):
        pass  # not in this build, or not for this dtype
    out["engine (models.common.linear)"] = lambda: linear(x, w)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--in", dest="k", type=int, default=2048)
    ap.add_argument("--out", dest="n", type=int, default=8192)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    flops = 2.0 * args.rows * args.k * args.n
    res: dict[str, Any] = {"machine": machine(), "threads": torch.get_num_threads(),
                           "shape": {"rows": args.rows, "in": args.k, "out": args.n}, "tflops": {}}
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        x = torch.empty(args.rows, args.k).uniform_(-1, 1, generator=g).to(dtype)
        w = torch.empty(args.n, args.k).uniform_(-1, 1, generator=g).to(dtype)
        fns = paths(x, w)
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {p: [] for p in fns}
        for _ in range(args.rounds):
            for p, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[p].append(time.perf_counter() - t0)
        res["tflops"][name] = {p: {"best": flops / min(t) / 1e12, "median": flops / statistics.median(t) / 1e12}
                               for p, t in times.items()}
        print(f"{name}:", file=sys.stderr)
        for p, r in res["tflops"][name].items():
            print(f"  {p:32} best {r['best']:.3f}  median {r['median']:.3f} TFLOP/s", file=sys.stderr)
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
