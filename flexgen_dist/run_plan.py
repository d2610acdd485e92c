"""The run's plan, made by rank 0 at the first call: layer ranges, one policy per stage
(policy files, flags or the planner), G, prefill items and schedule, all checked against the
memory budgets with the one peak model every rank checks its own stage with.

Split from the API object because it is one decision with one input (the config, the model's
shape, the workload) and one output (a plan every rank receives), and because both the
planner (``policy="auto"``) and runs with a fixed policy ask the same question of it: does a
candidate fit the budgets?
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .config import ConfigError, RunConfig
from .distributed.items import default_prefill_items, default_schedule
from .distributed.partition import partition_layers
from .engine.budget import check_budgets, predict_peaks
from .engine.policy import Policy
from .memory.tiers import MemoryBudgetError
from .models.loader import LoadedModel


class RunPlanner:
    """Plans a run of ``model`` on ``world_size`` stages under ``config``'s budgets."""

    def __init__(self, config: RunConfig, model: LoadedModel, world_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config, self.model, self.world_size, self.device = config, model, world_size, device
        self.dtype_bytes = torch.finfo(dtype).bits // 8

    def plan(self, work: dict[str, Any]) -> dict[str, Any]:
        """Layer ranges, one policy per stage, G, prefill items and schedule for ``work``
        (prompt lengths ``lens`` and ``gen_len``)."""
        cfg, spec, m = self.config, self.model.spec, self.world_size
        ranges = partition_layers(spec.num_layers, m, cfg.stage_layers)
        run_cfg = dataclasses.replace(cfg, gen_len=work["gen_len"])
        prompt_len, gen_len, n = max(work["lens"]), work["gen_len"], len(work["lens"])
        if cfg.auto_policy:
            from .planner.auto import auto_policies

            policies, predicted, ranges = auto_policies(
                run_cfg, spec, ranges, prompt_len, self.dtype_bytes, self.device, n,
                lambda pols, rngs, G, schedule: self.fits(pols, rngs, prompt_len, gen_len, G, schedule))
        else:
            policies = cfg.stage_policies(m)
        sizes = {p.block_size for p in policies}
        if len(sizes) != 1:
            raise ConfigError(f"stage policies have block sizes {sorted(sizes)} (gpu_batch_size x "
                              "num_gpu_batches): every stage must use the same block size")
        if not cfg.auto_policy and (not cfg.hardware or cfg.hardware == "auto"):  # no profile: no planner
            predicted = self._without_profile(policies, ranges, prompt_len, gen_len, n)
        elif not cfg.auto_policy:
            from .planner.auto import fixed_policy_choice

            predicted = fixed_policy_choice(
                run_cfg, spec, ranges, policies, prompt_len, self.dtype_bytes, self.device, n,
                lambda G, schedule="sequential": self.fits(policies, ranges, prompt_len, gen_len, G, schedule))
        G, items = predicted.pop("num_micro_batches"), predicted.pop("prefill_items")
        return {"policies": [p.to_dict() for p in policies], "ranges": [list(r) for r in ranges],
                "G": G, "prefill": items, "schedule": predicted.pop("schedule", "sequential"),
                "predicted": predicted}

    def _without_profile(self, policies: list[Policy], ranges: list[tuple[int, int]], prompt_len: int,
                         gen_len: int, n: int) -> dict[str, Any]:
        """G, prefill items and schedule by the rules that need no hardware profile."""
        cfg = self.config
        G = cfg.num_micro_batches or self.world_size
        items = cfg.prefill_items if cfg.prefill_items != "auto" else default_prefill_items(policies, self.device)
        schedule = cfg.schedule
        if schedule == "auto":
            schedule = default_schedule(policies, self.device, -(-n // policies[0].block_size), G, gen_len)
            if not self.fits(policies, ranges, prompt_len, gen_len, G, schedule):
                schedule = "sequential"
        return {"num_micro_batches": G, "prefill_items": items, "schedule": schedule}

    def fits(self, policies: list[Policy], ranges: list[tuple[int, int]], prompt_len: int, gen_len: int,
             G: int, schedule: str) -> bool:
        """Whether every stage's predicted peaks fit the budgets with G groups in flight."""
        try:
            for s, (p, r) in enumerate(zip(policies, ranges)):
                check_budgets(self.peaks(p, tuple(r), s, prompt_len, gen_len, G, schedule), self.config.budgets, s)
        except MemoryBudgetError:
            return False
        return True

    def peaks(self, policy: Policy, layers: tuple[int, int], stage: int, prompt_len: int, gen_len: int,
              G: int, schedule: str = "sequential") -> dict[str, int]:
        """The budget check's peak model (``engine/budget.py``) for one stage: G blocks in
        flight, two per group when the next block's prefill rides on the current's decode."""
        return predict_peaks(self.model.spec, policy, layers, has_embed=stage == 0,
                             has_head=stage == self.world_size - 1, prompt_len=prompt_len, gen_len=gen_len,
                             dtype_bytes=self.dtype_bytes,
                             num_blocks_in_flight=G * (2 if schedule == "overlapped" else 1),
                             packed=self.model.source.packed_formats)
