"""``--policy auto``: plan every stage's policy for this run from a hardware profile.

The profile comes from ``--hardware FILE`` or the per-host cache (measured on first use, under
a minute). Budgets given with --gpu-mem/--cpu-mem/--disk-mem replace the profile's
capacities. The plan's block size never exceeds what the prompts can fill across the
micro-batch groups.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from ..config import RunConfig
from ..engine.policy import Policy
from ..models.spec import ModelSpec
from .cost_model import Workload
from .hardware import HardwareSpec, hardware_for_stages, load_hardware_stages
from .profiler import load_or_profile
from .search import plan_pipeline


def hardware_for(cfg: RunConfig, device: torch.device, num_stages: int) -> list[HardwareSpec]:
    """Each stage's machine: --hardware FILE (one, or ``stages:`` one per stage) or this host's."""
    if cfg.hardware and cfg.hardware != "auto":
        hws = hardware_for_stages(load_hardware_stages(cfg.hardware), num_stages)
    else:
        print("planner: using the cached hardware profile of this host (profiling it if absent)",
              file=sys.stderr)
        hws = [load_or_profile(None, device.type, cfg.offload_dir)] * num_stages
    return [hw.with_budgets(gpu_mem=cfg.gpu_mem, cpu_mem=cfg.cpu_mem, disk_mem=cfg.disk_mem) for hw in hws]


def auto_policies(cfg: RunConfig, spec: ModelSpec, ranges: list[tuple[int, int]], prompt_len: int,
                  dtype_bytes: int, device: torch.device, num_prompts: int | None = None
                  ) -> tuple[list[Policy], dict[str, Any], list[tuple[int, int]]]:
    """Policies (one per stage), the planner's prediction, and the (possibly rebalanced) layer ranges."""
    m = len(ranges)
    hws = hardware_for(cfg, device, m)
    G = cfg.num_micro_batches or m
    n = num_prompts if num_prompts is not None else (cfg.num_prompts or 1)
    plan = plan_pipeline(spec, m, hws, Workload(prompt_len, cfg.gen_len, dtype_bytes),
                         stage_layers=[b - a for a, b in ranges], partition=cfg.partition,
                         num_micro_batches=G, compress=bool(cfg.compress_weight),
                         max_block_size=max(1, -(-n // G)))
    over = cfg.policy_overrides()
    policies = [Policy.from_dict({**s.policy.to_dict(), **over}) for s in plan.stages]
    new_ranges, a = [], 0
    for s in plan.stages:
        new_ranges.append((a, a + len(s.layers)))
        a += len(s.layers)
    predicted = {k: plan.predicted[k] for k in ("prefill_throughput", "decode_throughput", "total_throughput",
                                                "prefill_time_s", "decode_time_s") if k in plan.predicted}
    predicted["hardware"] = [hw.name for hw in hws]
    return policies, predicted, new_ranges
