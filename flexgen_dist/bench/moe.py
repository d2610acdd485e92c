"""A mixture of experts mostly on disk: this engine against transformers + accelerate disk
offload, and what a small batch reads, in one run.

    python -m flexgen_dist.bench.moe --json bench_results/moe.json

The model: a Mixtral-shaped checkpoint built by transformers with random weights (default 8
layers, 8 experts, top 2, hidden 1024, expert width 3584, in bfloat16), written once and read
by both systems, with ``--ram-share`` (default 20 %) of the weight bytes in RAM and the rest on
disk for both:

(a) this engine (``python -m flexgen_dist.run``, its own process): ``--percent 0 S 100 0 100 0``,
    blocks of ``--gpu-batch-size`` x ``--num-gpu-batches`` sequences sharing each loaded layer;
    a sparse layer reads the experts its block's tokens choose, when they choose them;
(b) transformers' ``generate`` over accelerate's disk offload (a ``device_map`` that fills the
    same RAM share in module order, the rest on "disk" with ``offload_folder``), in batches of
    ``--gpu-batch-size``: every step runs every offloaded layer's experts in and out;
(c) this engine on one sequence (``--small-prompts``, default 1): the expert bytes each
    generated token read against all experts' bytes, and the experts its routings chose against
    the cost model's E (1 - (1 - k/E)^T).

Both read the same prompts greedily; the tokens are compared. The page cache is dropped before
each run and every ``--drop-interval`` seconds during (a) and (b) (root only; the JSON says
whether it could): accelerate reads memory-mapped files, which the page cache would otherwise
keep in RAM beyond the budget. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..memory.disk import can_drop_page_cache
from .offload import CacheDropper, device_bytes_read
from .single import machine, run_hf, write_json


def build_checkpoint(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """A random Mixtral-shaped checkpoint, saved in ``args.dtype``; returns its config."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.expert_width,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, num_local_experts=args.experts,
                        num_experts_per_tok=args.top_k, max_position_embeddings=4096, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    with torch.device("cpu"):
        model = MixtralForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(out, max_shard_size="512MB")
    n = sum(p.numel() for p in model.parameters())
    del model
    return {"params": n, "bytes": n * dtype.itemsize}


def accelerate_map(ckpt: Path, budget: int, dtype: torch.dtype) -> tuple[dict[str, str], dict[str, int]]:
    """The embeddings, then layers while they fit ``budget`` bytes of RAM, the rest on disk."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(ckpt)))
    sizes = compute_module_sizes(model, dtype=dtype)
    inner = model.model
    parts = ["model.embed_tokens"] + [f"model.layers.{j}" for j in range(len(inner.layers))] + \
        ["model.norm", "model.rotary_emb", "lm_head"]
    dmap, used = {}, {"cpu": 0, "disk": 0}
    for name in parts:
        size = sizes.get(name, 0)
        dev = "cpu" if used["cpu"] + size <= budget or size == 0 else "disk"
        dmap[name] = dev
        used[dev] += size
    return dmap, used


def run_accelerate(ckpt: Path, prompts: list[list[int]], gen_len: int, batch: int, budget: int, work: Path,
                   dtype: torch.dtype, drop_interval: float) -> tuple[list[list[int]], dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    dmap, used = accelerate_map(ckpt, budget, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype, device_map=dmap,
                                                 offload_folder=str(work / "acc-offload")).eval()
    with CacheDropper(drop_interval):
        r0 = device_bytes_read(work)
        gen, outs = run_hf(model, torch.tensor(prompts), gen_len, batch, pad=0)
        r1 = device_bytes_read(work)
    tokens = len(prompts) * gen_len
    return outs, {"generate_s": gen, "total_throughput": tokens / gen, "device_map_bytes": used,
                  "device_bytes_read": None if r0 is None or r1 is None else r1 - r0}


def run_engine(ckpt: Path, prompts_file: Path, gen_len: int, args: argparse.Namespace, share: float, work: Path,
               tag: str, gbs: int, num_gb: int) -> tuple[list[list[int]], dict[str, Any]]:
    out, met = work / f"out-{tag}.jsonl", work / f"metrics-{tag}.json"
    cmd = [sys.executable, "-m", "flexgen_dist.run", "--model", str(ckpt), "--dtype", args.dtype,
           "--prompts", str(prompts_file), "--gen-len", str(gen_len), "--ignore-eos",
           "--percent", "0", f"{100 * share:g}", "100", "0", "100", "0",
           "--gpu-batch-size", str(gbs), "--num-gpu-batches", str(num_gb), "--offload-dir", str(work / "off"),
           "--output", str(out), "--overwrite", "--metrics", str(met), "--print-outputs", "0", "--no-progress",
           "--warmup"]
    with CacheDropper(args.drop_interval):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"moe: the engine's run failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    outs = [json.loads(line)["tokens"] for line in out.read_text().splitlines()]
    return outs, json.loads(met.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-width", type=int, default=3584)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--ram-share", type=float, default=0.2, help="of the weight bytes in RAM (the rest on disk)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--gpu-batch-size", type=int, default=8)
    ap.add_argument("--num-gpu-batches", type=int, default=8)
    ap.add_argument("--small-prompts", type=int, default=1)
    ap.add_argument("--small-gen-len", type=int, default=16)
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--drop-interval", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fg-moe-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "mixtral-shaped"
    print(f"# writing the checkpoint to {ckpt}", file=sys.stderr, flush=True)
    info = build_checkpoint(args, ckpt)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, args.vocab, (args.num_prompts, args.prompt_len), generator=g).tolist()
    pf = work / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    res: dict[str, Any] = {"machine": machine(), "config": {k: v for k, v in vars(args).items() if k != "json"},
                           "checkpoint": info, "page_cache_dropped": can_drop_page_cache(), "runs": {}}
    print("# (a) this engine", file=sys.stderr, flush=True)
    ours, met = run_engine(ckpt, pf, args.gen_len, args, args.ram_share, work, "a", args.gpu_batch_size,
                           args.num_gpu_batches)
    res["runs"]["a_engine"] = {k: met.get(k) for k in ("prefill_throughput", "decode_throughput", "total_throughput",
                                                       "prefill_time_s", "decode_time_s", "experts", "peak_bytes")}
    res["runs"]["a_engine"]["disk_bytes_read"] = met["stage_times"][0]["disk_bytes_read"]
    print(f"  total {met['total_throughput']:.2f} tok/s", file=sys.stderr, flush=True)
    if not args.skip_accelerate:
        print("# (b) transformers + accelerate disk offload", file=sys.stderr, flush=True)
        theirs, acc = run_accelerate(ckpt, prompts, args.gen_len, args.gpu_batch_size,
                                     int(args.ram_share * info["bytes"]), work, dtype, args.drop_interval)
        res["runs"]["b_accelerate"] = acc
        res["tokens_equal"] = ours == theirs
        res["tokens_agree_fraction"] = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b)) / max(
            1, sum(len(a) for a in ours))
        res["a_over_b_total"] = met["total_throughput"] / acc["total_throughput"]
        print(f"  total {acc['total_throughput']:.2f} tok/s; ours x{res['a_over_b_total']:.1f}", file=sys.stderr)
    print("# (c) a small batch", file=sys.stderr, flush=True)
    spf = work / "small.jsonl"
    spf.write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(prompts[:args.small_prompts])))
    _, small = run_engine(ckpt, spf, args.small_gen_len, args, args.ram_share, work, "c", args.small_prompts, 1)
    ex = small["experts"][0]
    from ..models.loader import load_model

    spec = load_model(str(ckpt), load_tokenizer=False).spec
    expert_bytes = spec.num_layers * spec.num_experts * spec.expert_numel() * dtype.itemsize
    tokens = args.small_prompts * args.small_gen_len
    res["runs"]["c_small"] = {"experts": ex, "generated_tokens": tokens,
                              "expert_bytes_moved_per_token": ex["bytes_moved"] / tokens,
                              "all_expert_bytes": expert_bytes,
                              "all_expert_bytes_off_ram": ex["bytes_possible"] / max(1, ex["loads"]) * spec.num_layers,
                              "chosen_over_expected": ex["chosen_over_expected"],
                              "total_throughput": small["total_throughput"]}
    print(f"  expert bytes moved per token {ex['bytes_moved'] / tokens / 2**20:.1f} MiB of {expert_bytes / 2**20:.0f} "
          f"MiB of experts; chosen / expected {ex['chosen_over_expected']:.3f}", file=sys.stderr)
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
