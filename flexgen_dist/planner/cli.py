"""``python -m flexgen_dist.planner {plan,profile}``: choose policies, or measure hardware.

``plan`` prints, for each stage count, every stage's policy and the predicted throughput, then
a summary with the decode scaling over one stage; ``--json`` writes the policies for the
runtime. ``profile`` measures this machine and writes the YAML the planner reads.
Errors are one line on stderr and a non-zero exit status.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flexgen_dist.models.registry import get_spec, registry_names
from flexgen_dist.engine.prefix_shape import PrefixShape
from flexgen_dist.engine.held import holds_prefix
from flexgen_dist.planner.cost_model import WorkShape
from flexgen_dist.planner.hardware import DEVICES, HardwareSpec, hardware_for_stages, load_hardware_stages
from flexgen_dist.config import ConfigError
from flexgen_dist.flags import ArgParser
from flexgen_dist.planner.profile_cache import default_cache_path, load_or_profile, write_cached
from flexgen_dist.planner.profiler import profile_hardware
from flexgen_dist.planner.pipeline import PipelinePlan, plan_pipeline
from flexgen_dist.planner.search import PlanError


def _parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog="python -m flexgen_dist.planner",
                                 description="Plan offloading policies per pipeline stage, or "
                                             "profile this machine.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="predict policies and throughput for 1..m stages")
    p.add_argument("--model", required=True, help=f"registry shape: {', '.join(registry_names())}")
    p.add_argument("--hardware", default="auto",
                   help="hardware YAML (configs/hardware/t4.yaml), or 'auto': this machine's "
                        "cached profile (measured on first use)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--shared-prefix", type=int, default=0, metavar="L", help="leading tokens every prompt "
                   "shares (a system prompt, few-shot examples): each block computes them once, and rows' caches "
                   "leave them out where the model holds them once through decode")
    p.add_argument("--stages", type=int, nargs="+", default=[1])
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batch groups in flight (default: the number of stages)")
    p.add_argument("--partition", choices=("equal", "balanced"), default="equal")
    p.add_argument("--compress", action="store_true", help="4-bit weights and KV cache")
    p.add_argument("--gpu-mem", help="override the hardware's gpu budget, e.g. 12GiB")
    p.add_argument("--cpu-mem", help="override the cpu budget")
    p.add_argument("--disk-mem", help="override the disk budget")
    p.add_argument("--dtype-bytes", type=int, choices=(2, 4), default=None,
                   help="bytes per element (default: 2 on cuda, 4 on a CPU device)")
    p.add_argument("--max-gpu-batch-size", type=int, default=64)
    p.add_argument("--max-num-gpu-batches", type=int, default=16)
    p.add_argument("--json", help="write the chosen policies and predictions to this file")
    q = sub.add_parser("profile", help="measure this machine and write its hardware YAML")
    q.add_argument("--device", choices=DEVICES, default="cpu")
    q.add_argument("--out", help="YAML to write (default: this host's cached profile, which runs reuse: "
                   f"{default_cache_path('<device>', 0).with_name('<host>-<device>-t<threads>.yaml')})")
    q.add_argument("--threads", type=int, default=None,
                   help="compute threads to measure with (default: what a run here chooses, threads.py)")
    q.add_argument("--offload-dir", default="/tmp", help="where the disk is measured")
    q.add_argument("--quick", action="store_true", help="smaller sizes, ~10 s (less accurate)")
    q.add_argument("--net-bw", type=float, help="bytes/s to the next stage (default: loopback)")
    q.add_argument("--net-latency", type=float, help="seconds one way (default: loopback)")
    return ap


def _fmt_layers(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)


def format_plan(plan: PipelinePlan, base_decode: float | None) -> str:
    """The per-stage table of one plan, then the pipeline's predicted figures."""
    p = plan.predicted
    lines = [f"== {plan.num_stages} stage(s), {plan.num_micro_batches} micro-batch group(s), "
             f"block size {p['block_size']} ==",
             f"{'stage':>5} {'layers':>7} {'gbs':>4} {'num_gb':>6} {'WG':>4} {'WC':>4} {'CG':>4} "
             f"{'CC':>4} {'HG':>4} {'HC':>4} {'SG':>4} {'SC':>4} {'cpu_att':>7} {'prefill_s':>10} "
             f"{'decode_step_s':>13}"]
    for i, (st, times) in enumerate(zip(plan.stages, p["stage_times"])):
        pol = st.policy
        pct = " ".join(f"{v:4.0f}" for v in (*pol.percent(), pol.state_gpu_percent, pol.state_cpu_percent))
        lines.append(f"{i:>5} {_fmt_layers(st.layers):>7} {pol.gpu_batch_size:>4} "
                     f"{pol.num_gpu_batches:>6} {pct} {'yes' if pol.cpu_attention else 'no':>7} "
                     f"{times['prefill_s']:>10.2f} {times['decode_step_s']:>13.3f}")
    scale = f"{p['decode_throughput'] / base_decode:.2f}x" if base_decode else "n/a"
    lines.append(f"predicted: prefill {p['prefill_throughput']:.1f} tok/s, decode "
                 f"{p['decode_throughput']:.2f} tok/s, total {p['total_throughput']:.2f} tok/s; "
                 f"decode scaling vs 1 stage: {scale}")
    return "\n".join(lines)


def _summary(rows: list[tuple[int, PipelinePlan]], base_decode: float | None) -> str:
    out = [f"{'stages':>6} {'block':>5} {'prefill tok/s':>13} {'decode tok/s':>12} "
           f"{'total tok/s':>11} {'decode scaling':>14}"]
    for m, plan in rows:
        p = plan.predicted
        scale = f"{p['decode_throughput'] / base_decode:.2f}x" if base_decode else "n/a"
        out.append(f"{m:>6} {p['block_size']:>5} {p['prefill_throughput']:>13.1f} "
                   f"{p['decode_throughput']:>12.2f} {p['total_throughput']:>11.2f} {scale:>14}")
    return "\n".join(out)


def _hardware(args: argparse.Namespace) -> list[HardwareSpec]:
    """The machines of the stages: one for all, or one per stage (a ``stages:`` YAML)."""
    if args.hardware == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        hws = [load_or_profile(None, device)]
    else:
        hws = load_hardware_stages(args.hardware)
    return [hw.with_budgets(args.gpu_mem, args.cpu_mem, args.disk_mem) for hw in hws]


def cmd_plan(args: argparse.Namespace) -> int:
    spec = get_spec(args.model)
    hws = _hardware(args)
    hw = hws[0]
    dtype_bytes = args.dtype_bytes or (2 if hw.compute_device == "cuda" else 4)
    try:
        wl = WorkShape(args.prompt_len, args.gen_len, dtype_bytes,
                       prefix=PrefixShape.call_wide(args.shared_prefix,
                                                    holds_prefix(spec, 1.0, args.prompt_len + args.gen_len))
                       if args.shared_prefix else None)
    except ValueError as e:
        raise SystemExit(f"error: --shared-prefix {args.shared_prefix}: {e}") from None
    kw = dict(partition=args.partition, compress=args.compress,
              max_gpu_batch_size=args.max_gpu_batch_size,
              max_num_gpu_batches=args.max_num_gpu_batches)
    print(f"{spec.name} on {hw.name} ({hw.source}): prompt {wl.prompt_len}, gen {wl.gen_len}, "
          f"{dtype_bytes} bytes/element, budgets gpu {hw.gpu_mem / 2**30:.1f} GiB, cpu "
          f"{hw.cpu_mem / 2**30:.1f} GiB, disk {hw.disk_mem / 2**30:.1f} GiB")
    base_decode = None
    try:
        base = plan_pipeline(spec, 1, hw, wl, num_micro_batches=args.micro_batches, **kw)  # on stage 0's machine
        base_decode = base.predicted["decode_throughput"] or None
    except PlanError:
        base = None
    rows, failed, records = [], 0, []
    for m in args.stages:
        try:
            plan = base if m == 1 and base is not None and len(hws) == 1 else plan_pipeline(
                spec, m, hardware_for_stages(hws, m), wl, num_micro_batches=args.micro_batches, **kw)
        except (PlanError, ValueError) as e:
            print(f"error: {m} stage(s): {e}", file=sys.stderr)
            failed += 1
            continue
        print()
        print(format_plan(plan, base_decode))
        rows.append((m, plan))
        p = plan.predicted
        records.append({"stages": m, "stage_layers": plan.stage_layers,
                        "num_micro_batches": plan.num_micro_batches,
                        "policies": [pol.to_dict() for pol in plan.policies],
                        "predicted": {k: p[k] for k in ("prefill_throughput", "decode_throughput",
                                                        "total_throughput", "prefill_time_s",
                                                        "decode_time_s")}})
    if rows:
        print()
        print(_summary(rows, base_decode))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")
    return 1 if failed else 0


def cmd_profile(args: argparse.Namespace) -> int:
    from flexgen_dist.threads import apply, choose_threads

    apply(choose_threads(args.threads))  # the threads a run on this host would compute with
    hw = profile_hardware(args.device, args.offload_dir, args.quick, net_bw=args.net_bw,
                          net_latency=args.net_latency)
    out = Path(args.out) if args.out else default_cache_path(args.device)
    write_cached(out, hw, args.device)  # with its version and identity: runs on this host reuse it
    print(out.read_text(), end="")
    print(f"# written to {out}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return cmd_plan(args) if args.cmd == "plan" else cmd_profile(args)
    except KeyError as e:  # unknown model name: its message is the first argument
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
    return 1
