"""The LLM's pooled calls (a mixin of ``api.LLM``): embeddings, a sequence classifier's
labels, and text pairs' scores. Each is one prefill with the last stage's head giving a
vector per input (``engine.head.embed``) instead of logits; the calls differ in how the
vectors are read (``embeddings.py``, ``pairs.py``)."""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

from .embeddings import Classification, Embedding, check_embed, embed_workload, finish
from .facade import Facade
from .pairs import Pairs, Ranked, cross_encoder, ranked
from .prompts import Prompt, check_truncation
from .workloads import LoraChoice, PromptLike, build_workload


class PooledCalls(Facade):
    """``embed``, ``classify``, ``score_pairs`` and ``rerank`` (and their streams) of ``LLM``,
    on its ``_guard``, ``_start``, ``_run`` and ``_windows``."""

    def embed(self, inputs: Sequence[PromptLike] | None = None, *, dimensions: int | None = None,
              normalize: bool = True, lora: LoraChoice = None,
              truncate_prompt_tokens: int | None = None) -> list[Embedding]:
        """Embeddings of ``inputs`` (strings, token-id lists or conversations), in input order:
        each input's last hidden states after the model's final norm, pooled as the model's
        files say (``ModelSpec.pooling``: the last token where they say nothing, as decoder
        embedding models such as Qwen3-Embedding define theirs; give the inputs as the model
        card says, e.g. with its instruction prefix), through its sentence-transformers Dense
        steps where it has them, cut to its first ``dimensions``
        (None: all ``embed_dim``) and L2-normalized unless ``normalize`` is False. One prefill
        per input, nothing generated; every placement, launcher and LoRA choice (``lora``, as
        ``generate``'s) applies. ``truncate_prompt_tokens`` (vLLM's): a longer input cut to its
        last K tokens (-1: what the model holds; None: the LLM's own setting); the pooled calls
        below take it too. On ranks other than 0 the arguments are ignored and the result is
        empty."""
        return [e for part in self.stream_embed(inputs, dimensions=dimensions, normalize=normalize, lora=lora,
                                                truncate_prompt_tokens=truncate_prompt_tokens)
                for e in part]

    def stream_embed(self, inputs: Sequence[PromptLike] | None = None, *, dimensions: int | None = None,
                     normalize: bool = True, lora: LoraChoice = None,
                     truncate_prompt_tokens: int | None = None) -> Iterator[list[Embedding]]:
        """Like ``embed``, yielding embeddings in input order as soon as they are final, a
        window of length-grouped blocks at a time (as ``stream``): a long job writes as it goes."""
        return self._pooled(inputs, dimensions, normalize, lora, "embed", truncate_prompt_tokens)

    def classify(self, inputs: Sequence[PromptLike] | None = None, *, lora: LoraChoice = None,
                 truncate_prompt_tokens: int | None = None) -> list[Classification]:
        """A sequence classifier's (``*ForSequenceClassification``: reward models, classifiers)
        result per input, in input order: its labels' logits at the last token, as transformers'
        model gives them, their softmax and the most likely label's name (a reward model's one
        logit is its reward). On ranks other than 0 the arguments are ignored and the result is
        empty."""
        return [c for part in self.stream_classify(inputs, lora=lora, truncate_prompt_tokens=truncate_prompt_tokens)
                for c in part]

    def stream_classify(self, inputs: Sequence[PromptLike] | None = None, *, lora: LoraChoice = None,
                        truncate_prompt_tokens: int | None = None) -> Iterator[list[Classification]]:
        """Like ``classify``, a window of length-grouped blocks at a time (as ``stream``)."""
        labels = self.model.spec.labels
        return ([Classification.of(e, labels) for e in part]
                for part in self._pooled(inputs, None, False, lora, "classify", truncate_prompt_tokens))

    def score_pairs(self, texts_1: str | Sequence[str] | None = None, texts_2: str | Sequence[str] | None = None,
                    *, activation: bool = True, lora: LoraChoice = None,
                    truncate_prompt_tokens: int | None = None) -> list[float]:
        """A score per text pair (``pairs.py``), paired 1:1, 1:N or N:N: a cross-encoder's (a
        one-label classifier: the pair read as one sequence, its logit through a sigmoid, or
        the logit itself without ``activation``), else the cosine of the two texts'
        embeddings. vLLM's ``LLM.score``. On ranks other than 0 the arguments are ignored and
        the result is empty."""
        return self._pair_scores(lambda: Pairs.of(texts_1, texts_2), activation, lora, truncate_prompt_tokens)

    def rerank(self, query: str | None = None, documents: Sequence[str] | None = None, *,
               top_n: int | None = None, lora: LoraChoice = None,
               truncate_prompt_tokens: int | None = None) -> list[Ranked]:
        """``documents`` ordered by their score against ``query`` (as ``score_pairs``), best
        first, the first ``top_n`` (None: all). On ranks other than 0 the arguments are
        ignored and the result is empty."""
        scores = self._pair_scores(lambda: Pairs.of(query, documents, ("query", "documents"), one_first=True),
                                   True, lora, truncate_prompt_tokens)
        return ranked(list(documents or ()), scores, top_n) if self.is_driver else []

    def _pair_scores(self, pairs_of: Callable[[], Pairs], activation: bool, lora: LoraChoice,
                     truncate: int | None = None) -> list[float]:
        spec = self.model.spec

        def build() -> tuple[Pairs, list[Prompt]]:  # rank 0: the pairs and what the model runs for them
            pairs = pairs_of()
            cfg = self.config
            keep = cfg.truncate_prompt_tokens if truncate is None else check_truncation(truncate)
            return pairs, pairs.prompts(spec, self.tokenizer, truncate=keep,
                                        template=cfg.score_template_text, template_kwargs=cfg.template_kwargs)

        pairs, prompts = self.on_driver(build)
        cross = cross_encoder(spec)
        if cross:
            results = [c.logits for c in self.classify(prompts, lora=lora)]
        else:
            results = [e.embedding for e in self.embed(prompts, normalize=False, lora=lora)]
        return pairs.scores(results, cross, activation) if self.is_driver else []

    def _pooled(self, inputs: Sequence[PromptLike] | None, dimensions: int | None, normalize: bool,
                lora: LoraChoice, call: str, truncate: int | None = None) -> Iterator[list[Embedding]]:
        """The last token's head output per input (``head.embed``), a window at a time."""
        self._check_open()
        with self._guard():
            if self.is_driver:
                check_embed(dimensions, self.model.spec, self.model.embed_dim)
            work, peaks = self._start(lambda: embed_workload(build_workload(
                inputs, 1, None, self.config, self.model.spec, self.tokenizer, scoring=True, lora=lora,
                served=self.model.adapters, call=call,
                truncate=None if truncate is None else check_truncation(truncate))))
            project = self.model.projection if call == "embed" else None  # a pipeline's Dense steps
            for window in self._windows(self._run(work, peaks)):
                yield [Embedding(n, finish(v if project is None else project(v), dimensions, normalize),
                                 len(work.prompts[n].ids)) for n, v in window]
