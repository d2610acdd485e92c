"""A decode step's attention: what each SDPA backend costs the host and the device.

    python -m flexgen_dist.bench.decode_attention --json bench_results/gpu/decode-attention.json

A merged decode step calls attention once per layer over every GPU batch's rows (one query
position per head, ``engine.attention._sdpa_decode``), and the cache grows by one position per
step, so every step has a new key length. On an H100 the step was host-bound with cuDNN's
attention (SDPA's first choice on that GPU) at ~1 ms of host time per call. For each backend
this engine may use (``cudnn``, ``efficient``, ``math``, and the engine's own choice,
``engine``), on rows x query heads x positions x head dim of ``--shape``, it reports:

- ``issue_ms``: host time to issue a call, from ``--calls`` calls of one key length issued back
  to back without waiting (on a CPU the call itself);
- ``device_ms``: device time per call (CUDA events around the same calls; on a CPU, wall time);
- ``new_length_ms``: wall time per call where each call has a key length one longer than the
  last, as a decode step's has (a backend that prepares a plan per shape pays it here);
- ``max_err``: the largest difference from the float32 softmax of the same values.

Backends a device lacks are reported as skipped with the reason. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .single import machine, write_json

BACKENDS = ("cudnn", "efficient", "math", "engine")


def _inputs(rows: int, heads: int, length: int, dim: int, cap: int, dtype: torch.dtype, dev: torch.device,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q (rows, heads, 1, dim) and a cache buffer (rows, cap, dim) read to ``length``, as the
    engine lays them out (``attend_rows``'s rows, one kv head each), and a boolean mask."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, dim, generator=g).to(dev, dtype)
    k = torch.randn(rows, cap, dim, generator=g).to(dev, dtype)
    v = torch.randn(rows, cap, dim, generator=g).to(dev, dtype)
    mask = torch.ones(rows, 1, 1, cap, dtype=torch.bool, device=dev)
    return q, k, v, mask


def _call(backend: str) -> Callable[..., torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..engine.attention import attend_rows

    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "math": SDPBackend.MATH}

    def engine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        return attend_rows(q, k[:, :n], v[:, :n], mask[..., :n], scale=q.shape[-1] ** -0.5)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        r, g, _, d = q.shape
        with sdpa_kernel(which[backend]):
            o = F.scaled_dot_product_attention(q.view(r, 1, g, d), k[:, :n].unsqueeze(1), v[:, :n].unsqueeze(1),
                                               attn_mask=mask[..., :n], scale=d ** -0.5)
        return o.view(r, g, 1, d)

    return engine if backend == "engine" else sdpa


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(backend: str, shape: tuple[int, int, int, int], dtype: torch.dtype, dev: torch.device,
            calls: int) -> dict[str, Any]:
    rows, heads, length, dim = shape
    q, k, v, mask = _inputs(rows, heads, length, dim, length + calls + 1, dtype, dev)
    fn = _call(backend)
    try:
        out = fn(q, k, v, mask, length)
    except RuntimeError as e:  # no kernel of this backend takes these inputs on this device
        return {"skipped": str(e).splitlines()[0][:200]}
    s = torch.einsum("rgd,rld->rgl", q[:, :, 0].float(), k[:, :length].float()) * dim ** -0.5
    ref = torch.einsum("rgl,rld->rgd", s.softmax(-1), v[:, :length].float())
    err = float((out[:, :, 0].float() - ref).abs().max())
    for _ in range(3):  # warm-up: compiled plans and caches of this length
        fn(q, k, v, mask, length)
    _sync(dev)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(calls):
        fn(q, k, v, mask, length)
    issue = (time.perf_counter() - t0) / calls
    if dev.type == "cuda":
        end.record()
        torch.cuda.synchronize(dev)
        device = start.elapsed_time(end) / 1e3 / calls
    else:
        device = issue
    _sync(dev)
    t0 = time.perf_counter()
    for i in range(calls):  # a new key length each call, as decode steps have
        fn(q, k, v, mask, length + 1 + i)
    _sync(dev)
    grow = (time.perf_counter() - t0) / calls
    return {"issue_ms": issue * 1e3, "device_ms": device * 1e3, "new_length_ms": grow * 1e3, "max_err": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, action="append", metavar=("ROWS", "HEADS", "LEN", "DIM"),
                    help="rows (sequences x kv heads), query heads per kv head, key length, head dim "
                         "(default: OPT-6.7B's decode at 128 sequences and 544 positions, and Llama-3-8B's "
                         "at 64 sequences and 1024)")
    ap.add_argument("--dtypes", nargs="+", default=None, help="default: float16 and bfloat16 on a GPU, "
                    "float32 on a CPU")
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="bench_results/decode-attention.json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    shapes = [tuple(s) for s in args.shape] if args.shape else [(128 * 32, 1, 544, 128), (64 * 8, 4, 1024, 128)]
    dtypes = args.dtypes or (["float16", "bfloat16"] if dev.type == "cuda" else ["float32"])
    results = []
    for shape in shapes:
        for dt in dtypes:
            for backend in BACKENDS:
                r = measure(backend, shape, getattr(torch, dt), dev, args.calls)  # type: ignore[arg-type]
                results.append({"shape": list(shape), "dtype": dt, "backend": backend, **r})
                figs = "skipped: " + r["skipped"] if "skipped" in r else ", ".join(
                    f"{k} {v:.3f}" if k.endswith("_ms") else f"{k} {v:.1e}" for k, v in r.items())
                print(f"{shape} {dt:9s} {backend:9s} {figs}", flush=True)
                # after every line: a run stopped by a time limit keeps what it measured
                write_json(args.json, {"benchmark": "decode_attention", "machine": machine(), "device": str(dev),
                                       "calls": args.calls, "results": results,
                                       "complete": len(results) == len(shapes) * len(dtypes) * len(BACKENDS)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
