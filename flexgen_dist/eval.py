"""``python -m flexgen_dist.eval ppl``: perplexity and next-token accuracy through the engine.

    python -m flexgen_dist.eval ppl                                   # bundled text, bundled model
    python -m flexgen_dist.eval ppl --text book.txt --window 512 --stride 256 --compress-weight
    python -m flexgen_dist.eval ppl --text ids.jsonl --model opt-1.3b --dummy-weights --json ppl.json
    torchrun --nproc-per-node 2 -m flexgen_dist.eval ppl --text book.txt ...
    python -m flexgen_dist.eval ppl --decode-tokens 128 --compress-cache     # the cache, as decode reads it

The text (a text file, or a ``.jsonl`` of ``{"input_ids": [...]}`` lines for models without a
tokenizer, concatenated) is cut into windows of ``--window`` tokens every ``--stride`` tokens,
as in Hugging Face's perplexity guide: each window scores the tokens not scored by the one
before (all but its first token when stride = window), teacher-forced, with the model's
logits at every position. Every placement, compression and sparsity flag of
``flexgen_dist.run`` applies (and ``--policy``, ``--config``, several ranks), so the effect
of a policy on accuracy is measured on the engine that runs it.

With ``--decode-tokens N`` only the last N tokens of each window are scored, each predicted
by a teacher-forced decode step over the KV cache (the rest of the window is context), so
the modes that act on decode attention (``--compress-cache``, ``--attn-sparsity``) show.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from .api import LLM
from .scoring import Score
from .config import ConfigError, RunConfig
from .flags import ArgParser, parse_config
from .prompts import jsonl_records
from .errors import exit_code_of

BUNDLED_TEXT = Path(__file__).with_name("data") / "english.txt"


def windows(n_tokens: int, window: int, stride: int, max_windows: int | None = None) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index within the window) of each window over n_tokens."""
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        trg = end - prev_end  # tokens no earlier window scored
        out.append((begin, end, max(1, end - begin - trg)))
        prev_end = end
        if end == n_tokens or (max_windows is not None and len(out) == max_windows):
            break
    return out


def read_ids(path: str | None, tokenizer: Any | None) -> tuple[list[int], str]:
    """The token ids of the text to score, and a name for it."""
    p = Path(path).expanduser() if path else BUNDLED_TEXT
    if not p.is_file():
        raise ConfigError(f"--text {path}: no such file")
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--text {p}: cannot be read as UTF-8 text ({e})") from None
    if p.suffix == ".jsonl":
        ids: list[int] = []
        for n, rec in jsonl_records(p, raw):
            if not isinstance(rec.get("input_ids"), list) or not all(isinstance(t, int) for t in rec["input_ids"]):
                raise ConfigError(f"{p}:{n + 1}: each line needs 'input_ids', a list of integers")
            ids += rec["input_ids"]
    else:
        if tokenizer is None:
            raise ConfigError(f"--text {p} is text but this model has no tokenizer: give a .jsonl file of "
                              '{"input_ids": [...]} lines')
        ids = list(tokenizer(raw)["input_ids"]) if raw.strip() else []
    if len(ids) < 2:
        raise ConfigError(f"--text {p}: {len(ids)} tokens; perplexity needs at least 2")
    return ids, str(p)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, RunConfig]:
    # no abbreviations: the run's flags pass through, and "--lora" must not read as "--lora-name"
    ap = ArgParser(prog="python -m flexgen_dist.eval", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Every flag of python -m flexgen_dist.run (model, placement, "
                                        "compression, distributed) is accepted too.")
    ap.add_argument("command", choices=["ppl"], help="ppl: perplexity and next-token top-1 accuracy")
    ap.add_argument("--text", help="text file, or .jsonl of {\"input_ids\": [...]} (default: a bundled "
                                   "English sample)")
    ap.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    ap.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: --window)")
    ap.add_argument("--max-windows", type=int, default=None, help="score at most this many windows")
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="score only the last N tokens of each window, predicted by teacher-forced decode "
                         "steps over the KV cache (where --compress-cache and --attn-sparsity act); the "
                         "rest of the window is context (default 0: every token, in prefill)")
    ap.add_argument("--lora-name", metavar="NAME", help="score with this adapter of --lora-modules (default: the "
                                                         "base model, or the --lora adapter merged into it)")
    ap.add_argument("--json", help="write the result here")
    args, rest = ap.parse_known_args(argv)
    args.stride = args.window if args.stride is None else args.stride
    if args.window < 2:
        raise ConfigError(f"--window {args.window}: must be >= 2")
    if not 1 <= args.stride <= args.window:
        raise ConfigError(f"--stride {args.stride}: must be in [1, --window {args.window}]")
    if not 0 <= args.decode_tokens < args.window - 1:
        raise ConfigError(f"--decode-tokens {args.decode_tokens}: must be in [0, --window - 2 = {args.window - 2}] "
                          "(each window keeps at least one token of context)")
    if args.max_windows is not None and args.max_windows < 1:
        raise ConfigError(f"--max-windows {args.max_windows}: must be >= 1")
    return args, parse_config(rest)


def evaluate(llm: LLM, *, text: str | None = None, window: int = 512, stride: int | None = None,
             max_windows: int | None = None, decode_tokens: int = 0, lora: str | None = None) -> dict[str, Any] | None:
    """Score the windows of ``text`` (default: the bundled sample) as ``eval ppl`` does, with
    the served adapter ``lora`` (``--lora-modules``; None: the base model); rank 0 returns the
    result (the other ranks serve their stage and return None)."""
    if not llm.is_driver:
        llm.score(None)
        return None
    stride = window if stride is None else stride
    ids, name = read_ids(text, llm.tokenizer)
    maxpos = llm.model.spec.max_positions
    if window > maxpos:
        raise ConfigError(f"--window {window} exceeds the model's {maxpos} positions: use --window {maxpos} "
                          "or less")
    wins = windows(len(ids), window, stride, max_windows)
    t0 = time.perf_counter()
    d = decode_tokens
    firsts = [max(f, b - a - d) if d else f for a, b, f in wins]  # decode-scored: the last d tokens only
    scores: list[Score] = llm.score([ids[a:b] for a, b, _ in wins], firsts, decode_tokens=d, lora=lora)
    elapsed = time.perf_counter() - t0
    nll, count, correct = (sum(getattr(s, k) for s in scores) for k in ("nll", "count", "correct"))
    m = llm.metrics
    return {
        "text": name, "model": m["model"], "dtype": m["dtype"], "device": m["device"], "world_size": m["world_size"],
        "window": window, "stride": stride, "windows": len(wins), "decode_tokens": d,
        **({"lora": lora} if lora else {}),
        "tokens_scored": count,
        "ppl": math.exp(nll / count), "nll_per_token": nll / count, "accuracy": correct / count,
        "time_s": elapsed, "tokens_per_s": sum(b - a for a, b, _ in wins) / elapsed,
        "policy": m["policy"], "peak_bytes": m["peak_bytes"],
    }


def report(res: dict[str, Any]) -> str:
    pol = res["policy"][0]
    flags = [k for k in ("compress_weight", "compress_cache") if pol.get(k)]
    if pol.get("attn_sparsity", 1.0) < 1.0:
        flags.append(f"attn_sparsity={pol['attn_sparsity']:g}")
    rows = [("text", res["text"]), ("model", res["model"]), ("dtype / ranks", f"{res['dtype']} / {res['world_size']}"),
            ("numerics", ", ".join(flags) or "exact (no compression, dense attention)"),
            ("windows", f"{res['windows']} x {res['window']} tokens, stride {res['stride']}"),
            ("scored in", f"decode steps (the last {res['decode_tokens']} tokens of each window)"
             if res["decode_tokens"] else "prefill (every token)"),
            ("tokens scored", str(res["tokens_scored"])), ("perplexity", f"{res['ppl']:.4f}"),
            ("next-token accuracy", f"{100 * res['accuracy']:.2f} %"),
            ("time", f"{res['time_s']:.2f} s ({res['tokens_per_s']:.1f} tok/s)")]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="flexgen_dist: %(message)s", stream=sys.stderr)
    try:
        args, cfg = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return exit_code_of(lambda: run(args, cfg))


def run(args: argparse.Namespace, cfg: RunConfig) -> int:
    with LLM(config=cfg) as llm:
        res = evaluate(llm, text=args.text, window=args.window, stride=args.stride,
                       max_windows=args.max_windows, decode_tokens=args.decode_tokens, lora=args.lora_name)
    if res is not None:
        print(report(res))
        if args.json:
            p = Path(args.json).expanduser()
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
