"""Same job, two revisions: a git revision (side A) against the working tree (side B).

    python -m flexgen_dist.bench compare --rev HEAD~1 -- --model opt-125m --dummy-weights \\
        --num-prompts 8 --prompt-len 64 --gen-len 8

Every option that is not compare's own (``--rev``, ``--repeat``, ``--no-warmup``, ``--json``),
or everything after ``--``, goes to ``python -m flexgen_dist.run`` unchanged. Side A is REV
checked out with ``git worktree add --detach`` into a temporary directory (removed afterwards,
also on an error or Ctrl-C); side B is the working tree of the repository this package was
imported from, uncommitted changes included. The job runs ``--repeat`` rounds, A then B in each,
so a drift of the machine's speed within the session falls on both sides alike; each run is
warmed up (the CLI's ``--warmup``) unless ``--no-warmup``, and writes its outputs to a
temporary file unless ``--output`` is given.

Both sides run in the caller's directory and environment, so relative paths in the job's
options mean the same on both; only ``PYTHONPATH`` differs, and the directory itself is kept
off ``sys.path``: the package may be installed (editable) from yet another checkout, and each
side must import its own copy. Before the rounds, each side's interpreter is asked where
``flexgen_dist`` comes from, and a side that would import another copy is an error.

The table gives the min and median of prefill, decode and total tok/s per side and the
ratio B/A of the medians; the JSON (``--json``) has every run in order, the summaries, the
ratios, both revisions and the machine. Errors are one line on stderr: exit code 2 for bad
input, 1 for a job that fails.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..flags import ArgParser
from ..output import check_writable

METRICS = ("prefill_throughput", "decode_throughput", "total_throughput")
PROG = "python -m flexgen_dist.bench compare"
# Runs a module with the caller's directory dropped from sys.path (``-c`` puts '' first; ``-P``
# would too, but needs Python 3.11): PYTHONPATH then decides which flexgen_dist is imported.
_PRELUDE = "import runpy, sys\nif sys.path[:1] == ['']: del sys.path[0]\n"
_RUN = _PRELUDE + "runpy.run_module('flexgen_dist.run', run_name='__main__', alter_sys=True)"
_WHERE = _PRELUDE + "import importlib.util as u; print(u.find_spec('flexgen_dist').origin)"
# the job options compare sets itself, or that would leave no run to time
_OWNED = {"--metrics": "compare writes each run's metrics itself",
          "--resume": "a resumed job skips the prompts the first run generated",
          "--explain": "it prints the plan and generates nothing"}


class CompareError(Exception):
    """A one-line error for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# ---- summaries (pure) ----

def summarize(values: Sequence[float]) -> dict[str, float]:
    """min and median of one side's figures for one metric."""
    if not values:
        raise ValueError("no runs to summarize")
    return {"min": min(values), "median": statistics.median(values)}


def summarize_side(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """min/median of each throughput over one side's runs."""
    return {k: summarize([r[k] for r in runs]) for k in METRICS}


def prediction_ratios(runs: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """One side's planner prediction over its median measured figure, per metric (the
    prediction is the same every run on one profile: the last run's is taken); None where
    the runs had no prediction (no hardware profile)."""
    pred = runs[-1].get("predicted") if runs else None
    if not pred:
        return None
    med = summarize_side(runs)
    return {k: pred[k] / med[k]["median"] for k in METRICS if k in pred and med[k]["median"]}


def ratios(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """B/A of the medians per metric; None where A's median is 0 (nothing to divide by)."""
    return {k: b[k]["median"] / a[k]["median"] if a[k]["median"] else None for k in METRICS}


def format_table(label_a: str, label_b: str, sa: dict[str, dict[str, float]],
                 sb: dict[str, dict[str, float]], ratio: dict[str, float | None]) -> str:
    """The printed result: min and median tok/s per side, then B/A of the medians."""
    w = max(len(label_a), len(label_b), 12) + 2
    head = f"{'':<{w}}" + "".join(f"{k.split('_')[0] + ' tok/s':>22}" for k in METRICS)
    sub = f"{'side':<{w}}" + f"{'min':>11}{'median':>11}" * len(METRICS)
    rows = [head, sub]
    for label, s in ((label_a, sa), (label_b, sb)):
        rows.append(f"{label:<{w}}" + "".join(f"{s[k]['min']:>11.1f}{s[k]['median']:>11.1f}" for k in METRICS))
    rows.append(f"{'B/A (median)':<{w}}" + "".join(
        f"{'':>11}{(f'{ratio[k]:.3f}x' if ratio[k] is not None else 'n/a'):>11}" for k in METRICS))
    return "\n".join(rows)


# ---- arguments ----

def _parser() -> ArgParser:
    ap = ArgParser(prog=PROG, allow_abbrev=False,
                   usage=f"{PROG} --rev REV [--repeat N] [--no-warmup] [--json PATH] [--] JOB_OPTIONS...",
                   description="Run the same `python -m flexgen_dist.run` job on git revision REV (A) "
                               "and on the working tree (B), alternating, and compare the throughputs. "
                               "Options not listed here (or everything after --) go to the job.")
    ap.add_argument("--rev", required=True, help="commit, tag or branch for side A (e.g. HEAD~1, main)")
    ap.add_argument("--repeat", type=int, default=3, metavar="N", help="rounds of A then B (default 3)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="time the cold start too (default: each run gets the CLI's --warmup)")
    ap.add_argument("--json", default="bench_results/compare.json", metavar="PATH", help="where the results go")
    return ap


def parse_args(argv: Sequence[str]) -> tuple[Any, list[str]]:
    """compare's own options and the job's: after ``--`` all is the job's, else the unknown ones."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        args, job = _parser().parse_args(argv[:i]), argv[i + 1:]
    else:
        args, job = _parser().parse_known_args(argv)
    if args.repeat < 1:
        raise CompareError(f"--repeat {args.repeat}: give 1 or more rounds")
    check_writable("--json", args.json)  # now, not after the rounds
    for flag, why in _OWNED.items():
        if any(a == flag or a.startswith(flag + "=") for a in job):
            raise CompareError(f"{flag} cannot be a job option here: {why}; leave it out")
    return args, job


def job_args(job: list[str], metrics: Path, output: Path, warmup: bool) -> list[str]:
    """The job's options for one run: the user's, plus where this run's metrics (and, unless
    the user named one, outputs) go; an output file the user named is overwritten each run."""
    has = lambda flag: any(a == flag or a.startswith(flag + "=") for a in job)  # noqa: E731
    extra = ["--metrics", str(metrics)]
    extra += ["--overwrite"] if has("--output") and not has("--overwrite") else []
    extra += [] if has("--output") else ["--output", str(output)]
    extra += ["--warmup"] if warmup and not has("--warmup") else []
    extra += [] if has("--no-progress") else ["--no-progress"]  # its bar would only fill the capture
    return job + extra


# ---- git ----

def _git(cwd: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)


def repo_root() -> Path:
    """The working tree this package was imported from, else the one around the current directory."""
    for where in (Path(__file__).resolve().parent, Path.cwd()):
        r = _git(where, "rev-parse", "--show-toplevel")
        if r.returncode == 0:
            return Path(r.stdout.strip())
    raise CompareError(f"not inside a git repository: run {PROG} from a git checkout of flexgen_dist")


def resolve_rev(top: Path, rev: str) -> str:
    """The full commit hash of ``rev`` in the repository at ``top``."""
    r = _git(top, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if r.returncode != 0 or not rev:
        raise CompareError(f"unknown revision '{rev}': give a commit, tag or branch that `git rev-parse` knows")
    return r.stdout.strip()


def show_file(top: Path, commit: str, path: str) -> str | None:
    """The text of ``path`` (relative to the repository's top) at ``commit``, or None where it has none."""
    r = _git(top, "show", f"{commit}:{path}")
    return r.stdout if r.returncode == 0 else None


def working_tree_state(top: Path) -> tuple[str | None, bool]:
    """(HEAD's full hash or None in a repository without commits, whether the tree differs from it)."""
    head = _git(top, "rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    dirty = _git(top, "status", "--porcelain").stdout.strip() != ""
    return (head.stdout.strip() or None), dirty


@contextlib.contextmanager
def checkout(top: Path, commit: str, parent: Path) -> Iterator[Path]:
    """``commit`` as a detached worktree under ``parent``, removed on the way out whatever happens."""
    tree = parent / "rev"
    r = _git(top, "worktree", "add", "--detach", str(tree), commit)
    if r.returncode != 0:
        raise CompareError(f"git worktree add failed for {commit[:12]}: {_last_line(r.stderr)}", 1)
    try:
        yield tree
    finally:
        _git(top, "worktree", "remove", "--force", str(tree))
        _git(top, "worktree", "prune")  # in case the removal itself failed half-way


# ---- runs ----

def side_env(tree: Path) -> dict[str, str]:
    """The caller's environment with ``tree`` first on PYTHONPATH."""
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(tree) + (os.pathsep + old if old else "")}


def check_import(side: str, tree: Path) -> str:
    """Where ``side``'s interpreter finds flexgen_dist; an error unless it is ``tree``'s copy."""
    r = subprocess.run([sys.executable, "-c", _WHERE], env=side_env(tree), capture_output=True, text=True)
    origin = r.stdout.strip()
    want = (tree / "flexgen_dist").resolve()
    if r.returncode != 0 or not origin or Path(origin).resolve().parent != want:
        got = origin or _last_line(r.stderr)
        raise CompareError(f"side {side} would import flexgen_dist from {got}, not {want}: "
                           "check PYTHONPATH and any .pth file that puts another copy first", 1)
    return origin


def run_once(side: str, label: str, tree: Path, job: list[str], work: Path, n: int, warmup: bool
             ) -> dict[str, Any]:
    """One job run of one side: its throughputs and times, read back from its --metrics JSON."""
    metrics, output = work / f"metrics-{side}{n}.json", work / f"output-{side}{n}.jsonl"
    cmd = [sys.executable, "-c", _RUN, *job_args(job, metrics, output, warmup)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=side_env(tree), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise CompareError(f"side {side} ({label}) job failed with exit code {r.returncode}: "
                           f"{_last_line(r.stderr) or _last_line(r.stdout)}", 1)
    if not metrics.is_file():
        raise CompareError(f"side {side} ({label}) job wrote no metrics: its run.py may predate --metrics", 1)
    m = json.loads(metrics.read_text())
    pred = m.get("predicted") or {}  # where the run planned with a hardware profile
    return {"side": side, **{k: m[k] for k in METRICS}, "prefill_time_s": m.get("prefill_time_s"),
            "decode_time_s": m.get("decode_time_s"), "wall_s": wall,
            "predicted": {k: pred[k] for k in METRICS if k in pred} or None}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "usable_cores": cores,
            "python": platform.python_version(), "torch": torch_version}


def _progress(msg: str) -> None:
    print(f"compare: {msg}", file=sys.stderr, flush=True)


def compare(args: Any, job: list[str]) -> dict[str, Any]:
    """Check both sides out, run the rounds, summarise; the result as written to the JSON."""
    top = repo_root()
    rev_a = resolve_rev(top, args.rev)
    head_b, dirty = working_tree_state(top)
    label_a = f"A {rev_a[:7]}"
    label_b = "B working tree" + (f" ({head_b[:7]}{', dirty' if dirty else ''})" if head_b else "")
    work = Path(tempfile.mkdtemp(prefix="flexgen-compare-"))
    try:
        with checkout(top, rev_a, work) as tree_a:
            trees = {"A": tree_a, "B": top}
            where = {s: check_import(s, t) for s, t in trees.items()}
            labels = {"A": f"rev {rev_a[:7]}", "B": "working tree"}
            runs: list[dict[str, Any]] = []
            for n in range(1, args.repeat + 1):
                for side in ("A", "B"):
                    _progress(f"round {n}/{args.repeat}: side {side} ({labels[side]}) running")
                    run = {"round": n, **run_once(side, labels[side], trees[side], job, work, n, args.warmup)}
                    runs.append(run)
                    _progress(f"round {n}/{args.repeat}: side {side} done in {run['wall_s']:.1f} s: prefill "
                              f"{run['prefill_throughput']:.1f} | decode {run['decode_throughput']:.1f} | "
                              f"total {run['total_throughput']:.1f} tok/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {s: summarize_side([r for r in runs if r["side"] == s]) for s in ("A", "B")}
    predicted = {s: prediction_ratios([r for r in runs if r["side"] == s]) for s in ("A", "B")}
    return {
        "benchmark": "compare",
        "sides": {"A": {"rev": rev_a, "ref": args.rev, "label": label_a, "package": where["A"]},
                  "B": {"rev": head_b, "dirty": dirty, "tree": str(top), "label": label_b, "package": where["B"]}},
        "job_args": job, "repeat": args.repeat, "warmup": args.warmup,
        "runs": runs, "summary": summary, "ratio": ratios(summary["A"], summary["B"]),
        "predicted_over_measured": predicted, "machine": machine(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, job = parse_args(sys.argv[1:] if argv is None else argv)
        res = compare(args, job)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("error: interrupted; the temporary checkout was removed", file=sys.stderr)
        return 130
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    a, b = res["sides"]["A"]["label"], res["sides"]["B"]["label"]
    print(format_table(a, b, res["summary"]["A"], res["summary"]["B"], res["ratio"]))
    for side, pm in res["predicted_over_measured"].items():
        if pm:
            print(f"side {side}: planner's prediction / measured median: " + ", ".join(
                f"{k.split('_')[0]} {v:.2f}" for k, v in pm.items()))
    print(f"{args.repeat} round(s) each, A then B; every run in {out}")
    return 0
