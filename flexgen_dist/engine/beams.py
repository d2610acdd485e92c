"""Beam search as transformers' ``generate(num_beams=k)`` runs it, for the prompts of one GPU
batch at once (the last stage's ``Choosers`` keep one ``BeamSearch`` per GPU batch of a beam
block).

A prompt runs as ``k`` consecutive rows of its GPU batch (its beams). Each step takes the
rows' float32 log-softmax (vLLM's controls, ``bans.py``, set banned ids to -inf after it, as
transformers' processors do), adds each beam's running score, and keeps, per prompt, the
``K = max(2, 1 + ending ids) * k`` best (beam, token) continuations. Of these, the first ``k``
that end (an ending id: EOS unless ignored, a stop id; or the last step) become finished
hypotheses scored ``sum of log-probs / generated length ** length_penalty`` (the best ``k``
kept), and the best ``k`` that do not end are the next running beams. A prompt is done when
its finished hypotheses can no longer improve (``early_stopping``: False, transformers'
heuristic at the current length; True, once it has ``k``; "never", at the longest length
where a positive length penalty could still help); its result is its finished hypotheses,
best first.

Each step returns the running beams' new ids (the next step's input, in beam order) and, per
row, the row whose history the beam continues (its parent): every stage reorders its KV
cache rows by it before the next step (``kvcache.BlockCache.reorder``). Everything is a
tensor over the batch's prompts; no Python loop runs per prompt or per step beyond the call.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .bans import TokenBans
from .endings import id_table

NEG = -1.0e9  # transformers' "never": added to a score that must not be chosen
# bytes per (row, vocabulary entry) a step holds beside the logits: the float32 log-softmax and
# the float32 running sums over every beam's continuations (``engine/footprint.py`` counts them)
BEAM_BYTES = 8
EARLY = (False, True, "never")


@dataclass(frozen=True)
class BeamConfig:
    """A beam search call's settings: ``width`` beams per prompt (transformers' ``num_beams``,
    vLLM's ``beam_width``), ``length_penalty`` (the exponent of the generated length that
    divides a finished hypothesis' summed log-probabilities), ``early_stopping`` (False, True or
    "never", as transformers'), and how many of the best hypotheses each prompt returns
    (``num_return``, at most ``width``; 0: all)."""

    width: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"beam width {self.width!r}: must be an integer >= 1")
        if self.early_stopping not in EARLY or isinstance(self.early_stopping, int) and \
                not isinstance(self.early_stopping, bool):
            raise ValueError(f"early_stopping {self.early_stopping!r}: give False, True or 'never'")
        if not isinstance(self.num_return, int) or not 0 <= self.num_return <= self.width:
            raise ValueError(f"num_return_sequences {self.num_return!r}: must be in [1, the beam width "
                             f"{self.width}]")
        object.__setattr__(self, "length_penalty", float(self.length_penalty))

    @property
    def returns(self) -> int:
        return self.num_return or self.width


class BeamSearch:
    """The beam search of one GPU batch's prompts (module doc): ``cfgs`` the rows' samplings
    (a prompt's ``width`` rows alike: its ending ids and bans), ``steps`` the most new tokens."""

    def __init__(self, beams: BeamConfig, cfgs: Sequence[Any], eos_ids: Sequence[int], steps: int,
                 device: torch.device) -> None:
        k = beams.width
        if len(cfgs) % k:
            raise ValueError(f"a GPU batch of {len(cfgs)} rows does not hold whole prompts of {k} beams")
        self.k, self.P, self.T, self.device = k, len(cfgs) // k, steps, device
        self.lp, self.early = beams.length_penalty, beams.early_stopping
        own = [cfgs[p * k] for p in range(self.P)]
        ends = [c.ends(eos_ids) for c in own]
        self.ends = id_table(ends, device, width=1)
        self.K = max(2, 1 + max(len(e) for e in ends)) * k  # continuations kept per prompt
        self.top = torch.arange(self.K, device=device) < k  # the first k: the ones that may finish
        self.bans = TokenBans(cfgs, device, eos_ids) if any(c.bans for c in cfgs) else None
        P = self.P
        self.running = torch.full((P, k, steps), -1, dtype=torch.long, device=device)
        self.scores = torch.zeros((P, k), dtype=torch.float32, device=device)
        self.scores[:, 1:] = NEG  # the beams start equal: only the first one's continuations count
        self.finished = torch.full((P, k, steps), -1, dtype=torch.long, device=device)
        self.final = torch.full((P, k), NEG, dtype=torch.float32, device=device)
        self.sent = torch.zeros((P, k), dtype=torch.bool, device=device)  # a finished slot holds one
        self.open = torch.ones((P, 1), dtype=torch.bool, device=device)  # could still improve
        self.hits = torch.zeros((P, k), dtype=torch.bool, device=device)
        self.base = (torch.arange(P, device=device) * k)[:, None]

    def step(self, logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token i of the batch's rows from their logits (rows, vocab): (each row's new id, the
        row it continues), both (rows,) long, rows in beam order."""
        P, k, K = self.P, self.k, self.K
        logp = torch.log_softmax(logits.float(), dim=-1)
        if self.bans is not None:
            logp = self.bans(logp, i, fresh=True)
        V = logp.shape[-1]
        acc = (logp.view(P, k, V) + self.scores[:, :, None]).view(P, k * V)
        top, idx = acc.topk(K, dim=-1)
        parent, ids = idx // V, idx % V
        seqs = self.running.gather(1, parent[:, :, None].expand(P, K, self.T)).clone()
        seqs[:, :, i] = ids
        hits = (ids[:, :, None] == self.ends[:, None, :]).any(-1) | (i == self.T - 1)
        # the next running beams: the best k that do not end
        alive = top + hits.float() * NEG
        keep = alive.topk(k, dim=-1).indices
        self.running = seqs.gather(1, keep[:, :, None].expand(P, k, self.T))
        self.scores = alive.gather(1, keep)
        self.hits = hits.gather(1, keep)
        rows = (parent.gather(1, keep) + self.base).view(-1)
        # the finished hypotheses: the best k of those kept and those of the top k that just ended
        just = hits & self.top[None, :]
        cand = top / float(i + 1) ** self.lp
        full = self.sent.all(dim=1, keepdim=True) & (self.early is True)
        cand = cand + full.float() * NEG + (~self.open).float() * NEG + (~just).float() * NEG
        merged = torch.cat([self.final, cand], dim=1)
        best = merged.topk(k, dim=-1).indices
        self.finished = torch.cat([self.finished, seqs], dim=1).gather(1, best[:, :, None].expand(P, k, self.T))
        self.final = merged.gather(1, best)
        self.sent = torch.cat([self.sent, just], dim=1).gather(1, best)
        # whether a running beam could still beat the worst finished one
        length = (self.T if self.early == "never" and self.lp > 0 else i + 1)
        possible = self.scores[:, :1] / float(length) ** self.lp
        worst = torch.where(self.sent, self.final.min(dim=1, keepdim=True).values, torch.full_like(self.final, NEG))
        self.open &= (possible > worst).any(dim=-1, keepdim=True)
        if self.bans is not None:
            self.bans.reorder(rows)
            self.bans.count(self.running[:, :, i].reshape(-1))
        return self.running[:, :, i].reshape(-1), rows

    def done(self) -> bool:
        """Whether every prompt's result is final (transformers' loop would stop)."""
        more = self.open.any() & ~(self.sent.all() & (self.early is True)) & ~self.hits.all()
        return not bool(more)

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, its prompt's r-th best hypothesis (r: the row's place among the prompt's
        rows): (rows, steps) ids padded with -1 after its end, and (rows,) its score."""
        return self.finished.reshape(self.P * self.k, self.T), self.final.reshape(-1)


@dataclass
class BeamStep:
    """One step of a block's beam search on the last stage (``Choosers.choose_beams``): the new
    ids (rows,), each row's parent row in the block (rows,), per GPU batch its rows' parents
    (``BlockCache.reorder``), whether every prompt's search is over, and (once it is, or at the
    last step) each row's hypothesis ((rows, steps) ids padded with -1, (rows,) scores)."""

    ids: torch.Tensor
    parents: torch.Tensor
    perms: dict[int, torch.Tensor]
    ended: bool
    results: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Beamed:
    """One row's result of a beam search: its prompt's r-th best hypothesis (r: the row's place
    among its prompt's rows), its ids (up to and including the id that ended it) and score."""

    tokens: list[int]
    score: float


def beamed_rows(ids: torch.Tensor, scores: torch.Tensor) -> list[Beamed]:
    """Per row, its hypothesis from ``BeamStep.results`` (one host copy)."""
    out = []
    for row, sc in zip(ids.tolist(), scores.tolist()):
        n = row.index(-1) if -1 in row else len(row)
        out.append(Beamed(row[:n], sc))
    return out


def one_tier_caches(policy: Any) -> list[Any]:
    """``policy`` with its cache whole on one tier (``beams_refusal``'s need), from the highest
    tier it uses down to disk (the same policy where it is on one already)."""
    tiers = [(100.0, 0.0), (0.0, 100.0), (0.0, 0.0)]  # (gpu %, cpu %): GPU, CPU, disk
    shares = (policy.cache_gpu_percent, policy.cache_cpu_percent, policy.cache_disk_percent)
    used = [t for t, share in enumerate(shares) if share > 0]
    if len(used) <= 1:
        return [policy]
    return [dataclasses.replace(policy, cache_gpu_percent=g, cache_cpu_percent=c) for g, c in tiers[used[0]:]]


def beams_refusal(policy: Any, width: int) -> str | None:
    """Why a stage's ``policy`` cannot run a beam search of ``width`` beams (None: it can):
    each prompt's beams share a GPU batch, and each GPU batch's cache rows are reordered in
    place on one tier."""
    if policy.gpu_batch_size % width:
        return (f"beam search with {width} beams needs a GPU batch size that is a multiple of {width} (each prompt's "
                f"beams run in one GPU batch); this run's is {policy.gpu_batch_size}: give --gpu-batch-size")
    tiers = [t for t in (policy.cache_gpu_percent, policy.cache_cpu_percent,
                         100.0 - policy.cache_gpu_percent - policy.cache_cpu_percent) if t > 0]
    if len(tiers) > 1:
        return ("beam search reorders each GPU batch's cache rows every step, on one tier: give the cache percent "
                "100 0 (GPU), 0 100 (CPU) or 0 0 (disk) in --percent")
    return None
