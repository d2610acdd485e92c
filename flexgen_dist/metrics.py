"""What a run measured: the loop's timings, one record per stage, the merged report.

The same keys for one process and for m ranks (world size 1 is a one-stage pipeline):
throughputs are prompt tokens / prefill time, tokens after each sequence's first / decode
time, and generated tokens / (prefill + decode time).
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Timings:
    """One stage's clock over one generate call, split by phase; the token counts are
    stage 0's (where outputs are gathered)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # generated tokens after the first of each sequence
    token_steps: int = 0  # (token, block) items this stage computed (fewer than all after EOS)
    # what the blocks computed: prompt positions (padding included), the padding, and
    # (sequence, step) rows of generation (a finished sequence's rows included until its block ends)
    prompt_positions: int = 0
    prompt_padding: int = 0
    prompt_shared: int = 0  # prompt positions a block's shared prefix spared (computed once, not per row)
    prompt_repeated: int = 0  # prompt positions of rows repeating another row of their GPU batch (``twins.py``)
    generated_rows: int = 0

    def metrics(self) -> dict[str, float]:
        tot = self.prefill_s + self.decode_s
        return {
            # generated tokens users asked for and got, per second (= total_throughput), beside
            # all the rows the blocks computed; the share of the prompt positions computed that
            # was padding, and of the generated rows that belonged to finished sequences
            "useful_throughput": self.generated_tokens / tot if tot else 0.0,
            "computed_throughput": self.generated_rows / tot if tot else 0.0,
            "padding_fraction": self.prompt_padding / self.prompt_positions if self.prompt_positions else 0.0,
            "shared_prefix_fraction": self.prompt_shared / self.prompt_positions if self.prompt_positions else 0.0,
            "repeated_prompt_fraction": self.prompt_repeated / self.prompt_positions if self.prompt_positions else 0.0,
            "finished_rows_fraction": (1 - self.generated_tokens / self.generated_rows) if self.generated_rows else 0.0,
            "prefill_time_s": self.prefill_s, "decode_time_s": self.decode_s,
            "prefill_throughput": self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0,
            "decode_throughput": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "total_throughput": self.generated_tokens / tot if tot else 0.0,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
        }

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


STAGE_TIME_KEYS = ("stage", "layers", "prefill_s", "decode_s", "compute_s", "io_wait_s", "comm_wait_s",
                   "prefill_compute_s", "prefill_io_wait_s", "prefill_comm_wait_s", "token_steps",
                   "disk_bytes_read")


def merge_metrics(run: dict[str, Any], timings: Timings, stages: list[dict[str, Any]],
                  predicted: dict[str, Any]) -> dict[str, Any]:
    """The report of one generate call: ``run`` (model, device, dtype, workload), stage 0's
    token counts in ``timings`` and the last stage's clock (where tokens come out: the
    pipeline's fill counts as prefill), with every stage's record (policy, peaks, times) in
    stage order."""
    disks = [s["direct_io"] for s in stages if s.get("direct_io") is not None]
    clock = Timings(**{**timings.as_dict(), "prefill_s": stages[-1]["prefill_s"], "decode_s": stages[-1]["decode_s"]})
    return {
        **run, "world_size": len(stages),
        **clock.metrics(),
        # the share of the cache's positions (stage 0's blocks) a shared prefix held once or a
        # repeated prompt kept once spared (``engine/held.py``, ``engine/prompt_groups.py``)
        "cache_spared_fraction": (stages[0].get("cache_spared", 0) / stages[0]["cache_positions"]
                                  if stages[0].get("cache_positions") else 0.0),
        "policy": [s["policy"] for s in stages], "peak_bytes": [s["peak_bytes"] for s in stages],
        "stage_times": [{k: s[k] for k in STAGE_TIME_KEYS} for s in stages],
        "predicted": {**predicted, "peak_bytes": [s["predicted_peak_bytes"] for s in stages]},
        "direct_io": all(disks) if disks else None,  # None: no stage used the disk tier
        "kernel_policy": [s.get("kernel_policy") for s in stages],
        "huge_pages": [s.get("huge_pages") for s in stages],  # per stage: on / off / unavailable
        "keep_freed": [s.get("keep_freed") for s in stages],  # per stage: freed host memory kept (hugepages.py)
        "threads": [s.get("threads") for s in stages],  # per stage: the compute threads and why
        "one_time_s": [s.get("one_time_s") for s in stages],  # per stage: costs kept out of the clock
        **({"experts": [s.get("experts") for s in stages]} if any(s.get("experts") for s in stages) else {}),
    }


def _prompts(metrics: dict[str, Any]) -> str:
    """The call's prompts in words: each a row, or each its beams' or candidates' rows."""
    for key, what in (("beam_width", "beams"), ("candidates_per_prompt", "candidates")):
        k = metrics.get(key)
        if k:
            return f"{metrics['num_prompts'] // k} prompts x {k} {what}"
    return f"{metrics['num_prompts']} prompts"


def summary(metrics: dict[str, Any]) -> str:
    """One or two lines: measured throughputs, and the planner's where it made a plan."""
    line = (f"prefill {metrics['prefill_throughput']:.1f} tok/s | decode {metrics['decode_throughput']:.1f} "
            f"tok/s | total {metrics['total_throughput']:.1f} tok/s  ({_prompts(metrics)}, "
            f"gen-len {metrics['gen_len']}, {metrics['prefill_time_s'] + metrics['decode_time_s']:.2f} s)")
    if metrics.get("padding_fraction"):
        line += (f"; {100 * metrics['padding_fraction']:.1f} % of the prompt positions were padding, "
                 f"{100 * metrics.get('finished_rows_fraction', 0):.1f} % of the generated rows were of finished sequences")
    if metrics.get("shared_prefix_fraction"):
        line += (f"; {100 * metrics['shared_prefix_fraction']:.1f} % of the prompt positions were a shared prefix, "
                 "computed once per block or taken from the block before")
    if metrics.get("repeated_prompt_fraction"):
        line += (f"; {100 * metrics['repeated_prompt_fraction']:.1f} % of the prompt positions repeated another "
                 "row's prompt, computed once")
    if metrics.get("cache_spared_fraction"):
        line += (f"; {100 * metrics['cache_spared_fraction']:.1f} % of the cache's positions were a shared prefix "
                 "or a repeated prompt kept once")
    pred = metrics.get("predicted", {})
    if "total_throughput" in pred:
        line += (f"\npredicted by the planner: prefill {pred['prefill_throughput']:.1f} | decode "
                 f"{pred['decode_throughput']:.1f} | total {pred['total_throughput']:.1f} tok/s")
    return line


def progress_bar(total_steps: int, enabled: bool) -> Any:
    """Progress on stderr counting token steps (the caller adds requests done and useful tok/s
    with ``set_postfix_str``), or None. On a terminal a tqdm bar redrawn in place; otherwise
    (a log file, a pipe shared with stdout) a whole line now and then, so redraws never run
    into the results printed on stdout."""
    if not enabled:
        return None
    if not sys.stderr.isatty():
        return LineProgress(total_steps)
    from tqdm import tqdm

    return tqdm(total=total_steps, desc="generating", unit="step", file=sys.stderr,
                mininterval=1.0, leave=False, dynamic_ncols=True)


class LineProgress:
    """Progress as whole lines on stderr, at most one per ``every`` seconds (``progress_bar``)."""

    def __init__(self, total: int, every: float = 30.0) -> None:
        self.total, self.every, self.n, self.note = total, every, 0, ""
        self.t0 = self.last = time.monotonic()

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every and self.n < self.total:
            self.last = now
            spent = now - self.t0
            eta = spent * (self.total - self.n) / self.n if self.n else float("nan")
            print(f"generating: {self.n}/{self.total} steps ({100 * self.n / self.total:.0f} %), "
                  f"{spent:.0f} s, ETA {eta:.0f} s{'; ' + self.note if self.note else ''}", file=sys.stderr, flush=True)

    def set_postfix_str(self, note: str) -> None:
        self.note = note

    def close(self) -> None:
        pass
