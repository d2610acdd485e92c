"""Multiple choice with a constrained answer: each reply is one of its question's options, and
its log-probabilities say how sure the model is.

    python examples/classify.py                 # the bundled SmolLM2-135M-Instruct
    python examples/classify.py --model DIR     # any chat model (a directory or a .gguf)

Each question has its own options: the first token of each option gets a logit bias of +100
in that question's ``SamplingConfig``, so its one-token reply is always one of them (greedy:
the option the model finds most likely). ``logprobs`` are the model's own distribution,
before the bias; the share of the chosen option's probability among its options' (over the
20 most likely first tokens) is printed beside it. The bundled model (135M parameters)
answers these five; harder questions need a larger model. The same request in a
batch file: ``"max_tokens": 1, "logit_bias": {"<id>": 100, ...}, "logprobs": true,
"top_logprobs": 20``.
"""
from __future__ import annotations

import argparse
import math

from flexgen_dist import LLM, SamplingConfig

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"]),
    ("Which planet is known as the red planet?", ["Mars", "Venus", "Jupiter", "Saturn"]),
    ("What color is the sky on a clear day?", ["Blue", "Green", "Red", "Yellow"]),
    ("What do bees make?", ["Honey", "Milk", "Silk", "Wax"]),
    ("What is the largest ocean on Earth?", ["Pacific", "Atlantic", "Indian", "Arctic"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the bundled SmolLM2)")
    args = ap.parse_args()
    with LLM(args.model, progress=False) as llm:
        chats, samplings, firsts = [], [], []
        for question, options in QUESTIONS:
            first = {llm.tokenizer.encode(o, add_special_tokens=False)[0]: o for o in options}
            if len(first) < len(options):
                raise SystemExit(f"two options of {question!r} start with the same token: reword them")
            firsts.append(first)
            samplings.append(SamplingConfig(logit_bias={i: 100.0 for i in first}))
            chats.append([{"role": "user", "content": f"{question} Answer with one word: {', '.join(options)}."}])
        for (question, _), first, c in zip(QUESTIONS, firsts, llm.chat(chats, 1, samplings, logprobs=20)):
            mass = sum(math.exp(lp) for i, lp in c.logprobs.top[0] if i in first)
            share = math.exp(c.logprobs.token_logprobs[0]) / mass if mass > 0 else float("nan")
            print(f"{first[c.token_ids[0]]:>8} ({share:.0%} of its options' probability)  {question}")


if __name__ == "__main__":
    main()
