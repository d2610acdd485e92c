"""What a decode step's choice costs beside the head's product, with and without the extras.

    python -m flexgen_dist.bench.sampling --json bench_results/sampling-extras.json

For each row count, on logits of ``--vocab`` columns (default: the bundled SmolLM2's 49152),
times the plain greedy choice (``RowSampling.sample``), the same with logprobs of K = 0, 5
and 20 alternatives (``token_logprobs``), with a frequency and presence penalty, with a
logit bias of 16 ids, with a repetition penalty over 256 prompt ids per row, and with a
JSON schema per row (structured output, the bundled SmolLM2's tokenizer, each row's matcher
inside a string value, where most tokens are allowed: the mask's costly case; where
``--vocab`` is another size this one is left out), and, for scale, the head's product of the same rows (float32, hidden
``--hidden``): medians over ``--reps`` calls after a warm-up, the variants alternating. A
sampler with penalties is timed with ``--steps`` tokens of history, as at a block's last step
(its per-step update, O(rows x steps), is left out). Reports, never asserts.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

from .single import machine, write_json


def variants(rows: int, vocab: int, hidden: int, steps: int) -> dict[str, Callable[[], Any]]:
    from ..engine.sampling import RowSampling, SamplingConfig, token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    keys = torch.arange(rows)
    dev = torch.device("cpu")
    plain = RowSampling([SamplingConfig()] * rows, dev)
    pen = RowSampling([SamplingConfig(frequency_penalty=0.5, presence_penalty=0.5)] * rows, dev, steps)
    bias = RowSampling([SamplingConfig(logit_bias={i * 7: 5.0 for i in range(16)})] * rows, dev)
    # a repetition penalty over prompts of 256 distinct ids each, with the same history
    prompts = [torch.randperm(vocab, generator=g)[:256].tolist() for _ in range(rows)]
    rep = RowSampling([SamplingConfig(repetition_penalty=1.3)] * rows, dev, steps, prompts)
    w, h = torch.randn(vocab, hidden, generator=g), torch.randn(rows, hidden, generator=g)
    for step in range(steps):  # a history as late in a block: every step's entry in use
        pen.sample(torch.randn(rows, vocab, generator=g), keys, step)
        rep.sample(torch.randn(rows, vocab, generator=g), keys, step)
    ids = plain.sample(logits, keys, 0)
    extra: dict[str, Callable[[], Any]] = {}
    guided = _json_rows(rows, vocab)
    if guided is not None:
        extra["greedy, JSON schema"] = lambda: guided._choose(guided.guides.mask(logits), keys, 0)
    return {
        "greedy choice": lambda: plain.sample(logits, keys, 0),
        "+ logprobs K=0": lambda: token_logprobs(logits, ids, 0),
        "+ logprobs K=5": lambda: token_logprobs(logits, ids, 5),
        "+ logprobs K=20": lambda: token_logprobs(logits, ids, 20),
        "greedy with penalties": lambda: pen._choose(pen.adjust(logits), keys, 0),
        "greedy with a logit bias": lambda: bias.sample(logits, keys, 0),
        "greedy, repetition penalty": lambda: rep._choose(rep.adjust(logits), keys, 0),
        **extra,
        "head product (scale)": lambda: torch.nn.functional.linear(h, w),
    }


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"]}


def _json_rows(rows: int, vocab: int) -> Any:
    """A sampler of ``rows`` rows under ``SCHEMA``, each matcher after '{"city":"Par' (None
    where the bundled tokenizer is missing or has another vocabulary size)."""
    from ..engine.sampling import RowSampling, SamplingConfig
    from ..engine.structure import Structure, guide_tokenizer
    from ..models.loader import load_model

    try:
        model = load_model(None)
    except Exception:  # noqa: BLE001 - no bundled model: the variant is left out
        return None
    if model.spec.vocab_size != vocab or model.tokenizer is None:
        return None
    tok = guide_tokenizer(model.tokenizer, vocab, model.spec.eos_token_ids)
    st = SamplingConfig(structure=Structure.json_schema(SCHEMA))
    rs = RowSampling([st] * rows, torch.device("cpu"), guide=tok, eos_ids=model.spec.eos_token_ids)
    for t in model.tokenizer.encode('{"city":"Par', add_special_tokens=False):
        rs.guides.advance(torch.full((rows,), t))  # type: ignore[union-attr]
    return rs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--steps", type=int, default=32, help="a penalised sampler's history: these many steps")
    ap.add_argument("--json", default="bench_results/sampling-extras.json")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {}
    for rows in args.rows:
        fns = variants(rows, args.vocab, args.hidden, steps=args.steps)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(args.reps):  # alternating, so drift hits every variant alike
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        results[str(rows)] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in results[str(rows)].items()), flush=True)
    write_json(args.json, {"benchmark": "sampling", "machine": machine(), "vocab": args.vocab,
                           "hidden": args.hidden, "reps": args.reps, "median_ms": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
