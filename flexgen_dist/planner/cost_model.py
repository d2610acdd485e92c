"""Latency and peak-memory model of one pipeline stage (FlexGen's cost model, per stage).

Every time term is *linear* in the nine placement fractions
``x = (wg, wc, wd, cg, cc, cd, hg, hc, hd)`` (weights, KV cache, activations on gpu/cpu/disk),
so one table of coefficients (built in ``terms.py``) serves both :func:`estimate_stage`
(evaluate it at a policy) and the LP in ``search.py`` (optimise over it). Peaks come from the
engine's own footprint (``engine/footprint.py``): exact here, linear in the LP.

Notation (as in docs/planner.md): l layers in the stage, s prompt length, n generated tokens, h1 hidden,
h2 FFN width, bls = gbs * num_gb sequences per block, G micro-batch groups in flight, b bytes
per element. Times are per layer for the whole block; a block's prefill takes l * Tpre and its
decode (n-1) * l * Tgen, each the max over the overlapped channels.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from flexgen_dist.distributed.items import PREFILL, Item, ItemStream
from flexgen_dist.engine.policy import Policy
from flexgen_dist.models.spec import ModelSpec
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner.terms import CHANNELS, PHASES, TIERS, WC, WD, WG, StageTerms, stage_terms
from flexgen_dist.planner.sizes import WorkShape


@dataclass(frozen=True)
class StageCost:
    """Predicted cost of one block (one micro-batch group) on one stage.

    ``prefill_time_s`` is the block's prefill, ``decode_time_s`` its whole decode ((n-1)
    steps), both with the network channel overlapped; ``*_net_s`` are the sends alone (for
    the pipeline's fill). ``peak[phase][tier]`` are bytes.
    """

    prefill_time_s: float
    decode_time_s: float
    peak: dict[str, dict[str, int]]
    block_size: int
    prompt_len: int
    gen_len: int
    num_layers: int
    prefill_net_s: float = 0.0
    decode_net_s: float = 0.0
    channels: dict[str, dict[str, float]] = field(default_factory=dict)
    overlap: bool = True  # channels overlap (max) or run one after another (sum)

    def ride_step_s(self, piece: StageCost, batches: int) -> float:
        """One decode step with ``batches`` GPU batches of the next block's prefill riding on
        it (``piece``: the cost of a one-batch block): each channel adds the pieces' traffic
        and compute but not their weight reads, which the step's loaded weights serve."""
        ch = [self.channels["decode_step"][c] + batches * piece.channels["prefill_shared"][c] for c in CHANNELS]
        return max(ch) if self.overlap else sum(ch)

    @property
    def decode_step_s(self) -> float:
        return self.decode_time_s / max(1, self.gen_len - 1)

    @property
    def prefill_throughput(self) -> float:
        return self.block_size * self.prompt_len / self.prefill_time_s

    @property
    def decode_throughput(self) -> float:
        steps = self.gen_len - 1
        return self.block_size * steps / self.decode_time_s if steps and self.decode_time_s else 0.0

    @property
    def total_throughput(self) -> float:
        return self.block_size * self.gen_len / (self.prefill_time_s + self.decode_time_s)

    @property
    def time_per_token_s(self) -> float:
        """The LP's objective T / bls."""
        return (self.prefill_time_s + self.decode_time_s) / self.block_size


def policy_fractions(policy: Policy) -> np.ndarray:
    x = np.array(policy.fractions("w") + policy.fractions("cache") + policy.fractions("act"))
    return np.round(x, 12)  # 1 - 0.91 - 0.09 is 1e-17, not a disk share


def cost_from_terms(terms: StageTerms, x: np.ndarray) -> StageCost:
    tp, tg = terms.layer_times(x)
    pre, dec = terms.block_time(x)
    pk = terms.peaks(x)
    peak = {ph: {t: max(0, int(math.ceil(pk[i, j] - 1e-6))) for j, t in enumerate(TIERS)}
            for i, ph in enumerate(PHASES)}
    shared = x.copy()
    shared[[WG, WC, WD]] = 0.0  # a rider's weights are the decode step's
    tp_shared, _ = terms.layer_times(shared)
    channels = {"prefill": {c: terms.num_layers * float(v) for c, v in zip(CHANNELS, tp)},
                "decode_step": {c: terms.num_layers * float(v) for c, v in zip(CHANNELS, tg)},
                "prefill_shared": {c: terms.num_layers * float(v) for c, v in zip(CHANNELS, tp_shared)}}
    return StageCost(prefill_time_s=pre, decode_time_s=dec, peak=peak,
                     block_size=terms.block_size, prompt_len=terms.prompt_len,
                     gen_len=terms.gen_len, num_layers=terms.num_layers,
                     prefill_net_s=terms.prefill_net_s, decode_net_s=terms.decode_net_s,
                     channels=channels, overlap=terms.overlap)


def terms_for_policy(spec: ModelSpec, num_layers: int, policy: Policy, hw: HardwareSpec,
                     workload: WorkShape, *, has_embed: bool, has_head: bool,
                     num_micro_batches: int = 1, num_stages: int = 1, head_share: float = 1.0) -> StageTerms:
    return stage_terms(spec, num_layers, hw, workload, gpu_batch_size=policy.gpu_batch_size,
                       num_gpu_batches=policy.num_gpu_batches, cpu_attention=policy.cpu_attention,
                       has_embed=has_embed, has_head=has_head,
                       compress_weight=policy.compress_weight,
                       compress_cache=policy.compress_cache, comp_bits=policy.comp_bits,
                       comp_group_size=policy.comp_group_size,
                       num_micro_batches=num_micro_batches, num_stages=num_stages,
                       overlap=policy.overlap, head_share=head_share,
                       merged=policy.merges_decode(hw.compute_device), state_fractions=policy.fractions("state"))


def estimate_stage(spec: ModelSpec, num_layers_in_stage: int, policy: Policy, hw: HardwareSpec,
                   workload: WorkShape, *, has_embed: bool, has_head: bool,
                   num_micro_batches: int = 1, num_stages: int = 1, head_share: float = 1.0) -> StageCost:
    """Predicted block times and per-tier peaks of ``policy`` on one stage.

    ``num_micro_batches`` groups share the stage (their KV caches all stay resident);
    ``num_stages`` > 1 adds the network channel (hidden states out, or token ids back from
    the last stage) and the send/receive buffers.
    """
    if num_layers_in_stage < 1:
        raise ValueError(f"num_layers_in_stage={num_layers_in_stage}: a stage needs >= 1 layer")
    terms = terms_for_policy(spec, num_layers_in_stage, policy, hw, workload,
                             has_embed=has_embed, has_head=has_head,
                             num_micro_batches=num_micro_batches, num_stages=num_stages,
                             head_share=head_share)
    return cost_from_terms(terms, policy_fractions(policy))


def piece_cost(spec: ModelSpec, num_layers_in_stage: int, policy: Policy, hw: HardwareSpec,
               workload: WorkShape, **kw: Any) -> StageCost:
    """The cost of one prefill piece (one GPU batch) under a block policy: the block's with one
    batch, and 1/num_gpu_batches of the block's one LM head pass (the head waits for the last
    batch and runs once for all). Keywords as for ``estimate_stage``."""
    return estimate_stage(spec, num_layers_in_stage, dataclasses.replace(policy, num_gpu_batches=1), hw,
                          workload, head_share=1.0 / policy.num_gpu_batches, **kw)


def _simulate(costs: list[StageCost], pieces: list[StageCost] | None, G: int, num_gb: int,
              num_blocks: int, *, split: bool = False, ride: bool = False) -> tuple[float, float]:
    """(prefill, decode) seconds of the last stage's clock for ``num_blocks`` blocks.

    Walks the runtime's own item stream (``distributed/items.py``): each stage takes the
    items in that order; an item starts on stage s when s is free and the item has arrived
    from s - 1 (its send time after it), a decode step on stage 0 when the block's previous
    tokens are back from the last stage. The last stage's wall time is split by item kind,
    waiting included, as the runtime's clock does (a decode step with a rider: by the
    rider's share of the step's compute). ``split``: one prefill item per GPU batch;
    ``ride``: the overlapped schedule (``pieces`` then gives a rider's cost per batch)."""
    m, n = len(costs), costs[0].gen_len
    stream = ItemStream([num_gb] * num_blocks, G, n, pieces="batch" if split else "block", ride=ride)
    free = [0.0] * m
    back: dict[int, float] = {}  # block -> when its latest tokens are at stage 0
    clock = pre = dec = 0.0
    while (it := stream.next()) is not None:
        arrive = back.get(it.block, 0.0) if it.kind != PREFILL else 0.0
        share = 0.0
        for s, c in enumerate(costs):
            busy, net, share = _item_cost(c, pieces[s] if pieces else None, it, num_gb)
            end = max(free[s], arrive) + busy
            free[s] = end
            arrive = end + (net if m > 1 else 0.0)
        span = free[-1] - clock
        pre += span * share
        dec += span * (1 - share)
        clock = free[-1]
        for p in it.parts():
            if p.last:
                back[p.block] = arrive if m > 1 else clock
    return pre, dec


def _item_cost(c: StageCost, piece: StageCost | None, it: Item, num_gb: int) -> tuple[float, float, float]:
    """(busy seconds, send seconds, prefill share of the time) of one item on one stage."""
    k = it.batches[1] - it.batches[0]
    if it.kind == PREFILL:
        if piece is None or k == num_gb:
            return c.prefill_time_s, c.prefill_net_s, 1.0
        return k * piece.prefill_time_s, k * piece.prefill_net_s, 1.0
    if it.ride is None or piece is None:
        return c.decode_step_s, c.decode_net_s, 0.0
    r = it.ride.batches[1] - it.ride.batches[0]
    busy = c.ride_step_s(piece, r)
    ride_comp = r * piece.channels["prefill_shared"]["comp"]
    comp = c.channels["decode_step"]["comp"] + ride_comp
    return busy, c.decode_net_s + r * piece.prefill_net_s, ride_comp / comp if comp > 0 else 0.5


def pipeline_prediction(costs: list[StageCost], num_micro_batches: int, *, num_blocks: int | None = None,
                        piece_costs: list[StageCost] | None = None, num_gpu_batches: int = 1,
                        split: bool | None = None, ride: bool = False,
                        num_prompts: int | None = None) -> dict:
    """Pipeline throughput from per-stage block costs (all stages share one block size).

    The runtime's item stream is simulated (``_simulate``) for ``num_blocks`` blocks (default:
    one per micro-batch group, G): a block's prefill crosses the stages as one item, or with
    ``piece_costs`` (each stage's cost of a one-GPU-batch block) as ``num_gpu_batches``
    pieces, so stage s + 1 starts after one piece rather than the whole block; a decode step
    of a block needs the whole ring (every stage, every send, the token ids back to stage 0)
    while the other G - 1 blocks keep the stages busy; a slot whose block ends starts the
    next block's prefill while the others decode. Long jobs are simulated over 6 G blocks
    and extended by the per-block increment of the last G. ``split`` (default: whether
    ``piece_costs`` are given) makes the prefill items per GPU batch; ``ride`` predicts the
    overlapped schedule (riders costed from ``piece_costs``). ``num_prompts``: the sequences
    the job has; the throughputs count those, not the rows of full blocks (a last block that
    is not full runs fewer rows; its time is taken as a full block's, an upper bound).
    """
    split = piece_costs is not None if split is None else split
    if ride and piece_costs is None:
        raise ValueError("the overlapped schedule's riders are costed per GPU batch: give piece_costs")
    G, m = num_micro_batches, len(costs)
    bls, s, n = costs[0].block_size, costs[0].prompt_len, costs[0].gen_len
    if any(c.block_size != bls for c in costs):
        raise ValueError(f"stages use block sizes {[c.block_size for c in costs]}: a pipeline "
                         "needs one block size (gpu_batch_size * num_gpu_batches) on every stage")
    nb = num_blocks or G
    cap = 6 * G
    if nb <= cap:
        prefill_time, decode_time = _simulate(costs, piece_costs, G, num_gpu_batches, nb, split=split, ride=ride)
    else:
        p1, d1 = _simulate(costs, piece_costs, G, num_gpu_batches, cap, split=split, ride=ride)
        p0, d0 = _simulate(costs, piece_costs, G, num_gpu_batches, cap - G, split=split, ride=ride)
        k = (nb - cap) / G
        prefill_time, decode_time = p1 + k * (p1 - p0), d1 + k * (d1 - d0)
    seqs = nb * bls if num_prompts is None else min(nb * bls, num_prompts)
    return {
        "prefill_throughput": seqs * s / prefill_time,
        "decode_throughput": seqs * (n - 1) / decode_time if n > 1 and decode_time else 0.0,
        "total_throughput": seqs * n / (prefill_time + decode_time),
        "prefill_time_s": prefill_time,
        "decode_time_s": decode_time,
        "num_stages": m,
        "num_micro_batches": G,
        "num_blocks": nb,
        "prefill_items": "batch" if split else "block",
        "schedule": "overlapped" if ride else "sequential",
        "block_size": bls,
        "stage_times": [{"layers": c.num_layers, "prefill_s": c.prefill_time_s,
                         "decode_step_s": c.decode_step_s, "prefill_net_s": c.prefill_net_s,
                         "decode_net_s": c.decode_net_s} for c in costs],
        "peak_bytes": [c.peak for c in costs],
    }


RIDE_MARGIN = 1.1  # predicted gain the overlapped schedule needs under --schedule auto


def best_pipeline(costs: list[StageCost], piece_costs: list[StageCost] | None, G: int, *,
                  num_blocks: int | None, num_gpu_batches: int, prefill_items: str = "auto",
                  schedule: str = "auto", num_prompts: int | None = None) -> dict:
    """``pipeline_prediction`` with the prefill items and schedule given, or (``auto``) the
    fastest of the options: one prefill item per block or per GPU batch (only a pipeline of
    several stages gains from pieces), sequential or overlapped (only with more blocks than
    groups: a group's first block has nothing to ride on)."""
    can_split = piece_costs is not None and len(costs) > 1 and num_gpu_batches > 1
    splits = {"block": [False], "batch": [True]}.get(prefill_items, [False, True] if can_split else [False])
    nb = num_blocks or G
    can_ride = piece_costs is not None and costs[0].gen_len > 1 and nb > G
    rides = {"sequential": [False], "overlapped": [True]}.get(schedule, [False, True] if can_ride else [False])
    best: dict | None = None
    for ride in rides:
        for split in splits:
            pred = pipeline_prediction(costs, G, num_blocks=num_blocks, piece_costs=piece_costs,
                                       num_gpu_batches=num_gpu_batches, split=split, ride=ride,
                                       num_prompts=num_prompts)
            # auto takes the overlapped schedule only for a clear predicted gain: it costs the
            # memory of a second block per group, and measured on a 2-core CPU node it lost
            # 2-6 % where the model gave it a few percent (the reads' CPU time: docs/benchmarks.md (vi),
            # and run D in docs/benchmarks-log.md)
            bar = RIDE_MARGIN if ride and best is not None and best["schedule"] == "sequential" else 1.0
            if best is None or pred["total_throughput"] > bar * best["total_throughput"]:
                best = pred
    assert best is not None
    return best


def estimate_pipeline(spec: ModelSpec, stage_layers: list[int], policies: list[Policy],
                      hws: list[HardwareSpec], workload: WorkShape,
                      num_micro_batches: int, *, num_blocks: int | None = None,
                      prefill_items: str = "auto", schedule: str = "auto",
                      num_prompts: int | None = None) -> dict:
    """Predicted prefill/decode/total throughput (tokens/s) of the whole pipeline.

    Keys: prefill_throughput (prompt tokens / prefill time), decode_throughput (tokens after
    the first / decode time), total_throughput (generated tokens / (prefill + decode)),
    prefill_time_s, decode_time_s, prefill_items and schedule (what ``auto`` chose), stage_times,
    peak_bytes (per stage, per phase, per tier). ``num_prompts``: the job's sequences; where
    they do not fill one block, the block the engine runs (the prompts in GPU batches of
    ``gpu_batch_size``) is costed, and the throughputs count the prompts, not the block's rows.
    """
    m = len(stage_layers)
    if not (len(policies) == len(hws) == m) or m < 1:
        raise ValueError(f"estimate_pipeline: {m} stage layer counts, {len(policies)} policies "
                         f"and {len(hws)} hardware specs: give one of each per stage")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches={num_micro_batches}: must be >= 1")
    def costs(fn: Callable[..., StageCost]) -> list[StageCost]:
        return [fn(spec, ls, pol, hw, workload, has_embed=i == 0, has_head=i == m - 1,
                   num_micro_batches=num_micro_batches, num_stages=m)
                for i, (ls, pol, hw) in enumerate(zip(stage_layers, policies, hws))]

    if num_prompts is not None and 0 < num_prompts < policies[0].block_size:
        policies = [_filled(p, num_prompts) for p in policies]
        num_blocks = 1
    ngb = policies[0].num_gpu_batches
    same_gbs = len({p.gpu_batch_size for p in policies}) == 1  # pieces are GPU batches
    pieces = costs(piece_cost) if same_gbs else None
    return best_pipeline(costs(estimate_stage), pieces, num_micro_batches, num_blocks=num_blocks,
                         num_gpu_batches=ngb, prefill_items=prefill_items, schedule=schedule,
                         num_prompts=num_prompts)


def _filled(policy: Policy, rows: int) -> Policy:
    """The block ``policy`` forms from only ``rows`` prompts: its GPU batches filled in order
    (the engine's cut, ``engine.blocks``), the last one short, costed as full."""
    gbs = min(policy.gpu_batch_size, rows)
    return dataclasses.replace(policy, gpu_batch_size=gbs, num_gpu_batches=-(-rows // gbs))
