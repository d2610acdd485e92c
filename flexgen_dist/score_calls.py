"""The LLM's teacher-forced scoring (a mixin of ``api.LLM``): ``score`` runs each sequence as a
prefill with the head on every position, its last tokens optionally by decode steps, and
returns each sequence's ``Score`` (``scoring.py``)."""
from __future__ import annotations

from typing import Sequence

from .facade import Facade
from .plan import Workload
from .scoring import Score
from .workloads import LoraChoice, PromptLike, scored_workload


class ScoreCalls(Facade):
    """``score`` of ``LLM``, on its ``_guard``, ``_start`` and ``_run``."""

    def score(self, sequences: Sequence[PromptLike] | None = None,
              first_scored: Sequence[int] | None = None, decode_tokens: int = 0,
              logprobs: int | None = None, lora: LoraChoice = None) -> list[Score]:
        """Teacher-forced scores of ``sequences`` (strings or token-id lists), in input order.
        Token j of sequence n counts from ``first_scored[n]`` on (default 1: every token that
        has a prefix). The last ``decode_tokens`` tokens of each sequence are predicted by
        decode steps (one token fed per step, attending to the KV cache as generation does:
        this is where ``compress_cache`` and ``attn_sparsity`` act); the others by one
        prefill with the head on every position. ``logprobs=K`` (0-20) also gives each scored
        token's log-probability and its K most likely alternatives (``Score.logprobs``: an
        ``echo`` of the prompt's logprobs, or a per-token perplexity filter). ``lora``: as
        ``generate``'s. On ranks other than 0 the arguments are ignored and the result is empty."""
        self._check_open()
        with self._guard():
            work, peaks = self._start(lambda: self._scored(sequences, first_scored, decode_tokens, logprobs, lora))
            out: list[Score] = []
            for blk, rows in self._run(work, peaks):
                for m, r in zip(blk.members, rows):
                    r, lp, ranks = r if work.logprobs is not None else (r, None, None)
                    out.append(Score(m, float(r[0]), int(r[1]), int(r[2]), lp, ranks))
            return sorted(out, key=lambda sc: sc.index)

    def _scored(self, sequences: Sequence[PromptLike] | None, first_scored: Sequence[int] | None,
                decode_tokens: int, logprobs: int | None = None, lora: LoraChoice = None) -> Workload:
        return scored_workload(sequences, first_scored, decode_tokens, self.config, self.model.spec, self.tokenizer,
                               logprobs, lora=lora, served=self.model.adapters)
