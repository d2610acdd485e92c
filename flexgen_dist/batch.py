"""Entry point: ``python -m flexgen_dist.batch -i requests.jsonl -o results.jsonl [run options]``
(bare, or under torchrun, mpirun or srun: rank 0 reads and writes).

A job in the OpenAI Batch format (``openai_batch.py``): one output line per request, in input
order, written and fsynced as soon as its window of requests is done; a request that cannot
run gets an error line and the job goes on. ``--resume`` finishes an interrupted job;
``--gen-len`` is the ``max_tokens`` of requests that give none. A thin shell over
``LLM.stream_batch``; nothing in the package imports it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from .api import LLM
from .config import ConfigError, RunConfig
from .flags import build_parser, parse_config_with
from .errors import exit_code_of
from .metrics import summary
from .output import OutputWriter, check_writable
from .prompts import Prompt

PROG = "python -m flexgen_dist.batch"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="flexgen_dist: %(message)s", stream=sys.stderr)
    p = build_parser(PROG)
    p.description = ("Run a batch file in the OpenAI Batch format (chat and completions requests) "
                     "and write the output file in the same format.")
    p.add_argument("-i", "--input", help="requests, one JSON line each: {custom_id, method, url, body}")
    p.add_argument("-o", dest="output", help="the output file (same as --output)")
    try:
        cfg, own = parse_config_with(argv, p, ("input",))
        if not own.get("input") or not cfg.output:
            raise ConfigError(f"give the requests with -i FILE and the output with -o FILE (see {PROG} --help)")
        if cfg.logprobs is not None:
            raise ConfigError("--logprobs is for prompt files: in a batch file each request asks for its own "
                              "(chat: \"logprobs\": true, \"top_logprobs\": K; completions: \"logprobs\": K)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return exit_code_of(lambda: run(cfg, Path(own["input"]).expanduser()))


def run(cfg: RunConfig, input_path: Path) -> int:
    """Rank 0 reads the requests and writes each window's lines as it completes."""
    for flag, path in (("-o", cfg.output), ("--metrics", cfg.metrics)):
        check_writable(flag, path)
    if not input_path.is_file():
        raise ConfigError(f"-i {input_path}: no such file")
    with LLM(config=cfg) as llm:
        lines: list[str] = []
        writer: OutputWriter | None = None

        def prepare() -> int:
            nonlocal lines, writer
            lines = [ln for ln in input_path.read_text(encoding="utf-8").splitlines() if ln.strip()]
            if not lines:
                raise ConfigError(f"-i {input_path}: no requests in the file")
            writer = OutputWriter(cfg.output, None, resume=cfg.resume, overwrite=cfg.overwrite, id_field="custom_id")
            done = writer.start([Prompt(_custom_id(n, ln), None, []) for n, ln in enumerate(lines)],
                                _fingerprint(cfg, llm, input_path))
            if done:
                print(f"resuming: {done} of {len(lines)} requests already in {cfg.output}", file=sys.stderr)
            return done, len(lines)

        done, total = llm.on_driver(prepare)
        if done == total:
            if llm.is_driver:
                print(f"nothing to do: all {total} requests are already in {cfg.output}")
            return 0
        t0, counts = time.perf_counter(), {"requests": 0, "errors": 0, "completion_tokens": 0, "embeddings": 0,
                                            "scores": 0, "classified": 0}
        try:
            for part in llm.stream_batch(lines if llm.is_driver else None, skip=done):
                assert writer is not None
                writer.write(part)
                for line in part:
                    counts["requests"] += 1
                    counts["errors"] += line["error"] is not None
                    if line["error"] is None:
                        out = line["response"]["body"]
                        used = out.get("usage") or {}  # a response's output tokens are its completion tokens
                        counts["completion_tokens"] += used.get("completion_tokens", used.get("output_tokens", 0))
                        data = out.get("data") or []
                        counts["embeddings"] += sum(d.get("object") == "embedding" for d in data)
                        counts["scores"] += sum(d.get("object") == "score" for d in data) + len(out.get("results", ()))
                        counts["classified"] += sum("label" in d for d in data)
        finally:
            if writer is not None:
                writer.close()
        if llm.is_driver:
            _report(cfg, llm, counts, time.perf_counter() - t0, done)
    return 0


def _custom_id(n: int, line: str) -> str:
    """The id an output line names its request by (as ``openai_requests`` gives it)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return f"line-{n + 1}"
    cid = rec.get("custom_id") if isinstance(rec, dict) else None
    return f"line-{n + 1}" if cid is None else str(cid)


def _fingerprint(cfg: RunConfig, llm: LLM, input_path: Path) -> dict[str, Any]:
    """What determines the output lines: the model, dtype, the job's defaults and the input."""
    return {"model": cfg.model or "(bundled)", "model_name": llm.model.spec.name, "dtype": str(llm.dtype),
            "dummy_weights": cfg.dummy_weights, "default_max_tokens": cfg.gen_len, "seed": cfg.seed,
            "ignore_eos": cfg.ignore_eos,
            **cfg.model_options(), "input_sha256": hashlib.sha256(input_path.read_bytes()).hexdigest()}


def _report(cfg: RunConfig, llm: LLM, counts: dict[str, int], seconds: float, done: int) -> None:
    ok = counts["requests"] - counts["errors"]
    print(f"{counts['requests']} requests written to {cfg.output} ({ok} answered, {counts['errors']} "
          f"with an error{f'; {done} already there before' if done else ''}); "
          f"{counts['completion_tokens']} completion tokens in {seconds:.1f} s "
          f"({counts['completion_tokens'] / max(seconds, 1e-9):.1f} useful tok/s)"
          + (f"; {counts['embeddings']} embeddings" if counts["embeddings"] else "")
          + (f"; {counts['scores']} pair scores" if counts["scores"] else "")
          + (f"; {counts['classified']} inputs classified" if counts["classified"] else ""))
    if llm.metrics:
        print(summary(llm.metrics))
    if cfg.metrics:
        p = Path(cfg.metrics).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({**llm.metrics, "batch": {**counts, "seconds": seconds, "resumed": done}},
                                indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
