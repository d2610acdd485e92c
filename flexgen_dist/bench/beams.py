"""Beam search side by side: this engine's ``LLM.beam_search`` against transformers'
``generate(num_beams=...)`` (its batches left-padded, no gradient) on the same prompts.

    python -m flexgen_dist.bench.beams --json bench_results/beams.json

The bundled SmolLM2-135M as a Hugging Face directory (its GGUF's values), ``--prompts``
prompts of ``--prompt-len`` random tokens, ``--width`` beams, ``--gen-len`` new tokens (EOS
ignored by neither: each search ends as its own rules say), in float32 and bfloat16: prompts
per second of each (after one untimed call each), and how many prompts' best hypotheses are
the same token for token (transformers' batches pad on the left, which moves float32 sums a
little: near-ties between beams can go either way). Reports, never asserts.
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


def hf_best(model: Any, ids: list[list[int]], batch: int, pad: int, width: int, gen: int,
            eos: list[int]) -> list[list[int]]:
    """transformers' best hypothesis of each prompt, up to and including the id that ended it."""
    out = []
    with torch.no_grad():
        for x, mask in left_padded_batches(ids, batch, pad):
            seqs = model.generate(input_ids=x, attention_mask=mask, num_beams=width, max_new_tokens=gen,
                                  do_sample=False, pad_token_id=pad, eos_token_id=eos)[:, x.shape[1]:].tolist()
            for row in seqs:
                n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
                out.append(row[:n])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="prompts per transformers batch and per engine GPU batch")
    ap.add_argument("--json", default="bench_results/beams.json")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import LLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = bundled_hf(tmp)
        tok = AutoTokenizer.from_pretrained(hf)
        g = torch.Generator().manual_seed(0)
        ids = [tok(tok.decode(torch.randint(1000, 40000, (args.prompt_len,), generator=g).tolist()))["input_ids"]
               for _ in range(args.prompts)]
        eos = [tok.eos_token_id]
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).replace("torch.", "")
            model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).eval()
            hf_best(model, ids[:args.batch], args.batch, 0, args.width, 2, eos)  # warm-up
            t0 = time.perf_counter()
            ref = hf_best(model, ids, args.batch, 0, args.width, args.gen_len, eos)
            hf_s = time.perf_counter() - t0
            del model
            with LLM(str(hf), dtype=name, gpu_batch_size=args.batch * args.width, num_gpu_batches=1,
                     progress=False) as llm:
                llm.beam_search(ids[:args.batch], args.width, 2)  # warm-up: the kernels
                t0 = time.perf_counter()
                outs = llm.beam_search(ids, args.width, args.gen_len)
                s = time.perf_counter() - t0
            best = [o.sequences[0].token_ids for o in outs]
            same = sum(a == b for a, b in zip(best, ref))
            res = {"dtype": name, "prompts": len(ids), "width": args.width, "gen_len": args.gen_len,
                   "prompts_s": len(ids) / s, "transformers_prompts_s": len(ids) / hf_s,
                   "best_tokens_s": sum(map(len, best)) / s, "transformers_best_tokens_s": sum(map(len, ref)) / hf_s,
                   "same_best_hypothesis": same}
            rows.append(res)
            print(f"{name:<9} {len(ids) / s:7.2f} prompts/s, transformers {len(ids) / hf_s:7.2f} (this engine "
                  f"{hf_s / s:.2f}x); the same best hypothesis for {same} of {len(ids)} prompts", file=sys.stderr)
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
