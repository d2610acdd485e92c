"""Offloading benchmark: a model whose weights mostly live on disk, three ways, in one run.

    python -m flexgen_dist.bench.offload --model opt-350m --num-prompts 32 --json out.json

(a) this engine, a block of many GPU batches sharing each loaded layer, the KV cache in RAM
    (the cpu tier) with CPU attention, so the compute tier holds one GPU batch's working set;
(b) this engine with num_gpu_batches 1 (each GPU batch reloads every layer);
(a, overlapped) with ``--blocks`` >= 2: (a)'s policy under the overlapped schedule (each
    block's prefill rides on the previous block's decode steps, one sweep for both), with
    per-phase clock, compute and I/O wait beside (a)'s;
(c) Hugging Face accelerate disk offload (a device_map of "cpu"/"disk" modules holding the
    same RAM budget, plus offload_folder) at the largest batch the same compute-memory budget
    allows (the GPU batch size of (a)).
Plus ablations of (a): no overlap, no CPU attention, the KV cache on the compute tier. With
``--compress-weight`` and/or ``--compress-cache``, (a) again with that compression (4-bit
groups, weights kept packed on their tier, disk files included): same placement fractions and
RAM budget, ~1/4 of the bytes to read; the JSON compares throughput, decode time per step and
bytes read from the device against (a). ``--skip-accelerate`` leaves (c) out.

The default model is the smallest registry OPT shape with at least 1 GB of weights in the
chosen dtype (opt-350m in float32, opt-1.3b in bfloat16).

All runs use the same dummy weights, written once as a Hugging Face checkpoint that the
engine loads too (so the tokens must agree), and the same prompts. The weights that do not
fit the RAM budget are on disk for everyone: the engine reads them with O_DIRECT, and
accelerate reads memory-mapped files, so the page cache is dropped before each run and every
``--drop-interval`` seconds during it (root only; the JSON says whether it was possible).
Otherwise RAM larger than the budget would silently hold accelerate's "disk" weights.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..distributed.local import generate
from ..kernels import gemm
from ..engine.policy import Policy
from ..engine.sampling import SamplingConfig
from ..engine.stage import StageEngine
from ..memory.disk import DiskStore, can_drop_page_cache, drop_page_cache
from ..models.families import get_family
from ..models.loader import load_model
from ..models.registry import get_spec, registry_names
from .single import machine, run_hf

def device_bytes_read(path: Path) -> int | None:
    """Bytes the block device holding ``path`` has read so far (/proc/diskstats), or None.

    The difference over a run is what really came off the disk (not from the page cache),
    for the engine's O_DIRECT reads and accelerate's memory-mapped ones alike.
    """
    try:
        dev = os.stat(path).st_dev
        key = (os.major(dev), os.minor(dev))
        with open("/proc/diskstats") as f:
            for line in f:
                c = line.split()
                if (int(c[0]), int(c[1])) == key:
                    return int(c[5]) * 512  # sectors read, 512-byte units
    except (OSError, ValueError, IndexError):
        pass
    return None


def checkpoint_mapped(ckpt: Path) -> list[str]:
    """Files under ``ckpt`` this process has memory-mapped (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if str(ckpt) in ln})
    except OSError:
        return []


def _delta(a: int | None, b: int | None) -> int | None:
    return b - a if a is not None and b is not None else None


class CacheDropper:
    """Drops the page cache every ``interval`` seconds while a run is in progress."""

    def __init__(self, interval: float) -> None:
        self.interval, self._stop = interval, threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            drop_page_cache()

    def __enter__(self) -> "CacheDropper":
        drop_page_cache()
        if can_drop_page_cache() and self.interval > 0:
            self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._t.is_alive():
            self._t.join()


def write_hf_checkpoint(lm: Any, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """Save the dummy weights under Hugging Face names, so accelerate runs the same model."""
    from safetensors.torch import save_file
    from transformers import OPTConfig

    spec = lm.spec
    if spec.family != "opt":
        raise SystemExit("the accelerate baseline is built for OPT shapes (use an opt-* model)")
    fam = get_family(spec.family)
    cfg = OPTConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, ffn_dim=spec.ffn_size,
                    num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                    max_position_embeddings=spec.max_positions, do_layer_norm_before=spec.pre_layer_norm,
                    word_embed_proj_dim=spec.embed_dim, pad_token_id=1, bos_token_id=2, eos_token_id=2,
                    dtype=str(dtype).removeprefix("torch."))
    cfg.save_pretrained(out)
    parts = [("embed", None)] + [("layer", j) for j in range(spec.num_layers)] + [("head", None)]
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    n = 0

    def flush() -> None:
        nonlocal shard, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, n = {}, n + 1

    for part, j in parts:
        ws = lm.source.get(part, j)
        for k, names in fam.hf_names(spec, part, j).items():
            key = [c for c in names if c.startswith("model.decoder.")][0]
            if key not in index and key not in shard:
                shard[key] = ws[k].to(dtype).contiguous()
        if sum(t.nbytes for t in shard.values()) > 512 * 2**20:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def run_engine(lm: Any, prompts: list[list[int]], gen_len: int, policy: Policy, offload: Path,
               drop_interval: float, dtype: torch.dtype = torch.float32,
               schedule: str = "sequential") -> tuple[list, dict]:
    """Place the weights (setup), drop the page cache, then time generation alone."""
    with CacheDropper(drop_interval), DiskStore(offload) as disk:
        t0 = time.perf_counter()
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=policy, device=torch.device("cpu"), dtype=dtype, disk=disk)
        try:
            setup = time.perf_counter() - t0
            drop_page_cache()
            r0, t0 = device_bytes_read(offload.parent), time.perf_counter()
            tune0 = gemm.summary()["tune_s"]
            outs, tm = generate(eng, prompts, gen_len, SamplingConfig(ignore_eos=True), schedule=schedule)
            gen = time.perf_counter() - t0
            info = {"setup_s": setup, "generate_s": gen, **tm.metrics(), **eng.times.as_dict(),
                    "device_bytes_read": _delta(r0, device_bytes_read(offload.parent)),
                    "peak_bytes": eng.peak_bytes(), "direct_io": disk.direct, "disk_bytes_read": disk.bytes_read,
                    # GEMM forms timed inside this run (once per machine and shape; a later run pays none)
                    "gemm_tune_s": gemm.summary()["tune_s"] - tune0}
        finally:
            eng.close()
    return outs, info


def accelerate_device_map(ckpt: Path, cpu_budget: int,
                          dtype: torch.dtype = torch.float32) -> tuple[dict[str, str], dict[str, int]]:
    """A device_map that fills the RAM budget in module order and puts the rest on "disk".

    ``device_map="auto"`` with the same ``max_memory`` is not a like-for-like baseline: its
    greedy pass reserves room for the largest layer and moves ``model.decoder.layers`` whole,
    so for opt-350m at 20 % only the embeddings (~8 %) stay in RAM, and for opt-125m the first
    module does not fit and the whole model goes to disk. Here the embeddings (with the tied
    head) come first, then decoder layers while they fit, so accelerate keeps the same share
    of weight bytes in RAM as the engine. Returns the map and the bytes per device.
    """
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(ckpt)))
    model.tie_weights()
    sizes = compute_module_sizes(model, dtype=dtype)
    dec = model.model.decoder
    parts = [f"model.decoder.{n}" for n, m in dec.named_children() if n != "layers" and m is not None]
    parts += [f"model.decoder.layers.{j}" for j in range(len(dec.layers))]
    dmap: dict[str, str] = {}
    used = {"cpu": 0, "disk": 0}
    for name in parts:
        dev = "cpu" if used["cpu"] + sizes[name] <= cpu_budget else "disk"
        dmap[name] = dev
        used[dev] += sizes[name]
    dmap["lm_head"] = dmap["model.decoder.embed_tokens"]  # tied: no bytes of its own
    return dmap, used


def run_accelerate(ckpt: Path, prompts: list[list[int]], gen_len: int, batch: int, cpu_budget: int,
                   offload: Path, drop_interval: float,
                   dtype: torch.dtype = torch.float32) -> tuple[list[list[int]], dict[str, Any]]:
    """Load with the disk-offload device_map (setup), drop the page cache, time generation."""
    from transformers import AutoModelForCausalLM

    with CacheDropper(drop_interval):
        t0 = time.perf_counter()
        dmap, used = accelerate_device_map(ckpt, cpu_budget, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            str(ckpt), dtype=dtype, device_map=dmap, offload_folder=str(offload),
            offload_state_dict=True).eval()
        placed = dict(getattr(model, "hf_device_map", {}))
        if "disk" not in placed.values():
            raise RuntimeError(f"accelerate kept every module in RAM ({placed}); the baseline would not offload")
        setup = time.perf_counter() - t0
        drop_page_cache()
        r0 = device_bytes_read(ckpt)
        gen, outs = run_hf(model, torch.tensor(prompts), gen_len, batch, pad=1)
        r1 = device_bytes_read(ckpt)
    info = {"setup_s": setup, "generate_s": gen, "device_bytes_read": _delta(r0, r1), "device_map_bytes": used,
            "modules_on_disk": sum(v == "disk" for v in placed.values()),
            "modules_in_ram": sum(v == "cpu" for v in placed.values())}
    return outs, info


def compression_variants(weight: bool, cache: bool) -> list[tuple[str, ...]]:
    """The compressed runs of (a): each flag given alone, and both together when both are."""
    flags = [f for f, on in (("compress_weight", weight), ("compress_cache", cache)) if on]
    return [(f,) for f in flags] + ([tuple(flags)] if len(flags) == 2 else [])


def compression_ratios(a: dict[str, Any], comp: dict[str, Any], gen_len: int) -> dict[str, Any]:
    """Compressed run over uncompressed (a): throughputs, decode time per step, bytes read."""
    def per_step(r: dict[str, Any]) -> float:
        return r["decode_time_s"] / max(1, gen_len - 1)

    def ratio(x: Any, y: Any) -> float | None:
        return x / y if x and y else None

    return {"throughput_over_a": ratio(comp["throughput"], a["throughput"]),
            "decode_throughput_over_a": ratio(comp["decode_throughput"], a["decode_throughput"]),
            "prefill_throughput_over_a": ratio(comp["prefill_throughput"], a["prefill_throughput"]),
            "decode_step_s": {"a": per_step(a), "compressed": per_step(comp)},
            "decode_step_speedup": ratio(per_step(a), per_step(comp)),
            "device_bytes_read": {"a": a["device_bytes_read"], "compressed": comp["device_bytes_read"]},
            "bytes_read_ratio": ratio(comp["disk_bytes_read"], a["disk_bytes_read"])}


def ratios(runs: dict[str, Any], comps: list[tuple[str, ...]], gen_len: int) -> dict[str, Any]:
    """Throughput ratios of the variants that ran: (a) over (b) and (c), overlapped over (a)
    and (c), and each compressed variant against (a)."""
    tps = {name: r["throughput"] for name, r in runs.items()}
    out: dict[str, Any] = {}
    for key, num, den in (("a_over_b", "a_block", "b_one_batch"), ("overlapped_over_a", "a_overlapped", "a_block"),
                          ("overlapped_over_c", "a_overlapped", "c_accelerate"),
                          ("a_over_c", "a_block", "c_accelerate")):
        if num in tps and den in tps:
            out[key] = tps[num] / tps[den]
    for comp in comps:
        name = "a_" + "_".join(comp)
        out[name] = compression_ratios(runs["a_block"], runs[name], gen_len)
    return out


def default_model(dtype: torch.dtype) -> str:
    """The smallest registry OPT shape with at least 1 GB of weights in ``dtype``."""
    shapes = sorted((get_spec(n).total_numel(), n) for n in registry_names() if n.startswith("opt-"))
    return next(n for numel, n in shapes if numel * dtype.itemsize >= 10**9)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="registry OPT shape (default: the smallest with >= 1 GB of weights in --dtype)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=1,
                    help="blocks the prompts are cut into (the overlapped variant needs >= 2: a block's "
                         "prefill rides on the decode of the block before)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="of weights and compute, for every run (bfloat16: AMX GEMMs where the CPU has them)")
    ap.add_argument("--cpu-weight-percent", type=float, default=20.0,
                    help="share of weights the RAM budget holds; the rest is on disk")
    ap.add_argument("--drop-interval", type=float, default=1.0)
    ap.add_argument("--workdir", default=None, help="where checkpoints and offload files go")
    ap.add_argument("--skip-ablations", action="store_true")
    ap.add_argument("--skip-accelerate", action="store_true", help="leave out the accelerate baseline (c)")
    ap.add_argument("--skip-one-batch", action="store_true", help="leave out (b)")
    ap.add_argument("--compress-weight", action="store_true", help="also run (a) with 4-bit weights")
    ap.add_argument("--compress-cache", action="store_true", help="also run (a) with a 4-bit KV cache")
    ap.add_argument("--comp-group-size", type=int, default=64)
    ap.add_argument("--json", default="bench_results/offload.json")
    ap.add_argument("--plot", default=None, help="write a figure of the variants here (PNG; the bench extra)")
    return ap.parse_args(argv)


def engine_variants(args: argparse.Namespace, lm: Any, prompts: list[list[int]], dtype: torch.dtype, work: Path,
                    record: Any, runs: dict[str, Any]) -> list:
    """(a), its overlapped schedule (with --blocks > 1), (b), the ablations and the compressed
    variants, each recorded; returns (a)'s tokens."""
    gbs, wc = args.gpu_batch_size, args.cpu_weight_percent
    ngb = max(1, args.num_prompts // (gbs * args.blocks))

    def engine(name: str, policy: Policy, schedule: str = "sequential") -> list:
        outs, info = run_engine(lm, prompts, args.gen_len, policy, work / "offload", args.drop_interval,
                                dtype, schedule)
        record(name, info, {"policy": policy.to_dict(), "schedule": schedule})
        return outs

    pct = (0, wc, 0, 100, 100, 0)  # weights: wc % in RAM, the rest on disk; KV cache in RAM
    ref = engine("a_block", Policy(gbs, ngb, *pct))
    if args.blocks > 1:
        match = engine("a_overlapped", Policy(gbs, ngb, *pct), "overlapped") == ref
        runs["a_overlapped"].update(tokens_match_a=match, blocks=-(-args.num_prompts // (gbs * ngb)))
    if not args.skip_one_batch:
        engine("b_one_batch", Policy(gbs, 1, *pct))
    if not args.skip_ablations:
        engine("a_no_overlap", Policy(gbs, ngb, *pct, overlap=False))
        engine("a_no_cpu_attention", Policy(gbs, ngb, *pct, cpu_attention=False))
        engine("a_cache_on_compute", Policy(gbs, ngb, 0, wc, 100, 0, 100, 0))
    for comp in compression_variants(args.compress_weight, args.compress_cache):
        pol = Policy(gbs, ngb, *pct, comp_group_size=args.comp_group_size, **{k: True for k in comp})
        engine("a_" + "_".join(comp), pol)
        if args.blocks > 1:
            engine("a_overlapped_" + "_".join(comp), pol, "overlapped")
    return ref


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fg-bench-", dir=str(Path.home())))
    work.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    args.model = args.model or default_model(dtype)
    dummy = load_model(args.model, dummy_weights=True, dtype=dtype)
    ckpt = work / f"hf-{args.model}-{args.dtype}"
    if not (ckpt / "config.json").exists():
        print("writing the dummy weights as a Hugging Face checkpoint ...", flush=True)
        write_hf_checkpoint(dummy, ckpt, dtype)
    # Everyone runs the written checkpoint (the engine too), so all runs provably use the same
    # weights and their tokens can be compared.
    held = {"lm": load_model(str(ckpt), load_tokenizer=False, dtype=dtype)}
    spec = dummy.spec
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, spec.vocab_size, (args.num_prompts, args.prompt_len), generator=g).tolist()
    weight_bytes = spec.total_numel() * dtype.itemsize
    cpu_budget = int(weight_bytes * args.cpu_weight_percent / 100)
    gbs, wc = args.gpu_batch_size, args.cpu_weight_percent
    runs: dict[str, Any] = {}

    def record(name: str, info: dict[str, Any], extra: dict[str, Any]) -> None:
        # throughput = generated tokens / generation wall time (weight placement or model
        # loading is reported as setup_s and excluded, for every run alike)
        runs[name] = {**extra, **info, "throughput": args.num_prompts * args.gen_len / info["generate_s"]}
        print(f"{name}: {runs[name]['throughput']:.2f} tok/s (generate {info['generate_s']:.1f} s, "
              f"setup {info['setup_s']:.1f} s)", flush=True)

    ref = engine_variants(args, held["lm"], prompts, dtype, work, record, runs)

    # The engine's checkpoint reader keeps the safetensors files memory-mapped, and the page
    # cache cannot drop mapped pages: left open, accelerate's "disk" reads would all come from
    # RAM (a first version of this benchmark measured 0.2 GB read from the device for 157 GB
    # of offloaded weights). Release every mapping before (c), and check.
    held.clear()
    gc.collect()
    if not args.skip_accelerate:
        mapped = checkpoint_mapped(ckpt)
        if mapped:
            raise RuntimeError(f"{ckpt} is still memory-mapped ({mapped}): accelerate would read RAM, not disk")
        outs, acc = run_accelerate(ckpt, prompts, args.gen_len, gbs, cpu_budget, work / f"hf-offload-{args.dtype}",
                                   args.drop_interval, dtype)
        record("c_accelerate", acc, {"batch_size": gbs, "ram_budget_bytes": cpu_budget,
                                     "tokens_match_a": outs == ref})

    res = {
        "benchmark": "offload", "machine": machine(), "model": spec.name, "weight_bytes": weight_bytes,
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                     "dtype": args.dtype, "ram_budget_weight_percent": wc},
        "page_cache_dropped": can_drop_page_cache(), "drop_interval_s": args.drop_interval,
        "runs": runs,
    }
    res["ratios"] = ratios(runs, compression_variants(args.compress_weight, args.compress_cache), args.gen_len)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res["ratios"]), "->", args.json)
    if args.plot:
        from .plots import plot_offload

        print("->", plot_offload(res, args.plot))
    return res


if __name__ == "__main__":
    main()
