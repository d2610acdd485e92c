"""Figures of the benchmarks' JSON (matplotlib, the ``bench`` extra; imported only to plot).

    python -m flexgen_dist.bench.plots bench_results/scaling.json bench_results/scaling.png
    python -m flexgen_dist.bench.plots bench_results/offload.json bench_results/offload.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PHASES = (("prefill_throughput", "prefill", "tab:blue"), ("decode_throughput", "decode", "tab:orange"),
          ("total_throughput", "total", "tab:green"))


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install -e \".[bench]\" (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_scaling(res: dict[str, Any], path: str | Path) -> Path:
    """Two panels: throughput against nodes (measured points, the medians under --repeat with
    each repeat faint beside them, predicted dashed, linear from one node dotted), and each
    stage's wall time split into compute / I/O wait / comm wait / other."""
    plt = _pyplot()
    runs = {int(m): r for m, r in res["runs"].items() if "metrics" in r}
    if not runs:
        raise ValueError("no measured runs to plot (a --dry-run result?)")
    ms = sorted(runs)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    for key, label, color in PHASES:
        meas = [runs[m]["metrics"][key] for m in ms]
        many = any(len(runs[m].get("repeats", [])) > 1 for m in ms)
        ax.plot(ms, meas, "o-", color=color, label=f"{label} measured" + (" (median)" if many else ""))
        for m in ms:  # every repeat, faint, beside its median
            for rep in runs[m].get("repeats", []):
                ax.plot([m], [rep["metrics"][key]], ".", color=color, alpha=0.35)
        pred = [runs[m].get("predicted", {}).get(key) for m in ms]
        if all(p is not None for p in pred):
            ax.plot(ms, pred, "--", color=color, alpha=0.8, label=f"{label} predicted")
        if ms[0] == 1:
            ax.plot(ms, [meas[0] * m for m in ms], ":", color=color, alpha=0.5, label=f"{label} x nodes")
    ax.set_xlabel("nodes (pipeline stages)")
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    ax.set_xticks(ms)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    mode = res.get("mode", "nodes")
    if res.get("disk_gbps"):
        mode += f", a {res['disk_gbps']:g} GB/s disk per node"
    ax.set_title(f"{res['model']}: throughput against nodes ({mode})", fontsize=10)
    labels, parts = [], {"compute": [], "I/O wait": [], "comm wait": [], "other": []}
    for m in ms:
        for st in runs[m]["metrics"]["stage_times"]:
            for label, times in _phase_bars(st):
                labels.append(f"{m}n s{st['stage']}{label}")
                for name, v in zip(parts, times):
                    parts[name].append(v)
    bottom = [0.0] * len(labels)
    for (name, vals), color in zip(parts.items(), ("tab:green", "tab:red", "tab:purple", "tab:gray")):
        bx.bar(labels, vals, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    bx.set_ylabel("seconds")
    bx.set_title("per stage (P prefill, D decode): where the wall time goes", fontsize=10)
    bx.legend(fontsize=8)
    bx.tick_params(axis="x", labelsize=8)
    return _save(plt, fig, path)


def _phase_bars(st: dict[str, Any]) -> list[tuple[str, list[float]]]:
    """A stage's wall time as (compute, I/O wait, comm wait, other): one bar per phase where
    the metrics split them (``prefill_compute_s``, ...), else one bar for the run."""
    def bar(wall: float, c: float, io: float, cw: float) -> list[float]:
        return [c, io, cw, max(0.0, wall - c - io - cw)]

    keys = ("compute_s", "io_wait_s", "comm_wait_s")
    total = [st[k] for k in keys]
    if "prefill_compute_s" not in st:
        return [("", bar(st.get("prefill_s", 0.0) + st.get("decode_s", 0.0), *total))]
    pre = [st[f"prefill_{k}"] for k in keys]
    return [(" P", bar(st["prefill_s"], *pre)),
            (" D", bar(st["decode_s"], *[t - p for t, p in zip(total, pre)]))]


def plot_offload(res: dict[str, Any], path: str | Path) -> Path:
    """Two panels: tokens/s of each variant, and the bytes each read from the disk device."""
    plt = _pyplot()
    runs = res["runs"]
    names = list(runs)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    tps = [runs[n]["throughput"] for n in names]
    colors = ["tab:gray" if n.startswith("c_") else "tab:blue" for n in names]
    ax.bar(names, tps, color=colors)
    for x, v in enumerate(tps):
        ax.annotate(f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{res['model']} {res['workload']['dtype']}: throughput by variant", fontsize=10)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    gb = [(runs[n].get("device_bytes_read") or 0) / 1e9 for n in names]
    bx.bar(names, gb, color=colors)
    bx.set_ylabel("GB read from the disk device")
    bx.set_title("bytes read during generation", fontsize=10)
    bx.tick_params(axis="x", labelrotation=30, labelsize=8)
    return _save(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args and args[0] in ("-h", "--help") else 2
    res = json.loads(Path(args[0]).read_text())
    kind = res.get("benchmark")
    if kind == "scaling":
        out = plot_scaling(res, args[1])
    elif kind == "offload":
        out = plot_offload(res, args[1])
    else:
        print(f"error: {args[0]} is not a scaling or offload result (benchmark={kind!r})", file=sys.stderr)
        return 2
    print("->", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
