"""Pipeline planning: every stage's policy for one block size shared by all stages, the
block size (and G's prediction, prefill items, schedule) with the highest predicted total
throughput of the whole pipeline, and optionally a layer split balanced by the prediction.
Each stage's own search is ``search.stage_candidates``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from flexgen_dist.distributed.partition import partition_layers
from flexgen_dist.engine.footprint import Packed
from flexgen_dist.engine.policy import Policy
from flexgen_dist.models.spec import ModelSpec
from flexgen_dist.planner.cost_model import StageCost, best_pipeline, piece_cost
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner.search import Candidate, PlanError, diagnose, stage_candidates
from flexgen_dist.planner.sizes import WorkShape


class PlannedStage(NamedTuple):
    """The planner's answer for one stage (the run's record of a stage is ``plan.StagePlan``)."""

    layers: range  # model layer indices this stage owns
    policy: Policy
    cost: StageCost


@dataclass(frozen=True)
class PipelinePlan:
    """Per-stage policies for one pipeline and the planner's predicted throughput."""

    model: str
    workload: WorkShape
    num_micro_batches: int
    stages: list[PlannedStage]
    predicted: dict

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_layers(self) -> list[int]:
        return [len(s.layers) for s in self.stages]

    @property
    def policies(self) -> list[Policy]:
        return [s.policy for s in self.stages]


def _balance(best_for: Callable[[list[int]], tuple[float, list[Candidate], dict]],
             best: tuple[float, list[Candidate], dict], layers: list[int],
             gen_len: int) -> tuple[tuple[float, list[Candidate], dict], list[int]]:
    """Hand one layer at a time from the slowest stage to a neighbour while that raises the
    predicted total throughput; the best plan and its layer counts."""
    m = len(layers)
    improved = True
    while improved:
        improved = False
        times = [s["prefill_s"] + (gen_len - 1) * s["decode_step_s"] for s in best[2]["stage_times"]]
        slow = int(np.argmax(times))
        for nb in (slow - 1, slow + 1):
            if not 0 <= nb < m or layers[slow] <= 1:
                continue
            trial = list(layers)
            trial[slow] -= 1
            trial[nb] += 1
            try:
                cand = best_for(trial)
            except PlanError:
                continue
            if cand[0] > best[0] * (1 + 1e-9):
                best, layers, improved = cand, trial, True
                break
    return best, layers


def _piece_costs(spec: ModelSpec, split: list[int], chosen: list[Candidate], hws: list[HardwareSpec],
                 workload: WorkShape, G: int) -> list:
    """Each stage's cost of one GPU batch's prefill with its own weight loads (a prefill
    piece, or a rider of the overlapped schedule), under the stage's chosen policy."""
    m = len(split)
    return [piece_cost(spec, n, c.policy(), hws[i], workload, has_embed=i == 0,
                           has_head=i == m - 1, num_micro_batches=G, num_stages=m)
            for i, (n, c) in enumerate(zip(split, chosen))]


def plan_pipeline(spec: ModelSpec, num_stages: int, hws: list[HardwareSpec] | HardwareSpec,
                  workload: WorkShape, *, stage_layers: list[int] | None = None,
                  partition: str = "equal", num_micro_batches: int | None = None,
                  compress: bool = False, max_gpu_batch_size: int = 64,
                  max_num_gpu_batches: int = 16, max_block_size: int | None = None,
                  num_prompts: int | None = None, prefill_items: str = "auto",
                  schedule: str = "auto", packed: Packed | None = None) -> PipelinePlan:
    """Plan every stage of an m-stage pipeline; all stages share one block size.

    Each stage's search gives its best placement per block size; the block size with the
    highest predicted total throughput of the whole pipeline wins. ``partition="balanced"``
    then moves layers across stage boundaries while that raises the prediction (it matters
    for the stages carrying the embedding and the LM head, and for mixed hardware).
    ``num_micro_batches`` defaults to the number of stages (every stage busy).
    ``num_prompts`` (default: one block per group) sets how many blocks the prediction runs;
    ``prefill_items`` (auto, block, batch) how a block's prefill crosses the stages;
    ``schedule`` (auto, sequential, overlapped) whether next blocks' prefill rides on decode;
    ``packed`` (a source's ``packed_formats``) sizes weights kept in their checkpoint's blocks.
    """
    m = num_stages
    hw_list = list(hws) if isinstance(hws, (list, tuple)) else [hws] * m
    if len(hw_list) != m:
        raise ValueError(f"{len(hw_list)} hardware specs for {m} stages: give one, or one per stage")
    if partition not in ("equal", "balanced"):
        raise ValueError(f"partition={partition!r}: use 'equal' or 'balanced'")
    G = num_micro_batches or m
    layers = [b - a for a, b in partition_layers(spec.num_layers, m, stage_layers, spec.layer_weights())]
    memo: dict[tuple, dict[int, Candidate]] = {}

    def candidates(i: int, first: int, n_layers: int) -> dict[int, Candidate]:
        # a packed checkpoint's layers may differ in size; otherwise only the count matters
        key = (n_layers, i == 0, i == m - 1, hw_list[i], first if packed is not None else 0)
        if key not in memo:
            memo[key] = stage_candidates(
                spec, n_layers, hw_list[i], workload, has_embed=i == 0, has_head=i == m - 1,
                max_gpu_batch_size=max_gpu_batch_size, max_num_gpu_batches=max_num_gpu_batches,
                compress=compress, num_micro_batches=G, num_stages=m, max_block_size=max_block_size,
                first_layer=first, packed=packed)
            if not memo[key]:
                where = f"stage {i} of {m}: " if m > 1 else ""
                raise PlanError(where + diagnose(
                    spec, n_layers, hw_list[i], workload, has_embed=i == 0, has_head=i == m - 1,
                    compress=compress, num_micro_batches=G, num_stages=m))
        return memo[key]

    def best_for(split: list[int]) -> tuple[float, list[Candidate], dict]:
        per_stage = [candidates(i, sum(split[:i]), n) for i, n in enumerate(split)]
        common = set.intersection(*(set(c) for c in per_stage))
        if not common:
            raise PlanError(f"the {m} stages of {spec.name} share no feasible block size: "
                            "raise the memory budgets or use another partition")
        best = None
        for bls in sorted(common):
            chosen = [c[bls] for c in per_stage]
            ngb = chosen[0].num_gpu_batches
            same_gbs = len({c.gpu_batch_size for c in chosen}) == 1  # pieces are GPU batches
            pieces = _piece_costs(spec, split, chosen, hw_list, workload, G) if same_gbs and (
                (m > 1 and ngb > 1 and prefill_items != "block") or schedule != "sequential") else None
            nblocks = -(-num_prompts // bls) if num_prompts else None
            pred = best_pipeline([c.cost() for c in chosen], pieces, G, num_blocks=nblocks,
                                 num_gpu_batches=ngb, prefill_items=prefill_items, schedule=schedule,
                                 num_prompts=num_prompts or None)
            if best is None or pred["total_throughput"] > best[0]:
                best = (pred["total_throughput"], chosen, pred)
        assert best is not None
        return best

    best = best_for(layers)
    if partition == "balanced" and m > 1:
        best, layers = _balance(best_for, best, layers, workload.gen_len)
    _, chosen, pred = best
    stages = [PlannedStage(range(a, b), c.policy(), c.cost())
              for (a, b), c in zip(partition_layers(spec.num_layers, m, layers), chosen)]
    return PipelinePlan(model=spec.name, workload=workload, num_micro_batches=G,
                        stages=stages, predicted=pred)
