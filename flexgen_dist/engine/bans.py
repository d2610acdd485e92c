"""Tokens a sequence may not choose next: vLLM's per-request controls, for the rows of one
GPU batch at once (``RowSampling`` applies them after the penalties and biases, before a
structure's mask).

- ``allowed_token_ids``: every other id is banned.
- ``bad_words_ids`` (and ``bad_words``, made ids by ``bad_word_ids``): a word's last token is
  banned where the completion's newest tokens are the rest of it (a one-token word: always).
  Only generated tokens count, not the prompt's, as in vLLM.
- ``min_tokens``: the ids that would end the completion (the model's EOS ids, even under
  ``ignore_eos``, and ``stop_token_ids``, as vLLM masks them) are banned before that many new
  tokens.

A banned id's logit is -inf, so greedy and sampled choice never take it; the reported
log-probabilities stay the model's own. No Python loop runs per row or per step: the bans are
(rows, k) id tables scattered onto the logits, and the multi-token words compare a (rows, w)
window of each row's newest ids with their prefixes in one pass.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .endings import id_table

WILD = -2  # a prefix position before a shorter word's first token: matches any id
NONE = -1  # no id yet (a row has generated fewer tokens than the window)


def bad_word_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's ids of ``bad_words``: each word (its leading spaces dropped) as the tokenizer
    encodes it alone, and once more after a space where that starts with another token and
    has as many (the word within a text, where a tokenizer folds the space into it)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(bare)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(w for w in out if w)


class TokenBans:
    """The bans of one GPU batch's rows (module doc). ``cfgs``: each row's ``SamplingConfig``;
    ``eos_ids``: the model's."""

    def __init__(self, cfgs: Sequence[Any], device: torch.device, eos_ids: Sequence[int]) -> None:
        self.device = device
        self.allowed = [(n, c.allowed_token_ids) for n, c in enumerate(cfgs) if c.allowed_token_ids]
        self.allowed_rows = torch.tensor([n for n, _ in self.allowed], dtype=torch.long, device=device)
        self._allowed_mask: torch.Tensor | None = None  # (rows with a list, vocab) True: banned
        # one-token bans: a table of ids per row, each entry banned always (a one-token bad
        # word) or before the row's min_tokens (its ending ids); NONE pads
        always = [sorted({w[0] for w in c.bad_words_ids if len(w) == 1}) for c in cfgs]
        ending = [list(dict.fromkeys((*eos_ids, *c.stop_token_ids))) if c.min_tokens else [] for c in cfgs]
        self.single = None
        if any(always) or any(ending):
            self.single = id_table([a + e for a, e in zip(always, ending)], device, fill=NONE)
            self.kind = id_table([[0] * len(a) + [1] * len(e) for a, e in zip(always, ending)], device,
                                 width=self.single.shape[1], fill=2)  # 0 always, 1 before min, 2 padding
            self.min_tokens = torch.tensor([c.min_tokens for c in cfgs], dtype=torch.long, device=device)
        # longer words: per word its row, its prefix (right-aligned, WILD before it) and last id
        words = [(n, w) for n, c in enumerate(cfgs) for w in dict.fromkeys(c.bad_words_ids) if len(w) > 1]
        self.words = None
        if words:
            w = max(len(x) - 1 for _, x in words)
            self.rows = torch.tensor([n for n, _ in words], dtype=torch.long, device=device)
            self.prefix = torch.tensor([[WILD] * (w - len(x) + 1) + list(x[:-1]) for _, x in words],
                                       dtype=torch.long, device=device)
            self.words = torch.tensor([x[-1] for _, x in words], dtype=torch.long, device=device)
            self.recent = torch.full((len(cfgs), w), NONE, dtype=torch.long, device=device)

    def __call__(self, logits: torch.Tensor, step: int, fresh: bool = False) -> torch.Tensor:
        """The logits (b, vocab) with this step's banned ids at -inf: ``step`` new tokens made so
        far; ``fresh``: ``logits`` is this call's own copy (changed in place), else one is made."""
        out = logits if fresh else logits.float().clone()
        if self.single is not None:
            on = (self.kind == 0) | ((self.kind == 1) & (self.min_tokens[:, None] > step))
            out.scatter_add_(1, self.single.clamp(min=0), torch.where(on, float("-inf"), 0.0))
        if self.words is not None:
            match = ((self.recent[self.rows] == self.prefix) | (self.prefix == WILD)).all(dim=1)
            out.index_put_((self.rows, self.words), torch.where(match, float("-inf"), 0.0), accumulate=True)
        if self.allowed:
            rows = self.allowed_rows
            out[rows] = out[rows].masked_fill(self._banned(out.shape[-1]), float("-inf"))
        return out

    def reorder(self, rows: torch.Tensor) -> None:
        """Row r now continues row ``rows[r]``'s completion (beam search): its window follows."""
        if self.words is not None:
            self.recent = self.recent[rows.to(self.recent.device)]

    def count(self, ids: torch.Tensor) -> None:
        """Each row generated ``ids`` (b,) at this step (the multi-token words' window moves)."""
        if self.words is not None:
            self.recent[:, :-1] = self.recent[:, 1:].clone()
            self.recent[:, -1] = ids.view(-1)

    def _banned(self, vocab: int) -> torch.Tensor:
        if self._allowed_mask is None or self._allowed_mask.shape[-1] != vocab:
            mask = torch.ones((len(self.allowed), vocab), dtype=torch.bool, device=self.device)
            for r, (_, ids) in enumerate(self.allowed):
                mask[r, torch.tensor([i for i in ids if i < vocab], dtype=torch.long, device=self.device)] = False
            self._allowed_mask = mask
        return self._allowed_mask
