"""The library API in a script: the same file runs alone or under torchrun, mpirun or srun.

    python examples/generate_api.py
    python examples/generate_api.py --model opt-125m --dummy-weights --percent 0 100 100 0 100 0
    torchrun --standalone --nproc-per-node 2 examples/generate_api.py --model opt-125m --dummy-weights

Every rank builds the LLM and calls generate (SPMD); rank 0 gets the completions, the other
ranks serve their pipeline stage and get an empty list.
"""
from __future__ import annotations

import argparse
import json

from flexgen_dist import LLM, SamplingConfig

PROMPTS = ["The capital of France is", "To make a cup of tea, first", [7, 8, 9, 10]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="registry name, HF dir or .gguf (default: bundled SmolLM2)")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--percent", nargs=6, type=float, default=None, help="WG WC CG CC HG HC")
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", default=None, help="write the completions here (rank 0)")
    args = ap.parse_args()

    opts = {"percent": args.percent} if args.percent else {}
    with LLM(args.model, dummy_weights=args.dummy_weights, gpu_batch_size=2, progress=False, **opts) as llm:
        prompts = PROMPTS if llm.tokenizer is not None else [p for p in PROMPTS if not isinstance(p, str)]
        sampling = SamplingConfig(temperature=args.temperature, seed=1)
        done = []
        for block in llm.stream(prompts, gen_len=args.gen_len, sampling=sampling):  # blocks as they finish
            for c in block:
                print(f"[{c.index}] {c.prompt or c.prompt_ids!r} -> {c.text if c.text is not None else c.token_ids!r}")
                done.append({"index": c.index, "tokens": c.token_ids, "text": c.text})
        if llm.is_driver:
            print(llm.summary())
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"completions": done, "metrics": llm.metrics}, f)


if __name__ == "__main__":
    main()
