"""What the two ends of the pipeline keep of each block in flight.

``Ledger`` is stage 0's record: the ids each step of a block fed or got back (kept on the
compute device with one stage, where they are fed in again), their log-probability rows, the
teacher-forced inputs when scoring, and its own view of which sequences are done (EOS, limits,
stop strings: ``BlockWatch``); at the block's end it turns them into the block's outputs, cut
where each sequence finished, and counts them on the clock's ``Timings``.

``Choosers`` is the last stage's: per block, one ``RowSampling`` (each sequence's own sampling,
penalties, structure) and one ``EosTracker`` per GPU batch, which choose each step's ids from
the logits and say when every sequence of the block is done.

With one stage both live in the same process, and the loop (``pipeline.py``) uses both.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..engine.blocks import BlockPlan, finished_rows
from ..engine.beams import BeamConfig, BeamSearch, BeamStep, beamed_rows
from ..engine.endings import BlockWatch, EosTracker
from ..engine.sampling import RowSampling, SamplingConfig, TokenLogprobs, token_logprobs
from ..metrics import Timings
from .scores import BlockScores


def _limits(limits: Sequence[int] | None, blk: BlockPlan) -> list[int] | None:
    """The block's sequences' own most new tokens (None: the call's)."""
    return None if limits is None else [limits[m] for m in blk.members]


class Ledger:
    """Stage 0's record of the blocks in flight (module doc)."""

    def __init__(self, blocks: list[BlockPlan], *, device: torch.device, ends: Sequence[tuple[int, ...]], pad: int,
                 gen_len: int, limits: Sequence[int] | None, stops: Any,
                 logprobs: int | None, scores: BlockScores | None, timings: Timings,
                 beams: BeamConfig | None = None, gbs: int | None = None) -> None:
        """``ends``: per sequence of the call, the ids that end it (``SamplingConfig.ends``);
        ``beams``: a beam search's (its blocks' results come from the last stage whole);
        ``gbs``: the GPU batch size, which decides which repeated prompts are computed once
        (``BlockPlan.repeated``; None: none counted)."""
        self.blocks, self.device, self.ends, self.pad, self.gbs = blocks, device, ends, pad, gbs
        self.beams = beams
        self.beam_results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per block: ids, scores
        self.parents: dict[int, torch.Tensor] = {}  # per block: its last step's rows' parents
        self.gen_len, self.limits, self.stops = gen_len, limits, stops
        self.logprobs, self.scores, self.timings = logprobs, scores, timings
        self.lp_width = 0 if logprobs is None else 1 + 2 * logprobs  # a token's row: see token_logprobs
        self.tokens: dict[int, list[torch.Tensor]] = {}  # per step (b,) ids; scoring: [the (b, 3) sums]
        self.lps: dict[int, list[torch.Tensor]] = {}  # logprobs: per step (b, width)
        self.forced: dict[int, torch.Tensor] = {}  # scoring: (b, gen_len - 1) decode inputs
        self.watch: dict[int, BlockWatch] = {}

    def open(self, b: int, prompts: list[list[int]] | None) -> None:
        """Block b's first item on stage 0."""
        blk = self.blocks[b]
        self.tokens[b] = []
        if self.scores is not None:
            assert prompts is not None
            n = self.gen_len - 1  # ids fed at decode steps 1.. (padding past a sequence's end)
            rows = [prompts[q][m:m + n] for q, m in zip(blk.members, blk.lens)]
            self.forced[b] = torch.tensor([r + [self.pad] * (n - len(r)) for r in rows], dtype=torch.long,
                                          device=self.device)
            return
        if self.logprobs is not None:
            self.lps[b] = []
        if self.beams is not None:  # the last stage says when the search is over
            return
        self.watch[b] = BlockWatch(EosTracker([self.ends[m] for m in blk.members], self.pad, self.device,
                                              _limits(self.limits, blk)), blk.members, self.stops)

    def keep(self, b: int, ids: torch.Tensor, lp: torch.Tensor | None = None) -> None:
        """Step ids of block b (and their logprob rows) chosen in this process."""
        self.tokens[b].append(ids)
        if lp is not None:
            self.lps[b].append(lp)

    def keep_beams(self, b: int, step: BeamStep) -> None:
        """A beam search step chosen in this process: its ids (fed in next) and, at its end, its
        results."""
        self.tokens[b].append(step.ids)
        if step.results is not None:
            self.beam_results[b] = step.results

    def take(self, b: int, msg: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A step's message from the last stage (``Ring.send_tokens``): keep its ids (and
        logprob rows); returns the ids and the last stage's early-stop flag. A beam block's
        (``Ring.send_beams``) also brings the rows' parents (``parents``) and, at its end, the
        search's results."""
        n = len(self.blocks[b].lens)
        ids = msg[:n]
        self.tokens[b].append(ids)
        if self.beams is not None:
            T = self.gen_len
            self.parents[b] = msg[n:2 * n]
            self.beam_results[b] = (msg[2 * n:2 * n + n * T].view(n, T),
                                    msg[2 * n + n * T:2 * n + n * T + n].view(torch.float64))
            return ids, bool(msg[-1])
        if self.lp_width:
            self.lps[b].append(msg[n:-1].view(torch.float64).view(n, self.lp_width))
        return ids, bool(msg[-1])

    def collect(self, b: int, msg: torch.Tensor) -> None:
        """The block's last message from the last stage: its last ids, or its score sums."""
        if self.scores is not None:
            self.tokens[b] = [msg]
        else:
            self.take(b, msg)

    def step(self, b: int, ids: torch.Tensor, i: int) -> bool:
        """Token i of block b's sequences is ``ids``; whether all are now done (stage 0's view)."""
        watch = self.watch.get(b)
        return watch is not None and watch.step(ids, i)

    def fed(self, b: int, i: int) -> torch.Tensor:
        """(b, 1) ids block b's decode step i feeds in: its forced inputs when scoring, else
        the ids of step i - 1 (kept here: one stage)."""
        if self.scores is not None:
            return self.forced[b][:, i - 1:i]
        return self.tokens[b][i - 1][:, None]

    def outputs(self, b: int) -> list[Any]:
        """Block b's token lists, cut where each sequence finished (with their logprobs where
        asked; scoring: its score rows), counted on the clock."""
        tokens = self.tokens.pop(b)
        self.forced.pop(b, None)
        watch = self.watch.pop(b, None)
        blk, tm = self.blocks[b], self.timings
        tm.prompt_positions += blk.prompt_len * len(blk.members)
        tm.prompt_padding += blk.padding
        tm.prompt_shared += blk.saved  # positions not computed again
        tm.prompt_repeated += blk.repeated(self.gbs) if self.gbs else 0
        if self.scores is not None:
            return self.scores.results(b, tokens[0])
        if self.beams is not None:  # each row's hypothesis, whole
            self.parents.pop(b, None)
            outs = beamed_rows(*self.beam_results.pop(b))
            tm.generated_rows += len(tokens) * len(outs)
            tm.generated_tokens += sum(len(o.tokens) for o in outs)
            tm.decode_tokens += sum(max(0, len(o.tokens) - 1) for o in outs)
            return outs
        seqs = torch.stack(tokens, 1).tolist()
        outs = finished_rows(seqs, blk.members, self.ends, self.limits,
                             watch.stopped if watch is not None else {})
        lps = self.lps.pop(b, None)
        tm.generated_rows += len(seqs[0]) * len(seqs) if seqs else 0
        tm.generated_tokens += sum(len(o) for o in outs)
        tm.decode_tokens += sum(max(0, len(o) - 1) for o in outs)
        if lps is not None:  # each completion with its tokens' logprobs, cut as its tokens
            rows = torch.stack(lps, 1).cpu()  # (b, steps, width): one host copy per block
            k = self.logprobs or 0
            return [(o, TokenLogprobs.of_rows(r[:len(o)], k)) for o, r in zip(outs, rows)]
        return outs


class Choosers:
    """The last stage's samplers and EOS trackers, per block and GPU batch (module doc)."""

    def __init__(self, blocks: list[BlockPlan], *, device: torch.device, eos: Sequence[int], pad: int,
                 gen_len: int, gbs: int, sampling: SamplingConfig, samplings: Sequence[SamplingConfig] | None,
                 limits: Sequence[int] | None, seen: Sequence[Sequence[int]] | None, guide: Any,
                 keys: torch.Tensor, logprobs: int | None, beams: BeamConfig | None = None) -> None:
        self.blocks, self.device, self.eos, self.pad = blocks, device, eos, pad
        self.beams = beams
        self.searches: dict[int, list[BeamSearch]] = {}
        self.gen_len, self.gbs, self.sampling, self.samplings = gen_len, gbs, sampling, samplings
        self.limits, self.seen, self.guide, self.keys, self.logprobs = limits, seen, guide, keys, logprobs
        self.trackers: dict[int, list[EosTracker]] = {}
        self.samplers: dict[int, list[RowSampling]] = {}

    def open(self, b: int) -> None:
        """Block b's first item on the last stage."""
        blk = self.blocks[b]
        limits, g = _limits(self.limits, blk), self.gbs
        rows = [blk.members[a:a + g] for a in range(0, len(blk.members), g)]
        cfgs = [[self.sampling if self.samplings is None else self.samplings[m] for m in r] for r in rows]
        if self.beams is not None:  # each GPU batch's prompts, each as its beams' rows in a row
            k = self.beams.width
            for r in rows:
                if any(r[a:a + k] != list(range(r[a], r[a] + k)) or r[a] % k for a in range(0, len(r), k)):
                    raise RuntimeError(f"block {b}'s GPU batches do not hold whole prompts of {k} beams")
            self.searches[b] = [BeamSearch(self.beams, cs, self.eos, self.gen_len, self.device) for cs in cfgs]
            return
        self.trackers[b] = [EosTracker([c.ends(self.eos) for c in cs], self.pad, self.device,
                                       None if limits is None else limits[a * g:a * g + len(r)])
                            for a, (r, cs) in enumerate(zip(rows, cfgs))]
        self.samplers[b] = [RowSampling(cs, self.device, self.gen_len,
                                        None if self.seen is None else [self.seen[m] for m in r],
                                        self.guide, self.eos)
                            for r, cs in zip(rows, cfgs)]

    def drop(self, b: int) -> None:
        self.trackers.pop(b, None)
        self.samplers.pop(b, None)
        self.searches.pop(b, None)

    def choose_beams(self, b: int, i: int, batches: tuple[int, int], logits: list[torch.Tensor],
                     last: bool) -> BeamStep:
        """Token i of block b's beams (every GPU batch of ``batches``, from their ``logits``):
        the new ids, each row's parent row in the block, per GPU batch its parents (to reorder
        the cache), whether every prompt's search is over, and then its results."""
        parts, perms, base = [], {}, 0
        searches = self.searches[b]
        for kb, (bs, lg) in enumerate(zip(searches[batches[0]:batches[1]], logits), start=batches[0]):
            ids, rows = bs.step(lg, i)
            parts.append((ids, rows + base))
            perms[kb] = rows
            base += rows.shape[0]
        ended = all(s.done() for s in searches)
        over = last and (ended or i == self.gen_len - 1)
        results = None
        if over:
            res = [s.results() for s in searches]
            results = (torch.cat([r[0] for r in res]), torch.cat([r[1] for r in res]))
            self.drop(b)
        return BeamStep(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), perms, ended, results)

    def choose(self, b: int, i: int, rows: tuple[int, int], batches: tuple[int, int],
               logits: list[torch.Tensor], last: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Token i of block b's rows ``rows`` (GPU batches ``batches``), from each GPU batch's
        ``logits``: (the ids, their logprob rows or None, whether every sequence of the block
        is done). ``last``: the step's last part (then a block that is done is dropped)."""
        r0, r1 = rows
        keys = self.keys[self.blocks[b].members[r0:r1]].split(self.gbs)
        parts, lps = [], []
        for t, r, lg, k in zip(self.trackers[b][batches[0]:batches[1]], self.samplers[b][batches[0]:batches[1]],
                               logits, keys):
            lg = lg.float()
            parts.append(t.update(r.sample(lg, k, i), i))
            if self.logprobs is not None:
                lps.append(token_logprobs(lg, parts[-1], self.logprobs))
        ids = parts[0] if len(parts) == 1 else torch.cat(parts)
        lp = None if not lps else lps[0] if len(lps) == 1 else torch.cat(lps)
        ended = all(t.all_done() for t in self.trackers[b])
        if last and (ended or i == self.gen_len - 1):
            self.drop(b)
        return ids, lp, ended
