"""One rank's side of a run: its stage engine (built once, for the first plan), the pipeline
loop over a call's blocks, and the stage's record of what it measured.

The API (``api.LLM``) owns the rank group and the plan; a ``StageWorker`` receives both as
values and never decides anything about the run.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterator

import torch

from . import hugepages
from .config import RunConfig
from .distributed.group import RankGroup
from .distributed.pipeline import Pipeline
from .engine.blocks import (MIN_SHARED, BlockPlan, plan_blocks, prefill_positions, prefix_groupings,
                            prefix_reuse, repeat_counts, repeated_prompts, shared_prefixes, unscored_prefixes)
from .engine.footprint import needs_disk
from .engine.held import held_floor, holds_prefix
from .engine.prompt_groups import kept_positions
from .engine.prefix_shape import PrefixShape
from .engine.prefix import longest_sharing, shares_prefix
from .engine.stage import StageEngine
from .engine.structure import guide_tokenizer
from .kernels import gemm
from .memory.disk import DiskStore
from .metrics import progress_bar
from .models.loader import LoadedModel
from .plan import Peaks, RunPlan, Workload
from .threads import ThreadChoice

log = logging.getLogger("flexgen_dist")


def call_blocks(work: Workload, block_size: int, sort_window: int) -> list[BlockPlan]:
    """The call's blocks (``engine/blocks.py``), the same on every rank: grouped by opening
    (where rank 0 chose groups) and length within windows (scoring: in input order), each
    with the prefix its prompts share."""
    limits = None if work.max_new_tokens is None else list(work.max_new_tokens)
    blocks = plan_blocks(list(work.lens), block_size, limits, sort_window if work.targets is None else 0,
                         work.groups, work.twins)
    if work.shared is not None:
        for blk in blocks:
            blk.shared = work.shared[blk.members[0]]
    if work.adapters is not None:  # a block's rows by adapter: each adapter's rows one run (``lora_rows.py``)
        for blk in blocks:
            order = sorted(range(len(blk.members)), key=lambda r: work.adapters[blk.members[r]])  # type: ignore[index]
            blk.members, blk.lens = [blk.members[r] for r in order], [blk.lens[r] for r in order]
            blk.adapters = [work.adapters[m] for m in blk.members]
    if work.twins is not None:  # a block's repeated prompts (``engine/twins.py``)
        for blk in blocks:
            firsts = [work.twins[m] for m in blk.members]
            blk.twins = firsts if len(set(firsts)) < len(firsts) else None
    if work.reuse is not None:
        for blk, nxt in zip(blocks, blocks[1:] + [None]):
            blk.reuse = work.reuse[blk.members[0]]
            blk.keep = nxt is not None and work.reuse[nxt.members[0]]
    return blocks


def with_twins(work: Workload) -> Workload:
    """Rank 0: ``work`` with each request's first request of the same prompt and adapter
    (``blocks.repeated_prompts``), whose prefill a GPU batch computes once (``engine/twins.py``;
    generation and embeddings, not scoring); else ``work`` as it is."""
    if not work.prompts or work.targets is not None:
        return work
    twins = repeated_prompts([p.ids for p in work.prompts], work.adapters)
    if twins is None:
        return work
    shape = dataclasses.replace(work.prefix or PrefixShape(), repeats=repeat_counts(twins))  # what the planner expects
    return dataclasses.replace(work, twins=twins, prefix=shape)


def with_shared_prefixes(work: Workload, plan: RunPlan, spec: Any, fits: Callable[[Workload], bool],
                         cuda: bool = False) -> Workload:
    """Rank 0: ``work`` with each request's prefix shared with the rest of its block
    (``blocks.shared_prefixes``) where the model can share one (``prefix.shares_prefix``) and the
    plan still ``fits`` with the prefixes' keys held; else ``work`` as it is (``cuda``: the
    stages compute on GPUs, for what keeping repeated prompts once leaves out). Where the
    window's prompts open differently, the requests are grouped by opening first if a grouping
    computes fewer prefill positions (``blocks.prefix_groupings``, ``blocks.prefill_positions``)."""
    if not work.prompts or not shares_prefix(spec) or (work.embed and spec.pooling != "last"):
        return work  # (an embedding pooled over every position needs each input's states whole)
    ids, longest = [p.ids for p in work.prompts], longest_sharing(spec)
    # requests of different LoRA adapters share no keys: each prompt opens with a token of its
    # adapter's own for the comparisons (one more shared token where they agree; taken off after)
    mixed = int(work.adapters is not None and len(set(work.adapters)) > 1)
    if mixed:
        ids = [[-1 - a] + list(p) for p, a in zip(ids, work.adapters)]  # type: ignore[arg-type]
        longest = None if longest is None else longest + 1
    best: tuple[int, tuple[int, ...] | None, tuple[int, ...], tuple[bool, ...], list[BlockPlan]] | None = None
    for groups in [None, *prefix_groupings(ids, plan.block_size, plan.sort_window, MIN_SHARED + mixed)]:
        blocks = call_blocks(dataclasses.replace(work, groups=groups), plan.block_size, plan.sort_window)
        shared = tuple(max(0, n - mixed) for n in shared_prefixes(ids, blocks, MIN_SHARED + mixed, longest))
        if work.targets is not None:  # scoring: never over a scored position
            shared = unscored_prefixes(blocks, shared, work.lens, work.targets)
        reuse = prefix_reuse(ids, blocks, tuple(n + mixed if n else 0 for n in shared))
        cost = prefill_positions(blocks, shared, reuse)
        if best is None or cost < best[0]:
            best = (cost, groups, shared, reuse, blocks)
    assert best is not None
    _, groups, shared, reuse, blocks = best
    total = work.prompt_len + work.gen_len
    holds = all(holds_prefix(spec, s.policy.attn_sparsity, total) for s in plan.stages)
    cuts = {(s.policy.gpu_batch_size, s.policy.fractions("cache")) for s in plan.stages}

    def kept(lengths: tuple[int, ...]) -> list[int | None] | None:
        """Per block, what keeping its GPU batches' repeated prompts once leaves out of a row of
        the call's length (``engine/prompt_groups.py``), the least over the stages' policies."""
        if work.twins is None or not holds:
            return None
        out: list[int | None] = []
        for blk in blocks:
            got = [kept_positions(blk.meta(gbs, work.gen_len), gbs, spec.num_kv_heads, fr, lengths[blk.members[0]],
                                  cuda) for gbs, fr in cuts]
            out.append(None if None in got else min(got) + work.prompt_len - blk.prompt_len)  # type: ignore[type-var]
        return out

    nothing = (0,) * work.num_prompts  # decided: no prefix shared, held or taken from another block
    unshared = dataclasses.replace(work, shared=nothing, held=held_floor(blocks, nothing, total, plan.block_size,
                                                                         kept(nothing)))
    if not any(shared):
        return unshared
    if groups is not None:
        log.info("requests grouped by their opening before their length: %d prefix groups",
                 len({g for g in groups if g >= 0}))

    def sharing(lengths: tuple[int, ...], reused: tuple[bool, ...]) -> Workload:
        return dataclasses.replace(work, shared=lengths, groups=groups, reuse=reused if any(reused) else None,
                                   held=held_floor(blocks, lengths, total, plan.block_size, kept(lengths)))

    out = sharing(shared, reuse)
    if fits(out):
        return out
    # the plan may count on the opening every prompt shares being held (``PrefixShape.floor``):
    # the blocks then share that much and no more
    floor = work.prefix.floor if work.prefix is not None else 0
    if floor:
        capped = tuple(min(n, floor) for n in shared)
        out = sharing(capped, prefix_reuse(ids, blocks, tuple(n + mixed if n else 0 for n in capped)))
        if fits(out):
            log.info("the blocks' shared prefixes are cut to the %d tokens every prompt shares: longer ones would "
                     "not fit the memory budgets", floor)
            return out
    log.info("the prompts' shared prefixes are computed with each prompt: the prefix's keys would not fit "
             "the memory budgets")
    return unshared


class StageWorker:
    """The stage of ``group.rank`` under a plan: its engine, offload files and records."""

    def __init__(self, config: RunConfig, model: LoadedModel, group: RankGroup, device: torch.device,
                 dtype: torch.dtype, threads: ThreadChoice | None = None) -> None:
        self.config, self.model, self.group, self.device, self.dtype = config, model, group, device, dtype
        self.threads = threads  # the rank's compute threads, already applied (threads.py)
        self.one_time: dict[str, float] = {}  # what preparing the stage cost, outside the clock
        self.engine: StageEngine | None = None
        self.disk: DiskStore | None = None
        self.record: dict[str, Any] = {}  # the last call's stage record
        self.timings: Any = None  # the last call's pipeline timings
        self.blocks: list[BlockPlan] = []  # the current call's blocks

    def build(self, plan: RunPlan, peaks: Peaks) -> bool:
        """Place this stage's weights for ``plan`` (once); whether it was built now."""
        if self.engine is not None:
            return False
        st, rank = plan.stage(self.group.rank), self.group.rank
        try:
            if needs_disk([st.policy], states=any(self.model.spec.linear(j) for j in range(*st.layers))):
                self.disk = DiskStore(self.config.offload_dir, rank=rank,
                                      direct_io=self.config.direct_io)
                self.group.add_cleanup(self.disk.close)
                self.disk.check_space(peaks.disk)
            self.engine = StageEngine(self.model.spec, self.model.source, st.layers, has_embed=rank == 0,
                                      has_head=rank == self.group.size - 1, policy=st.policy, device=self.device,
                                      dtype=self.dtype, disk=self.disk)
        except BaseException:
            if self.disk is not None:  # no half-built stage keeps files
                self.disk.close()
                self.disk = None
            raise
        log.info("stage %d: layers [%d, %d) weights %s", rank, *st.layers, self.engine.describe())
        return True

    def prepare(self, plan: RunPlan, work: Workload) -> dict[str, float]:
        """Cut this call's blocks and pay the stage's one-time costs for them before any clock
        starts (``StageEngine.prepare``: the kernels' build, the GEMM forms of the row counts
        the blocks' steps will have); returns those costs, also kept in the stage record."""
        engine = self.engine
        assert engine is not None, "build() first"
        self.blocks = call_blocks(work, engine.policy.block_size, plan.sort_window)
        gbs = engine.policy.gpu_batch_size
        rows = {r for b in self.blocks for r in (len(b.members), *b.meta(gbs, 1).batch_sizes)}
        self.one_time = engine.prepare(rows)
        return self.one_time

    def run(self, plan: RunPlan, work: Workload, peaks: Peaks) -> Iterator[tuple[BlockPlan, list[Any]]]:
        """The one loop over this call's blocks: rank 0 gets (block, per-row results) of each
        block; ``blocks`` are the call's blocks (grouped by length, ``engine/blocks.py``); at the
        end ``record`` holds this stage's figures."""
        engine = self.engine
        assert engine is not None, "build() first"
        blocks = self.blocks  # cut by prepare()
        stops = work.stop_strings(self.model.tokenizer) if self.group.is_driver else None
        guide = None
        if engine.has_head and work.structured:  # the last stage masks the choices by llguidance's tokenizer
            spec = self.model.spec
            guide = guide_tokenizer(self.model.tokenizer, spec.vocab_size, spec.eos_token_ids)
        pipe = Pipeline(engine, blocks, gen_len=work.gen_len, sampling=work.sampling,
                        num_groups=plan.num_micro_batches, ctx=self.group.ctx,
                        targets=None if work.targets is None else [list(t) for t in work.targets],
                        keys=None if work.keys is None else list(work.keys), prefill=plan.prefill_items,
                        ride=plan.schedule == "overlapped", limits=work.max_new_tokens,
                        samplings=work.samplings, stops=stops, logprobs=work.logprobs, seen=work.seen,
                        guide=guide, embed=work.embed, beams=work.beams)
        times0 = engine.times.as_dict()
        cache0 = list(engine.cache_positions)
        experts0 = engine.weights.expert_stats.copy()
        read0 = self.disk.bytes_read if self.disk is not None else 0
        bar = progress_bar(len(blocks) * work.gen_len, self.config.progress and self.group.is_driver)
        t0, requests = time.perf_counter(), 0
        try:
            for blk, outs in pipe.run([p.ids for p in work.prompts] if work.prompts else None,
                                      bar.update if bar is not None else None):
                if bar is not None and work.targets is None:
                    requests += len(blk.members)
                    rate = pipe.timings.generated_tokens / max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"{requests}/{work.num_prompts} requests, {rate:.1f} useful tok/s")
                yield blk, outs
        finally:
            if bar is not None:
                bar.close()
        times = {k: v - times0[k] for k, v in engine.times.as_dict().items()}
        self.timings = pipe.timings
        self.record = {
            "stage": self.group.rank, "layers": list(plan.stage(self.group.rank).layers),
            "policy": engine.policy.to_dict(), "peak_bytes": engine.peak_bytes(),
            "predicted_peak_bytes": peaks.as_dict(), **times,
            "comm_wait_s": pipe.comm_wait_s, "token_steps": pipe.timings.token_steps,
            "cache_positions": engine.cache_positions[0] - cache0[0], "cache_spared": engine.cache_positions[1] - cache0[1],
            "prefill_s": pipe.timings.prefill_s, "decode_s": pipe.timings.decode_s,
            **{f"prefill_{k}": v for k, v in pipe.prefill_split.items()},
            "disk_bytes_read": (self.disk.bytes_read - read0) if self.disk is not None else 0,
            "direct_io": None if self.disk is None else self.disk.direct,
            "kernel_policy": gemm.summary(),  # which GEMM forms ran: equal digests, same sums
            "huge_pages": hugepages.status(),  # large host tensors on huge pages (hugepages.py)
            "keep_freed": hugepages.keep_freed(),  # freed host memory kept in the heap for reuse
            "threads": self.threads.as_dict() if self.threads is not None else None,
            "one_time_s": dict(self.one_time),  # kernel build, GEMM tuning: not in the clock
        }
        if self.model.spec.num_experts:  # what the sparse layers routed and read, beside the cost model's count
            self.record["experts"] = engine.weights.expert_stats.since(experts0).as_dict()

    def close(self) -> None:
        for thing in (self.engine, self.disk):
            if thing is not None:
                thing.close()
