"""Policy search: enumerate (gbs, num_gb), one LP over the nine placement fractions each.

For a fixed GPU batch size, number of GPU batches and attention mode every cost term is
linear in the fractions (``cost_model.stage_terms``), and each phase's time is a max over
channels; with one auxiliary variable per phase (Tpre >= every prefill channel, Tgen >= every
decode channel) the whole problem is an LP that HiGHS solves in milliseconds. The LP answer
is rounded to whole percents, checked against the engine's exact peaks (the footprint the run
itself checks), nudged toward lower tiers when rounding overshot, and pushed toward higher
tiers where that costs nothing (ties).
"""
from __future__ import annotations

import itertools

from dataclasses import dataclass

import numpy as np

from flexgen_dist.engine.footprint import Packed
from flexgen_dist.engine.policy import Policy, merge_decode
from flexgen_dist.memory.units import format_bytes
from flexgen_dist.models.spec import ModelSpec
from flexgen_dist.planner.cost_model import StageCost, cost_from_terms
from flexgen_dist.planner.terms import CC, CD, CG, CONST, HC, HD, HG, TIERS, WC, WD, WG, StageTerms, stage_terms
from flexgen_dist.planner.sizes import WorkShape
from flexgen_dist.planner.hardware import HardwareSpec

GIB = 2**30
GBS_CANDIDATES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
NUM_GB_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
TIE_BREAK = 1e-5  # per unit fraction per tier below gpu, relative to the objective's scale


class PlanError(ValueError):
    """No placement fits the memory budgets; the message names the short tier."""


@dataclass(frozen=True, eq=False)
class Candidate:
    """The best rounded placement found for one (gbs, num_gb, cpu_attention)."""

    gpu_batch_size: int
    num_gpu_batches: int
    cpu_attention: bool
    compress: bool
    percents: np.ndarray  # nine integers, each triple summing to 100
    terms: StageTerms
    objective: float  # seconds per sequence of the block: (prefill + decode) / bls
    states: tuple[float, float] = (100.0, 0.0)  # the linear layers' states: gpu and cpu percent

    @property
    def block_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    def policy(self) -> Policy:
        return _policy(self.gpu_batch_size, self.num_gpu_batches, self.cpu_attention, self.compress,
                       self.percents, self.states)

    def cost(self) -> StageCost:
        return cost_from_terms(self.terms, self.percents / 100.0)


def _policy(gbs: int, ngb: int, cpu_att: bool, compress: bool, percents: np.ndarray,
            states: tuple[float, float] = (100.0, 0.0)) -> Policy:
    """The policy of whole percents (nine, WG WC WD CG CC CD HG HC HD) and a batch shape."""
    p = [float(v) for v in percents]
    return Policy(gpu_batch_size=gbs, num_gpu_batches=ngb, w_gpu_percent=p[0], w_cpu_percent=p[1],
                  cache_gpu_percent=p[3], cache_cpu_percent=p[4], act_gpu_percent=p[6],
                  act_cpu_percent=p[7], state_gpu_percent=states[0], state_cpu_percent=states[1],
                  cpu_attention=cpu_att, compress_weight=compress, compress_cache=compress)


def _fractions(states: tuple[float, float]) -> tuple[float, float, float]:
    return states[0] / 100, states[1] / 100, 1 - (states[0] + states[1]) / 100


def state_options(spec: ModelSpec, first_layer: int, num_layers: int) -> tuple[tuple[float, float], ...]:
    """Where the search tries a stage's linear-attention states (gpu %, cpu %): on the compute
    device, and in host RAM (a larger block for the traffic of bringing them in and out each
    step; ``engine/states.py``). One option, the device, for a stage without linear layers."""
    if not any(spec.linear(j) for j in range(first_layer, first_layer + num_layers)):
        return ((100.0, 0.0),)
    return ((100.0, 0.0), (0.0, 100.0))


def _budgets(hw: HardwareSpec) -> np.ndarray:
    return np.array([hw.gpu_mem, hw.cpu_mem, hw.disk_mem], dtype=float)


def _objective(terms: StageTerms, x: np.ndarray) -> float:
    pre, dec = terms.block_time(x)
    return (pre + dec) / terms.block_size


def _fits(terms: StageTerms, x: np.ndarray, budgets: np.ndarray) -> bool:
    return bool(np.all(terms.peaks(x) <= budgets))


def solve_lp(terms: StageTerms, budgets: np.ndarray, *, weights_all_gpu: bool,
             no_disk_weights: bool, pinned: dict[int, float] | None = None) -> np.ndarray | None:
    """Optimal fractions (length 9) for one candidate, or None when no placement fits.

    Variables: the nine fractions, then Tpre and Tgen (per-layer seconds, in units of the
    decode compute time so HiGHS sees O(1) numbers). Memory rows are in GiB. The whole-tensor
    slack of split weights is charged whenever the bounds allow a split (conservative).
    ``pinned``: fractions held at a value (index -> value), as merged decode needs.
    """
    n = terms.gen_len
    tau = max(float(terms.decode[4, CONST]), float(terms.prefill[4, CONST]) / 1e3, 1e-12)
    c = np.zeros(11)
    c[[1, 4, 7]] = TIE_BREAK
    c[[2, 5, 8]] = 2 * TIE_BREAK
    c[9], c[10] = (1.0 / (n - 1), 1.0) if n > 1 else (1.0, 0.0)
    rows = terms.peak_rows(not weights_all_gpu, not no_disk_weights).reshape(6, 10)
    C = terms.prefill.shape[0]  # channels: one row each per phase, then 2 phases x 3 tiers of memory
    A = np.zeros((2 * C + 6, 11))
    b = np.zeros(2 * C + 6)
    A[0:C, :9], A[0:C, 9], b[0:C] = terms.prefill[:, :9] / tau, -1.0, -terms.prefill[:, CONST] / tau
    A[C:2 * C, :9], A[C:2 * C, 10], b[C:2 * C] = terms.decode[:, :9] / tau, -1.0, -terms.decode[:, CONST] / tau
    A[2 * C:, :9] = rows[:, :9] / GIB
    b[2 * C:] = (np.tile(budgets, 2) - rows[:, CONST]) / GIB
    A_eq = np.zeros((3, 11))
    for i in range(3):
        A_eq[i, 3 * i:3 * i + 3] = 1.0
    bounds = [(0.0, 1.0)] * 9 + [(0.0, None)] * 2
    if weights_all_gpu:
        bounds[0:3] = [(1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]
    elif no_disk_weights:
        bounds[2] = (0.0, 0.0)
    for i, v in (pinned or {}).items():
        bounds[i] = (v, v)
    from scipy.optimize import linprog  # 0.36 s to import: only runs that plan pay it

    res = linprog(c, A_ub=A, b_ub=b, A_eq=A_eq, b_eq=np.ones(3), bounds=bounds, method="highs")
    return np.clip(res.x[:9], 0.0, 1.0) if res.status == 0 else None


def round_percents(x: np.ndarray) -> np.ndarray:
    """Whole percents per triple, summing to 100 (largest remainder)."""
    out = np.zeros(9, dtype=int)
    for i in range(0, 9, 3):
        v = np.clip(x[i:i + 3], 0, 1) * 100.0
        v = v / v.sum() * 100.0 if v.sum() > 0 else np.array([100.0, 0.0, 0.0])
        fl = np.floor(v + 1e-9).astype(int)
        for j in np.argsort(-(v - fl), kind="stable")[:100 - fl.sum()]:
            fl[j] += 1
        out[i:i + 3] = fl
    return out


def _nudge_down(terms: StageTerms, p: np.ndarray, budgets: np.ndarray,
                no_disk_weights: bool) -> np.ndarray | None:
    """Move whole percents to lower tiers until the peaks fit (or give up: None)."""
    p = p.copy()
    for _ in range(400):
        over = terms.peaks(p / 100.0) - budgets
        if np.all(over <= 0):
            return p
        ph, t = np.unravel_index(np.argmax(over), over.shape)
        if t == 2:
            return None  # nothing below disk
        rows = terms.peak_rows(True, True)[ph, t]
        best = None
        for k in range(3):  # weights, cache, activations
            src, dst = 3 * k + t, 3 * k + t + 1
            if p[src] == 0 or (no_disk_weights and k == 0 and t == 1):
                continue
            gain = rows[src] - rows[dst]
            if best is None or gain > best[0]:
                best = (gain, src, dst)
        if best is None or best[0] <= 0:
            return None
        p[best[1]] -= 1
        p[best[2]] += 1
    return None


def _push_up(terms: StageTerms, p: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """Among equally fast placements prefer the higher tier (less traffic, fewer files)."""
    best = _objective(terms, p / 100.0)
    for k in (2, 1, 0):  # activations, cache, weights
        for src, dst in ((2, 1), (1, 0), (2, 0)):
            i, j = 3 * k + src, 3 * k + dst
            d = int(p[i])
            while d >= 1:
                q = p.copy()
                q[i] -= d
                q[j] += d
                if _fits(terms, q / 100.0, budgets):
                    obj = _objective(terms, q / 100.0)
                    if obj <= best * (1 + 1e-12):
                        p, best = q, obj
                        break
                d //= 2
    return p


def stage_candidates(spec: ModelSpec, num_layers_in_stage: int, hw: HardwareSpec,
                     workload: WorkShape, *, has_embed: bool, has_head: bool,
                     max_gpu_batch_size: int = 64, max_num_gpu_batches: int = 16,
                     cpu_attention_options: tuple[bool, ...] = (True, False),
                     compress: bool = False, num_micro_batches: int = 1,
                     num_stages: int = 1, max_block_size: int | None = None,
                     first_layer: int = 0, packed: Packed | None = None) -> dict[int, Candidate]:
    """The best candidate per block size (a pipeline needs one block size on every stage).

    Larger batches only need more memory, so once (gbs, num_gb) has no feasible placement
    every larger num_gb is skipped, and once (gbs, 1) has none every larger gbs is.
    ``first_layer`` and ``packed`` (a source's ``packed_formats``) size weights kept in their
    checkpoint's own blocks, as the engine will store them.
    """
    if num_layers_in_stage < 1:
        raise ValueError(f"num_layers_in_stage={num_layers_in_stage}: a stage needs >= 1 layer")
    budgets = _budgets(hw)
    gbs_list = [g for g in GBS_CANDIDATES if g <= max_gpu_batch_size] or [max_gpu_batch_size]
    ngb_list = [k for k in NUM_GB_CANDIDATES if k <= max_num_gpu_batches] or [max_num_gpu_batches]
    best: dict[int, Candidate] = {}
    for states, cpu_att in itertools.product(state_options(spec, first_layer, num_layers_in_stage),
                                             dict.fromkeys(cpu_attention_options)):
        fractions = _fractions(states)
        for gbs in gbs_list:
            for ngb in ngb_list:
                if max_block_size is not None and gbs * ngb > max_block_size and (gbs, ngb) != (1, 1):
                    continue
                kw = dict(gpu_batch_size=gbs, num_gpu_batches=ngb, cpu_attention=cpu_att,
                          has_embed=has_embed, has_head=has_head, compress_weight=compress,
                          compress_cache=compress, num_micro_batches=num_micro_batches,
                          num_stages=num_stages, first_layer=first_layer, packed=packed,
                          state_fractions=fractions)
                terms = stage_terms(spec, num_layers_in_stage, hw, workload, **kw)  # type: ignore[arg-type]
                bar = best[gbs * ngb].objective if gbs * ngb in best else float("inf")
                merged = stage_terms(spec, num_layers_in_stage, hw, workload, merged=True,
                                     **kw) if ngb > 1 else None  # type: ignore[arg-type]
                cand = _solve_candidate(terms, budgets, gbs, ngb, cpu_att, compress, bar,
                                        merged=merged, device=hw.compute_device, states=states)
                if cand is None:
                    break
                if cand.objective < bar:
                    best[gbs * ngb] = cand
            else:
                continue
            if ngb == ngb_list[0]:
                break  # (gbs, 1) infeasible: every larger gbs is too
    return best


def merged_pins(device: str, cpu_attention: bool) -> dict[int, float]:
    """The fractions a placement holds for decode to merge its GPU batches on ``device``
    (``engine.policy.merge_decode``): every activation on the device, and the cache off disk
    (a CPU device, or CPU attention) or all on the device (a GPU without CPU attention)."""
    cache = {CD: 0.0} if merge_decode(device, False, False, cpu_attention) else {CG: 1.0, CC: 0.0, CD: 0.0}
    return {HG: 1.0, HC: 0.0, HD: 0.0, **cache}


def _solve_candidate(terms: StageTerms, budgets: np.ndarray, gbs: int, ngb: int,
                     cpu_att: bool, compress: bool, bar: float = float("inf"), *,
                     merged: StageTerms | None = None, device: str = "cuda",
                     states: tuple[float, float] = (100.0, 0.0)) -> Candidate | None:
    """Solve, round and repair one (gbs, num_gb, cpu_attention); ``bar``: best so far for
    this block size (the tie-breaking push toward higher tiers is skipped for clear losers).
    The repair checks the engine's exact peaks, so a candidate fits the run's own check.
    ``merged``: the terms of merged decode (several GPU batches), solved a second time with
    the placement it needs pinned; an answer that the rounding moved off it is costed by
    ``terms``."""
    found: list[tuple[np.ndarray, StageTerms]] = []
    W = float(terms.peak_base[0, 0, WG])
    near = 1.0 - (float(terms.peak_base[0, 0, WC]) + terms.gpu_slack) / W
    all_gpu = terms.peak_base[:, 0, WG] + terms.peak_base[:, 0, CONST]
    variants = [(terms, None)] + ([(merged, merged_pins(device, cpu_att))] if merged is not None else [])
    for t, pins in variants:
        x = solve_lp(t, budgets, weights_all_gpu=False, no_disk_weights=compress, pinned=pins)
        if x is not None:
            found.append((x, t))
        # Keeping every weight on the gpu saves the split buffers and the whole-tensor slack;
        # that can only matter when the general answer already keeps almost all weights there.
        if np.all(all_gpu <= budgets[0]) and (x is None or near <= x[WG] < 1 - 1e-9):
            x = solve_lp(t, budgets, weights_all_gpu=True, no_disk_weights=True, pinned=pins)
            if x is not None:
                found.append((x, t))
    best = None
    for x, t in found:
        p = _nudge_down(t, round_percents(x), budgets, compress)
        if p is None:
            continue
        obj = _objective(t, p / 100.0)
        if obj <= bar * 1.001:
            p = _push_up(t, p, budgets)
        if merged is not None:  # costed as the engine will run these percents: the repair may
            # have moved a merged answer off its placement, or a general one onto it
            t = merged if _policy(gbs, ngb, cpu_att, compress, p, states).merges_decode(device) else terms
        obj = _objective(t, p / 100.0)
        if best is None or obj < best.objective:
            best = Candidate(gbs, ngb, cpu_att, compress, p, t, obj, states)
    return best


def diagnose(spec: ModelSpec, num_layers_in_stage: int, hw: HardwareSpec, workload: WorkShape,
             *, has_embed: bool, has_head: bool, cpu_attention: bool = True,
             compress: bool = False, num_micro_batches: int = 1,
             num_stages: int = 1) -> str:
    """Why the smallest block (gbs 1, one GPU batch) does not fit: which tier, by how much.

    An LP with one slack variable per tier finds the least extra memory that would make a
    placement fit; slack on disk is cheapest (any bytes can go there), gpu dearest.
    """
    terms = stage_terms(spec, num_layers_in_stage, hw, workload, gpu_batch_size=1,
                        num_gpu_batches=1, cpu_attention=cpu_attention, has_embed=has_embed,
                        has_head=has_head, compress_weight=compress, compress_cache=compress,
                        num_micro_batches=num_micro_batches, num_stages=num_stages,
                        state_fractions=_fractions(state_options(spec, 0, num_layers_in_stage)[-1]))
    rows = terms.peak_rows(True, not compress)
    A = np.zeros((6, 12))
    for ph in range(2):
        for t in range(3):
            A[3 * ph + t, :9] = rows[ph, t, :9] / GIB
            A[3 * ph + t, 9 + t] = -1.0
    b = (np.tile(_budgets(hw), 2) - rows[:, :, CONST].reshape(6)) / GIB
    A_eq = np.zeros((3, 12))
    for i in range(3):
        A_eq[i, 3 * i:3 * i + 3] = 1.0
    bounds = [(0.0, 1.0)] * 9 + [(0.0, None)] * 3
    if compress:
        bounds[WD] = (0.0, 0.0)
    from scipy.optimize import linprog

    res = linprog(np.r_[np.zeros(9), 3.0, 2.0, 1.0], A_ub=A, b_ub=b, A_eq=A_eq,
                  b_eq=np.ones(3), bounds=bounds, method="highs")
    short = [(t, s) for t, s in zip(TIERS, res.x[9:]) if s > 1e-6] if res.status == 0 else []
    if not short:  # the slack LP says it fits: rounding to whole percents must have failed
        return (f"no whole-percent placement fits for {spec.name} at block size 1: "
                "raise --gpu-mem/--cpu-mem/--disk-mem or add stages")
    what = "; ".join(f"{t} too small by {format_bytes(max(int(s * GIB), 1))}" for t, s in short)
    flags = " / ".join(f"--{t}-mem" for t, _ in short)
    if hw.compute_device == "cpu" and any(t != "disk" for t, _ in short):
        # one pool of RAM: --cpu-mem caps it, --gpu-mem only says how much of it computes
        flags = ("--cpu-mem (the RAM pool of a CPU-only machine), and --gpu-mem where you gave it (the share of "
                 "that pool that computes)" if any(t == "gpu" for t, _ in short) else
                 "--cpu-mem (the RAM pool of a CPU-only machine; --gpu-mem is its compute share)") + \
            "".join(" / --disk-mem" for t, _ in short if t == "disk")
    stage = (f" ({num_layers_in_stage} of {spec.num_layers} layers in this stage)"
             if num_layers_in_stage != spec.num_layers else "")
    return f"{what} for {spec.name}{stage} at block size 1: raise {flags} or add stages"


def plan_stage(spec: ModelSpec, num_layers_in_stage: int, hw: HardwareSpec, workload: WorkShape,
               *, has_embed: bool, has_head: bool, max_gpu_batch_size: int = 64,
               max_num_gpu_batches: int = 16,
               cpu_attention_options: tuple[bool, ...] = (True, False), compress: bool = False,
               num_micro_batches: int = 1, num_stages: int = 1) -> tuple[Policy, StageCost]:
    """The fastest policy (least time per sequence of a block) for one stage on ``hw``.

    Raises :class:`PlanError` naming the tier that is too small when nothing fits.
    """
    cands = stage_candidates(spec, num_layers_in_stage, hw, workload, has_embed=has_embed,
                             has_head=has_head, max_gpu_batch_size=max_gpu_batch_size,
                             max_num_gpu_batches=max_num_gpu_batches,
                             cpu_attention_options=cpu_attention_options, compress=compress,
                             num_micro_batches=num_micro_batches, num_stages=num_stages)
    if not cands:
        raise PlanError(diagnose(spec, num_layers_in_stage, hw, workload, has_embed=has_embed,
                                 has_head=has_head, compress=compress,
                                 cpu_attention=cpu_attention_options[0],
                                 num_micro_batches=num_micro_batches, num_stages=num_stages))
    best = min(cands.values(), key=lambda c: (c.objective, c.block_size))
    return best.policy(), best.cost()
