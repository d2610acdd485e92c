"""Compute threads on a shared host: a job alone and beside a busy process, per thread setting.

    python -m flexgen_dist.bench.threads --rounds 5 --json bench_results/threads.json
    python -m flexgen_dist.bench.threads -- --model opt-125m --dummy-weights --gen-len 16

Runs the same ``python -m flexgen_dist.run`` job (default: the README's first command, the
bundled model on its example questions) under each setting, alone and then beside one
competing process (a single-threaded busy loop, or with ``--competitor torch`` a two-thread
torch GEMM loop, another job's shape), the settings in turn within every round:

- ``default``: what the runtime chooses (``threads.py``: the CPUs it may use, less those
  other processes keep busy at start);
- ``all-cpus``: ``--threads`` = every CPU of the affinity mask (torch's own default);
- ``omp1``: ``OMP_NUM_THREADS=1``;
- ``passive``: every CPU with ``OMP_WAIT_POLICY=passive`` (waiting threads sleep, not spin).

Each run's figure is the job's generation time from its metrics (prefill + decode, the time
the throughputs are computed from). The JSON has every run, the medians, and each setting's
median against the best setting's in the same condition. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .single import machine, write_json

SETTINGS = ("default", "all-cpus", "omp1", "passive")
_BUSY = {"loop": "while True: pass",
         "torch": "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\nwhile True: a @ a"}


def _setting(name: str, cpus: int) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if name == "default":
        return [], env
    if name == "all-cpus":
        return ["--threads", str(cpus)], env
    if name == "omp1":
        return [], {**env, "OMP_NUM_THREADS": "1"}
    return ["--threads", str(cpus)], {**env, "OMP_WAIT_POLICY": "passive"}


def run_job(job: list[str], extra: list[str], env: dict[str, str], workdir: Path) -> dict[str, Any]:
    m = workdir / "metrics.json"
    cmd = [sys.executable, "-m", "flexgen_dist.run", *job, *extra, "--metrics", str(m), "--print-outputs", "0",
           "--no-progress"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"threads: the job failed (exit {r.returncode}): "
                         f"{(r.stderr.strip().splitlines() or ['no output'])[-1]}")
    data = json.loads(m.read_text())
    return {"seconds": data["prefill_time_s"] + data["decode_time_s"], "threads": data["threads"][0]["threads"],
            "why": data["threads"][0]["why"], "total_throughput": data["total_throughput"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--competitor", choices=sorted(_BUSY), default="loop")
    ap.add_argument("--json", default=None)
    ap.add_argument("job", nargs=argparse.REMAINDER, help="run options after --")
    args = ap.parse_args(argv)
    job = [a for a in args.job if a != "--"]
    cpus = len(os.sched_getaffinity(0))
    subprocess.run([sys.executable, "-m", "flexgen_dist.run", *job, "--print-outputs", "0", "--no-progress"],
                   capture_output=True, check=False, timeout=1800)  # kernels built, GEMM forms stored
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c: {s: [] for s in SETTINGS} for c in ("alone", "beside")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for cond in ("alone", "beside"):
                busy = subprocess.Popen([sys.executable, "-c", _BUSY[args.competitor]]) if cond == "beside" else None
                try:
                    for s in SETTINGS:
                        extra, env = _setting(s, cpus)
                        res = run_job(job, extra, env, Path(tmp))
                        runs[cond][s].append(res)
                        print(f"round {r + 1}/{args.rounds} {cond:6} {s:8}: {res['seconds']:.2f} s "
                              f"({res['threads']} threads)", file=sys.stderr, flush=True)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    out: dict[str, Any] = {"machine": machine(), "cpus": cpus, "competitor": args.competitor, "job": job,
                           "rounds": args.rounds, "runs": runs, "median_s": {}, "vs_best": {}}
    for cond, by in runs.items():
        med = {s: statistics.median(x["seconds"] for x in v) for s, v in by.items()}
        best = min(med.values())
        out["median_s"][cond] = med
        out["vs_best"][cond] = {s: m / best for s, m in med.items()}
    print(f"{'setting':10} {'alone s':>9} {'beside s':>9} {'beside / best':>14}")
    for s in SETTINGS:
        print(f"{s:10} {out['median_s']['alone'][s]:9.2f} {out['median_s']['beside'][s]:9.2f} "
              f"{out['vs_best']['beside'][s]:13.2f}x")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
