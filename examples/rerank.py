"""Reranking with a language model as the judge: each document's score is the model's
probability of "Yes" against "No" after a prompt asking whether the document answers the
query (``classifier_from_token``), the way LLM rerankers such as Qwen3-Reranker work.

    python examples/rerank.py                                   # the bundled SmolLM2-135M-Instruct
    python examples/rerank.py --model DIR --qwen3-reranker      # Qwen3-Reranker-0.6B/4B/8B
    python examples/rerank.py --model DIR --tokens no yes       # another judge's answer tokens

``rerank(query, documents)`` reads each pair as the query's text followed by the document's
(an LLM reranker's pairs are joined, not separated), so the query side carries the prompt's
start and the document side its end. With the bundled chat model the prompt is its own chat
template around a question; with ``--qwen3-reranker`` it is Qwen3-Reranker's documented
prompt and its tokens "no" and "yes". The same in a batch file: ``"url": "/v1/rerank",
"body": {"query": ..., "documents": [...]}`` with ``--classifier-from-token``.

The bundled 135M model is a weak judge: it puts the answer first, but its scores are low
and close together. They are exactly its own probabilities (``generate(..., logprobs=20)``
gives the same "Yes" and "No" log-probabilities); a trained reranker separates them clearly.
"""
from __future__ import annotations

import argparse

from flexgen_dist import LLM

QUERY = "What is the capital of France?"
DOCUMENTS = ["Bees make honey from the nectar of flowers.",
             "Paris is the capital and largest city of France.",
             "The Pacific is the largest ocean on Earth.",
             "France is a country in Western Europe."]
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"


def chat_sides(llm: LLM, query: str) -> tuple[str, str]:
    """The query side (the prompt up to the document) and the document side's end, cut from
    the model's chat template rendered around a placeholder."""
    mark = "\x00DOCUMENT\x00"
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Question: {query}\nDocument: {mark}\nDoes this document answer the question? "
                                     "Answer Yes or No."}],
        tokenize=False, add_generation_prompt=True)
    head, tail = text.split(mark)
    return head, tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the bundled SmolLM2)")
    ap.add_argument("--tokens", nargs=2, default=None, metavar=("NO", "YES"),
                    help="the judge's two answer tokens (default: No Yes; no yes with --qwen3-reranker)")
    ap.add_argument("--qwen3-reranker", action="store_true", help="Qwen3-Reranker's own prompt and tokens")
    args = ap.parse_args()
    tokens = args.tokens or (["no", "yes"] if args.qwen3_reranker else ["No", "Yes"])
    with LLM(args.model, progress=False, classifier_from_token=tokens) as llm:
        if args.qwen3_reranker:
            head, tail = f"{QWEN3_PREFIX}<Instruct>: {INSTRUCT}\n<Query>: {QUERY}\n", QWEN3_SUFFIX
            docs = [f"<Document>: {d}{tail}" for d in DOCUMENTS]
        else:
            head, tail = chat_sides(llm, QUERY)
            docs = [d + tail for d in DOCUMENTS]
        print(f"query: {QUERY}")
        for r in llm.rerank(head, docs):
            print(f"  {r.score:.3f}  {DOCUMENTS[r.index]}")


if __name__ == "__main__":
    main()
