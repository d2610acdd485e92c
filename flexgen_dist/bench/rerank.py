"""Reranking side by side: this engine's ``LLM.rerank`` with a language model read as a judge
of its answer tokens (``classifier_from_token``: the sigmoid of logit("Yes") - logit("No"), as
LLM rerankers such as Qwen3-Reranker score) against transformers computing the same from its
causal LM's last-position logits (the batch left-padded, no gradient) on the same pairs.

    python -m flexgen_dist.bench.rerank --json bench_results/rerank.json

The bundled SmolLM2-135M as a Hugging Face directory (its GGUF's values), ``--queries``
queries of ``--query-len`` tokens each against ``--docs`` random documents of
``--doc-len`` tokens, in float32 and bfloat16: pairs per second of each (after one untimed
call each), the largest difference between their scores and each one's largest difference
to transformers' float32 scores. Reports, never asserts.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

import torch

from .embeddings import bundled_hf, left_padded_batches
from .single import machine, write_json


def hf_scores(model: Any, ids: list[list[int]], batch: int, pad: int, yes: int, no: int) -> torch.Tensor:
    """sigmoid(logit(yes) - logit(no)) at each sequence's last position, float64."""
    out = []
    with torch.no_grad():
        for x, mask in left_padded_batches(ids, batch, pad):
            lg = model(input_ids=x, attention_mask=mask, logits_to_keep=1).logits[:, -1].double()
            out.append((lg[:, yes] - lg[:, no]).sigmoid())
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queries", type=int, default=4)
    ap.add_argument("--docs", type=int, default=64, help="documents per query")
    ap.add_argument("--query-len", type=int, default=32)
    ap.add_argument("--doc-len", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32, help="transformers' batch and the engine's GPU batch")
    ap.add_argument("--json", default="bench_results/rerank.json")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import LLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = bundled_hf(tmp)
        tok = AutoTokenizer.from_pretrained(hf)
        yes, no = tok.convert_tokens_to_ids("Yes"), tok.convert_tokens_to_ids("No")
        g = torch.Generator().manual_seed(0)
        words = lambda n: tok.decode(torch.randint(1000, 40000, (n,), generator=g).tolist())  # noqa: E731
        queries = [words(args.query_len) for _ in range(args.queries)]
        docs = [[words(args.doc_len) for _ in range(args.docs)] for _ in queries]
        # what the engine runs for a pair with classifier_from_token: the two texts joined
        ids = [tok(q + d)["input_ids"] for q, ds in zip(queries, docs) for d in ds]
        pairs, tokens = len(ids), sum(map(len, ids))
        exact: torch.Tensor | None = None
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).replace("torch.", "")
            model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).eval()
            hf_scores(model, ids[:args.batch], args.batch, 0, yes, no)  # warm-up
            t0 = time.perf_counter()
            ref = hf_scores(model, ids, args.batch, 0, yes, no)
            hf_s = time.perf_counter() - t0
            del model
            exact = ref if exact is None else exact
            with LLM(str(hf), dtype=name, classifier_from_token=["No", "Yes"], gpu_batch_size=args.batch,
                     num_gpu_batches=1, progress=False) as llm:
                llm.rerank(queries[0], docs[0][:args.batch])  # warm-up: the kernels
                t0 = time.perf_counter()
                got = [r for q, ds in zip(queries, docs) for r in sorted(llm.rerank(q, ds), key=lambda r: r.index)]
                s = time.perf_counter() - t0
            ours = torch.tensor([r.score for r in got], dtype=torch.float64)
            res: dict[str, Any] = {
                "dtype": name, "pairs": pairs, "tokens": tokens, "pairs_s": pairs / s, "tok_s": tokens / s,
                "transformers_pairs_s": pairs / hf_s, "transformers_tok_s": tokens / hf_s,
                "max_abs_diff_to_transformers": float((ours - ref).abs().max()),
                "max_abs_diff_to_float32": float((ours - exact).abs().max()),
                "transformers_max_abs_diff_to_float32": float((ref - exact).abs().max())}
            rows.append(res)
            print(f"{name:<9} {pairs / s:8.1f} pairs/s ({tokens / s:8.1f} tok/s), transformers {pairs / hf_s:8.1f} "
                  f"(this engine {hf_s / s:.2f}x); max |diff| of scores {res['max_abs_diff_to_transformers']:.2e}; "
                  f"to float32 {res['max_abs_diff_to_float32']:.2e} (transformers "
                  f"{res['transformers_max_abs_diff_to_float32']:.2e})", file=sys.stderr)
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
