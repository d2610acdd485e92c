"""Entry point: ``python -m flexgen_dist.run`` (bare, or under torchrun, mpirun or srun).

Parse, build, run, always clean up. User errors end with one line on stderr and exit code 1
(2 for bad flags); outputs already produced stay on disk.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, RunConfig, parse_config
from .memory.disk import DiskStoreError
from .memory.tiers import MemoryBudgetError
from .models.loader import ModelLoadError

USER_ERRORS = (ConfigError, ModelLoadError, DiskStoreError, MemoryBudgetError, ValueError,
               FileNotFoundError, PermissionError)
log = logging.getLogger("flexgen_dist")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="flexgen_dist: %(message)s", stream=sys.stderr)
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return run(cfg)
    except KeyboardInterrupt:
        print("error: interrupted; outputs written so far are kept", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def run(cfg: RunConfig) -> int:
    from .dist.topology import detect_topology

    topo = detect_topology(master_addr=cfg.master_addr, master_port=cfg.master_port)
    if topo.world_size > 1:
        from .dist.pipeline import run_pipeline

        return run_pipeline(cfg, topo)
    return run_single(cfg)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def budgets_of(cfg: RunConfig) -> dict[str, int | None]:
    from .memory.tiers import parse_size

    return {t: parse_size(v) if v is not None else None
            for t, v in (("gpu", cfg.gpu_mem), ("cpu", cfg.cpu_mem), ("disk", cfg.disk_mem))}


def needs_disk(policies: list[Any]) -> bool:
    return any(p.fractions(kind)[2] > 1e-9 for p in policies for kind in ("w", "cache", "act"))


def check_prompt_lengths(prompts: list[Any], gen_len: int, max_positions: int) -> None:
    for p in prompts:
        if len(p.ids) + gen_len > max_positions:
            raise ConfigError(f"prompt {p.id!r} has {len(p.ids)} tokens; with --gen-len {gen_len} that "
                              f"exceeds the model's {max_positions} positions: shorten it or lower --gen-len")


def run_single(cfg: RunConfig) -> int:
    from .engine.budget import check_budgets, predict_peaks
    from .engine.generate import generate
    from .engine.stage import StageEngine
    from .memory.disk import DiskStore
    from .models.loader import describe, load_model
    from .prompts import OutputWriter, read_prompts

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    loaded = load_model(cfg.model, dummy_weights=cfg.dummy_weights, dtype=dtype, seed=cfg.seed)
    spec = loaded.spec
    prompts = read_prompts(cfg.prompts, cfg.num_prompts, cfg.prompt_len, loaded.tokenizer,
                           spec.vocab_size, cfg.seed)
    check_prompt_lengths(prompts, cfg.gen_len, spec.max_positions)
    max_len = max(len(p.ids) for p in prompts)
    dtype_bytes = torch.finfo(dtype).bits // 8
    predicted: dict[str, Any] = {}
    if cfg.auto_policy:
        from .planner.auto import auto_policies

        policies, predicted, _ = auto_policies(cfg, spec, [(0, spec.num_layers)], max_len, dtype_bytes,
                                               device, len(prompts))
        policy = policies[0]
    else:
        policy = cfg.stage_policies(1)[0]
    peak = predict_peaks(spec, policy, (0, spec.num_layers), has_embed=True, has_head=True,
                         prompt_len=max_len, gen_len=cfg.gen_len, dtype_bytes=dtype_bytes)
    budgets = budgets_of(cfg)
    check_budgets(peak, budgets)
    print(f"model: {describe(loaded)}", file=sys.stderr)
    print(f"policy: gbs={policy.gpu_batch_size} num_gb={policy.num_gpu_batches} percent="
          f"{' '.join(f'{x:g}' for x in policy.percent())} cpu_attention={policy.cpu_attention} "
          f"overlap={policy.overlap}", file=sys.stderr)
    disk = engine = writer = bar = None
    try:
        if needs_disk([policy]):
            disk = DiskStore(Path(cfg.offload_dir).expanduser(), rank=0, direct_io=cfg.direct_io)
            disk.check_space(peak["disk"])
        engine = StageEngine(spec, loaded.source, (0, spec.num_layers), has_embed=True, has_head=True,
                             policy=policy, device=device, dtype=dtype, disk=disk)
        writer = OutputWriter(cfg.output, loaded.tokenizer)
        bar = _progress(cfg, len(prompts), policy.block_size)
        records: list[dict[str, Any]] = []

        def on_block(first: int, outs: list[list[int]]) -> None:
            recs = [writer.record(prompts[first + n], toks) for n, toks in enumerate(outs)]
            writer.write(recs)
            records.extend(recs)

        _, tm = generate(engine, [p.ids for p in prompts], cfg.gen_len, cfg.sampling,
                         on_block=on_block, progress=bar.update if bar else None)
        if bar:
            bar.close()
        metrics = {
            "model": describe(loaded), "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "num_prompts": len(prompts), "prompt_len": max_len, "gen_len": cfg.gen_len, "world_size": 1,
            **tm.metrics(),
            "policy": [policy.to_dict()], "peak_bytes": [engine.peak_bytes()],
            "stage_times": [{**engine.times.as_dict(), "comm_wait_s": 0.0, "token_steps": tm.token_steps}],
            "predicted": {**predicted, "peak_bytes": [peak]},
            "direct_io": None if disk is None else disk.direct,
        }
        _report(cfg, records, metrics)
        return 0
    finally:
        close_all(bar, engine, disk, writer)


def close_all(*things: Any) -> None:
    """Close each of ``things`` that exists, in order (the engine before its disk store)."""
    for t in things:
        if t is not None:
            t.close()


def _progress(cfg: RunConfig, num_prompts: int, block_size: int) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    blocks = -(-num_prompts // block_size)
    return tqdm(total=blocks * cfg.gen_len, desc="generating", unit="step", file=sys.stderr,
                mininterval=1.0, leave=False, dynamic_ncols=True)


def _report(cfg: RunConfig, records: list[dict[str, Any]], metrics: dict[str, Any]) -> None:
    for r in records[: cfg.print_outputs]:
        head = r.get("prompt")
        body = r.get("text") if "text" in r else str(r["tokens"])
        print(f"[{r['id']}] {head!r} -> {body!r}" if head is not None else f"[{r['id']}] -> {body}")
    if len(records) > cfg.print_outputs:
        more = f" (all in {cfg.output})" if cfg.output else " (use --output FILE for all)"
        print(f"... {len(records) - cfg.print_outputs} more{more}")
    print(f"prefill {metrics['prefill_throughput']:.1f} tok/s | decode {metrics['decode_throughput']:.1f} "
          f"tok/s | total {metrics['total_throughput']:.1f} tok/s  ({metrics['num_prompts']} prompts, "
          f"gen-len {metrics['gen_len']}, {metrics['prefill_time_s'] + metrics['decode_time_s']:.2f} s)")
    pred = metrics.get("predicted", {})
    if "total_throughput" in pred:
        print(f"predicted by the planner: prefill {pred['prefill_throughput']:.1f} | decode "
              f"{pred['decode_throughput']:.1f} | total {pred['total_throughput']:.1f} tok/s")
    if cfg.metrics:
        p = Path(cfg.metrics).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(metrics, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
