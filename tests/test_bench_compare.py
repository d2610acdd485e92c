"""bench compare: the summary math, argument errors, and real runs of both sides."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_dist.bench import compare
from flexgen_dist.bench.__main__ import main as bench_main
from flexgen_dist.bench.compare import (CompareError, format_table, job_args, parse_args, prediction_ratios, ratios,
                                        summarize, summarize_side)

ROOT = Path(__file__).resolve().parents[1]


def _bench(args: list[str], cwd: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """``python -m flexgen_dist.bench ...`` importing this checkout from ``cwd``; temp files under ``tmp``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-m", "flexgen_dist.bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _run(side: str, p: float, d: float, t: float) -> dict:
    return {"side": side, "prefill_throughput": p, "decode_throughput": d, "total_throughput": t}


def test_summary_min_median_and_ratio() -> None:
    assert summarize([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0}
    assert summarize([4.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 3.0}  # even count: mean of the middle two
    a = summarize_side([_run("A", 100, 10, 8), _run("A", 120, 12, 9), _run("A", 90, 11, 7)])
    b = summarize_side([_run("B", 150, 30, 0), _run("B", 300, 33, 0), _run("B", 200, 36, 0)])
    assert a["prefill_throughput"] == {"min": 90, "median": 100} and a["decode_throughput"]["median"] == 11
    r = ratios(a, b)
    assert r["prefill_throughput"] == pytest.approx(2.0) and r["decode_throughput"] == pytest.approx(3.0)
    assert r["total_throughput"] == 0.0
    assert ratios(b, a)["total_throughput"] is None  # A's median 0: no ratio, not a ZeroDivisionError
    with pytest.raises(ValueError):
        summarize([])
    table = format_table("A abc1234", "B working tree (abc1234, dirty)", a, b, r).splitlines()
    assert table[2].split() == ["A", "abc1234", "90.0", "100.0", "10.0", "11.0", "7.0", "8.0"]
    assert table[3].startswith("B working tree (abc1234, dirty)") and "200.0" in table[3]
    assert table[4].split() == ["B/A", "(median)", "2.000x", "3.000x", "0.000x"]


def test_prediction_over_measured_per_side() -> None:
    """Where a side's runs planned with a hardware profile, its prediction over the median of
    what it measured, per metric; none without a prediction."""
    pred = {"prefill_throughput": 200.0, "decode_throughput": 22.0, "total_throughput": 9.0}
    runs = [{**_run("A", 100, 10, 8), "predicted": pred}, {**_run("A", 120, 12, 9), "predicted": pred},
            {**_run("A", 90, 11, 7), "predicted": pred}]
    assert prediction_ratios(runs) == pytest.approx({"prefill_throughput": 2.0, "decode_throughput": 2.0,
                                                     "total_throughput": 9.0 / 8})
    assert prediction_ratios([{**_run("B", 1, 1, 1), "predicted": None}]) is None
    assert prediction_ratios([]) is None


def test_arguments_split_between_compare_and_the_job(tmp_path: Path) -> None:
    job = ["--model", "opt-125m", "--dummy-weights", "--percent", "0", "20", "80", "100", "0", "100"]
    args, rest = parse_args(["--rev", "HEAD~1", *job[:2], "--repeat", "2", *job[2:]])
    assert (args.rev, args.repeat, args.warmup, rest) == ("HEAD~1", 2, True, job)
    args, rest = parse_args(["--rev", "v1", "--no-warmup", "--json", str(tmp_path / "c.json"), "--", "--repeat", "x"])
    assert (args.rev, args.repeat, args.warmup, rest) == ("v1", 3, False, ["--repeat", "x"])  # after --: the job's
    m, o = tmp_path / "m.json", tmp_path / "o.jsonl"
    assert job_args(["--gen-len", "2"], m, o, True) == ["--gen-len", "2", "--metrics", str(m), "--output", str(o),
                                                        "--warmup", "--no-progress"]
    mine = job_args(["--output", "mine.jsonl"], m, o, False)  # the user's file, rewritten by each run
    assert mine == ["--output", "mine.jsonl", "--metrics", str(m), "--overwrite", "--no-progress"]
    for bad in (["--repeat", "0"], ["--metrics", "m.json"], ["--resume"], ["--explain"]):
        with pytest.raises(CompareError):
            parse_args(["--rev", "HEAD", *bad])


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    r = _bench(["compare", "--rev", "no-such-rev-xyz", "--model", "opt-125m"], ROOT, tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: unknown revision 'no-such-rev-xyz': give a commit, tag or "
                                             "branch that `git rev-parse` knows"]
    assert compare.main(["--rev", "HEAD", "--repeat", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --repeat 0: give 1 or more rounds"]
    for argv in ([], ["nope"]):  # no subcommand, or an unknown one: the usage with the subcommands
        assert bench_main(argv) == 2
        err = capsys.readouterr().err
        assert "usage: python -m flexgen_dist.bench" in err and "compare" in err


def test_outside_a_git_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(compare, "__file__", str(tmp_path / "compare.py"))  # as if installed outside a checkout
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert compare.main(["--rev", "HEAD", "--json", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: not inside a git repository")


def _no_checkout_left(tmp: Path) -> None:
    assert not list(tmp.glob("flexgen-compare-*"))
    trees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list", "--porcelain"], capture_output=True,
                           text=True).stdout
    assert str(tmp) not in trees


def test_failing_job_names_the_side_and_cleans_up(tmp_path: Path) -> None:
    r = _bench(["compare", "--rev", "HEAD", "--repeat", "1", "--json", str(tmp_path / "c.json"), "--",
                "--model", "no-such-model-xyz"], tmp_path, tmp_path)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 1 and len(err) == 1, r.stderr
    assert err[0].startswith(f"error: side A (rev {head}) job failed with exit code 1: error: unknown model name")
    assert "Traceback" not in r.stderr and not (tmp_path / "c.json").exists()
    _no_checkout_left(tmp_path)


def _fake_runs(calls: list[tuple[str, Path]], stop_at: int = 0):
    """A stand-in for one job run: records the side and its tree (checked out at that moment)."""
    def run_once(side: str, label: str, tree: Path, job: list[str], work: Path, n: int, warmup: bool) -> dict:
        assert (tree / "flexgen_dist" / "run.py").is_file()
        calls.append((side, tree))
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return {"side": side, **{k: 10.0 * len(calls) for k in compare.METRICS}, "wall_s": 0.1}
    return run_once


def test_rounds_alternate_and_the_checkout_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The orchestration with the job run faked: A B A B, each side in its own tree, the
    checkout removed afterwards, also on Ctrl-C."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(compare.tempfile, "tempdir", None)  # re-read TMPDIR
    calls: list[tuple[str, Path]] = []
    monkeypatch.setattr(compare, "run_once", _fake_runs(calls))
    out = tmp_path / "c.json"
    assert compare.main(["--rev", "HEAD", "--repeat", "2", "--json", str(out), "--gen-len", "2"]) == 0
    assert [s for s, _ in calls] == ["A", "B", "A", "B"]
    assert calls[1][1] == ROOT and calls[0][1] != ROOT and not calls[0][1].exists()
    res = json.loads(out.read_text())
    assert [(r["round"], r["side"]) for r in res["runs"]] == [(1, "A"), (1, "B"), (2, "A"), (2, "B")]
    assert res["summary"]["A"]["total_throughput"] == {"min": 10.0, "median": 20.0}  # runs 1 and 3
    assert res["ratio"]["total_throughput"] == pytest.approx(30.0 / 20.0)
    assert res["job_args"] == ["--gen-len", "2"] and len(res["sides"]["A"]["rev"]) == 40
    assert "1.500x" in capsys.readouterr().out
    _no_checkout_left(tmp_path)
    calls.clear()
    monkeypatch.setattr(compare, "run_once", _fake_runs(calls, stop_at=2))
    assert compare.main(["--rev", "HEAD", "--json", str(tmp_path / "d.json")]) == 130
    assert len(calls) == 2 and not (tmp_path / "d.json").exists()
    _no_checkout_left(tmp_path)


@pytest.mark.slow
def test_end_to_end_both_sides(tiny_models, tmp_path: Path) -> None:
    """One real round on a tiny model (15-40 s here, with the machine's load); relative paths in the job mean the caller's directory on both sides."""
    (tmp_path / "model").symlink_to(tiny_models["opt-pre"].path)
    out = tmp_path / "res" / "c.json"
    r = _bench(["compare", "--rev", "HEAD", "--repeat", "1", "--json", str(out), "--model", "model",
                "--num-prompts", "2", "--prompt-len", "8", "--gen-len", "3", "--ignore-eos"], tmp_path, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert res["sides"]["A"]["rev"] == head and res["sides"]["B"]["rev"] == head
    assert isinstance(res["sides"]["B"]["dirty"], bool)
    assert res["sides"]["B"]["package"] == str(ROOT / "flexgen_dist" / "__init__.py")
    assert "flexgen-compare-" in res["sides"]["A"]["package"]  # side A imported its own checkout
    assert [(x["round"], x["side"]) for x in res["runs"]] == [(1, "A"), (1, "B")]
    for run in res["runs"]:
        assert all(run[k] > 0 for k in compare.METRICS), run
    for side in ("A", "B"):
        assert set(res["summary"][side]) == set(compare.METRICS)
    assert set(res["ratio"]) == set(compare.METRICS) and all(v > 0 for v in res["ratio"].values())
    assert res["job_args"][:2] == ["--model", "model"] and res["warmup"] is True
    assert res["machine"]["cores"] >= 1 and "torch" in res["machine"]
    assert "B/A (median)" in r.stdout and f"A {head[:7]}" in r.stdout
    assert "round 1/1: side A" in r.stderr and "round 1/1: side B" in r.stderr
    assert not list(tmp_path.glob("*.jsonl"))  # outputs went to temporary files
    _no_checkout_left(tmp_path)


def test_compare_attention_builds_a_revision_beside_this_tree(tmp_path: Path) -> None:
    """compare-attention: REV's kernel sources built beside this tree's, both run on the same
    inputs; against HEAD whose sources equal the tree's (or differ only by what is uncommitted),
    the outputs are bit for bit equal where the kernel source is unchanged, and the JSON holds
    every round of both sides."""
    from flexgen_dist import kernels
    from flexgen_dist.bench import attention_compare

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    assert kernels.library() is not None, "g++ is present, so the native kernels must build"
    out = tmp_path / "att.json"
    rc = attention_compare.main(["--rev", "HEAD", "--shape", "6", "2", "21", "32", "--shape", "4", "1", "3", "64",
                                 "--dtypes", "float32", "bfloat16", "--rounds", "2", "--calls", "1",
                                 "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [(r["shape"], r["dtype"]) for r in res["results"]] == [
        ([6, 2, 21, 32], "float32"), ([6, 2, 21, 32], "bfloat16"), ([4, 1, 3, 64], "float32"),
        ([4, 1, 3, 64], "bfloat16")]
    head_src = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "flexgen_dist/kernels"],
                              capture_output=True).returncode == 0
    for r in res["results"]:
        assert len(r["ms"]["A"]) == len(r["ms"]["B"]) == 2 and r["ratio"] > 0
        if head_src:
            assert r["equal"] and r["max_diff"] == 0.0


def test_compare_attention_bad_revision_is_one_line(capsys) -> None:
    from flexgen_dist.bench import attention_compare

    assert attention_compare.main(["--rev", "no-such-revision-xyz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown revision 'no-such-revision-xyz'" in err[0]
    assert attention_compare.main(["--rev", "HEAD", "--rounds", "0"]) == 2
