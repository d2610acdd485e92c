"""The CPU decode-attention kernel of a git revision against the working tree's, in one process.

    python -m flexgen_dist.bench compare-attention --rev HEAD~1 --json bench_results/attention-compare.json

Where ``bench compare`` times a whole job, this times the native kernel alone (``fg_attention``,
what a decode step runs per layer and GPU batch where the CPU attends to the cache): side A is
built from REV's kernel sources (``git show``, the same compiler and flags as this build), side
B is this tree's build. For each shape (``--shape ROWS HEADS LEN DIM``: cache rows, i.e.
sequences x kv heads; query heads per kv head; key length; head dim) and dtype, both sides run on
the same inputs, alternately for ``--rounds`` rounds of ``--calls`` calls; the table gives each
side's least time per call and the ratio A/B (above 1: B faster), and whether the outputs are
bit for bit equal (a change meant to keep the numerics must keep ``equal``). The JSON has every
round. The kernels' C signature is this tree's: a revision whose ``fg_attention`` took other
arguments cannot be compared this way.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .. import kernels
from ..kernels import attend
from .compare import CompareError, machine, repo_root, resolve_rev, show_file, working_tree_state
from .single import write_json

PROG = "python -m flexgen_dist.bench compare-attention"
# rows = sequences x kv heads, at 512 + 32 positions: the bundled SmolLM2 (3 kv heads of 3
# query heads), Llama-3-8B (8 of 4) and Qwen2.5-7B (4 of 7) at 32 sequences, OPT-1.3B (32 heads
# of 64) at 16 and OPT-6.7B (32 of 128) at 14; and Llama-3.2-1B (8 of 4, dim 64) at 32
# sequences of 1024 + 32
SHAPES = [(96, 3, 544, 64), (256, 4, 544, 128), (128, 7, 544, 128), (512, 1, 544, 64), (448, 1, 544, 128),
          (256, 4, 1056, 64)]


def revision_sources(top: Path, commit: str, dest: Path) -> Path:
    """The kernel sources of ``commit`` written under ``dest``."""
    rel = Path(kernels.__file__).resolve().parent.relative_to(top)
    for f in kernels._SOURCES + kernels._HEADERS:
        text = show_file(top, commit, (rel / f.name).as_posix())
        if text is None and f.name in ("cpu_kernels.cpp", "cpu_simd.h"):  # later sources are optional
            raise CompareError(f"{commit[:12]} has no {rel / f.name}: pick a revision with the native kernels", 2)
        if text is not None:
            (dest / f.name).write_text(text)
    return dest


def inputs(shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q (rows, heads, 1, dim); k, v read in place from (rows, len + 32, dim) caches; a mask with
    a tenth of the positions hidden (each row sees its first)."""
    rows, heads, length, dim = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, dim, generator=g).to(dtype)
    k, v = (torch.randn(rows, length + 32, dim, generator=g).to(dtype)[:, :length] for _ in range(2))
    mask = torch.rand(rows, 1, 1, length, generator=g) > 0.1
    mask[..., 0] = True
    return q, k, v, mask


def measure(libs: dict[str, Any], shape: tuple[int, int, int, int], dtype: torch.dtype, rounds: int,
            calls: int) -> dict[str, Any]:
    q, k, v, mask = inputs(shape, dtype)
    scale = shape[3] ** -0.5
    outs = {side: attend.attention(q, k, v, mask, scale, lib=lib) for side, lib in libs.items()}
    if any(o is None for o in outs.values()):
        return {"skipped": "the kernel declines these inputs (head dim not a multiple of the vector width?)"}
    times: dict[str, list[float]] = {side: [] for side in libs}
    for _ in range(rounds):
        for side, lib in libs.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                attend.attention(q, k, v, mask, scale, lib=lib)
            times[side].append((time.perf_counter() - t0) / calls * 1e3)
    a, b = outs["A"], outs["B"]
    best = {side: min(ts) for side, ts in times.items()}
    return {"ms": times, "best_ms": best, "ratio": best["A"] / best["B"], "equal": bool(torch.equal(a, b)),
            "max_diff": float((a.float() - b.float()).abs().max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="the git revision of side A (side B: the working tree)")
    ap.add_argument("--shape", type=int, nargs=4, action="append", metavar=("ROWS", "HEADS", "LEN", "DIM"),
                    help=f"default: {' '.join(','.join(map(str, s)) for s in SHAPES)}")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"],
                    choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--json", default="bench_results/attention-compare.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        print(f"{PROG}: error: --rounds and --calls must be at least 1", file=sys.stderr)
        return 2
    if kernels.library() is None:
        print(f"{PROG}: error: this tree's native kernels are unavailable (see the warning above; "
              "FLEXGEN_CPU_KERNELS=0 turns them off)", file=sys.stderr)
        return 1
    try:
        top = repo_root()
        commit = resolve_rev(top, args.rev)
        with tempfile.TemporaryDirectory(prefix="attention-compare-") as tmp:
            src = revision_sources(top, commit, Path(tmp))
            try:
                old = kernels.build_from(src, Path(tmp) / "rev.so")
            except (RuntimeError, OSError) as e:
                raise CompareError(f"building {commit[:12]}'s kernels failed: {e}", 1) from e
            head, dirty = working_tree_state(top)
            libs = {"A": old, "B": kernels.library()}
            shapes = [tuple(s) for s in args.shape] if args.shape else SHAPES
            results: list[dict[str, Any]] = []
            print(f"{'rows x heads x len x dim':>26} {'dtype':9} {'A ms':>8} {'B ms':>8} {'A/B':>6}  equal")
            for shape in shapes:
                for dt in args.dtypes:
                    r = measure(libs, shape, getattr(torch, dt), args.rounds, args.calls)  # type: ignore[arg-type]
                    results.append({"shape": list(shape), "dtype": dt, **r})
                    name = " x ".join(map(str, shape))
                    if "skipped" in r:
                        print(f"{name:>26} {dt:9} skipped: {r['skipped']}", flush=True)
                    else:
                        print(f"{name:>26} {dt:9} {r['best_ms']['A']:8.3f} {r['best_ms']['B']:8.3f} "
                              f"{r['ratio']:5.2f}x  {'yes' if r['equal'] else 'NO (max diff %.1e)' % r['max_diff']}",
                              flush=True)
                    write_json(args.json, {"benchmark": "attention_compare", "machine": machine(),
                                           "threads": torch.get_num_threads(), "rev": commit,
                                           "working_tree": {"head": head, "dirty": dirty},
                                           "rounds": args.rounds, "calls": args.calls, "results": results})
    except CompareError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code
    print(f"A: {commit[:12]}, B: the working tree; least of {args.rounds} rounds of {args.calls} calls; "
          f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
