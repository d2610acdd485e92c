"""The typed records of a run (plan.py), the planner's choices (run_plan.py), ``--explain``,
per-request generation limits, and the property that every plan the planner returns fits the
budgets it was made for."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import PROMPTS, reference_generate
from flexgen_dist import LLM, Policy
from flexgen_dist.budgets import Budgets, fits
from flexgen_dist.engine.footprint import HeadLoad, predict_peaks
from flexgen_dist.models.registry import get_spec
from flexgen_dist.plan import Choice, Peaks, RunPlan, StagePlan, Workload
from flexgen_dist.planner.cost_model import WorkShape
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner.pipeline import plan_pipeline
from flexgen_dist.planner.search import PlanError
from flexgen_dist.run import main

ROOT = Path(__file__).resolve().parents[1]
GEN = 5


def _plan(*, schedule: str = "sequential", G: int = 1) -> RunPlan:
    pol = Policy(2, 2, 0, 100, 100, 0, 100, 0)
    stages = (StagePlan(0, (0, 2), pol, Peaks(1, 2, 3)), StagePlan(1, (2, 4), pol, Peaks(4, 5, 6)))
    return RunPlan(stages, G, "block", schedule, num_blocks=3,
                   choices=(Choice("schedule", schedule, "--schedule"),))


def test_records_are_frozen_and_validated() -> None:
    plan = _plan()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.schedule = "overlapped"  # type: ignore[misc]
    assert plan.block_size == 4 and plan.blocks_in_flight == 1
    assert _plan(schedule="overlapped", G=2).blocks_in_flight == 4
    other = StagePlan(1, (2, 4), Policy(1, 2, 0, 100, 100, 0, 100, 0), Peaks(0, 0, 0))
    with pytest.raises(ValueError, match="same block size"):
        RunPlan((plan.stages[0], other), 1, "block", "sequential", num_blocks=1)
    with pytest.raises(ValueError, match="prefill_items"):
        RunPlan(plan.stages, 1, "rows", "sequential", num_blocks=1)
    with pytest.raises(ValueError, match="max_new_tokens 9"):
        Workload(lens=(3, 4), gen_len=8, max_new_tokens=(2, 9))
    with pytest.raises(ValueError, match="keys has 1 entries for 2 requests"):
        Workload(lens=(3, 4), gen_len=8, keys=(0,))


def test_plan_reports_as_json_and_in_words() -> None:
    plan = _plan()
    d = json.loads(json.dumps(plan.to_dict()))
    assert [s["layers"] for s in d["stages"]] == [[0, 2], [2, 4]]
    assert d["stages"][1]["predicted_peak_bytes"] == {"gpu": 4, "cpu": 5, "disk": 6}
    assert d["choices"] == [{"name": "schedule", "value": "sequential", "why": "--schedule"}]
    text = plan.explain()
    assert "stage 1: layers [2, 4)" in text and "schedule = sequential: --schedule" in text


def test_workload_header_leaves_the_prompts_behind() -> None:
    from flexgen_dist.prompts import Prompt
    w = Workload(lens=(2, 3), gen_len=4, max_new_tokens=(4, 2), prompts=(Prompt(0, "a", [1, 2]), Prompt(1, "b", [1, 2, 3])))
    h = w.header()
    assert h.prompts == () and h == w  # the prompts do not take part in equality
    assert (w.limit(0), w.limit(1), w.prompt_len, w.num_prompts) == (4, 2, 3, 2)


def test_per_request_limits_cut_completions(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    ref = reference_generate(tm, PROMPTS, GEN)
    limits = [1 + n % GEN for n in range(len(PROMPTS))]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        outs = llm.generate(PROMPTS, gen_len=GEN, max_new_tokens=limits)
        with pytest.raises(ValueError, match="max_new_tokens"):
            llm.generate(PROMPTS[:2], gen_len=GEN, max_new_tokens=[GEN + 1, 1])
    assert [c.token_ids for c in outs] == [r[:k] for r, k in zip(ref, limits)]


def test_metrics_report_the_plan_and_its_reasons(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        llm.generate(PROMPTS, gen_len=2)
        plan, metrics = llm.plan, llm.metrics
    assert plan is not None and metrics["plan"] == plan.to_dict()
    names = [c["name"] for c in metrics["plan"]["choices"]]
    assert {"layers", "policies", "num_micro_batches", "prefill_items", "schedule"} <= set(names)
    assert all(c["why"] for c in metrics["plan"]["choices"])


def test_explain_prints_the_plan_without_running(tiny_models, tmp_path: Path, capsys) -> None:
    out = tmp_path / "never.jsonl"
    args = ["--model", str(tiny_models["opt-pre"].path), "--num-prompts", "4", "--prompt-len", "8",
            "--gen-len", "4", "--gpu-batch-size", "2", "--output", str(out), "--no-progress", "--explain"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "stage 0: layers [0, " in text and "schedule = " in text and "fits the memory budgets" in text
    assert not out.exists()
    assert main(args + ["--cpu-mem", "1KiB"]) == 1
    text = capsys.readouterr().out
    assert "does not fit" in text and "--cpu-mem" in text


# Every plan the planner returns fits the budgets the run checks ----------------------------
SHAPES = ["opt-125m", "opt-1.3b", "opt-6.7b", "llama-2-7b", "opt-30b"]


def _random_case(rng: random.Random) -> tuple:
    spec = get_spec(rng.choice(SHAPES))
    m = rng.choice([1, 2, 3, 4])
    wbytes = spec.total_numel() * 2
    gpu = int(wbytes * rng.uniform(0.02, 1.5) / m)
    cpu = int(wbytes * rng.uniform(0.05, 2.0) / m)
    disk = int(wbytes * rng.uniform(0.5, 3.0))
    shape = WorkShape(prompt_len=rng.choice([32, 128, 512]), gen_len=rng.choice([8, 32]), dtype_bytes=2)
    return spec, m, (gpu, cpu, disk), shape, rng.random() < 0.3


@pytest.mark.parametrize("seed", range(12))
def test_every_planned_stage_fits_its_budgets(seed: int) -> None:
    spec, m, (gpu, cpu, disk), shape, compress = _random_case(random.Random(seed))
    hw = HardwareSpec.from_yaml(ROOT / "configs" / "hardware" / "t4.yaml")
    hw = dataclasses.replace(hw, gpu_mem=gpu, cpu_mem=cpu, disk_mem=disk)
    try:
        plan = plan_pipeline(spec, m, hw, shape, max_gpu_batch_size=16, max_num_gpu_batches=4,
                             compress=compress)
    except PlanError as e:
        assert str(e)  # an infeasible case is refused with a reason, never planned over budget
        return
    budgets = Budgets(gpu=gpu, cpu=cpu, disk=disk)
    G = plan.num_micro_batches
    for i, st in enumerate(plan.stages):
        peaks = Peaks.of(predict_peaks(spec, st.policy, (st.layers.start, st.layers.stop), has_embed=i == 0,
                                       has_head=i == m - 1, prompt_len=shape.prompt_len, gen_len=shape.gen_len,
                                       dtype_bytes=2, num_blocks_in_flight=G))
        assert fits(peaks, budgets), (spec.name, m, i, st.policy, peaks, budgets)
        for phase in ("prefill", "decode"):  # and the LP's own peaks, with its rounding reserve
            lp = np.array([st.cost.peak[phase][t] for t in ("gpu", "cpu", "disk")], dtype=float)
            assert np.all(lp <= np.array([gpu, cpu, disk]) * (1 + 1e-9)), (phase, lp)


# One peak model ------------------------------------------------------------------------
def test_tier_placer_stays_within_one_tensor_of_each_fraction() -> None:
    """Error diffusion: over a whole stage, whole tensors put at most one tensor (the largest)
    more on a tier than its fraction of the bytes, which is what the planner's LP reserves."""
    from flexgen_dist.engine.weights import TierPlacer
    from flexgen_dist.memory.tiers import Tier

    rng = random.Random(0)
    for _ in range(200):
        slot = [rng.choice([1, 1, 1, 1, 4, 4]) * rng.randint(1, 3) for _ in range(rng.randint(1, 8))]
        slots = [slot] * rng.randint(1, 40)  # a stage's layers have the same tensors
        g = rng.randint(0, 100) / 100
        c = rng.randint(0, 100 - int(g * 100)) / 100
        placer = TierPlacer((g, c, 1 - g - c))
        on = {t: 0 for t in Tier}
        for sizes in slots:
            for size, tier in zip(sizes, placer.place(sizes)):
                on[tier] += size
        total, largest = sum(map(sum, slots)), max(slot)
        for tier, frac in zip(Tier, (g, c, 1 - g - c)):
            assert on[tier] <= frac * total + largest + 1e-9, (tier, on, g, c, slots[0])


def test_planner_and_check_read_one_footprint() -> None:
    """The LP's linear rows are the exact footprint without rounding: at fractions where every
    tier holds whole slots (0 or 100 %), the two agree to the byte."""
    from flexgen_dist.engine.footprint import StageShape, stage_footprint

    spec = get_spec("llama-2-7b")
    for cpu_att, cuda in ((True, False), (False, True)):
        fp = stage_footprint(spec, StageShape(num_layers=4, has_embed=True, has_head=False, prompt_len=64,
                                              gen_len=8, dtype_bytes=2, gpu_batch_size=4, num_gpu_batches=2,
                                              cpu_attention=cpu_att, cuda=cuda))
        base, gpu_step, cpu_step, _ = fp.linear()
        x = np.array([0, 0, 1, 0, 1, 0, 0, 1, 0], dtype=float)  # weights on disk, cache and acts on the host
        lin = base @ np.append(x, 1.0)
        lin[:, 0] += gpu_step
        lin[:, 1] += cpu_step
        assert np.allclose(fp.peaks(x), lin)


def test_the_last_stage_counts_every_batchs_logits_and_what_choosing_holds() -> None:
    """The head's logits of every GPU batch of the block (they wait for the block's choice),
    then per GPU batch their float32 copy and the choice's own bytes: nothing for greedy,
    sampling's sorted probabilities and sums, a penalty's adjusted copy, the log-softmax."""
    from flexgen_dist.engine.sampling import ADJUST_BYTES, LOGPROB_BYTES, SAMPLE_BYTES, SamplingConfig

    spec = get_spec("llama-3.1-8b")
    V, b, ngb = spec.vocab_size, 16, 4
    pol = Policy(gpu_batch_size=b, num_gpu_batches=ngb)

    def gpu(has_head: bool, dtype_bytes: int = 2, choice: int = 0) -> int:
        return predict_peaks(spec, pol, (30, 32), has_embed=False, has_head=has_head, prompt_len=64, gen_len=8,
                             dtype_bytes=dtype_bytes, head=HeadLoad(choice))["gpu"]

    head_w = gpu(True) - gpu(False)
    assert head_w >= V * (ngb * b * 2 + b * 4)  # the head's weights besides
    assert gpu(True, 2, 36) - gpu(True) == b * V * 36  # one GPU batch's choice at a time
    greedy = Workload(lens=(5, 7), gen_len=4)
    sampled = Workload(lens=(5, 7), gen_len=4, samplings=(SamplingConfig(), SamplingConfig(temperature=0.7)))
    biased = Workload(lens=(5,), gen_len=4, sampling=SamplingConfig(logit_bias={3: 1.0}), logprobs=2)
    scored = Workload(lens=(5,), gen_len=1, targets=((1, 2, 3, 4, -1),))
    assert greedy.head_load == HeadLoad(0) and scored.head_load == HeadLoad(scoring=True)
    assert sampled.head_load.choice_bytes == SAMPLE_BYTES
    assert biased.head_load.choice_bytes == max(ADJUST_BYTES, LOGPROB_BYTES)
    assert sampled.header().head_load == sampled.head_load  # every rank reads the same peaks
    nucleus = Workload(lens=(5,), gen_len=4, sampling=SamplingConfig(temperature=0.5, top_p=0.9))
    assert nucleus.head_load.sorts and not sampled.head_load.sorts
    pol1 = Policy(gpu_batch_size=b, num_gpu_batches=1)

    def peak(head: HeadLoad, cuda: bool) -> int:
        return predict_peaks(spec, pol1, (30, 32), has_embed=False, has_head=True, prompt_len=64, gen_len=8,
                             dtype_bytes=2, head=head, cuda=cuda)["gpu"]
    from flexgen_dist.engine.footprint import CUDA_SORT_BYTES
    sort_gpu = peak(nucleus.head_load, True) - peak(HeadLoad(SAMPLE_BYTES), True)
    assert sort_gpu == b * V * CUDA_SORT_BYTES  # a GPU's sort holds its own buffers
    assert peak(nucleus.head_load, False) == peak(HeadLoad(SAMPLE_BYTES), False)  # a CPU's does not


def _peak_allocated(fn) -> int:  # noqa: ANN001
    """The most bytes ``fn`` held at once on the CPU beyond what it started with, from the
    profiler's allocation and free records in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    ev = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                for e in prof.events() if e.name == "[memory]" or e.self_cpu_memory_usage)
    cur = peak = 0
    for _, d in ev:
        cur += d
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("what", ["greedy", "sampled", "nucleus", "mixed", "penalties+logprobs"])
def test_what_choosing_allocates_is_what_the_model_counts(what: str) -> None:
    """A GPU batch's choice, as the pipeline runs it (the float32 copy of its logits, the
    draw, the log-probabilities), measured: never more than the peak model counts for it, and
    not far below (within 12 bytes per entry)."""
    import torch

    from flexgen_dist.engine.sampling import RowSampling, SamplingConfig, choice_bytes, token_logprobs

    b, V = 32, 32768
    cfgs = {"greedy": [SamplingConfig()] * b,
            "sampled": [SamplingConfig(temperature=0.8, seed=1)] * b,
            "nucleus": [SamplingConfig(temperature=0.9, top_p=0.9, seed=2)] * b,
            "mixed": [SamplingConfig(temperature=0.9, top_p=0.9, top_k=50, min_p=0.05, seed=2)] * (b // 2)
            + [SamplingConfig()] * (b // 2),
            "penalties+logprobs": [SamplingConfig(temperature=1.0, frequency_penalty=0.5, logit_bias={7: 2.0})] * b,
            }[what]
    k = 5 if what == "penalties+logprobs" else None
    logits = torch.randn(b, V, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    rs = RowSampling(cfgs, torch.device("cpu"), steps=4)
    keys = torch.arange(b)

    def choose() -> None:
        lg = logits.float()
        ids = rs.sample(lg, keys, 0)
        if k is not None:
            token_logprobs(lg, ids, k)

    used = _peak_allocated(choose)
    model = b * V * (4 + choice_bytes(cfgs, k))
    assert model - 12 * b * V <= used <= model + 64 * b, (what, used / (b * V), model / (b * V))


@pytest.mark.parametrize("k", [None, 0, 4])
def test_what_scoring_allocates_is_what_the_model_counts(k: int | None) -> None:
    """The scoring head (``head.score``) of one GPU batch's prefill, measured: within what the
    peak model counts for it (its chunk of float32 logits with the head's output and
    temporaries, and with per-token logprobs their rows), and not far below."""
    import torch

    from flexgen_dist.engine import head as head_mod
    from flexgen_dist.engine.head import score_width
    from flexgen_dist.engine.footprint import StageShape, _head_bytes
    from flexgen_dist.models.families import get_family

    spec = get_spec("opt-125m")
    b, s, h, V = 2, 24, spec.hidden_size, spec.vocab_size
    g = torch.Generator().manual_seed(0)
    w = {"norm.w": torch.ones(h), "norm.b": torch.zeros(h),
         "tok.w": (torch.randn(V, h, generator=g) * 0.02).to(torch.bfloat16)}
    w["norm.w"], w["norm.b"] = w["norm.w"].to(torch.bfloat16), w["norm.b"].to(torch.bfloat16)
    x = torch.randn(b, s, h, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, V, (b, s), generator=g)
    targets[:, :3] = -1
    head_mod.score(get_family("opt"), spec, w, x, targets, k)  # first use's one-time allocations apart
    used = _peak_allocated(lambda: head_mod.score(get_family("opt"), spec, w, x, targets, k))
    z = StageShape(num_layers=1, has_embed=False, has_head=True, prompt_len=s, gen_len=1, dtype_bytes=2,
                   gpu_batch_size=b, num_gpu_batches=1, head=HeadLoad(scoring=True,
                                                                    score_width=0 if k is None else score_width(k)))
    model = _head_bytes(spec, z, 0)
    held = b * (3 + (s + 1) * z.head.score_width) * 8  # the block's rows, held by the pipeline, not score()
    assert 0.6 * (model - held) <= used <= model, (k, used, model)


def test_a_sampled_workloads_plan_passes_the_check() -> None:
    """The planner's footprint and the run's check count the same choice bytes: a plan for a
    sampled workload in a tight GPU budget still fits its peaks."""
    spec = get_spec("opt-1.3b")
    hw = HardwareSpec.from_yaml(ROOT / "configs" / "hardware" / "t4.yaml")
    hw = dataclasses.replace(hw, gpu_mem=3 << 30)
    for choice in (0, 40):
        shape = WorkShape(256, 32, 2, HeadLoad(choice))
        plan = plan_pipeline(spec, 1, hw, shape, max_gpu_batch_size=64, max_num_gpu_batches=8)
        st = plan.stages[0]
        peaks = Peaks.of(predict_peaks(spec, st.policy, (st.layers.start, st.layers.stop), has_embed=True,
                                       has_head=True, prompt_len=256, gen_len=32, dtype_bytes=2,
                                       num_blocks_in_flight=plan.num_micro_batches, head=HeadLoad(choice)))
        assert fits(peaks, Budgets(gpu=hw.gpu_mem, cpu=hw.cpu_mem, disk=hw.disk_mem)), (choice, st.policy, peaks)
        lp_gpu = max(st.cost.peak[ph]["gpu"] for ph in ("prefill", "decode"))
        assert peaks.gpu <= lp_gpu * (1 + 1e-9) + 1


def test_a_profile_adds_each_stages_predicted_times(tiny_models) -> None:
    hw = ROOT / "configs" / "hardware" / "cpu-2core.yaml"
    with LLM(str(tiny_models["opt-pre"].path), gpu_batch_size=2, num_gpu_batches=2, hardware=str(hw),
             progress=False) as llm:
        plan = llm.explain(PROMPTS, gen_len=3)
    assert plan is not None and plan.prediction is not None
    st = plan.stages[0]
    assert st.prefill_s is not None and st.prefill_s > 0 and st.decode_step_s is not None and st.decode_step_s > 0
    assert "predicted times: prefill" in plan.explain()
    assert plan.to_dict()["stages"][0]["predicted_prefill_s"] == st.prefill_s


# The block size where none is given ------------------------------------------------------
def test_default_block_is_sized_to_the_workload() -> None:
    import torch

    from flexgen_dist.run_plan import default_block
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_block(64, 1, cpu) == 64
    assert default_block(100, 1, cpu) == 56       # two equal blocks of 50, rounded up to 8s
    assert default_block(3, 1, cpu) == 8
    assert default_block(10, 2, cpu) == 8         # each of the 2 groups gets 5
    assert default_block(1000, 1, cpu) == 64
    assert default_block(1000, 1, cuda) == 256
    assert default_block(300, 2, cuda) == 152     # 150 per group, one block each


def test_default_block_follows_the_workload_and_the_budgets(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["opt-pre"]
    prompts = [p * 4 for p in PROMPTS] * 10
    with LLM(str(tm.path), progress=False) as llm:
        plan = llm.explain(prompts, gen_len=4)
        spec = llm.model.spec
    assert plan is not None and plan.stages[0].policy.gpu_batch_size == -(-len(prompts) // 8) * 8
    why = {c.name: c.why for c in plan.choices}
    assert "no --gpu-batch-size" in why["gpu_batch_size"] and "halved" not in why["gpu_batch_size"]
    def ram(gbs: int) -> int:  # the predicted RAM of a CPU run (compute and host tiers share it)
        pol = dataclasses.replace(plan.stages[0].policy, gpu_batch_size=gbs)
        p = predict_peaks(spec, pol, plan.stages[0].layers, has_embed=True, has_head=True,
                          prompt_len=max(map(len, prompts)), gen_len=4, dtype_bytes=4)
        return p["gpu"] + p["cpu"]
    full = plan.stages[0].policy.gpu_batch_size
    assert ram(1) < ram(full)
    with LLM(str(tm.path), progress=False, cpu_mem=str((ram(1) + ram(full)) // 2)) as llm:
        small = llm.explain(prompts, gen_len=4)
    assert small is not None and 1 <= small.stages[0].policy.gpu_batch_size < plan.stages[0].policy.gpu_batch_size
    assert "halved" in {c.name: c.why for c in small.choices}["gpu_batch_size"]
    # nothing fits: one row, so that the budget check reports the least the placement needs
    with LLM(str(tm.path), progress=False, cpu_mem="1KiB") as llm:
        none = llm.explain(prompts, gen_len=4)
        assert none is not None and none.stages[0].policy.gpu_batch_size == 1
        assert "not even one row" in {c.name: c.why for c in none.choices}["gpu_batch_size"]
        with pytest.raises(Exception, match="exceeds --cpu-mem"):
            llm.check_plan(none, prompts, gen_len=4)
    # a budget measured on the machine is filled to 90 % at most by the sized default; a cap given is whole
    b = Budgets(gpu=1000, cpu=2000, disk=None, given=("cpu",))
    assert b.with_headroom(0.9) == Budgets(gpu=900, cpu=2000, disk=None, given=("cpu",))
    # a size given anywhere is kept: a flag, or a policy file's key
    with LLM(str(tm.path), progress=False, gpu_batch_size=3) as llm:
        given = llm.explain(prompts, gen_len=4)
    assert given is not None and given.stages[0].policy.gpu_batch_size == 3
    assert "gpu_batch_size" not in {c.name for c in given.choices}
    pol = tmp_path / "p.yaml"
    pol.write_text("num_gpu_batches: 2\npercent: [100, 0, 100, 0, 100, 0]\n")
    with LLM(str(tm.path), progress=False, policy=str(pol)) as llm:
        filed = llm.explain(prompts, gen_len=4)
    assert filed is not None and (filed.stages[0].policy.gpu_batch_size, filed.stages[0].policy.num_gpu_batches) == (8, 2)


def test_default_block_tokens_equal_transformers(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    prompts = PROMPTS * 3
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        got = llm.generate(prompts, gen_len=5)
        assert llm.plan is not None and llm.plan.stages[0].policy.gpu_batch_size >= len(prompts)
    ref = reference_generate(tm, prompts, 5)
    assert [c.token_ids for c in got] == ref


@pytest.mark.parametrize("what", ["gqa-mask", "causal", "softcap", "sinks"])
def test_what_prompt_attention_allocates_on_the_cpu_is_what_the_model_counts(what: str) -> None:
    """One GPU batch's prompt attention on a CPU device, measured: SDPA's fused kernel holds
    nothing of (s, s) per head beyond its output, grouped-query heads and an explicit mask
    included, so the peak model counts the mask alone; softcapped scores and sinks, computed one
    sequence at a time, stay within the four (heads, s, s) float32 tensors it counts for them.
    A GPU keeps every head's scores counted (``_prefill_scores_bytes``)."""
    import torch

    from flexgen_dist.engine.attention import prefill_attention
    from flexgen_dist.engine.footprint import StageShape, _prefill_scores_bytes

    from types import SimpleNamespace

    # the fields the term reads (a family with softcap and sinks together need not exist)
    spec = SimpleNamespace(num_heads=16, attn_softcap=30.0 if what == "softcap" else 0.0, attn_sinks=what == "sinks")
    b, s, nh, kvh, d = 2, 512, 16, 4, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, generator=g) for n in (nh, kvh, kvh))
    mask = None if what == "causal" else torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s).clone()
    sinks = torch.randn(nh, generator=g) if what == "sinks" else None
    softcap = 30.0 if what == "softcap" else 0.0
    prefill_attention(q, k, v, mask, softcap=softcap, sinks=sinks)  # first use's one-time allocations apart
    used = _peak_allocated(lambda: prefill_attention(q, k, v, mask, softcap=softcap, sinks=sinks))
    out = b * s * nh * d * 4
    z = StageShape(num_layers=1, has_embed=False, has_head=False, prompt_len=s, gen_len=1, dtype_bytes=4,
                   gpu_batch_size=b, num_gpu_batches=1)
    counted = _prefill_scores_bytes(spec, z)
    assert used <= out + counted, (what, used, out, counted)
    every_head = b * nh * s * s * 4
    if what in ("gqa-mask", "causal"):
        assert counted == b * s * s and used < out + every_head // 8  # not one head's scores per row
    else:
        assert used > nh * s * s * 4  # a sequence's scores are there, and counted
    assert _prefill_scores_bytes(spec, dataclasses.replace(z, cuda=True)) == b * s * s + every_head


@pytest.mark.parametrize("model", ["opt-125m", "smollm2-135m"])
def test_what_a_prefill_allocates_on_the_cpu_is_what_the_model_counts(model: str) -> None:
    """A whole generate call of one block on a CPU device (dummy weights, float32), measured:
    beyond the cache and activations it places, the prefill holds no more than the peak model
    counts for its working set (the layer forwards drop q, k and v before the MLP; the prompt
    attention holds its mask, no scores), and not far less (at least 3/4 of it)."""
    import torch

    from flexgen_dist.engine.footprint import StageShape, stage_footprint

    spec = get_spec(model)
    b, s = 8, 256
    with LLM(model, dummy_weights=True, dtype="float32", gpu_batch_size=b, num_gpu_batches=1,
             ignore_eos=True, progress=False) as llm:
        ids = torch.randint(100, 5000, (b, s), generator=torch.Generator().manual_seed(0)).tolist()
        # first use's one-time allocations apart: of the block's own shapes (a GEMM form not
        # yet chosen for them is timed over a pool of weights larger than the last-level cache)
        llm.generate(ids, gen_len=2)
        used = _peak_allocated(lambda: llm.generate(ids, gen_len=2))
    z = StageShape(num_layers=spec.num_layers, has_embed=True, has_head=True, prompt_len=s, gen_len=2,
                   dtype_bytes=4, gpu_batch_size=b, num_gpu_batches=1)
    fp = stage_footprint(spec, z)
    placed = fp.cache[0] * fp.cache[1] * fp.cache[2] + fp.acts[0] * fp.acts[1] * fp.acts[2]
    work = fp.work[0, 0, 9]
    assert 0.75 * work <= used - placed <= work, (model, used - placed, work)
