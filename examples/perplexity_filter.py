"""Filter documents by how natural the model finds them: per-document perplexity and the most
surprising token, from one teacher-forced scoring pass (no generation).

    python examples/perplexity_filter.py                          # built-in samples, bundled model
    python examples/perplexity_filter.py --input docs.jsonl --max-ppl 60 --output kept.jsonl

``--input``: a JSONL file of ``{"text": ...}`` lines (or a text file, one document per line).
Each document is scored with ``LLM.score(texts, logprobs=0)``: every token after the first
gets its log-probability given the text before it. A document is kept where its perplexity
(``exp`` of the mean negative log-probability) is at most ``--max-ppl``; each output line
says its perplexity and its least likely token (after the first three) with that token's
probability, which is where garbled or off-language text usually shows. The bundled model
(135M parameters, an instruct model scoring bare text) puts the built-in natural sentences
at 12-110 and the two garbled ones at ~900 and ~26000. The same request in an OpenAI Batch file:
``{"url": "/v1/completions", "body": {"prompt": TEXT, "echo": true, "max_tokens": 0,
"logprobs": 0}}`` (its ``token_logprobs`` are these, the first null).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from flexgen_dist import LLM

CONTEXT = 3  # tokens of context before a token counts as "least likely"
SAMPLES = [
    "The capital of France is Paris, a city known for its museums and cafes.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "qzx vvb plork ghh tnnn wq zzzp lorm vvvt xqq",
    "Banana the the the seventeen purple quickly sofa because.",
    "Bees make honey from the nectar of flowers.",
]


def read_texts(path: str | None) -> list[str]:
    if path is None:
        return list(SAMPLES)
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"error: --input {path} does not exist")
    lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if p.suffix == ".jsonl":
        try:
            return [str(json.loads(ln)["text"]) for ln in lines]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SystemExit(f"error: {path}: each line must be a JSON object with a 'text' field") from None
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--input", help="JSONL of {\"text\"} lines, or a text file of one document per line")
    ap.add_argument("--max-ppl", type=float, default=200.0, help="keep documents at most this perplexity")
    ap.add_argument("--output", help="write the kept documents here as JSONL (default: print every verdict)")
    args = ap.parse_args(argv)
    texts = read_texts(args.input)
    with LLM(args.model, progress=False) as llm:
        scores = llm.score(texts, logprobs=0)
        ids = [llm.tokenizer(t)["input_ids"] for t in texts] if llm.tokenizer is not None else None
    kept = []
    for n, (text, sc) in enumerate(zip(texts, scores)):
        if sc.count == 0:  # one token: nothing has a prefix
            print(f"  skip  (one token)  {text[:60]}")
            continue
        ppl = math.exp(sc.nll / sc.count)
        lps = sc.logprobs.token_logprobs  # tokens 1.. of the document
        # the least likely token once a few tokens of context are there (a text's first ones
        # are surprising to any model)
        worst = min(range(min(CONTEXT, len(lps) - 1), len(lps)), key=lps.__getitem__)
        token = llm.tokenizer.decode([ids[n][worst + 1]]) if ids is not None else "?"
        keep = ppl <= args.max_ppl
        print(f"{'  keep' if keep else '  drop'}  ppl {ppl:8.1f}  least likely {token!r} "
              f"(p={math.exp(lps[worst]):.2g})  {text[:60]}")
        if keep:
            kept.append({"text": text, "ppl": ppl})
    if args.output:
        Path(args.output).write_text("".join(json.dumps(k) + "\n" for k in kept), encoding="utf-8")
        print(f"kept {len(kept)} of {len(texts)} documents in {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
