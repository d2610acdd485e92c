"""Several completions of one prompt: ``n`` choices, the best of ``best_of`` candidates (vLLM's
``SamplingParams(n, best_of)``, OpenAI's completions ``n`` and ``best_of``).

Every candidate is a row of its own: a prompt is given ``best_of`` times in a row (a GPU batch
computes its prefill once: ``engine/twins.py``), candidate j of prompt i draws with the key
``key_i * MAX_CHOICES + j`` (so a prompt's candidates draw apart, and a resumed job draws the
same), and the ``n`` with the highest mean log-probability per token are kept, best first
(``by_mean_logprob``; the model's own distribution, as ``logprobs`` reports it). ``Choices``
expands a call's per-prompt arguments to rows and folds its completions back, a prompt at a
time once all its candidates are in.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, TypeVar

from .engine.sampling import SamplingConfig

MAX_CHOICES = 128  # candidates per prompt at most (keys of a prompt's candidates stay apart)

T = TypeVar("T")


def by_mean_logprob(cands: Sequence[Any]) -> list[Any]:
    """Completions best first by the mean log-probability of their tokens (OpenAI's best_of
    rule), ties in their order; one without tokens or logprobs last."""
    def mean(c: Any) -> float:
        lps = c.logprobs.token_logprobs if c.logprobs is not None else []
        return sum(lps) / len(lps) if lps else float("-inf")

    return sorted(cands, key=lambda c: -mean(c))


@dataclass(frozen=True)
class Choices:
    """A call's ``n`` choices per prompt out of ``best_of`` candidates."""

    n: int = 1
    best_of: int = 1

    @classmethod
    def of(cls, n: int, best_of: int | None, sampling: SamplingConfig | Sequence[SamplingConfig] | None,
           default: SamplingConfig) -> Choices:
        """Checked (``ValueError``; the callers' ``ConfigError``); with greedy sampling every
        candidate is the greedy one, so none beyond n is drawn."""
        n = int(n)
        best = n if best_of is None else int(best_of)
        if not 1 <= n <= best <= MAX_CHOICES:
            raise ValueError(f"n {n}, best_of {best}: give 1 <= n <= best_of <= {MAX_CHOICES}")
        cfgs = [default] if sampling is None else [sampling] if isinstance(sampling, SamplingConfig) else sampling
        if all(c.greedy for c in cfgs):
            best = n
        return cls(n, best)

    @property
    def many(self) -> bool:
        return self.best_of > 1

    def rows(self, xs: Sequence[T] | None) -> list[T] | None:
        """A per-prompt argument given per candidate row."""
        return None if xs is None else [x for x in xs for _ in range(self.best_of)]

    def expand(self, prompts: Sequence[Any], sampling: Any, keys: Sequence[int] | None,
               max_new_tokens: Sequence[int] | None, stop: Sequence[Sequence[str]] | None,
               logprobs: int | None, lora: Any) -> dict[str, Any]:
        """A call's per-prompt arguments per candidate row: each prompt's key k gives its
        candidate j the key ``k * MAX_CHOICES + j`` (module doc); the call asks for the chosen
        tokens' log-probabilities at least where it ranks."""
        base = range(len(prompts)) if keys is None else keys
        return dict(prompts=self.rows(prompts),
                    sampling=self.rows(sampling) if isinstance(sampling, (list, tuple)) else sampling,
                    keys=[int(k) * MAX_CHOICES + j for k in base for j in range(self.best_of)],
                    max_new_tokens=self.rows(max_new_tokens), stop=self.rows(stop),
                    logprobs=logprobs if self.best_of == self.n else max(logprobs or 0, 0),
                    lora=self.rows(lora) if isinstance(lora, (list, tuple)) else lora)

    def fold(self, windows: Iterator[list[Any]], asked: int | None) -> Iterator[list[Any]]:
        """The rows' completions (``completions.Completion``, which this module does not import:
        the config takes ``MAX_CHOICES`` from here) (windows in row order) as each prompt's ``n`` best, prompt
        index and choice set, logprobs dropped where the call did not ask for them; a prompt
        whose candidates straddle two windows comes with the later."""
        held: list[Any] = []
        for window in windows:
            out: list[Any] = []
            held += window
            whole = len(held) - len(held) % self.best_of
            for a in range(0, whole, self.best_of):
                cands = held[a:a + self.best_of]
                best = by_mean_logprob(cands) if self.best_of > self.n else cands
                out += [dataclasses.replace(c, index=c.index // self.best_of, choice=j,
                                            logprobs=c.logprobs if asked is not None else None)
                        for j, c in enumerate(best[:self.n])]
            held = held[whole:]
            if out:
                yield out
