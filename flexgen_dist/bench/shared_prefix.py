"""What computing a block's shared prefix once saves, side by side in one run.

    python -m flexgen_dist.bench.shared_prefix --json bench_results/shared-prefix.json

A few-shot workload: ``--prompts`` prompts that all begin with the same ``--prefix`` tokens
(a system prompt and examples) and end with a question of 8 to ``--tail`` tokens of their
own, ``--gen-len`` new tokens each, greedy. For each variant (float32, bfloat16, and
bfloat16 with 4-bit weights, ``--compress-weight``), the same model is loaded twice, with
shared prefixes (the default) and with ``--no-share-prefix``, and the two run alternately
``--rounds`` times; reports the medians of prefill time, prefill throughput and total time,
``shared_prefix_fraction``, and whether the two gave the same tokens. Reports, never asserts.
The shared run also holds the prefix once through decode (``engine/held.py``): its decode
time beside the unshared one's is what that saves (``decode_speedup``; ``--percent`` places
the cache, e.g. in RAM with the CPU attending, as on a GPU host).

``--tasks K`` mixes K such workloads, each with its own prefix, interleaved in the input
(request n is task n mod K): blocks cut by length alone would mix the tasks, so what is saved
there comes from grouping the requests by opening (``blocks.prefix_groupings``).

``--repeats N`` asks each prompt N times in a row (a request's ``n`` choices; ``--prefix 0``
for prompts that share nothing else): the shared run computes each GPU batch's repeats once
(``engine/twins.py``, ``repeated_prompt_fraction``) and keeps each batch's prompts once in its
cache through decode (``engine/prompt_groups.py``: ``decode_speedup``), the unshared one every row.

``--score`` scores each prompt's own tokens instead (``LLM.score(first_scored=prefix)``, a
few-shot log-likelihood job) and compares the scores: the context is computed once per block
where the prefix is shared, never over a scored position.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from .single import machine, write_json

VARIANTS = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
            "bfloat16-4bit": dict(dtype="bfloat16", compress_weight=True)}


def workload(n: int, prefix: int, tail: int, vocab: int, seed: int = 0, tasks: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(10, vocab, (prefix,), generator=g).tolist() for _ in range(tasks)]
    lens = torch.randint(8, tail + 1, (n,), generator=g).tolist()
    return [heads[k % tasks] + torch.randint(10, vocab, (m,), generator=g).tolist() for k, m in enumerate(lens)]


def run_variant(model: str | None, opts: dict[str, Any], prompts: list[list[int]], gen_len: int, rounds: int,
                block: dict[str, int], score_from: int = 0) -> dict[str, Any]:
    from .. import LLM

    llms = {share: LLM(model, share_prefix=share, ignore_eos=True, progress=False, **block, **opts)
            for share in (True, False)}
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    try:
        for share in (True, False):  # places the weights; not timed
            llms[share].warmup(prompts)
        for _ in range(rounds):
            for share in (True, False):
                llm = llms[share]
                if score_from:  # the nll, count and hits of each prompt's own tokens
                    tokens[share] = [[s.nll, s.count, s.correct] for s in
                                     llm.score(prompts, first_scored=[score_from] * len(prompts))]
                else:
                    tokens[share] = [c.token_ids for c in llm.generate(prompts, gen_len=gen_len)]
                m = llm.metrics
                runs[share].append({k: m[k] for k in ("prefill_time_s", "decode_time_s", "prefill_throughput",
                                                      "total_throughput", "shared_prefix_fraction",
                                                      "repeated_prompt_fraction")})
                if (m.get("predicted") or {}).get("prefill_time_s") is not None:  # with a hardware profile
                    runs[share][-1]["predicted_prefill_s"] = m["predicted"]["prefill_time_s"]
    finally:
        for llm in llms.values():
            llm.close()
    out: dict[str, Any] = {}
    for share, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        med["total_time_s"] = statistics.median(r["prefill_time_s"] + r["decode_time_s"] for r in rs)
        out["shared" if share else "unshared"] = med
    if score_from:  # the same counts and hits, the sums within float rounding (another order of adds)
        rel = max(abs(a[0] - b[0]) / max(abs(b[0]), 1e-30) for a, b in zip(tokens[True], tokens[False]))
        out["max_rel_nll_difference"] = rel
        out["same_tokens"] = all(a[1:] == b[1:] for a, b in zip(tokens[True], tokens[False])) and rel < 1e-5
    else:
        out["same_tokens"] = tokens[True] == tokens[False]
    out["prefill_speedup"] = out["unshared"]["prefill_time_s"] / out["shared"]["prefill_time_s"]
    out["total_speedup"] = out["unshared"]["total_time_s"] / out["shared"]["total_time_s"]
    # decode: each row's cache without its prefix, the prefix attended once per kv head (``engine/held.py``)
    out["decode_speedup"] = out["unshared"]["decode_time_s"] / out["shared"]["decode_time_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the bundled SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=384, help="tokens every prompt begins with")
    ap.add_argument("--tail", type=int, default=48, help="most tokens of a prompt's own (at least 8)")
    ap.add_argument("--tasks", type=int, default=1, help="prefixes, interleaved in the input")
    ap.add_argument("--repeats", type=int, default=1, help="each prompt asked this many times in a row (n choices)")
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--score", action="store_true", help="score each prompt's own tokens instead of generating")
    ap.add_argument("--gpu-batch-size", type=int, default=16)
    ap.add_argument("--num-gpu-batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--percent", type=float, nargs=6, default=None, metavar="P",
                    help="placement: weights, cache, activations on the compute device and in RAM (as the CLI's)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--hardware", default=None, help="a hardware profile (a YAML file, or 'auto': this "
                    "machine's cached one): the planner's predicted prefill beside each measured one")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from .. import LLM

    with LLM(a.model, progress=False) as probe:
        vocab = probe.model.spec.vocab_size
    if a.repeats < 1 or a.prompts % a.repeats:
        ap.error(f"--repeats {a.repeats}: give a divisor of --prompts {a.prompts}")
    prompts = [p for p in workload(a.prompts // a.repeats, a.prefix, a.tail, vocab, tasks=a.tasks)
               for _ in range(a.repeats)]
    block: dict[str, Any] = dict(gpu_batch_size=a.gpu_batch_size, num_gpu_batches=a.num_gpu_batches)
    if a.percent is not None:
        block["percent"] = tuple(a.percent)
    results = {"machine": machine(), "model": a.model or "(bundled)", "prompts": a.prompts, "prefix": a.prefix,
               "tasks": a.tasks, "repeats": a.repeats, "score": a.score,
               "tail": a.tail, "gen_len": a.gen_len, "rounds": a.rounds, **block, "variants": {}}
    for name in a.variants:
        opts = {**VARIANTS[name], **({"hardware": a.hardware} if a.hardware else {})}
        r = results["variants"][name] = run_variant(a.model, opts, prompts, a.gen_len, a.rounds, block,
                                                    a.prefix if a.score else 0)
        s, u = r["shared"], r["unshared"]
        print(f"{name:>14}: prefill {u['prefill_time_s']:.2f} -> {s['prefill_time_s']:.2f} s "
              f"({r['prefill_speedup']:.2f}x), total {u['total_time_s']:.2f} -> {s['total_time_s']:.2f} s "
              f"({r['total_speedup']:.2f}x), decode {u['decode_time_s']:.2f} -> {s['decode_time_s']:.2f} s "
              f"({r['decode_speedup']:.2f}x), shared {100 * s['shared_prefix_fraction']:.0f} % and repeated "
              f"{100 * s['repeated_prompt_fraction']:.0f} % of the prompt positions, same tokens: {r['same_tokens']}",
              file=sys.stderr)
        if "predicted_prefill_s" in s:
            print(f"{'':>14}  predicted prefill {u['predicted_prefill_s']:.2f} -> {s['predicted_prefill_s']:.2f} s",
                  file=sys.stderr)
    if a.json:
        write_json(a.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
