"""Planner: cost model, LP search, pipeline plans, hardware YAML, profiler and CLI.

Fast (the searches take well under a second each) and free of wall-clock assertions.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from flexgen_dist.engine.policy import Policy
from flexgen_dist.models.registry import get_spec
from flexgen_dist.models.spec import ModelSpec
from flexgen_dist.planner.cli import main as cli_main
from flexgen_dist.planner.cost_model import WorkShape, estimate_pipeline, estimate_stage
from flexgen_dist.planner.terms import _read_and_compute, stage_terms
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner.profiler import profile_hardware
from flexgen_dist.planner.pipeline import plan_pipeline
from flexgen_dist.planner.search import PlanError, plan_stage, round_percents, solve_lp

ROOT = Path(__file__).resolve().parents[1]
T4 = ROOT / "configs" / "hardware" / "t4.yaml"
WL = WorkShape(prompt_len=512, gen_len=32)
FAST = dict(max_gpu_batch_size=16, max_num_gpu_batches=4)  # a smaller grid for property tests


@pytest.fixture(scope="module")
def t4() -> HardwareSpec:
    return HardwareSpec.from_yaml(T4)


def _budgets(hw: HardwareSpec) -> dict[str, int]:
    return {"gpu": hw.gpu_mem, "cpu": hw.cpu_mem, "disk": hw.disk_mem}


def _assert_fits(peak: dict[str, dict[str, int]], hw: HardwareSpec) -> None:
    for phase in ("prefill", "decode"):
        for tier, budget in _budgets(hw).items():
            assert peak[phase][tier] <= budget, (phase, tier, peak[phase][tier], budget)


def _plan(name: str, hw: HardwareSpec, **kw) -> tuple[Policy, object]:
    spec = get_spec(name)
    return plan_stage(spec, spec.num_layers, hw, WL, has_embed=True, has_head=True, **kw)


# LP and rounding ----------------------------------------------------------------------
@pytest.mark.parametrize("gbs,ngb,cpu_att", [(8, 4, True), (32, 2, False), (64, 8, True)])
def test_lp_solution_satisfies_constraints(t4, gbs, ngb, cpu_att):
    spec = get_spec("opt-30b")
    terms = stage_terms(spec, spec.num_layers, t4, WL, gpu_batch_size=gbs, num_gpu_batches=ngb,
                        cpu_attention=cpu_att, has_embed=True, has_head=True)
    budgets = np.array([t4.gpu_mem, t4.cpu_mem, t4.disk_mem], dtype=float)
    x = solve_lp(terms, budgets, weights_all_gpu=False, no_disk_weights=False)
    assert x is not None
    assert np.all(x >= -1e-9) and np.all(x <= 1 + 1e-9)
    for i in range(0, 9, 3):
        assert abs(x[i:i + 3].sum() - 1.0) < 1e-6
    lp_peaks = terms.peak_rows(True, True) @ np.append(x, 1.0)  # what the LP constrained
    assert np.all(lp_peaks <= budgets * (1 + 1e-6))
    p = round_percents(x)
    assert all(p[i:i + 3].sum() == 100 for i in range(0, 9, 3))


@pytest.mark.parametrize("name,budget,grid", [
    ("opt-6.7b", {}, {}), ("opt-175b", {}, {}), ("opt-30b", {}, FAST),
    ("opt-30b", {"gpu_mem": "6GiB", "cpu_mem": "64GiB"}, FAST),
    ("llama-2-70b", {"cpu_mem": "100GiB"}, FAST)])
def test_plan_fits_budgets_after_rounding(t4, name, budget, grid):
    hw = t4.with_budgets(**budget)
    pol, cost = _plan(name, hw, **grid)
    assert all(float(v).is_integer() for v in pol.percent())
    for kind in ("w", "cache", "act"):
        assert abs(sum(pol.fractions(kind)) - 1.0) < 1e-6
    _assert_fits(cost.peak, hw)
    spec = get_spec(name)
    again = estimate_stage(spec, spec.num_layers, pol, hw, WL, has_embed=True, has_head=True)
    assert again.peak == cost.peak
    assert again.total_throughput == pytest.approx(cost.total_throughput)


@pytest.mark.parametrize("name,field,values", [
    ("opt-6.7b", "gpu_mem", ["24GiB", "16GiB", "8GiB", "3GiB"]),
    ("opt-30b", "cpu_mem", ["200GiB", "96GiB", "32GiB"]),
    ("opt-175b", "disk_mem", ["1300GiB", "400GiB", "200GiB"]),
])
def test_tighter_budget_never_raises_throughput(t4, name, field, values):
    prev = float("inf")
    for v in values:  # loosest first
        _, cost = _plan(name, t4.with_budgets(**{field: v}), **FAST)
        assert cost.total_throughput <= prev * (1 + 1e-9), (field, v)
        prev = cost.total_throughput


def test_unlimited_gpu_puts_everything_on_gpu(t4):
    pol, _ = _plan("opt-1.3b", t4.with_budgets(gpu_mem="10TiB"), **FAST)
    assert pol.percent() == (100.0, 0.0, 100.0, 0.0, 100.0, 0.0)


def test_tiny_gpu_huge_cpu_keeps_weights_and_cache_on_cpu(t4):
    pol, _ = _plan("opt-6.7b", t4.with_budgets(gpu_mem="2GiB", cpu_mem="1TiB"), **FAST)
    assert pol.w_cpu_percent >= 95 and pol.w_disk_percent == 0
    assert pol.cache_cpu_percent >= 95 and pol.cache_disk_percent == 0


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_merged_decode_streams_the_weights_once_per_step(t4, device):
    """Decode merges a block's GPU batches (``Policy.merges_decode``) where every activation
    is on the device and the cache is all on it (a GPU) or off disk (a CPU device): the cost
    model then streams each weight matrix once per step, not once per GPU batch, and the
    search finds such a placement when memory allows it."""
    hw = t4.with_budgets(gpu_mem="10TiB") if device == "cuda" else \
        replace(t4, compute_device="cpu", gemm_bw=t4.gemm_bw or 1e11)
    spec = get_spec("opt-1.3b")
    merged = Policy(8, 4, 100, 0, 100, 0, 100, 0)
    apart = Policy(8, 4, 100, 0, 99 if device == "cuda" else 0, 0, 100, 0)  # 1 % of the cache on cpu / all on disk
    one_gb = Policy(8, 1, 100, 0, 100, 0, 100, 0)
    assert merged.merges_decode(device) and not apart.merges_decode(device)
    assert not one_gb.merges_decode(device) and not replace(merged, act_gpu_percent=99).merges_decode(device)
    in_ram = replace(merged, cache_gpu_percent=0, cache_cpu_percent=100)
    assert in_ram.merges_decode(device)  # with CPU attention q goes to the cache: nothing travels
    assert replace(in_ram, cpu_attention=False).merges_decode(device) == (device == "cpu")
    kw = dict(has_embed=True, has_head=True)
    step = {p: estimate_stage(spec, spec.num_layers, p, hw, WL, **kw).channels["decode_step"]["comp"]
            for p in (merged, apart)}
    terms = {m: stage_terms(spec, spec.num_layers, hw, WL, gpu_batch_size=8, num_gpu_batches=4,
                            cpu_attention=False, merged=m, **kw) for m in (True, False)}
    x = np.array([1, 0, 0, 1, 0, 0, 1, 0, 0], dtype=float)
    t_m, t_u = (float(terms[m].layer_times(x)[1][4]) * spec.num_layers for m in (True, False))
    assert t_m < t_u and step[merged] == pytest.approx(t_m)
    pol, cost = _plan("opt-1.3b", hw, max_gpu_batch_size=8, max_num_gpu_batches=4)
    assert pol.num_gpu_batches > 1 and pol.merges_decode(device)


@pytest.mark.parametrize("name,budget,tier", [
    ("opt-175b", {"disk_mem": "10GiB"}, "disk"),
    ("opt-30b", {"gpu_mem": "256MiB"}, "gpu"),
    ("opt-175b", {"cpu_mem": "1GiB"}, "cpu"),
])
def test_infeasible_budget_names_the_tier(t4, name, budget, tier):
    with pytest.raises(PlanError, match=rf"{tier} too small by [0-9.]+ [KMGT]iB for {name}") as e:
        _plan(name, t4.with_budgets(**budget))
    assert f"--{tier}-mem" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_a_cpu_only_machines_short_compute_share_names_both_flags(t4):
    """On a CPU-only machine the gpu tier is RAM's compute share: a shortfall there is raised
    with --cpu-mem (the pool) and --gpu-mem where it was given; a small one reads in MiB."""
    cpu = replace(t4, compute_device="cpu", gpu_mem=64 * 2**20, cpu_mem=2**34)
    with pytest.raises(PlanError, match=r"gpu too small by [0-9.]+ (MiB|GiB) for opt-1.3b") as e:
        _plan("opt-1.3b", cpu)
    assert "raise --cpu-mem (the RAM pool of a CPU-only machine), and --gpu-mem where you gave it" in str(e.value)


def test_compression_keeps_weights_off_disk(t4):
    pol, cost = _plan("opt-175b", t4, compress=True, **FAST)
    assert pol.compress_weight and pol.compress_cache and pol.w_disk_percent == 0
    _, plain = _plan("opt-175b", t4, **FAST)
    assert cost.total_throughput > plain.total_throughput


# cost model ---------------------------------------------------------------------------
def test_gqa_cache_is_smaller_than_mha(t4):
    shape = dict(name="x", family="llama", num_layers=32, hidden_size=4096, ffn_size=11008,
                 num_heads=32, vocab_size=32000, max_positions=4096)
    mha, gqa = ModelSpec(**shape), ModelSpec(**shape, num_kv_heads=8)
    pol = Policy(gpu_batch_size=16, num_gpu_batches=4, w_gpu_percent=0, w_cpu_percent=0,
                 cache_gpu_percent=0, cache_cpu_percent=100)
    peaks = [estimate_stage(s, 32, pol, t4, WL, has_embed=True, has_head=True).peak
             for s in (mha, gqa)]
    assert peaks[1]["decode"]["cpu"] < peaks[0]["decode"]["cpu"] / 2


def test_micro_batch_groups_multiply_the_cache(t4):
    spec = get_spec("opt-6.7b")
    pol = Policy(gpu_batch_size=8, num_gpu_batches=2, w_gpu_percent=0, w_cpu_percent=100,
                 cache_gpu_percent=0, cache_cpu_percent=100)
    one, four = (estimate_stage(spec, 8, pol, t4, WL, has_embed=False, has_head=False,
                                num_micro_batches=g).peak["decode"]["cpu"] for g in (1, 4))
    cache = 8 * 16 * (512 + 32) * 2 * spec.kv_dim * 2
    assert four - one == pytest.approx(3 * cache, rel=1e-6)


def test_without_overlap_channels_add_up(t4):
    spec = get_spec("opt-30b")
    pol = Policy(gpu_batch_size=16, num_gpu_batches=2, w_gpu_percent=10, w_cpu_percent=70,
                 cache_gpu_percent=0, cache_cpu_percent=50)
    on = estimate_stage(spec, 48, pol, t4, WL, has_embed=True, has_head=True)
    off = estimate_stage(spec, 48, replace(pol, overlap=False), t4, WL, has_embed=True,
                         has_head=True)
    assert off.decode_time_s > on.decode_time_s
    step = on.channels["decode_step"]
    assert on.decode_step_s == pytest.approx(max(step.values()))
    assert off.decode_step_s == pytest.approx(sum(step.values()))


def test_cpu_device_plan_uses_its_own_hardware():
    hw = HardwareSpec.from_yaml(ROOT / "configs" / "hardware" / "cpu-2core.yaml")
    assert hw.compute_device == "cpu" and hw.source == "measured"
    spec = get_spec("smollm2-135m")
    pol, cost = plan_stage(spec, spec.num_layers, hw, WorkShape(64, 8, dtype_bytes=4),
                           has_embed=True, has_head=True, **FAST)
    _assert_fits(cost.peak, hw)
    assert cost.decode_throughput > 0 and cost.prefill_throughput > 0


def test_estimate_pipeline_matches_plan(t4):
    spec = get_spec("opt-30b")
    plan = plan_pipeline(spec, 2, t4, WL, **FAST)
    again = estimate_pipeline(spec, plan.stage_layers, plan.policies, [t4, t4], WL,
                              plan.num_micro_batches)
    for k in ("prefill_throughput", "decode_throughput", "total_throughput"):
        assert again[k] == pytest.approx(plan.predicted[k])
    assert plan.stages[0].layers == range(0, 24) and plan.stages[1].layers == range(24, 48)


@pytest.mark.parametrize("device,combine", [("cpu", sum), ("cuda", max)])
def test_a_products_arithmetic_and_weight_stream_add_on_a_cpu_overlap_on_a_gpu(t4, device, combine):
    """Decode's linear layers: on a CPU device the same cores load the weights and multiply,
    so the two times add up; on a GPU they overlap and the larger one sets the pace."""
    from flexgen_dist.planner.terms import CONST
    spec = get_spec("opt-1.3b")
    hw = replace(t4, compute_device=device, mm_flops=5e11, gemm_bw=2e10, host_layer_s=None, host_batch_s=None)
    terms = stage_terms(spec, spec.num_layers, hw, WorkShape(64, 8), gpu_batch_size=8, num_gpu_batches=1,
                        cpu_attention=False, has_embed=False, has_head=False)
    arithmetic = 2.0 * 8 * spec.layer_numel() / hw.mm_flops
    stream = spec.layer_numel() * 2 / hw.gemm_bw
    assert arithmetic > 0.1 * stream and stream > 0.1 * arithmetic  # both terms matter here
    assert terms.decode[4, CONST] == pytest.approx(combine((arithmetic, stream)))


def test_prediction_counts_the_prompts_not_the_rows_of_full_blocks(t4):
    """A job of fewer prompts than one block runs those prompts only (the engine cuts its GPU
    batches from the prompts it has): the prediction costs that block and counts those
    sequences; a job whose last block is short counts its prompts, with that block's time
    taken as a full one's."""
    spec = get_spec("opt-1.3b")
    hw = t4.with_budgets(gpu_mem="10TiB")
    pol = Policy(8, 4, 100, 0, 100, 0, 100, 0)
    wl = WorkShape(prompt_len=64, gen_len=16)
    few = estimate_pipeline(spec, [spec.num_layers], [pol], [hw], wl, 1, num_blocks=1, num_prompts=12)
    ran = estimate_pipeline(spec, [spec.num_layers], [Policy(8, 2, 100, 0, 100, 0, 100, 0)], [hw], wl, 1,
                            num_blocks=1)  # the block 12 prompts form: GPU batches of 8 and 4
    assert few["block_size"] == 16
    assert few["decode_time_s"] == pytest.approx(ran["decode_time_s"])
    assert few["decode_throughput"] == pytest.approx(12 * 15 / ran["decode_time_s"])
    full = estimate_pipeline(spec, [spec.num_layers], [pol], [hw], wl, 1, num_blocks=1)
    assert few["decode_throughput"] < full["decode_throughput"]  # fewer rows read the same weights
    # 40 prompts in blocks of 32: two blocks' time, 40 sequences, not 64
    two = estimate_pipeline(spec, [spec.num_layers], [pol], [hw], wl, 1, num_blocks=2, num_prompts=40)
    rows = estimate_pipeline(spec, [spec.num_layers], [pol], [hw], wl, 1, num_blocks=2)
    assert two["decode_time_s"] == pytest.approx(rows["decode_time_s"])
    assert two["total_throughput"] == pytest.approx(rows["total_throughput"] * 40 / 64)


def test_more_stages_scale_decode_super_linearly_when_one_stage_needs_disk(t4):
    spec = get_spec("opt-175b")
    one = plan_pipeline(spec, 1, t4, WL)
    pol = one.policies[0]
    assert pol.w_disk_percent > 0 or pol.cache_disk_percent > 0
    four = plan_pipeline(spec, 4, t4, WL)
    assert four.num_micro_batches == 4
    assert four.predicted["decode_throughput"] > 4 * one.predicted["decode_throughput"]
    for st in four.stages:
        _assert_fits(st.cost.peak, t4)


def test_balanced_partition_is_no_worse(t4):
    spec = get_spec("opt-1.3b")
    caps = dict(max_gpu_batch_size=16, max_num_gpu_batches=4)
    eq = plan_pipeline(spec, 3, t4, WL, **caps)
    bal = plan_pipeline(spec, 3, t4, WL, partition="balanced", **caps)
    assert sum(bal.stage_layers) == spec.num_layers
    assert bal.predicted["total_throughput"] >= eq.predicted["total_throughput"] * (1 - 1e-9)


# hardware -----------------------------------------------------------------------------
def test_hardware_yaml_round_trip(t4, tmp_path):
    path = tmp_path / "hw.yaml"
    t4.to_yaml(path)
    assert HardwareSpec.from_yaml(path) == t4
    assert t4.gpu_mem == 15 * 2**30  # "15GiB" in the file
    assert t4.with_budgets(cpu_mem="64GiB").cpu_mem == 64 * 2**30


def test_hardware_yaml_rejects_unknown_and_missing_keys(t4, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(T4.read_text() + "gpu_memory: 16GiB\n")
    with pytest.raises(ValueError, match="unknown key.*gpu_memory"):
        HardwareSpec.from_yaml(bad)
    d = t4.to_dict()
    del d["dtoc_bw"]
    with pytest.raises(ValueError, match="missing key.*dtoc_bw"):
        HardwareSpec.from_dict(d)
    with pytest.raises(ValueError, match="ctog_bw"):
        replace(t4, ctog_bw=0.0)


def test_profiler_quick_mode_is_positive(tmp_path):
    hw = profile_hardware("cpu", str(tmp_path), quick=True)
    assert hw.source == "measured" and hw.compute_device == "cpu"
    for k, v in hw.to_dict().items():
        if isinstance(v, (int, float)):
            # disk reads may cost no compute; the host's time is fitted as two parts, one may be 0
            assert v >= 0 if k in ("disk_cpu", "host_layer_s", "host_batch_s", "host_cache_batch_s") else v > 0, k
    assert hw.disk_cpu is not None  # measured on a CPU device
    assert hw.host_layer_s + hw.host_batch_s > 0 and hw.host_cache_batch_s is not None
    assert hw.att_flops_dtype is not None and set(hw.att_flops_dtype) == {"float32", "bfloat16", "float16"}
    assert hw.att_flops == hw.att_flops_dtype["float32"]  # a CPU device computes in float32 by default
    from flexgen_dist.kernels import library
    assert (hw.cpu_packed_flops is not None) == (library() is not None)  # codes read in place where built
    assert set(hw.cpu_att_peak_dtype) == {"float32", "bfloat16", "float16"}
    assert hw.cpu_att_peak == hw.cpu_att_peak_dtype["float32"]
    for name in ("decode_flops", "cpu_att_read", "gemm_bw"):  # each per dtype, float32's the plain figure
        assert set(getattr(hw, name + "_dtype")) == {"float32", "bfloat16", "float16"}
        assert getattr(hw, name) == getattr(hw, name + "_dtype")["float32"], name
    assert hw.cpu_att_read == hw.cpu_flops  # the one-head probe in float32
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the DiskStore cleaned up


def test_a_profile_says_when_the_machines_speed_moved_while_it_measured(capsys):
    from flexgen_dist.planner.profiler import _check_steady
    assert _check_steady(10e9, 11e9) and capsys.readouterr().err == ""
    assert not _check_steady(16e9, 10.8e9)
    err = capsys.readouterr().err
    assert "speed moved while it was measured (decode GEMM 16.0 GB/s at the start, 10.8 at the end)" in err
    assert "measure again when it is idle" in err and err.count("\n") == 1


def test_disk_cpu_adds_compute_for_disk_bytes_on_cpu_devices(tmp_path):
    """Disk traffic costs ``disk_cpu`` compute seconds per byte on a CPU device, nothing on a
    GPU; and the field round-trips through YAML and rejects a negative value."""
    cpu = HardwareSpec.from_yaml(ROOT / "configs" / "hardware" / "cpu-2core.yaml")
    spec = get_spec("opt-125m")
    args = dict(gpu_batch_size=4, num_gpu_batches=2, cpu_attention=True, has_embed=True, has_head=True)
    x = np.array([0, 0.5, 0.5, 1, 0, 0, 1, 0, 0], dtype=float)  # half the weights on disk
    base = stage_terms(spec, spec.num_layers, cpu, WL, **args)
    c = 1e-9  # one second per GB
    more = stage_terms(spec, spec.num_layers, replace(cpu, disk_cpu=c), WL, **args)
    for phase in (0, 1):
        t0, t1 = base.layer_times(x)[phase], more.layer_times(x)[phase]
        disk_bytes = t0[2] * cpu.dtoc_bw + t0[3] * cpu.ctod_bw
        assert disk_bytes > 0
        assert t1[4] == pytest.approx(t0[4] + c * disk_bytes)
        assert np.allclose(np.delete(t1, 4), np.delete(t0, 4))
    on_gpu = replace(cpu, compute_device="cuda")
    g0 = stage_terms(spec, spec.num_layers, on_gpu, WL, **args).layer_times(x)
    g1 = stage_terms(spec, spec.num_layers, replace(on_gpu, disk_cpu=c), WL, **args).layer_times(x)
    assert np.allclose(g0[0], g1[0]) and np.allclose(g0[1], g1[1])
    replace(cpu, disk_cpu=c).to_yaml(tmp_path / "hw.yaml")
    assert HardwareSpec.from_yaml(tmp_path / "hw.yaml").disk_cpu == c
    with pytest.raises(ValueError, match="disk_cpu"):
        replace(cpu, disk_cpu=-1.0)


def test_host_time_is_its_own_channel_on_a_gpu_and_compute_on_a_cpu(tmp_path):
    """``host_layer_s``/``host_batch_s``: the host's time to issue a layer. On a GPU it is a
    channel of its own (the device computes while the host issues the next kernels, so a step
    takes the slower of the two); on a CPU device it adds to compute. Merged decode issues the
    linear part once per step. The fields round-trip through YAML and refuse a negative value."""
    spec = get_spec("opt-125m")
    a, b = 3e-4, 1e-4
    x = np.array([1, 0, 0, 1, 0, 0, 1, 0, 0], dtype=float)
    for device in ("cuda", "cpu"):
        hw = replace(HardwareSpec.from_yaml(T4), compute_device=device)
        for merged in (False, True):
            kw = dict(gpu_batch_size=4, num_gpu_batches=3, cpu_attention=False, has_embed=True, has_head=True,
                      merged=merged)
            t0 = stage_terms(spec, spec.num_layers, hw, WL, **kw).layer_times(x)
            t1 = stage_terms(spec, spec.num_layers, replace(hw, host_layer_s=a, host_batch_s=b), WL, **kw).layer_times(x)
            host = {0: 3 * (a + b), 1: a * (1 if merged else 3) + 3 * b}  # prefill, decode per layer
            row = 6 if device == "cuda" else 4
            for phase in (0, 1):
                assert t1[phase][row] == pytest.approx(t0[phase][row] + host[phase])
                assert np.allclose(np.delete(t1[phase], row), np.delete(t0[phase], row))
    slow = replace(HardwareSpec.from_yaml(T4), host_layer_s=1e-2, host_batch_s=0.0)  # a very slow host
    cost = estimate_stage(spec, spec.num_layers, Policy(4, 3, 100, 0, 100, 0, 100, 0), slow, WL,
                          has_embed=True, has_head=True)
    assert cost.channels["decode_step"]["host"] == pytest.approx(spec.num_layers * 1e-2)  # merged: once per layer
    assert cost.decode_step_s == pytest.approx(spec.num_layers * 1e-2)  # the host sets the pace
    slow.to_yaml(tmp_path / "hw.yaml")
    assert HardwareSpec.from_yaml(tmp_path / "hw.yaml").host_layer_s == 1e-2
    with pytest.raises(ValueError, match="host_batch_s"):
        replace(slow, host_batch_s=-1.0)
    # a compressed cache adds its per-batch share, and only where the policy compresses the cache
    c = 2e-4
    for compress in (False, True):
        kw = dict(gpu_batch_size=4, num_gpu_batches=3, cpu_attention=False, has_embed=True, has_head=True,
                  merged=True, compress_cache=compress)
        t0 = stage_terms(spec, spec.num_layers, replace(hw, host_layer_s=a, host_batch_s=b), WL, **kw).layer_times(x)
        t1 = stage_terms(spec, spec.num_layers, replace(hw, host_layer_s=a, host_batch_s=b, host_cache_batch_s=c), WL,
                         **kw).layer_times(x)
        for phase in (0, 1):
            assert t1[phase][4] == pytest.approx(t0[phase][4] + (3 * c if compress else 0.0))
    assert HardwareSpec.from_dict({**slow.to_dict(), "host_cache_batch_s": c}).host_cache_batch_s == c


def test_a_compressed_cache_the_host_attends_costs_its_measured_rate(tmp_path):
    """``cpu_packed_flops``: the host's decode attention over a compressed cache reads its codes
    in place at that rate, where the cache lies off the device under CPU attention (and anywhere
    on a CPU device); without the figure the cache is counted expanded, then attended, as before.
    A GPU's own share and an uncompressed cache are not touched; the field round-trips and
    refuses a rate that is not positive."""
    spec = get_spec("opt-125m")
    packed = 3e10
    kw = dict(gpu_batch_size=4, num_gpu_batches=3, has_embed=True, has_head=True)

    def comp(hw: HardwareSpec, x: list[float], compress: bool, cpu_attention: bool = True) -> float:
        return stage_terms(spec, spec.num_layers, hw, WL, cpu_attention=cpu_attention, compress_cache=compress,
                           **kw).decode @ np.append(np.array(x, dtype=float), 1.0)

    gpu = HardwareSpec.from_yaml(T4)
    base = np.array([1, 0, 0, 0, 0, 0, 1, 0, 0], dtype=float)  # weights, activations on the device
    x_cc, x_cg = base.copy(), base.copy()
    x_cc[4], x_cg[3] = 1.0, 1.0  # the cache in host RAM, or on the device
    bls, ctx = 12, WL.prompt_len + WL.gen_len / 2
    att = 4.0 * bls * ctx * spec.q_dim
    for device in ("cuda", "cpu"):
        hw = replace(gpu, compute_device=device)
        with_rate = replace(hw, cpu_packed_flops=packed)
        t_old = comp(hw, x_cc, True)[4]
        t_new = comp(with_rate, x_cc, True)[4]
        # the host's share: attention at the packed rate in place of expansion + attention
        assert t_old - t_new == pytest.approx(att / hw.cpu_flops + bls * ctx * spec.kv_numel_per_token() * WL.dtype_bytes
                                              / (2 * hw.cpu_flops) - att / packed)
        assert np.allclose(comp(hw, x_cc, False), comp(with_rate, x_cc, False))  # no compressed cache: no change
        g_old, g_new = comp(hw, x_cg, True)[4], comp(with_rate, x_cg, True)[4]
        if device == "cuda":  # the GPU attends its own share, expanded, as before
            assert g_new == pytest.approx(g_old)
            # without CPU attention the host's share comes to the GPU too
            assert comp(with_rate, x_cc, True, cpu_attention=False)[4] == pytest.approx(comp(hw, x_cc, True, False)[4])
        else:  # a CPU device attends every share where it lies, codes in place
            assert g_new == pytest.approx(t_new)
    gpu_rate = replace(gpu, cpu_packed_flops=packed)
    gpu_rate.to_yaml(tmp_path / "hw.yaml")
    assert HardwareSpec.from_yaml(tmp_path / "hw.yaml").cpu_packed_flops == packed
    with pytest.raises(ValueError, match="cpu_packed_flops"):
        replace(gpu, cpu_packed_flops=0.0)


@pytest.mark.parametrize("model", ["opt-125m", "llama-3.2-1b"])
def test_the_hosts_decode_attention_reads_then_computes(model):
    """``cpu_att_peak`` (eight query heads a key) with ``cpu_att_read`` (one head a key, or
    ``cpu_flops`` where absent): the host's decode attention is its cache's bytes at the read
    rate the two imply plus its FLOPs at the compute rate they imply; a shape of one head a key
    costs what the one-head probe measured, one of eight what the peak probe measured, those
    between in between. Without the peak: FLOPs at ``cpu_flops``, as before. ``for_dtype`` takes
    the run dtype's figures; a CPU device attends its own share so too, a GPU its own as before."""
    spec = get_spec(model)
    kw = dict(gpu_batch_size=4, num_gpu_batches=3, has_embed=True, has_head=True, cpu_attention=True)
    bls, ctx = 12, WL.prompt_len + WL.gen_len / 2
    flops, kv = 4.0 * bls * ctx * spec.q_dim, bls * ctx * spec.kv_numel_per_token()
    g = spec.num_heads / spec.num_kv_heads  # query heads a key
    gpu = HardwareSpec.from_yaml(T4)
    coef = lambda hw, col, wl=WL: stage_terms(spec, spec.num_layers, hw, wl, **kw).decode[4, col]  # noqa: E731
    CG, CC = 3, 4
    assert coef(gpu, CC) == pytest.approx(flops / gpu.cpu_flops)  # no peak measured: as before
    one, eight = gpu.cpu_flops, gpu.cpu_flops * 3
    hw = replace(gpu, cpu_att_peak=eight)
    got = coef(hw, CC)
    assert got == pytest.approx(_read_and_compute(kv * WL.dtype_bytes, flops, one, eight, WL.dtype_bytes))
    # the rates are of the run's dtype: one head a key is the one-head probe's shape
    assert flops / eight <= got * (1 + 1e-9) and (got < flops / one * (1 - 1e-9)) == (g > 1)
    assert coef(hw, CG) == pytest.approx(coef(gpu, CG))  # the GPU's own share
    on_cpu = replace(hw, compute_device="cpu")
    assert coef(on_cpu, CG) == pytest.approx(coef(on_cpu, CC)) == pytest.approx(got)
    wl32 = WorkShape(WL.prompt_len, WL.gen_len, dtype_bytes=4)
    if g == 1:  # one head a key: the one-head probe's own shape and rate
        assert coef(hw, CC, wl32) == pytest.approx(flops / one) == pytest.approx(got)
    read_fast = replace(hw, cpu_att_read=one * 2)  # a faster read rate in the run's dtype: less time
    assert coef(read_fast, CC) < got
    # the kernel's two rates reproduce both probes, and a shape between lies between
    for b in (2, 4):
        f = 1e9
        assert _read_and_compute(f * b / 2, f, one, eight, b) == pytest.approx(f / one)
        assert _read_and_compute(f * b / 16, f, one, eight, b) == pytest.approx(f / eight)
        assert f / eight < _read_and_compute(f * b / 6, f, one, eight, b) < f / one
    typed = replace(gpu, cpu_att_peak_dtype={"float32": 1e11, "bfloat16": 2e11},
                    cpu_att_read_dtype={"float32": 1e10, "bfloat16": 3e10})
    assert typed.for_dtype("bfloat16").cpu_att_peak == 2e11 and typed.for_dtype("float16").cpu_att_peak is None
    assert typed.for_dtype("bfloat16").cpu_att_read == 3e10 and typed.for_dtype("float16").cpu_att_read is None
    for bad in (dict(cpu_att_peak=-1.0), dict(cpu_att_read=0.0), dict(cpu_att_peak_dtype={"int8": 1.0}),
                dict(cpu_att_read_dtype={"float32": -2.0})):
        with pytest.raises(ValueError, match=next(iter(bad))):
            replace(gpu, **bad)


def test_a_products_rate_moves_from_the_decode_figure_to_the_prefill_one():
    """``decode_flops``: products of up to 64 rows are costed at it, of 512 and more at
    ``mm_flops``, geometric between; a decode step's products (rows: its GPU batch, or the
    block where merged) take it, a prefill's the GEMM rate; without it every size takes
    ``mm_flops``, as before. ``for_dtype`` takes the run dtype's."""
    gpu = HardwareSpec.from_yaml(T4)
    hw = replace(gpu, decode_flops=gpu.mm_flops / 4)
    assert gpu.product_flops(8) == gpu.product_flops(4096) == gpu.mm_flops
    assert hw.product_flops(1) == hw.product_flops(64) == gpu.mm_flops / 4
    assert hw.product_flops(512) == hw.product_flops(10**6) == gpu.mm_flops
    mid = hw.product_flops(64 * 8 ** 0.5)  # halfway in the doublings: the geometric mean
    assert mid == pytest.approx(gpu.mm_flops / 2)
    rates = [hw.product_flops(r) for r in (64, 100, 200, 300, 512)]
    assert rates == sorted(rates)
    spec = get_spec("opt-1.3b")
    for cpu in (False, True):
        base = replace(gpu, compute_device="cpu") if cpu else gpu
        slow = replace(base, decode_flops=base.mm_flops / 1000)  # slow enough to set a GPU's pace
        kw = dict(gpu_batch_size=8, num_gpu_batches=2, has_embed=False, has_head=False, cpu_attention=False)
        a, b = (stage_terms(spec, spec.num_layers, h, WL, **kw) for h in (base, slow))
        assert a.prefill[4, -1] == pytest.approx(b.prefill[4, -1])  # 8 x 512 rows: the GEMM's rate
        assert b.decode[4, -1] > a.decode[4, -1]  # 8 rows a product: the slower decode rate
        fast = replace(base, decode_flops=base.mm_flops * 4)
        assert stage_terms(spec, spec.num_layers, fast, WL, **kw).decode[4, -1] <= a.decode[4, -1]
    typed = replace(gpu, decode_flops_dtype={"float32": 1e12, "bfloat16": 3e12})
    assert typed.for_dtype("bfloat16").decode_flops == 3e12 and typed.for_dtype("float16").decode_flops is None
    for bad in (dict(decode_flops=-1.0), dict(decode_flops_dtype={"fp8": 1e12})):
        with pytest.raises(ValueError, match=next(iter(bad))):
            replace(gpu, **bad)
    # a profile file carries them through YAML
    d = typed.to_dict()
    assert HardwareSpec.from_dict(d) == typed


# CLI ----------------------------------------------------------------------------------
def test_cli_plan_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", "--model", "opt-1.3b", "--hardware", str(T4), "--prompt-len", "128",
                   "--gen-len", "8", "--stages", "1", "2", "--json", str(out),
                   "--max-gpu-batch-size", "16", "--max-num-gpu-batches", "4"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "decode scaling" in text and "WG" in text
    data = json.loads(out.read_text())
    assert [d["stages"] for d in data] == [1, 2]
    for d in data:
        assert len(d["policies"]) == d["stages"]
        Policy.from_dict(d["policies"][0])
        assert set(d["predicted"]) >= {"prefill_throughput", "decode_throughput",
                                       "total_throughput"}


def test_cli_errors_are_one_line(capsys):
    assert cli_main(["plan", "--model", "opt-175b", "--hardware", str(T4),
                     "--disk-mem", "1GiB"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "disk too small" in err[0]
    assert cli_main(["plan", "--model", "no-such-model", "--hardware", str(T4)]) != 0
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    readme = T4.parent / "README.md"  # not a profile: not even YAML
    assert cli_main(["plan", "--model", "opt-1.3b", "--hardware", str(readme)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not valid YAML" in err[0]


def test_per_stage_hardware_list(tmp_path) -> None:
    from flexgen_dist.planner.hardware import hardware_for_stages, load_hardware_stages

    hw_dir = Path(__file__).resolve().parents[1] / "configs" / "hardware"
    f = tmp_path / "mixed.yaml"
    f.write_text(f"stages:\n  - {hw_dir / 't4.yaml'}\n  - {hw_dir / 'cpu-2core.yaml'}\n")
    hws = load_hardware_stages(f)
    assert [h.compute_device for h in hws] == ["cuda", "cpu"]
    assert len(load_hardware_stages(hw_dir / "t4.yaml")) == 1
    with pytest.raises(ValueError, match="lists 2 stages but the pipeline has 3"):
        hardware_for_stages(hws, 3)
    plan = plan_pipeline(get_spec("opt-1.3b"), 2, hardware_for_stages(hws, 2), WorkShape(128, 16))
    # the CPU stage is the slower one: its policy is planned for its own memory and rates
    assert plan.stages[1].cost.decode_time_s > plan.stages[0].cost.decode_time_s


def _cost(pre: float, step: float, n: int = 5, bls: int = 4, net: float = 0.0):  # noqa: ANN202
    from flexgen_dist.planner.cost_model import StageCost

    return StageCost(prefill_time_s=pre, decode_time_s=step * (n - 1), peak={}, block_size=bls, prompt_len=8,
                     gen_len=n, num_layers=1, prefill_net_s=net, decode_net_s=net)


def test_pipeline_simulation_of_the_item_stream() -> None:
    """The prediction walks the runtime's item stream: one stage is the sum of its items; two
    equal stages pay a fill of one prefill item, which pieces (one per GPU batch) shrink."""
    from flexgen_dist.planner.cost_model import pipeline_prediction

    one = pipeline_prediction([_cost(2.0, 0.5)], 1, num_blocks=3)
    assert one["prefill_time_s"] == pytest.approx(3 * 2.0) and one["decode_time_s"] == pytest.approx(3 * 4 * 0.5)
    two = [_cost(1.0, 0.25), _cost(1.0, 0.25)]
    whole = pipeline_prediction(two, 2, num_blocks=2)
    assert whole["prefill_time_s"] == pytest.approx(1.0 + 2 * 1.0)  # fill, then both blocks on stage 1
    pieces = pipeline_prediction(two, 2, num_blocks=2, piece_costs=[_cost(0.25, 0.0625)] * 2, num_gpu_batches=4)
    assert pieces["prefill_time_s"] == pytest.approx(0.25 + 2 * 1.0)
    assert pieces["prefill_items"] == "batch" and whole["prefill_items"] == "block"
    # decode: a block's step needs the ring (both stages); with G = 2 the other block fills the gap
    assert whole["decode_time_s"] == pytest.approx(4 * 2 * 0.25, rel=0.01)


def test_pipeline_simulation_of_many_blocks_extends_the_steady_state() -> None:
    from flexgen_dist.planner.cost_model import pipeline_prediction

    two = [_cost(1.0, 0.25, net=0.01), _cost(1.2, 0.3, net=0.01)]
    exact = pipeline_prediction(two, 2, num_blocks=40)  # > 6 G: extrapolated from 12 blocks
    from flexgen_dist.planner import cost_model

    p, d = cost_model._simulate(two, None, 2, 1, 40)
    assert exact["prefill_time_s"] + exact["decode_time_s"] == pytest.approx(p + d, rel=0.02)


def test_pipeline_simulation_of_the_overlapped_schedule() -> None:
    """A rider adds its compute (not its weight reads) to the decode step it rides on: a
    disk-bound step (1.0 s of reads, 0.2 s of compute) carries a 0.5 s piece for free, so
    three blocks of two batches take 1 + 3 x 2 steps instead of 3 x (1 + 2)."""
    from flexgen_dist.planner.cost_model import StageCost, best_pipeline, pipeline_prediction
    from flexgen_dist.planner.terms import CHANNELS

    def cost(pre: float, step: float, shared_comp: float, bls: int) -> StageCost:
        ch = {"prefill": dict.fromkeys(CHANNELS, 0.0), "decode_step": dict.fromkeys(CHANNELS, 0.0),
              "prefill_shared": dict.fromkeys(CHANNELS, 0.0)}
        ch["prefill"]["comp"] = pre
        ch["decode_step"].update(dtoc=step, comp=0.2)
        ch["prefill_shared"]["comp"] = shared_comp
        return StageCost(prefill_time_s=pre, decode_time_s=2 * step, peak={}, block_size=bls, prompt_len=8,
                         gen_len=3, num_layers=1, channels=ch)

    block, piece = [cost(1.0, 1.0, 1.0, 4)], [cost(0.5, 1.0, 0.5, 2)]
    seq = pipeline_prediction(block, 1, num_blocks=3, piece_costs=piece, num_gpu_batches=2, split=False)
    ovl = pipeline_prediction(block, 1, num_blocks=3, piece_costs=piece, num_gpu_batches=2, split=False, ride=True)
    assert seq["prefill_time_s"] + seq["decode_time_s"] == pytest.approx(9.0)
    assert ovl["prefill_time_s"] + ovl["decode_time_s"] == pytest.approx(7.0)
    # a riding step's time is split by compute: 0.5 of its 0.7 s of compute is the rider's
    assert ovl["prefill_time_s"] == pytest.approx(1.0 + 4 * 0.5 / 0.7)
    assert ovl["schedule"] == "overlapped" and seq["schedule"] == "sequential"
    pick = best_pipeline(block, piece, 1, num_blocks=3, num_gpu_batches=2)
    assert pick["schedule"] == "overlapped"
    # one block per group: nothing to ride on
    assert best_pipeline(block, piece, 1, num_blocks=1, num_gpu_batches=2)["schedule"] == "sequential"


@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_a_profile_with_per_dtype_rates_plans(gpu: str) -> None:
    """The GPU profiles carry per-dtype matrix rates (dicts): the planner memoizes stages by
    their hardware, so a spec must hash, and equal specs hash equal."""
    path = Path(__file__).resolve().parents[1] / "configs" / "hardware" / f"{gpu}.yaml"
    hw = HardwareSpec.from_yaml(path)
    assert hw.mm_flops_dtype and hash(hw) == hash(HardwareSpec.from_yaml(path))
    assert hash(hw.for_dtype("bfloat16")) != hash(hw.for_dtype("float32"))
    plan = plan_pipeline(get_spec("opt-6.7b"), 1, hw.for_dtype("float16"), WL)
    assert plan.predicted["total_throughput"] > 0 and plan.stages[0].policy.w_gpu_percent == 100


# linear-attention states (Qwen3-Next) ----------------------------------------------------
def test_the_states_leave_the_gpu_only_where_that_buys_a_larger_block() -> None:
    """Qwen3-Next-80B's 36 linear layers keep 72 MiB a sequence of states. Where the whole
    model fits the GPU the plan keeps them there; where it does not, it moves them to RAM
    (``state_percent=0 100``) for a larger block than the GPU could hold them for, costs their
    traffic (a decode step brings each layer's in and sends it back) and fits the budgets."""
    hw = HardwareSpec.from_yaml(ROOT / "configs" / "hardware" / "h100.yaml")
    spec, wl = get_spec("qwen3-next-80b-a3b"), WorkShape(prompt_len=512, gen_len=32, dtype_bytes=2)
    roomy = hw.with_budgets(gpu_mem="200GiB", cpu_mem="400GiB", disk_mem="1TiB")
    tight = hw.with_budgets(gpu_mem="40GiB", cpu_mem="400GiB", disk_mem="1TiB")
    pol, _ = plan_stage(spec, spec.num_layers, roomy, wl, has_embed=True, has_head=True, max_num_gpu_batches=4)
    assert (pol.state_gpu_percent, pol.state_cpu_percent) == (100, 0)
    pol, cost = plan_stage(spec, spec.num_layers, tight, wl, has_embed=True, has_head=True)
    assert (pol.state_gpu_percent, pol.state_cpu_percent) == (0, 100)
    _assert_fits(cost.peak, tight)
    on_gpu = estimate_stage(spec, spec.num_layers, replace(pol, state_gpu_percent=100, state_cpu_percent=0), tight,
                            wl, has_embed=True, has_head=True)
    assert on_gpu.peak["decode"]["gpu"] > tight.gpu_mem  # the same block with its states on the GPU does not fit
    assert cost.channels["decode_step"]["ctog"] > on_gpu.channels["decode_step"]["ctog"]  # the traffic is costed
    assert cost.channels["decode_step"]["gtoc"] > on_gpu.channels["decode_step"]["gtoc"]


def test_a_model_without_linear_layers_plans_no_state_placement(t4) -> None:
    from flexgen_dist.planner.search import state_options

    assert state_options(get_spec("opt-1.3b"), 0, 24) == ((100.0, 0.0),)
    spec = get_spec("qwen3-next-80b-a3b")
    assert state_options(spec, 3, 1) == ((100.0, 0.0),)  # layer 3 attends
    assert state_options(spec, 0, 1) == ((100.0, 0.0), (0.0, 100.0))
