"""A decode step's 4-bit products on a GPU: the fused Triton kernel against expand-then-cuBLAS
and against the uncompressed weight, per shape, row count and dtype.

    python -m flexgen_dist.bench.qlinear_paths --json bench_results/gpu/qlinear-paths.json
    python -m flexgen_dist.bench.qlinear_paths --models opt-6.7b --rows 1 32 --dtypes float16

For each linear layer shape of the ``--models`` (q/k/v/o, fc1, fc2) and each row count, times
(CUDA events, median over ``--reps`` after a warm-up, the weights rotated among enough copies to
exceed the L2 cache):

- ``dense``: ``F.linear`` on the uncompressed weight (what an uncompressed decode step runs);
- ``fused``: ``kernels.qlinear_gpu`` on the packed codes with its default tiling (what a
  compressed one runs now), and ``fused[BN:BK:SPLIT:WARPS:STAGES]`` with each of ``--tiles``
  (split-K among them), to choose the default from;
- ``expand+gemm``: ``QWeight.dense`` (the whole weight expanded) then ``F.linear``, the path
  before the fused kernel; the engine shares one expansion among a block's GPU batches, so
  ``--gpu-batches`` divides the expansion's time.

Also reports the relative error of the fused output against the expanded weight's product and
each path's effective bandwidth (weight bytes it must read over its time). Reports, never asserts.
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


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each distinct linear product of one decoder layer of a registry shape."""
    from ..models.registry import get_spec

    s = get_spec(model)
    h, f = s.hidden_size, s.ffn_size
    return {"qkvo": (h, h), "fc1": (f, h), "fc2": (h, f)}


def time_calls(fn: Callable[[int], Any], n_sets: int, reps: int, dev: torch.device) -> float:
    """Median milliseconds of ``fn(i)`` over ``reps`` calls, i cycling over the weight sets
    (CUDA events on a GPU; the host clock for ``--device cpu``, a smoke run in Triton's
    interpreter)."""
    for i in range(3):
        fn(i % n_sets)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for r in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(r % n_sets)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn(r % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def one(out_f: int, in_f: int, rows: int, dtype: torch.dtype, group: int, reps: int, gpu_batches: int,
        l2_bytes: int, dev: torch.device, tiles: list[str] = ()) -> dict[str, Any]:
    from ..kernels import qlinear_gpu
    from ..kernels.qweight import QWeight
    from ..memory.quant import quantize

    w = (torch.randn(out_f, in_f, device=dev) * 0.02).to(dtype)
    q = quantize(w, 4, group, dim=1)
    n_sets = max(2, -(-4 * l2_bytes // w.nbytes))  # enough copies that every call reads from memory
    dense = [w.clone() for _ in range(n_sets)]
    packed = [(q.data.clone(), q.mins.clone(), q.scales.clone()) for _ in range(n_sets)]
    x = torch.randn(rows, in_f, device=dev).to(dtype)

    def fused(i: int, t: qlinear_gpu.Tiles | None = None) -> torch.Tensor:
        c, m, s = packed[i]
        return qlinear_gpu.qlinear(x, c, m, s, out_f, group, 4, tiles=t)

    def expand(i: int) -> torch.Tensor:
        c, m, s = packed[i]
        return QWeight(c, m, s, (out_f, in_f), group, 4, dtype).dense()

    paths: dict[str, Callable[[int], Any]] = {"dense": lambda i: F.linear(x, dense[i]), "fused": fused,
                                              "expand": expand}
    for text in tiles:
        t = qlinear_gpu.Tiles.parse(text)
        paths[f"fused[{text}]"] = lambda i, t=t: fused(i, t)
    res: dict[str, Any] = {"out": out_f, "in": in_f, "rows": rows, "dtype": str(dtype).split(".")[-1]}
    if fused(0) is None:
        res["fused"] = None
        res["error"] = "the fused kernel did not take this product (Triton missing?)"
        return res
    ms = {k: time_calls(f, n_sets, reps, dev) for k, f in paths.items()}
    ms["expand+gemm"] = ms["expand"] / gpu_batches + ms["dense"]
    ref = F.linear(x.float(), expand(0).float())
    y = fused(0).float()
    res["fused_rel_err"] = float((y - ref).norm() / ref.norm())
    for text in tiles:
        yt = fused(0, qlinear_gpu.Tiles.parse(text)).float()
        res.setdefault("tiles_rel_err", {})[text] = float((yt - ref).norm() / ref.norm())
    best = min((k for k in ms if k.startswith("fused")), key=ms.get)
    res["best_fused"] = best
    res["ms"] = {k: round(v, 4) for k, v in ms.items()}
    wbytes = {"dense": w.nbytes, "fused": q.nbytes}
    res["GB/s"] = {k: round(wbytes[k] / (ms[k] * 1e-3) / 1e9, 1) for k in wbytes}
    res["fused_over_dense"] = round(ms["dense"] / ms["fused"], 3)
    res["fused_over_expand+gemm"] = round(ms["expand+gemm"] / ms["fused"], 3)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["opt-6.7b", "opt-30b"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--group", type=int, default=64, help="quantization group (the engine's default: 64)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--gpu-batches", type=int, default=4, help="GPU batches sharing one expansion")
    ap.add_argument("--tiles", nargs="*", default=["64:128:1", "64:256:1:4:4", "64:128:4", "64:256:4:4:4",
                                                   "128:128:2:8:3", "32:256:8:4:4", "128:256:4:8:4"],
                    help="other tilings of the fused kernel to time, BN:BK:SPLIT[:WARPS[:STAGES]] (none: --tiles)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the logic (TRITON_INTERPRET=1)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("qlinear_paths times CUDA kernels: run it on a machine with a GPU")
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20) if dev.type == "cuda" else 2**20
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for name, (o, i) in layer_shapes(model).items():
            for dt in args.dtypes:
                for m in args.rows:
                    r = one(o, i, m, getattr(torch, dt), args.group, args.reps, args.gpu_batches, l2, dev,
                            args.tiles)
                    r.update(model=model, layer=name)
                    rows.append(r)
                    t = r.get("ms", {})
                    print(f"{model:9s} {name:5s} {o:6d}x{i:<6d} {dt:8s} rows {m:3d}  dense {t.get('dense')} ms  "
                          f"fused {t.get('fused')} ms  expand+gemm {t.get('expand+gemm')} ms  "
                          f"x{r.get('fused_over_dense')} of dense  err {r.get('fused_rel_err', 0):.1e}  "
                          f"best {r.get('best_fused')} {t.get(r.get('best_fused'))} ms", flush=True)
    result = {"benchmark": "qlinear_paths", "machine": machine(), "group": args.group,
              "gpu_batches": args.gpu_batches, "results": rows}
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
