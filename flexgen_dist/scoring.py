"""Teacher-forced scoring (``LLM.score``): what each sequence's result is, which positions
count, and how a sequence splits into its prefill and its decode-scored tail."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .config import ConfigError
from .engine.sampling import TokenLogprobs


@dataclass
class Score:
    """Teacher-forced score of one sequence: each scored token's -log p given what precedes it."""

    index: int  # position of the sequence in the score call's input
    nll: float  # sum over the scored tokens of -log p(token | prefix), natural log
    count: int  # tokens scored
    correct: int  # scored tokens that were the model's top-1 prediction
    # score(logprobs=K): each scored token's log p and its K most likely alternatives (the
    # distribution its prefix gives), in order; None where not asked for
    logprobs: TokenLogprobs | None = None
    ranks: list[int] | None = None  # with logprobs: each scored token's rank (1: the most likely)

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else 0.0


def score_targets(seqs: list[list[int]], first_scored: Sequence[int] | None) -> list[list[int]]:
    """Per sequence, the id that follows each position (-1 where that token is not scored)."""
    if first_scored is not None and len(first_scored) != len(seqs):
        raise ConfigError(f"first_scored has {len(first_scored)} entries for {len(seqs)} sequences")
    out = []
    for n, ids in enumerate(seqs):
        f = 1 if first_scored is None else int(first_scored[n])
        if not 1 <= f <= len(ids):
            raise ConfigError(f"sequence {n}: first_scored {f} must be in [1, {len(ids)}] (token 0 has no prefix)")
        out.append([t if j + 1 >= f else -1 for j, t in enumerate(ids[1:])] + [-1])
    return out


def score_split(lens: list[int], decode_tokens: int) -> tuple[list[int], int]:
    """Scoring: each sequence's prefill length, and the steps of the call (1 + decode steps).

    The last ``decode_tokens`` tokens of a sequence are predicted at decode steps: its prefill
    stops before them (at 1 token at least), and it feeds one token per step up to its
    second-to-last (the last token is only a target)."""
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ConfigError(f"decode_tokens {decode_tokens!r}: must be an integer >= 0")
    prefix = [max(1, n - 1 - decode_tokens) if decode_tokens else n for n in lens]
    return prefix, 1 + max(max(0, n - 1 - p) for n, p in zip(lens, prefix))
