"""Scoring text pairs (reranking): ``LLM.score_pairs`` and ``LLM.rerank``, a batch file's
``/v1/score`` and ``/v1/rerank`` requests (vLLM's and Jina's bodies).

Two kinds of model score a pair, as vLLM serves them:

* a **cross-encoder**, a sequence classifier with one label (``*ForSequenceClassification``,
  ``num_labels`` 1: a reranker such as bge-reranker-v2-gemma or a converted Qwen3-Reranker)
  reads both texts as one sequence (the tokenizer's pair encoding, ``tokenizer(text,
  text_pair)``; a config with ``use_sep_token`` false joins the two texts and tokenizes them
  as one) and its one logit at the last token, through a sigmoid, is the score (the logit
  itself with ``activation`` off);
* any other model **embeds** each text (``embeddings.py``: last-token pooling after the final
  norm) and the score is the cosine of the two vectors; a query shared by N documents is
  embedded once.

Texts pair 1:1, 1:N (one query, N documents) or N:N (pair i with pair i), nothing else."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .config import ConfigError
from .models.spec import ModelSpec
from .prompts import Prompt, make_prompt, truncated


@dataclass
class Ranked:
    """One document of a rerank: its place among the documents given, its text, its score."""

    index: int
    document: str
    score: float


@dataclass
class Pairs:
    """The pairs of one scoring: the texts on each side and, per pair, which of each it joins."""

    first: list[str]
    second: list[str]

    @classmethod
    def of(cls, first: Any, second: Any, names: tuple[str, str] = ("texts_1", "texts_2"),
           one_first: bool = False) -> Pairs:
        """The pairs of two sides, each a string or a non-empty list of strings; the first side
        has one text (it pairs with every text of the second; ``one_first``: it must be one
        string) or as many as the second."""
        if one_first and not (isinstance(first, str) and first):
            raise ConfigError(f"{names[0]} must be one non-empty string")
        sides = []
        for side, name in zip((first, second), names):
            texts = [side] if isinstance(side, str) else side
            if not isinstance(texts, (list, tuple)) or not texts or \
                    not all(isinstance(t, str) and t for t in texts):
                raise ConfigError(f"{name} must be a non-empty string or a non-empty list of them")
            sides.append(list(texts))
        a, b = sides
        if len(a) not in (1, len(b)):
            raise ConfigError(f"{names[0]} has {len(a)} texts and {names[1]} {len(b)}: pair them 1:1, 1:N or N:N")
        return cls(a, b)

    def __len__(self) -> int:
        return len(self.second)

    def joined(self, n: int) -> tuple[str, str]:
        return self.first[n if len(self.first) > 1 else 0], self.second[n]

    # --- what the model runs, per kind ---------------------------------------------------
    def prompts(self, spec: ModelSpec, tokenizer: Any | None, pid: str = "pair", truncate: int | None = None,
                template: str | None = None, template_kwargs: dict[str, Any] | None = None) -> list[Prompt]:
        """The sequences the model runs: each pair's joined tokens (a cross-encoder: through
        ``template`` where given, ``pair_ids``), else each text once (the first side, then
        the second), each within the model's positions (cut to its last ``truncate`` tokens
        first, where given: vLLM's ``truncate_prompt_tokens``)."""
        if tokenizer is None:
            raise ConfigError("scoring text pairs needs the model's tokenizer: this model has none")
        cross = cross_encoder(spec)
        if template is not None and not cross:
            raise ConfigError("a score template joins a pair for a cross-encoder: this model embeds each text (leave "
                              "--score-template out, or load a one-label classifier or --classifier-from-token)")
        if cross:
            out = [make_prompt(f"{pid}[{n}]", None, pair_ids(tokenizer, *self.joined(n), spec.pair_sep, template,
                                                              template_kwargs), tokenizer, spec.vocab_size)
                   for n in range(len(self))]
        else:
            out = [make_prompt(f"{pid}[{n}]", t, None, tokenizer, spec.vocab_size)
                   for n, t in enumerate(self.first + self.second)]
        out = [truncated(p, truncate, spec.max_positions) for p in out]
        for n, p in enumerate(out):
            if len(p.ids) > spec.max_positions:
                raise ConfigError(f"{'pair' if cross else 'text'} {n} has {len(p.ids)} tokens, more "
                                  f"than the model's {spec.max_positions} positions: shorten it (or give "
                                  "truncate_prompt_tokens)")
        return out

    def scores(self, results: Sequence[Sequence[float]], cross: bool, activation: bool = True) -> list[float]:
        """Each pair's score from the model's results for ``prompts`` (in their order): a
        cross-encoder's logit (through a sigmoid where ``activation``), else the cosine of the
        pair's two vectors."""
        if cross:
            return [sigmoid(r[0]) if activation else float(r[0]) for r in results]
        k = len(self.first)
        return [cosine(results[n if k > 1 else 0], results[k + n]) for n in range(len(self))]


def cross_encoder(spec: ModelSpec) -> bool:
    """Whether ``spec`` scores a pair as one sequence (a one-label classifier), refusing a
    classifier of several labels (its logits are no one score)."""
    if spec.num_labels > 1:
        raise ConfigError(f"scoring pairs needs a one-label classifier (a cross-encoder, a reranker) or a model "
                          f"that embeds: this classifier has {spec.num_labels} labels; use classify()")
    return spec.num_labels == 1


def pair_ids(tokenizer: Any, first: str, second: str, sep: bool = True, template: str | None = None,
             template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A pair's tokens: the Jinja ``template`` rendered over the messages ``[{"role": "query",
    "content": first}, {"role": "document", "content": second}]`` (vLLM's score template; the
    text holds its own special tokens), or the tokenizer's pair encoding (its separator and
    special tokens, as the cross-encoder was trained), or, without ``sep``, the two texts
    joined as one."""
    if template is not None:
        msgs = [{"role": "query", "content": first}, {"role": "document", "content": second}]
        try:
            text = tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                                 **(template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - the template's own error, in one line
            raise ConfigError(f"the score template failed on a pair ({type(e).__name__}: {e})") from None
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    enc = tokenizer(text=first, text_pair=second) if sep else tokenizer(first + second)
    return list(enc["input_ids"])


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two vectors (float64; 0 for a zero vector)."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(x @ y / (x.norm() * y.norm()).clamp_min(1e-12))


def ranked(documents: Sequence[str], scores: Sequence[float], top_n: int | None = None) -> list[Ranked]:
    """The documents by score, best first (ties in their given order), the first ``top_n``
    (None or 0: all)."""
    out = sorted((Ranked(n, d, s) for n, (d, s) in enumerate(zip(documents, scores))), key=lambda r: -r.score)
    return out[:top_n] if top_n else out
