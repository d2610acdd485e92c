"""Pipeline scaling benchmark: the real CLI on 1, 2, ... nodes under a fixed per-node RAM budget.

    python -m bench.scaling --plot bench_results/scaling.png
    python -m bench.scaling --netns --link-gbit 10       # shaped links between nodes
    python -m bench.scaling --disk-gbps 0.2              # a 0.2 GB/s disk per node
    python -m bench.scaling --physical-memory            # a VM's memory as a machine's
    python -m bench.scaling --shared-cores               # the old mode (see below)
    python -m bench.scaling --dry-run                    # print the commands, run nothing

Run from the repository root: ``bench`` is not part of the installed package. Every run is
the CLI (``python -m flexgen_dist.run`` under torchrun) in a process of its own.

The claim under test: each stage holds 1/m of the weights, so under the same
per-node RAM budget it offloads less to disk, and decode throughput can grow faster than m.

Nodes (default): every rank is a node of its own. It gets ``--cores-per-node`` CPUs of its
own (``sched_setaffinity``, and as many compute threads), its own offload directory and the
same RAM budget for weights, and it is launched as a node is: ``torchrun --nnodes m
--node-rank r --nproc-per-node 1`` with a static rendezvous. With ``--netns`` each node also
lives in its own network namespace, joined to the others through a bridge by a veth pair
whose egress is shaped to ``--link-gbit`` (``tc tbf``), so hidden states cross a real link.
Node counts default to 1, 2, 4, ... up to what the cores allow.

Disks: by default the nodes share the machine's one disk (reads of all nodes queue on it),
whose rate on a VM also moves between runs (by 2.5x on ours): a 2-node run then gets another
disk than a 1-node run, while real nodes each have one of their own. ``--disk-gbps R`` gives
every node its own disk of a fixed rate: each node's processes (the node, its disk probe,
and for node 0 the profile) run in a block-I/O cgroup of their own whose reads and writes on
the device holding ``--workdir`` are limited to R GB/s (root; cgroup v1 blkio or v2 io). Pick
R at most the disk's slowest rate divided by the largest node count, so that every node
gets R whatever the others do; the probes still measure what each node got.

Budget: every node may keep ``--weight-budget`` bytes of weights in RAM (default 512 MiB);
the rest of its stage's weights go to disk. With W_s the weight bytes stage s owns (its
layers, plus the embedding on stage 0 and the final norm + LM head on the last stage), the
stage's policy keeps ``w_cpu = min(100, 100 * B / W_s)`` percent in RAM and the rest on disk;
KV cache and activations stay on the compute tier. For opt-350m fp32 (W = 1.3 GB): one
stage keeps ~40 % of its weights in RAM, each of two stages ~75-90 %.

Predictions: node 0's cores are profiled once (``planner profile``, pinned like a node; the
link rate replaces the measured loopback under ``--netns``). Right before the run of m nodes,
m probes (one per node, on its cores) measure the disk at once, and that run's ``--hardware``
is the profile with the disk rates a node got while sharing it (and the compute the
transfers cost, ``disk_cpu``): the nodes here share one disk, whose rate also moves between
runs on a VM. The run's cost model predicts its prefill/decode/total beside the measurement
and picks G, the prefill items and the schedule (``--num-micro-batches``, ``--prefill-items``
and ``--schedule`` override).

Warm-up (default; ``--no-warmup`` leaves it out): each run places its weights and runs one
untimed pass before its clock starts (the CLI's ``--warmup``), as this project's other
benchmarks and FlexGen's do. The benchmark drops the page cache before every run, so a cold
start pages the libraries' code back in from the node's throttled disk, behind its weight
reads, at the first call of each kernel; in a pipeline every stage's cold start then lies on
the critical path, one after another.

Memory (``--physical-memory``, root): on a VM that hands freed guest memory back to its host
(free page reporting), a node that touches memory the host took back waits while the host
backs it again, 5-6 times what a fresh page costs a physical machine here, and a pipeline stage
writes most of its KV cache into such memory, where one node reuses what its loader freed.
The flag turns reporting off and backs the free memory once before the runs (restored after;
``nodes.NodeMemory``), so the nodes' memory behaves as separate machines' would. The JSON
records what was done under ``physical_memory``.

Defaults (``--defaults``): every run as a user runs it, with nothing hand-made and nothing that
needs root: no ``--hardware`` file (each node plans with this host's own cached profile,
which ``planner profile`` measures once, pinned like a node, into ``<workdir>/hardware-cache``
as a first ``--policy auto`` run would), no ``--prefill-items`` or ``--schedule`` (the runs'
cost models choose), the page cache left alone, and the VM's memory as it is. The RAM budget
per node stays what the user gives (``--weight-budget``). Where a host setting still matters
(a disk per node: ``--disk-gbps``; the VM's memory: ``--physical-memory``), run both and say so.

Shared cores (``--shared-cores``): all ranks on the machine's cores with cores/m threads
each (``torchrun --standalone``). Compute does not grow with m there; only the bytes read
from disk shrink, so its figures say nothing about separate machines.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.nodes import DiskLimit, Network, NodeMemory, disk_share, node_cpus, preexec, profile_node
from flexgen_dist.bench.single import machine


def stage_weight_bytes(model: str, num_stages: int, dtype_bytes: int = 4) -> list[int]:
    """Weight bytes each stage holds (the engine's slots: embed, layers, head)."""
    import math

    import torch

    from flexgen_dist.distributed.partition import partition_layers
    from flexgen_dist.models.loader import DummySource
    from flexgen_dist.models.registry import get_spec

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


def default_nodes(cores: int, cores_per_node: int) -> list[int]:
    out, m = [], 1
    while m * cores_per_node <= cores:
        out.append(m)
        m *= 2
    return out


def run_args(args: argparse.Namespace, policy_file: Path, metrics: Path, offload: Path, output: Path,
             hardware: Path | None) -> list[str]:
    """The flexgen_dist.run arguments of one run (every node gets the same, but its offload dir)."""
    out = ["--model", args.model, "--dummy-weights", "--num-prompts", str(args.num_prompts),
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--ignore-eos",
           "--device", "cpu", "--dtype", "float32", "--policy", str(policy_file), "--offload-dir", str(offload),
           "--metrics", str(metrics), "--output", str(output), "--overwrite", "--print-outputs", "0",
           "--no-progress"]
    if not args.defaults:
        out += ["--prefill-items", args.prefill_items, "--schedule", args.schedule]
    if hardware is not None and not args.defaults:
        out += ["--hardware", str(hardware)]
    if args.num_micro_batches:
        out += ["--num-micro-batches", str(args.num_micro_batches)]
    if args.warmup:
        out.append("--warmup")
    return out


def shared_command(m: int, run: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(m),
            "-m", "flexgen_dist.run", *run]


def node_command(m: int, rank: int, master: str, port: int, run: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(m), "--node-rank", str(rank),
            "--nproc-per-node", "1", "--master-addr", master, "--master-port", str(port),
            "-m", "flexgen_dist.run", *run]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from flexgen_dist.memory.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="opt-350m", help="registry shape (dummy weights)")
    ap.add_argument("--nodes", "--stages", dest="stages", type=int, nargs="+", default=None,
                    help="node counts (pipeline sizes) to run (default: 1, 2, 4, ... as the cores allow)")
    ap.add_argument("--cores-per-node", type=int, default=1, help="CPUs (and compute threads) of each node")
    ap.add_argument("--defaults", action="store_true",
                    help="run as a user would: no --hardware file (this host's self-measured profile), no "
                         "--prefill-items/--schedule, no root (see the module doc)")
    ap.add_argument("--shared-cores", action="store_true",
                    help="all ranks on all cores, cores/m threads each (the old mode; no node isolation)")
    ap.add_argument("--netns", action="store_true",
                    help="each node in its own network namespace, joined by shaped veth links (root)")
    ap.add_argument("--link-gbit", type=float, default=10.0, help="link rate under --netns (Gbit/s)")
    ap.add_argument("--disk-gbps", type=float, default=None,
                    help="each node its own disk: its processes' reads and writes on the workdir's device "
                         "limited to this many GB/s (1e9 B/s) in a cgroup per node (root; default: unthrottled)")
    ap.add_argument("--weight-budget", default="512MiB", type=parse_size,
                    help="RAM each node may hold for weights; the rest of its stage goes to disk")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-batch-size", type=int, default=2,
                    help="small GPU batches make fine prefill items (the pipeline's fill is one of them)")
    ap.add_argument("--num-gpu-batches", type=int, default=8)
    ap.add_argument("--num-micro-batches", type=int, default=None, help="default: the run's choice")
    ap.add_argument("--prefill-items", choices=("auto", "block", "batch"), default="auto")
    ap.add_argument("--schedule", choices=("auto", "sequential", "overlapped"), default="auto",
                    help="the runs' block schedule (auto: each run's cost model chooses)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="each run places its weights and runs one untimed pass before its clock starts "
                         "(the CLI's --warmup), as the other benchmarks do; --no-warmup times the cold start")
    ap.add_argument("--hardware", default=None,
                    help="a node's hardware profile YAML (default: profile node 0 once, in the workdir)")
    ap.add_argument("--no-predict", action="store_true", help="no profile, no predictions")
    ap.add_argument("--physical-memory", action="store_true",
                    help="turn a VM's free page reporting off and back its free memory for the runs "
                         "(root; restored after), so fresh pages cost what they cost a physical machine")
    ap.add_argument("--quick-profile", action="store_true", help="a ~10 s profile (less accurate; the disk probes stay full under --disk-gbps)")
    ap.add_argument("--workdir", default=None, help="policy files, metrics and offload files go here")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over the node counts; each throughput is the median of its rounds")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and policies, run nothing")
    ap.add_argument("--json", default=None,
                    help="result file (default bench_results/scaling.json; a --dry-run writes one only when named)")
    ap.add_argument("--plot", default=None, help="write the figure here (PNG; needs the bench extra)")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    if args.cores_per_node < 1:
        ap.error("--cores-per-node must be >= 1")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.stages is None:
        args.stages = default_nodes(cores, args.cores_per_node) if not args.shared_cores else [1, 2]
    if any(m < 1 for m in args.stages):
        ap.error("--nodes: every node count must be >= 1")
    if not args.shared_cores and max(args.stages) * args.cores_per_node > cores:
        ap.error(f"--nodes {max(args.stages)} x --cores-per-node {args.cores_per_node} needs more than the "
                 f"{cores} CPUs here: fewer nodes, fewer cores per node, or --shared-cores")
    if args.netns and args.shared_cores:
        ap.error("--netns isolates nodes: not with --shared-cores")
    if args.disk_gbps is not None and args.shared_cores:
        ap.error("--disk-gbps gives each node its own disk: not with --shared-cores")
    if args.disk_gbps is not None and not args.disk_gbps > 0:
        ap.error(f"--disk-gbps must be > 0 GB/s, got {args.disk_gbps}")
    if args.netns and not args.dry_run and os.geteuid() != 0:
        ap.error("--netns needs root (network namespaces)")
    if args.defaults and (args.hardware or args.no_predict or args.prefill_items != "auto"
                          or args.schedule != "auto"):
        ap.error("--defaults runs as a user would: not with --hardware, --no-predict, --prefill-items or --schedule")
    if args.physical_memory and not args.dry_run and os.geteuid() != 0:
        ap.error("--physical-memory needs root (it sets /sys/module/page_reporting); run without it")
    return args


def launch(args: argparse.Namespace, m: int, run: list[str], logs: Path, net: Network | None,
           disk: DiskLimit | None = None) -> list[int]:
    """Start the m nodes of one run (each in its disk cgroup under --disk-gbps); wait for all;
    return their exit codes (killing the rest when one fails)."""
    from flexgen_dist.distributed.topology import free_port

    port = free_port(pair=True)  # the failure monitor listens on port + 1
    procs = []
    try:
        for r in range(m):
            if args.shared_cores:
                if r:
                    break
                cmd, env = shared_command(m, run), {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // m))}
                cpus = sorted(os.sched_getaffinity(0))
            else:
                cmd = node_command(m, r, net.master if net else "127.0.0.1", port, run)
                # a node's threads: its CPUs (the runtime counts its affinity), or as the launcher says
                env = {} if args.defaults else {"OMP_NUM_THREADS": str(args.cores_per_node)}
                if net is not None:
                    cmd, extra = net.wrap(r, cmd)
                    env.update(extra)
                cpus = node_cpus(r, args.cores_per_node)
            log = open(logs / f"m{m}-node{r}.log", "w")
            procs.append(subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                          preexec_fn=preexec(cpus, disk, r)))
            log.close()
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                grace = time.monotonic() + 30  # the others should exit by themselves, naming the failed node
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        return [p.poll() if p.poll() is not None else -9 for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def summarize(met: dict[str, Any]) -> dict[str, Any]:
    keep = ("prefill_throughput", "decode_throughput", "total_throughput", "prefill_time_s", "decode_time_s",
            "world_size", "num_micro_batches", "prefill_items", "schedule", "stage_times", "peak_bytes",
            "huge_pages")
    return {k: met.get(k) for k in keep}


def plan_runs(args: argparse.Namespace, work: Path, hardware: Path | None) -> dict[int, dict[str, Any]]:
    """Per node count: the stages' weight bytes, their policies, the CLI arguments and the
    command lines shown."""
    cores = len(os.sched_getaffinity(0))
    plans: dict[int, dict[str, Any]] = {}
    for m in args.stages:
        sb = stage_weight_bytes(args.model, m)
        pols = stage_policies(sb, args.weight_budget, args.gpu_batch_size, args.num_gpu_batches)
        pf = work / f"policy-{m}.yaml"
        pf.write_text(yaml.safe_dump({"stages": pols}, sort_keys=False))
        hw_m = work / f"node-{m}.yaml" if hardware is not None and not args.hardware else hardware
        run = run_args(args, pf, work / f"metrics-{m}.json", work / f"offload-{m}", work / f"out-{m}.jsonl", hw_m)
        if args.shared_cores:
            shown = f"OMP_NUM_THREADS={max(1, cores // m)} " + shlex.join(shared_command(m, run))
        else:
            omp = "" if args.defaults else f"OMP_NUM_THREADS={args.cores_per_node} "
            lines = [f"taskset -c {','.join(map(str, node_cpus(r, args.cores_per_node)))} "
                     f"{omp}" + shlex.join(node_command(m, r, "MASTER", 0, run)) for r in range(m)]
            if args.disk_gbps is not None:
                lines.insert(0, f"# each node in its own disk cgroup: {args.disk_gbps:g} GB/s read and write "
                                "on the workdir's device")
            shown = "\n".join(lines)
        plans[m] = {"stage_weight_bytes": sb, "policies": pols, "command": shown, "run": run}
    return plans


def measure_run(args: argparse.Namespace, m: int, plan: dict[str, Any], work: Path,
                tokens: dict[int, list], disk: DiskLimit | None = None) -> dict[str, Any]:
    """Run m nodes once (page cache dropped first): the metrics, the prediction, the device's
    bytes read (and each node's, counted by its disk cgroup under --disk-gbps) and whether the
    tokens equal the 1-node run's. The device's and the nodes' bytes cover the whole processes
    (start, loading, the warm-up, the run); each stage's ``disk_bytes_read`` in the metrics
    covers its timed run only."""
    from flexgen_dist.memory.disk import drop_page_cache
    from flexgen_dist.bench.offload import device_bytes_read

    rec: dict[str, Any] = {"page_cache_dropped": False if args.defaults else drop_page_cache()}
    nodes0 = [disk.bytes_read(r) for r in range(m)] if disk else None
    r0, t0 = device_bytes_read(work), time.perf_counter()
    net = Network(m, args.link_gbit) if args.netns else None
    with net or contextlib.nullcontext():
        rcs = launch(args, m, plan["run"], work, net, disk)
    rec["wall_s"] = time.perf_counter() - t0
    r1 = device_bytes_read(work)
    rec["device_bytes_read"] = None if r0 is None or r1 is None else r1 - r0
    if nodes0 is not None:
        rec["node_bytes_read"] = [disk.bytes_read(r) - b for r, b in enumerate(nodes0)]
    if any(rcs):
        logs = "\n".join((work / f"m{m}-node{r}.log").read_text()[-2000:] for r in range(len(rcs)))
        raise SystemExit(f"{m} node(s) failed (exit codes {rcs}):\n{logs}")
    met = json.loads((work / f"metrics-{m}.json").read_text())
    rec["metrics"] = summarize(met)
    rec["predicted"] = pred = {k: v for k, v in met.get("predicted", {}).items() if k != "peak_bytes"}
    out = [json.loads(line)["tokens"] for line in (work / f"out-{m}.jsonl").read_text().splitlines()]
    tokens.setdefault(m, out)
    rec["tokens_match_1_node"] = out == tokens[1] if 1 in tokens else None
    line = (f"{m} node(s): prefill {met['prefill_throughput']:.1f} | decode {met['decode_throughput']:.2f} | "
            f"total {met['total_throughput']:.2f} tok/s ({rec['wall_s']:.0f} s wall)")
    if "total_throughput" in pred:
        line += (f"; predicted {pred['prefill_throughput']:.1f} | {pred['decode_throughput']:.2f} | "
                 f"{pred['total_throughput']:.2f}")
    print(line, flush=True)
    return rec


_KEYS = ("prefill_throughput", "decode_throughput", "total_throughput")


def settle(run: dict[str, Any], reps: list[dict[str, Any]]) -> None:
    """One node count's record from its repeats: every repeat under ``repeats``; the rest
    from the repeat of median total throughput (its stage times, bytes, prediction), with
    each throughput the median over the repeats (one repeat: that run as it is)."""
    mid = sorted(reps, key=lambda r: r["metrics"]["total_throughput"])[len(reps) // 2]
    run.update({k: v for k, v in mid.items() if k != "metrics"})
    run["metrics"] = {**mid["metrics"], **{k: statistics.median(r["metrics"][k] for r in reps) for k in _KEYS}}
    run["tokens_match_1_node"] = None if mid["tokens_match_1_node"] is None else \
        all(r["tokens_match_1_node"] for r in reps)
    if len(reps) > 1:
        run["repeats"] = reps


def bench(args: argparse.Namespace, work: Path, disk: DiskLimit | None) -> dict[str, Any]:
    """Profile, plan and (unless --dry-run) measure every node count; the result JSON's content."""
    mode = "shared-cores" if args.shared_cores else ("nodes+netns" if args.netns else "nodes")
    if args.defaults:  # the runs find this host's profile where planner profile keeps it
        os.environ["FLEXGEN_HARDWARE_CACHE"] = str(work / "hardware-cache")
    hardware = None if args.dry_run else profile_node(args, work, disk)
    plans = plan_runs(args, work, hardware)
    res: dict[str, Any] = {
        "benchmark": "scaling", "mode": mode, "model": args.model, "dry_run": args.dry_run,
        "defaults": args.defaults,
        "cores": len(os.sched_getaffinity(0)), "machine": machine(),
        "cores_per_node": None if args.shared_cores else args.cores_per_node,
        "link_gbit": args.link_gbit if args.netns else None,
        "disk_gbps": args.disk_gbps, "disk_limit": None if disk is None else disk.describe(),
        "weight_budget_bytes_per_node": args.weight_budget,
        "hardware_profile": None if hardware is None else yaml.safe_load(Path(hardware).read_text()),
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                     "gpu_batch_size": args.gpu_batch_size, "num_gpu_batches": args.num_gpu_batches,
                     "dtype": "float32"},
        "warmup": args.warmup,
        "runs": {},
    }
    for m, plan in plans.items():
        print(f"# {m} node(s): weights per stage {[f'{b / 2**20:.0f} MiB' for b in plan['stage_weight_bytes']]}, "
              f"RAM share {[p['percent'][1] for p in plan['policies']]} %", flush=True)
        print(plan["command"], flush=True)
        res["runs"][str(m)] = {k: v for k, v in plan.items() if k != "run"}
    if not args.dry_run:
        tokens: dict[int, list] = {}
        reps: dict[int, list[dict[str, Any]]] = {m: [] for m in plans}
        res["repeat"] = args.repeat
        for rnd in range(args.repeat):  # rounds interleave the node counts: a machine whose speed drifts
            if args.repeat > 1:         # moves every count's runs alike
                print(f"# round {rnd + 1} of {args.repeat}", flush=True)
            for m, plan in plans.items():
                run = res["runs"][str(m)]
                if args.defaults:
                    pass  # the runs plan with the cached profile as it is
                elif rnd == 0 and hardware is not None and not args.hardware and not args.shared_cores:
                    run["hardware_profile"] = yaml.safe_load(disk_share(args, m, work, hardware, disk).read_text())
                elif rnd == 0 and hardware is not None and not args.hardware:  # shared cores: the profile as it is
                    (work / f"node-{m}.yaml").write_text(hardware.read_text())
                reps[m].append(measure_run(args, m, plan, work, tokens, disk))
        for m, r in reps.items():
            settle(res["runs"][str(m)], r)
        base = res["runs"].get("1", {}).get("metrics")
        if base:
            res["scaling_vs_1_node"] = {m: {k: r["metrics"][k] / base[k] for k in _KEYS}
                                        for m, r in res["runs"].items()}
            print(json.dumps(res["scaling_vs_1_node"]), flush=True)
        res["predicted_over_measured"] = {
            m: {k: r["predicted"][k] / r["metrics"][k] for k in _KEYS}
            for m, r in res["runs"].items() if "total_throughput" in r.get("predicted", {})}
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fg-scaling-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    disk = DiskLimit(max(args.stages), args.disk_gbps, work) if args.disk_gbps and not args.dry_run else None
    if args.physical_memory and args.dry_run:
        print("# --physical-memory: free page reporting goes off, and the free memory is backed, before the runs")
    mem = NodeMemory() if args.physical_memory and not args.dry_run else None
    with disk or contextlib.nullcontext(), mem or contextlib.nullcontext():
        res = bench(args, work, disk)
    res["physical_memory"] = None if mem is None else mem.info
    out = args.json or (None if args.dry_run else "bench_results/scaling.json")
    if out:  # a dry run does not overwrite a measured result unless told to
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2, default=str) + "\n")
        print("->", out)
    if args.plot and not args.dry_run:
        from flexgen_dist.bench.plots import plot_scaling

        print("->", plot_scaling(res, args.plot))
    return res


if __name__ == "__main__":
    main()
