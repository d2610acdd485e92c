"""The one place that decides what a run will do: ``RunPlanner.plan(workload) -> RunPlan``.

Rank 0 calls it once, at the first call, with the config, the model's shape, the workload,
the number of ranks and the memory budgets; every other module receives the ``RunPlan``.
Each choice is recorded with its reason (``RunPlan.choices``; ``--explain`` prints them):

- **layer ranges**: ``--stage-layers``, else equal (``--policy auto`` may rebalance them);
- **policies**: ``--policy auto`` (the planner's LP over a hardware profile), else the policy
  file or flags, one per stage;
- **micro-batch groups G**: ``--num-micro-batches``, else the cost model's best of m and 2m
  where there is a profile (``--hardware FILE``, or this host's cached one, which the first
  ``--policy auto`` run measures), else m (every stage busy);
- **prefill items** and **schedule**: the flags, else the cost model's choice where there is
  a profile, else the rules below that need none;
- **peaks**: each stage's predicted bytes per tier (``engine/footprint.py``), checked against
  the budgets before anything is allocated.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .budgets import Budgets, check_budgets, fits
from .config import DEFAULT_SORT_WINDOW, ConfigError, RunConfig
from .distributed.partition import partition_layers
from .engine.beams import beams_refusal, one_tier_caches
from .engine.footprint import predict_peaks
from .engine.held import holds_prefix, planned_hold
from .engine.policy import Policy
from .models.loader import LoadedModel
from .plan import Choice, Peaks, Prediction, RunPlan, StagePlan, Workload
from .planner.profile_cache import cached_profile

Ranges = list[tuple[int, int]]


class RunPlanner:
    """Plans a run of ``model`` on ``world_size`` stages within ``budgets``."""

    def __init__(self, config: RunConfig, model: LoadedModel, world_size: int, device: torch.device,
                 dtype: torch.dtype, budgets: Budgets) -> None:
        self.config, self.model, self.world_size, self.device = config, model, world_size, device
        self.budgets = budgets
        self.dtype = dtype
        self.dtype_bytes = torch.finfo(dtype).bits // 8
        # a default GPU batch size is a multiple of this (a batch job's beam searches: every width)
        self.row_unit = 1

    def plan(self, work: Workload) -> RunPlan:
        """Every stage's layers, policy and peaks, G, prefill items and schedule for ``work``."""
        cfg, m = self.config, self.world_size
        weights = self.model.spec.layer_weights()
        ranges = partition_layers(self.model.spec.num_layers, m, cfg.stage_layers, weights)
        split = "equal split (--partition equal)" if weights is None else \
            "split by the layers' bytes and compute (dense and sparse layers differ)"
        why: list[Choice] = [Choice("layers", str([list(r) for r in ranges]),
                                    "--stage-layers" if cfg.stage_layers else split)]
        if cfg.auto_policy:
            policies, predicted, ranges = self._auto(work, ranges)
            why = [Choice("layers", str([list(r) for r in ranges]),
                          "--partition balanced: moved by the planner's stage times" if cfg.partition == "balanced"
                          else "--stage-layers" if cfg.stage_layers else "equal split (--partition equal)"),
                   Choice("policies", "planned", "--policy auto: the planner's LP for each stage on "
                          f"{', '.join(predicted['hardware'])}")]
        else:
            policies = cfg.stage_policies(m)
            why.append(Choice("policies", "given", f"--policy {cfg.policy}" if cfg.policy else
                              "the flags (--percent, --gpu-batch-size, ...) or their defaults"))
            if not cfg.block_given(m):
                policies, reason = self._default_block(policies, ranges, work)
                why.append(Choice("gpu_batch_size", str(policies[0].gpu_batch_size), reason))
            if len({p.block_size for p in policies}) != 1:
                raise ConfigError(f"stage policies have block sizes {sorted({p.block_size for p in policies})} "
                                  "(gpu_batch_size x num_gpu_batches): every stage must use the same block size")
            if cfg.hardware and cfg.hardware != "auto":
                predicted = self._fixed(work, ranges, policies)
            elif cfg.hardware == "auto" or cached_profile(self.device.type) is not None:
                # this host's profile, measured by an earlier --policy auto run (or `planner
                # profile`): the cost model chooses what the flags leave open
                predicted = self._fixed(work, ranges, policies)
                predicted["why"].insert(0, Choice("hardware", predicted["hardware"][0],
                                                  "this host's cached profile (--hardware FILE for another)"))
            else:
                predicted = self._without_profile(work, ranges, policies)
        return self._record(work, ranges, policies, predicted, why)

    def _record(self, work: Workload, ranges: Ranges, policies: list[Policy], predicted: dict[str, Any],
                why: list[Choice]) -> RunPlan:
        G, items, schedule = predicted["num_micro_batches"], predicted["prefill_items"], predicted["schedule"]
        why += predicted["why"]
        inflight = G * (2 if schedule == "overlapped" else 1)
        times = predicted.get("stage_times") or [{}] * len(policies)
        stages = tuple(StagePlan(s, (r[0], r[1]), p, self.peaks(p, (r[0], r[1]), s, work, inflight),
                                 t.get("prefill_s"), t.get("decode_step_s"))
                       for s, (p, r, t) in enumerate(zip(policies, ranges, times)))
        pred = Prediction.of(predicted) if "total_throughput" in predicted else None
        nblocks = -(-work.num_prompts // policies[0].block_size)
        w = self.config.sort_window
        why.append(Choice("blocks", f"grouped by length, {w} blocks' worth of requests at a time" if w else
                          "in input order", ("--sort-window" if w != DEFAULT_SORT_WINDOW else f"the default (--sort-window {w})")
                          + ": outputs go out in input order, a window at a time"))
        return RunPlan(stages, G, items, schedule, nblocks, pred, tuple(why), w)

    # --- the three ways to G, prefill items and schedule ------------------------------------
    def _auto(self, work: Workload, ranges: Ranges) -> tuple[list[Policy], dict[str, Any], Ranges]:
        from .planner.auto import auto_policies

        cfg = dataclasses.replace(self.config, gen_len=work.gen_len)
        policies, predicted, ranges = auto_policies(
            cfg, self.model.spec, ranges, work.prompt_len, self.dtype_bytes, self.device, work.num_prompts,
            lambda pols, rngs, G, schedule: self.fits(pols, rngs, work, G, schedule), self.budgets,
            packed=self.model.source.packed_formats, dtype=self.dtype, head=work.head_load, prefix=work.prefix)
        predicted["why"] = _model_reasons(cfg, predicted)
        unit = self._unit(work)
        if unit > 1 and any(p.gpu_batch_size % unit for p in policies):  # whole prompts' beams per GPU batch
            policies = [dataclasses.replace(p, gpu_batch_size=max(unit, p.gpu_batch_size // unit * unit))
                        for p in policies]
            predicted["why"].append(Choice("gpu_batch_size", str(policies[0].gpu_batch_size),
                                           f"the planner's, rounded to a multiple of {unit} (each prompt's beams in "
                                           "one GPU batch)"))
        if work.beams is not None and any(len(one_tier_caches(p)) > 1 for p in policies):
            policies = self._one_tier(policies, ranges, work, unit, predicted)
        return policies, predicted, ranges

    def _one_tier(self, policies: list[Policy], ranges: Ranges, work: Workload, unit: int,
                  predicted: dict[str, Any]) -> list[Policy]:
        """A beam search moves each GPU batch's cache rows in place, on one tier: each stage's
        split cache on its highest tier that fits (``one_tier_caches``), the GPU batch halved
        (whole prompts' beams) until one does; the reasons join ``predicted["why"]``."""
        G, schedule = predicted.get("num_micro_batches", 1), predicted.get("schedule", "sequential")
        gbs = policies[0].gpu_batch_size
        while True:
            sized = [dataclasses.replace(p, gpu_batch_size=gbs) for p in policies]
            for s, p in enumerate(sized):
                sized[s] = next((o for o in one_tier_caches(p)
                                 if self.fits([*sized[:s], o, *sized[s + 1:]], ranges, work, G, schedule)), p)
            if all(len(one_tier_caches(p)) == 1 for p in sized) or gbs == unit:
                break
            gbs = max(unit, gbs // 2 // unit * unit)
        for s, (p, q) in enumerate(zip(policies, sized)):
            if (p.cache_gpu_percent, p.cache_cpu_percent) != (q.cache_gpu_percent, q.cache_cpu_percent):
                predicted["why"].append(Choice(
                    "cache percent", f"{q.cache_gpu_percent:g} {q.cache_cpu_percent:g} (stage {s})",
                    "the planner's split cache on its highest tier that fits"
                    + (f" with GPU batches of {gbs}" if gbs != p.gpu_batch_size else "")
                    + ": a beam search reorders each GPU batch's cache on one tier"))
        return sized

    def _unit(self, work: Workload) -> int:
        """A GPU batch size's unit: every beam width the run will search with."""
        return math.lcm(self.row_unit, work.beams.width if work.beams is not None else 1)

    def _fixed(self, work: Workload, ranges: Ranges, policies: list[Policy]) -> dict[str, Any]:
        from .planner.auto import fixed_policy_choice

        cfg = dataclasses.replace(self.config, gen_len=work.gen_len)
        predicted = fixed_policy_choice(
            cfg, self.model.spec, ranges, policies, work.prompt_len, self.dtype_bytes, self.device,
            work.num_prompts, lambda G, schedule="sequential": self.fits(policies, ranges, work, G, schedule),
            self.budgets, dtype=self.dtype, head=work.head_load, prefix=work.prefix)
        predicted["why"] = _model_reasons(cfg, predicted)
        return predicted

    def _without_profile(self, work: Workload, ranges: Ranges, policies: list[Policy]) -> dict[str, Any]:
        """G, prefill items and schedule by the rules that need no hardware profile."""
        cfg, m = self.config, self.world_size
        G = cfg.num_micro_batches or m
        why = [Choice("num_micro_batches", str(G), "--num-micro-batches" if cfg.num_micro_batches else
                      "no hardware profile: one group per stage keeps every stage busy")]
        if cfg.prefill_items != "auto":
            items, reason = cfg.prefill_items, "--prefill-items"
        else:
            items, reason = default_prefill_items(policies, self.device)
        why.append(Choice("prefill_items", items, reason))
        if cfg.schedule != "auto":
            schedule, reason = cfg.schedule, "--schedule"
        else:
            nblocks = -(-work.num_prompts // policies[0].block_size)
            schedule, reason = default_schedule(policies, self.device, nblocks, G, work.gen_len)
            if schedule == "overlapped" and not self.fits(policies, ranges, work, G, schedule):
                schedule, reason = "sequential", "two blocks per group would not fit the memory budgets"
        why.append(Choice("schedule", schedule, reason))
        return {"num_micro_batches": G, "prefill_items": items, "schedule": schedule, "why": why}

    def _default_block(self, policies: list[Policy], ranges: Ranges, work: Workload) -> tuple[list[Policy], str]:
        """Every stage's policy with the block ``default_block`` sizes for ``work``, halved
        until the stages' peaks fit 90 % of the machine-measured budgets (else the budgets
        whole); and the reason. Where not even one row fits, one row: the budget check then
        reports what the placement needs at the least."""
        G = self.config.num_micro_batches or self.world_size
        unit = self._unit(work)  # a prompt's beams share a GPU batch
        cap = DEFAULT_MAX_BLOCK[self.device.type]
        # a prompt's candidates (n choices, best_of) share one too where the block allows: each
        # batch then computes each prompt's prefill once (``engine/twins.py``)
        same = set(work.prefix.repeats) if work.prefix is not None and work.prefix.repeats else set()
        base = default_block(work.num_prompts, G, self.device)
        cut = base < -(-work.num_prompts // G)  # a group's rows over several GPU batches
        soft = math.lcm(unit, *same) if cut and len(same) == 1 and max(same) > 1 else unit
        groups = f" over {G} micro-batch groups" if G > 1 else ""
        held = self._prefix_terms(policies[0], work)["held"]
        counted = f"; each row's cache counted without the {held}-token opening every prompt shares (held once)" \
            if held else ""
        for u in dict.fromkeys((soft if soft <= cap else unit, unit)):
            size = -(-base // u) * u
            reason = (f"no --gpu-batch-size: {work.num_prompts} prompts{groups} in equal blocks of at most {cap} rows "
                      f"on a {self.device.type} device, rounded up to a multiple of {BLOCK_ROUND}"
                      + (f" and of {u} (each prompt's {max(same)} candidates in one GPU batch)" if u != unit else ""))
            for share, budgets in ((DEFAULT_BLOCK_HEADROOM, self.budgets.with_headroom(DEFAULT_BLOCK_HEADROOM)),
                                   (1.0, self.budgets)):
                gbs = size
                while True:
                    sized = [dataclasses.replace(p, gpu_batch_size=gbs) for p in policies]
                    if self.fits(sized, ranges, work, G, "sequential", budgets):
                        if gbs < size:
                            reason += f"; halved from {size} to fit {share:.0%} of the memory budgets"
                        return sized, reason + counted
                    if gbs == u:
                        break
                    gbs = max(u, gbs // 2 // u * u)
        return ([dataclasses.replace(p, gpu_batch_size=unit) for p in policies],
                "no --gpu-batch-size, and not even one row fits the memory budgets: the placement must change")

    # --- memory ------------------------------------------------------------------------------
    def fits(self, policies: list[Policy], ranges: Ranges, work: Workload, G: int, schedule: str,
             budgets: Budgets | None = None) -> bool:
        """Whether every stage's predicted peaks fit the budgets (the run's, or ``budgets``)
        with G groups in flight."""
        inflight = G * (2 if schedule == "overlapped" else 1)
        return all(fits(self.peaks(p, (r[0], r[1]), s, work, inflight), budgets or self.budgets)
                   for s, (p, r) in enumerate(zip(policies, ranges)))

    def peaks(self, policy: Policy, layers: tuple[int, int], stage: int, work: Workload,
              blocks_in_flight: int) -> Peaks:
        """The peak model (``engine/footprint.py``, the planner's too) for one stage and ``work``."""
        return Peaks.of(predict_peaks(self.model.spec, policy, layers, has_embed=stage == 0,
                                      has_head=stage == self.world_size - 1, prompt_len=work.prompt_len,
                                      gen_len=work.gen_len, dtype_bytes=self.dtype_bytes,
                                      num_blocks_in_flight=blocks_in_flight,
                                      packed=self.model.source.packed_formats, num_stages=self.world_size,
                                      cuda=self.device.type == "cuda", head=work.head_load,
                                      **self._prefix_terms(policy, work)))

    def _prefix_terms(self, policy: Policy, work: Workload) -> dict[str, Any]:
        """The peaks' shared-prefix terms: the longest prefix a block computes once and the
        fewest positions a row's cache leaves out where the model and policy hold prefixes through
        decode (``engine/held.py``; None: not held). Once rank 0 has found the blocks' prefixes
        (``Workload.shared``), theirs; before (planning), the opening every prompt shares
        (``PrefixShape.floor``), which every block will share at the least. A call's blocks that
        keep their GPU batches' repeated prompts once count what that leaves out of a row
        instead (``Workload.held``, ``engine/prompt_groups.py``)."""
        if work.shared is not None:
            shared, held = max(work.shared), work.held
        else:
            shared = held = planned_hold(None if work.embed else work.prefix, work.prompt_len + work.gen_len,
                                         policy.block_size)
        holds = holds_prefix(self.model.spec, policy.attn_sparsity, work.prompt_len + work.gen_len)
        return {"shared": shared, "held": held if holds else None}

    def check(self, plan: RunPlan, work: Workload, rank: int) -> Peaks:
        """This rank's stage's peaks for ``work`` under ``plan``, refused if over a budget."""
        st = plan.stage(rank)
        if work.beams is not None:  # the same on every rank: each checks every stage
            for s in plan.stages:
                why = beams_refusal(s.policy, work.beams.width)
                if why:
                    raise ConfigError(why)
        peaks = self.peaks(st.policy, st.layers, rank, work, plan.blocks_in_flight)
        check_budgets(peaks, self.budgets, stage=rank)
        return peaks


def _model_reasons(cfg: RunConfig, predicted: dict[str, Any]) -> list[Choice]:
    """Why G, prefill items and schedule are what the cost model's prediction says."""
    total = predicted.get("total_throughput", 0.0)
    by_model = f"the cost model's best (predicted total {total:.1f} tok/s)"
    given = {"num_micro_batches": cfg.num_micro_batches is not None, "prefill_items": cfg.prefill_items != "auto",
             "schedule": cfg.schedule != "auto"}
    flags = {"num_micro_batches": "--num-micro-batches", "prefill_items": "--prefill-items",
             "schedule": "--schedule"}
    return [Choice(k, str(predicted[k]), flags[k] if given[k] else by_model) for k in flags]


DEFAULT_MAX_BLOCK = {"cpu": 64, "cuda": 256}  # rows of a default block, per compute device type
BLOCK_ROUND = 8
DEFAULT_BLOCK_HEADROOM = 0.9  # a sized default fills at most this share of a budget measured on the machine


def default_block(num_prompts: int, num_groups: int, device: torch.device) -> int:
    """The GPU batch size where no flag, policy file or stage mapping gives one (one GPU
    batch per block): each of the ``num_groups`` micro-batch groups gets a share of the
    prompts, cut into as few blocks as the device's cap allows, of equal size, rounded up
    to a multiple of 8 (few distinct GEMM shapes). A decode step reads every weight once per
    block whatever its rows, so fewer, larger blocks carry more tokens per read: on a 2-core
    CPU the bundled model's decode went from 128 tok/s in blocks of 8 to 305 in blocks of 32
    and held at 64 (docs/benchmarks.md). The caps (64 rows on a CPU, 256 on a GPU) bound
    the padding and the memory a guess may take; the run planner halves the size until it
    fits 90 % of each budget measured on the machine (the user's caps whole)."""
    share = -(-num_prompts // max(1, num_groups))
    cap = DEFAULT_MAX_BLOCK.get(device.type, DEFAULT_MAX_BLOCK["cpu"])
    blocks = -(-share // cap)
    rows = -(-share // blocks)
    return min(cap, -(-rows // BLOCK_ROUND) * BLOCK_ROUND)


def default_prefill_items(policies: list[Policy], device: torch.device) -> tuple[str, str]:
    """Without a hardware profile: one prefill item per GPU batch where that costs no extra
    weight traffic (every stage's weights at rest on the compute device, uncompressed) and
    the stages share one GPU batch size; else one per block. Returns (choice, reason)."""
    if len(policies) == 1:
        return "block", "one stage: nothing to overlap a block's prefill with"
    if len({p.gpu_batch_size for p in policies}) > 1:
        return "block", "the stages' GPU batch sizes differ (pieces are GPU batches)"
    for p in policies:
        wg, wc, wd = p.fractions("w")
        resident = wd < 1e-9 if device.type == "cpu" else wg > 1 - 1e-9
        if p.num_gpu_batches == 1 or p.compress_weight or not resident:
            return "block", "no hardware profile, and pieces would re-read off-device weights per GPU batch"
    return "batch", "no hardware profile; weights at rest on the compute device, so pieces cost no reads"


def default_schedule(policies: list[Policy], device: torch.device, num_blocks: int, num_groups: int,
                     gen_len: int) -> tuple[str, str]:
    """Without a hardware profile: overlapped on a GPU whose decode steps stream weights from
    host RAM or disk (the GPU idles while they come, and a rider's prefill fills that time)
    and where some group has a next block to ride; else sequential. On a CPU device the
    reads take CPU time from the same cores, and whether a rider gains depends on how
    disk-bound decode is (measured +23 % to -2 %): only the cost model, with a profile,
    takes it there. Returns (choice, reason)."""
    if device.type != "cuda":
        return "sequential", "no hardware profile on a CPU device (a rider's gain depends on the disk)"
    if gen_len < 2 or num_blocks <= num_groups:
        return "sequential", "no group has a next block to ride on its decode steps"
    if any(p.fractions("w")[0] < 1 - 1e-9 for p in policies):
        return "overlapped", "the GPU waits for streamed weights in decode: a rider's prefill fills it"
    return "sequential", "every weight on the GPU: decode does not wait for reads"

