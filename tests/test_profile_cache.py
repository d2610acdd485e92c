"""This host's hardware profile: measured once, cached with a version and the machine's
identity, measured again (saying why in one line) when unreadable, corrupt, stale or of
another machine; --hardware FILE wins; plain runs plan with the cached one; per-dtype rates."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flexgen_dist.planner import profiler
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner.profile_cache import (PROFILE_VERSION, cached_profile, default_cache_path, load_or_profile,
                                               read_cached, write_cached)

ROOT = Path(__file__).resolve().parents[1]
CPU = HardwareSpec.from_yaml(ROOT / "configs" / "hardware" / "cpu-2core.yaml")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("FLEXGEN_HARDWARE_CACHE", str(tmp_path / "hw"))
    return tmp_path / "hw"


@pytest.fixture
def measured(monkeypatch) -> list[int]:
    """profile_hardware replaced by a fixed spec; the list counts the measurements."""
    calls: list[int] = []

    def fake(device: str = "cpu", offload_dir: str = "/tmp", quick: bool = False, **kw) -> HardwareSpec:
        calls.append(1)
        return dataclasses.replace(CPU, name="measured-here", mm_flops_dtype={"float32": 1e11, "bfloat16": 3e11})

    monkeypatch.setattr(profiler, "profile_hardware", fake)
    return calls


def test_cache_path_follows_xdg_and_names_host_device_threads(monkeypatch, tmp_path: Path) -> None:
    for var in ("FLEXGEN_HARDWARE_CACHE", "FLEXGEN_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    p = default_cache_path("cpu", threads=3)
    assert p.parent == tmp_path / "xdg" / "flexgen_dist" / "hardware"
    assert p.name.endswith("-cpu-t3.yaml")
    monkeypatch.setenv("FLEXGEN_CACHE", str(tmp_path / "fg"))
    assert default_cache_path("cpu").parent == tmp_path / "fg" / "hardware"
    monkeypatch.setenv("FLEXGEN_HARDWARE_CACHE", str(tmp_path / "only"))
    assert default_cache_path("cuda").parent == tmp_path / "only"


def test_measured_once_then_reused(cache: Path, measured: list[int], capsys) -> None:
    hw = load_or_profile(None, "cpu")
    assert hw.name == "measured-here" and len(measured) == 1
    err = capsys.readouterr().err
    assert "no profile of this host is cached yet: measuring this machine now" in err
    path = default_cache_path("cpu")
    data = yaml.safe_load(path.read_text())
    assert data["profile_version"] == PROFILE_VERSION and data["identity"]["threads"] == torch.get_num_threads()
    assert load_or_profile(None, "cpu") == hw and len(measured) == 1  # the cache, not a new measurement
    assert capsys.readouterr().err == ""
    assert HardwareSpec.from_yaml(path) == hw  # the cache file also serves as --hardware FILE


@pytest.mark.parametrize("damage,said", [
    (lambda p: p.write_text("{{{ not yaml"), "is unreadable"),
    (lambda p: p.write_text("- a list\n"), "is corrupt (not a mapping)"),
    (lambda p: p.write_text(p.read_text().replace(f"profile_version: {PROFILE_VERSION}", "profile_version: 2")), "is stale"),
    (lambda p: p.write_text(p.read_text().replace("threads:", "threads: 999 #")), "of another threads"),
    # new native kernels (a package upgrade) time the engine's products differently
    (lambda p: p.write_text(re.sub(r"(?m)^  native: .*$", "  native: an-older-build", p.read_text())),
     "of another native"),
    (lambda p: p.write_text("\n".join(ln for ln in p.read_text().splitlines() if not ln.startswith("mm_flops:"))),
     "is corrupt (")])
def test_a_bad_cache_is_measured_again_saying_why(cache: Path, measured: list[int], capsys, damage, said) -> None:
    load_or_profile(None, "cpu")
    path = default_cache_path("cpu")
    damage(path)
    hw, why = read_cached(path, "cpu")
    assert hw is None and said in why
    capsys.readouterr()
    assert load_or_profile(None, "cpu").name == "measured-here" and len(measured) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "measuring this machine now" in lines[0]
    assert read_cached(path, "cpu")[0] is not None  # rewritten whole


def test_a_named_file_wins_over_the_cache(cache: Path, measured: list[int], tmp_path: Path) -> None:
    load_or_profile(None, "cpu")
    f = tmp_path / "mine.yaml"
    CPU.to_yaml(f)
    assert load_or_profile(f, "cpu") == CPU and len(measured) == 1
    with pytest.raises(FileNotFoundError, match="not found"):
        load_or_profile(tmp_path / "missing.yaml", "cpu")  # a user's file is not replaced by a measurement


def test_rates_follow_the_run_dtype() -> None:
    hw = dataclasses.replace(CPU, mm_flops_dtype={"float32": 1e11, "bfloat16": 4e11},
                             gemm_bw_dtype={"bfloat16": 3e9})
    assert hw.for_dtype("bfloat16").mm_flops == 4e11 and hw.for_dtype("bfloat16").gemm_bw == 3e9
    assert hw.for_dtype("float32").mm_flops == 1e11 and hw.for_dtype("float32").gemm_bw == hw.gemm_bw
    assert hw.for_dtype("float16") == hw  # no figure: the general one
    with pytest.raises(ValueError, match="mm_flops_dtype"):
        dataclasses.replace(CPU, mm_flops_dtype={"int8": 1e11})
    att = dataclasses.replace(hw, att_flops=1e11, att_flops_dtype={"float32": 1e11, "bfloat16": 1.3e11})
    assert att.for_dtype("bfloat16").att_flops == 1.3e11 and att.for_dtype("float16").att_flops == 1e11
    with pytest.raises(ValueError, match="att_flops"):
        dataclasses.replace(CPU, att_flops=0.0)


def test_prompt_attention_is_costed_at_its_own_rate(tmp_path: Path) -> None:
    """The prefill's attention, ``4 rows s q`` FLOPs a layer, is timed at ``att_flops`` where the
    profile has it (else at ``mm_flops``): halving it adds exactly that term again; a profile
    without it reads and plans as before; the YAML keeps it."""
    from flexgen_dist.engine.policy import Policy
    from flexgen_dist.models.registry import get_spec
    from flexgen_dist.planner.cost_model import WorkShape, estimate_pipeline

    spec, wl = get_spec("opt-125m"), WorkShape(256, 4, 4)
    pol = [Policy(4, 2, 100, 0, 100, 0, 100, 0)]

    def prefill(hw) -> float:
        return estimate_pipeline(spec, [spec.num_layers], pol, [hw], wl, 1, num_blocks=1)["prefill_time_s"]

    base = prefill(CPU)
    fast, slow = (dataclasses.replace(CPU, att_flops=CPU.mm_flops * f) for f in (1.0, 0.5))
    att = 4.0 * 8 * 256 * 256 * spec.num_heads * spec.head_dim * spec.num_layers / CPU.mm_flops
    assert prefill(fast) == pytest.approx(base)
    assert prefill(slow) - base == pytest.approx(att, rel=1e-6)
    f = tmp_path / "att.yaml"
    slow.to_yaml(f)
    assert HardwareSpec.from_yaml(f) == slow


def _explain(extra: list[str]) -> str:
    r = subprocess.run([sys.executable, "-m", "flexgen_dist.run", "--model", "opt-125m", "--dummy-weights",
                        "--num-prompts", "8", "--prompt-len", "16", "--gen-len", "4", "--explain", *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def test_plain_runs_plan_with_the_cached_profile(cache: Path) -> None:
    out = _explain(["--threads", "1"])
    assert "no hardware profile" in out and "this host's cached profile" not in out
    write_cached(default_cache_path("cpu", 1), CPU, "cpu", threads=1)  # as a 1-thread run measures it
    out = _explain(["--threads", "1"])
    assert "hardware = cpu-2core: this host's cached profile" in out
    assert "the cost model's best" in out and "no hardware profile" not in out
    assert "no hardware profile" in _explain(["--threads", "2"])  # a profile of 1 thread is not 2 threads'
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cached_profile("cpu") is not None
    finally:
        torch.set_num_threads(before)
