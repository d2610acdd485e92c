"""``--policy auto``: plan every stage's policy for this run from a hardware profile.

The profile comes from ``--hardware FILE`` or the per-host cache (measured on first use, under
a minute, and again when it is unreadable, stale or of another machine; ``profile_cache.py``). Budgets given with --gpu-mem/--cpu-mem/--disk-mem replace the profile's
capacities. The plan's block size never exceeds what the prompts can fill across the
micro-batch groups.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..budgets import Budgets
from ..config import RunConfig
from ..distributed.partition import partition_layers
from ..engine.prefix_shape import PrefixShape
from ..engine.footprint import HeadLoad, Packed
from ..engine.policy import Policy
from ..models.spec import ModelSpec
from .cost_model import WorkShape, estimate_pipeline
from .hardware import HardwareSpec, hardware_for_stages, load_hardware_stages
from .profile_cache import load_or_profile
from .pipeline import plan_pipeline
from .search import PlanError


def hardware_for(cfg: RunConfig, device: torch.device, num_stages: int,
                 budgets: Budgets | None = None, dtype: torch.dtype | None = None) -> list[HardwareSpec]:
    """Each stage's machine: --hardware FILE (one, or ``stages:`` one per stage) or this host's
    cached profile (measured now where there is none, or it cannot be used), with the rates of
    the run's compute ``dtype`` where the profile has them, its capacities cut to the run's
    ``budgets``: the user's caps replace them, and what this machine has bounds them (a
    profile may be another machine's)."""
    if cfg.hardware and cfg.hardware != "auto":
        hws = hardware_for_stages(load_hardware_stages(cfg.hardware), num_stages)
    else:
        hws = [load_or_profile(None, device.type, cfg.offload_dir)] * num_stages
    if dtype is not None:
        hws = [hw.for_dtype(str(dtype).replace("torch.", "")) for hw in hws]
    if budgets is None:
        return [hw.with_budgets(gpu_mem=cfg.gpu_mem, cpu_mem=cfg.cpu_mem, disk_mem=cfg.disk_mem) for hw in hws]
    return [_within(hw, budgets) for hw in hws]


def _within(hw: HardwareSpec, b: Budgets) -> HardwareSpec:
    """``hw`` with the run's budgets: a user's cap replaces the profile's capacity, a machine
    figure bounds it. On a CPU-only machine the compute and host tiers share one pool of RAM,
    which the LP sees as two halves unless the user capped the compute tier below the pool."""
    caps = {"gpu_mem": b.gpu, "cpu_mem": b.cpu, "disk_mem": b.disk}
    if b.pooled and b.cpu is not None:
        capped = "gpu" in b.given and b.gpu is not None and b.gpu < b.cpu
        gpu = b.gpu if capped and b.gpu is not None else b.cpu // 2
        caps["gpu_mem"], caps["cpu_mem"] = gpu, max(0, b.cpu - gpu)
    given = {"gpu_mem": "gpu" in b.given, "cpu_mem": "cpu" in b.given and not b.pooled,
             "disk_mem": "disk" in b.given}
    out = {}
    for field, cap in caps.items():
        if cap is not None:
            out[field] = cap if given[field] else min(cap, getattr(hw, field))
    return hw.with_budgets(**out)


PREDICTED_KEYS = ("prefill_throughput", "decode_throughput", "total_throughput", "prefill_time_s",
                  "decode_time_s", "num_micro_batches", "prefill_items", "schedule", "stage_times")


def group_options(cfg: RunConfig, num_stages: int) -> list[int]:
    """Micro-batch group counts to weigh: the one asked for, else m (every stage busy) and 2m
    (a block's ring trip hidden behind more blocks, at the memory of m more caches)."""
    if cfg.num_micro_batches:
        return [cfg.num_micro_batches]
    return [num_stages] if num_stages == 1 else [num_stages, 2 * num_stages]


def _schedule_that_fits(cfg: RunConfig, estimate: Callable[[str], dict[str, Any]], G: int,
                        fits: Callable[[int, str], bool] | None) -> dict[str, Any]:
    """The prediction under ``--schedule``; under ``auto``, overlapped only where it is
    predicted faster and two blocks per group fit the budgets (the run's own check)."""
    pred = estimate(cfg.schedule)
    if cfg.schedule == "auto" and pred.get("schedule") == "overlapped" and fits is not None \
            and not fits(G, "overlapped"):
        pred = estimate("sequential")
    return pred


def auto_policies(cfg: RunConfig, spec: ModelSpec, ranges: list[tuple[int, int]], prompt_len: int,
                  dtype_bytes: int, device: torch.device, num_prompts: int | None = None,
                  fits: Callable[[list[Policy], list[tuple[int, int]], int, str], bool] | None = None,
                  budgets: Budgets | None = None, packed: Packed | None = None,
                  dtype: torch.dtype | None = None, head: HeadLoad | None = None,
                  prefix: PrefixShape | None = None) -> tuple[list[Policy], dict[str, Any], list[tuple[int, int]]]:
    """Policies (one per stage), the planner's prediction (with its choice of G, prefill
    items and schedule), and the (possibly rebalanced) layer ranges. The policies are planned
    for G blocks in flight; the overlapped schedule (two per group) is then chosen where it
    is predicted faster and ``fits(policies, ranges, G, schedule)``."""
    m = len(ranges)
    hws = hardware_for(cfg, device, m, budgets, dtype)
    n = num_prompts if num_prompts is not None else (cfg.num_prompts or 1)
    plan = None
    for G in group_options(cfg, m):
        if G > m and G > n:  # a group without prompts
            continue
        try:
            wl = WorkShape(prompt_len, cfg.gen_len, dtype_bytes, head or HeadLoad(), prefix)
            p = plan_pipeline(spec, m, hws, wl,
                              stage_layers=[b - a for a, b in ranges], partition=cfg.partition,
                              num_micro_batches=G, compress=bool(cfg.compress_weight),
                              max_block_size=max(1, -(-n // G)), num_prompts=n,
                              prefill_items=cfg.prefill_items,
                              schedule="sequential" if cfg.schedule == "auto" else cfg.schedule,
                              packed=packed)
        except PlanError:
            if plan is None and G == group_options(cfg, m)[-1]:
                raise
            continue
        if plan is None or p.predicted["total_throughput"] > plan.predicted["total_throughput"]:
            plan = p
    assert plan is not None
    over = cfg.policy_overrides()
    policies = [Policy.from_dict({**s.policy.to_dict(), **over}) for s in plan.stages]
    new_ranges = partition_layers(spec.num_layers, m, plan.stage_layers)
    pred = plan.predicted
    if cfg.schedule == "auto":
        G = pred["num_micro_batches"]
        wl = WorkShape(prompt_len, cfg.gen_len, dtype_bytes, head or HeadLoad(), prefix)
        either = estimate_pipeline(spec, plan.stage_layers, policies, hws, wl, G,
                                   num_blocks=-(-n // policies[0].block_size),
                                   prefill_items=pred["prefill_items"], schedule="auto", num_prompts=n)
        if either["schedule"] == "overlapped" and (fits is None or fits(policies, new_ranges, G, "overlapped")):
            pred = either
    predicted = {k: pred[k] for k in PREDICTED_KEYS if k in pred}
    predicted["hardware"] = [hw.name for hw in hws]
    return policies, predicted, new_ranges


def fixed_policy_choice(cfg: RunConfig, spec: ModelSpec, ranges: list[tuple[int, int]], policies: list[Policy],
                        prompt_len: int, dtype_bytes: int, device: torch.device, num_prompts: int,
                        fits: Any, budgets: Budgets | None = None,
                        dtype: torch.dtype | None = None, head: HeadLoad | None = None,
                        prefix: PrefixShape | None = None) -> dict[str, Any]:
    """For policies given by the user with ``--hardware FILE``: the prediction, choosing G
    among ``group_options`` where ``fits(G)``, and the prefill items and schedule by the cost
    model (overlapped where ``fits(G, "overlapped")``)."""
    m = len(ranges)
    hws = hardware_for(cfg, device, m, budgets, dtype)
    wl = WorkShape(prompt_len, cfg.gen_len, dtype_bytes, head or HeadLoad(), prefix)
    best: dict[str, Any] | None = None
    options = group_options(cfg, m)
    for G in options:
        if G != options[0] and not fits(G):
            continue
        def estimate(schedule: str, G: int = G) -> dict[str, Any]:
            return estimate_pipeline(spec, [b - a for a, b in ranges], policies, hws, wl, G,
                                     num_blocks=-(-num_prompts // policies[0].block_size),
                                     prefill_items=cfg.prefill_items, schedule=schedule,
                                     num_prompts=num_prompts)

        pred = _schedule_that_fits(cfg, estimate, G, fits)
        if best is None or pred["total_throughput"] > best["total_throughput"]:
            best = pred
    assert best is not None
    out = {k: best[k] for k in PREDICTED_KEYS}
    out["hardware"] = [hw.name for hw in hws]
    return out
