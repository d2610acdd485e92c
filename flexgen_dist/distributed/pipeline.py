"""The one generation loop: blocks of prompts through m stages (m = 1: one process, no comm).

Every rank walks the same stream of items (``items.py``): G group slots take the blocks in
turn, and each slot's block goes through its prefill (one item per block, or one per GPU
batch so the next stage can start sooner) and its decode steps; a slot whose block ends
starts its next block's prefill while the other slots still decode. For each item, stage s
receives the hidden states from s-1, runs its block schedule over the item's GPU batches,
and sends them to s+1; the last stage samples and sends the new token ids of the block back
to stage 0 (with their log-probabilities, in the same message, when the call asks for
them), which feeds them in at the block's next step. With G >= m, stage 0 has other
blocks to work on while a block's token travels round the ring, so every stage stays busy.
Stage 0 keeps every token id it receives (its ``Ledger``, ``ledger.py``), so it yields outputs in
prompt order without a separate gather; a block's last tokens arrive at a *collect* item of
stage 0 only. The last stage chooses the ids with its ``Choosers`` (``ledger.py``). Receives
are posted one item ahead so they overlap compute.

Scoring (``targets`` given): each sequence's first ``lens`` ids are its prefill, and its
next ids are fed one per step as teacher-forced decode steps (gen_len - 1 of them; a
sequence with fewer feeds padding, unscored), so decode attention reads the cache as it
does in generation (compressed, sparse). The last stage adds up per sequence the negative
log-likelihood of the targets, the positions scored and the top-1 hits, (b, 3) float64,
over every step and sends the sum to stage 0 after the block's last step, which yields it
in place of token lists. Stage 0 needs nothing back between steps: its inputs are known.

With one stage (the single process) the same loop runs with no communicator: stage 0 is
also the last, samples itself, and keeps the sampled ids on the compute device (no wire
copies, no per-step host sync beyond the EOS check).

Early stop: a sequence finishes at EOS, at its own limit of new tokens, or (stage 0 checks
these, with the tokenizer) when its text contains one of its stop strings. When every
sequence of a block has reached EOS or its limit, the last stage flags it in the token
message it sends stage 0 (one extra element); stage 0 ends the block on that flag or when
its own view (stop strings included) says every sequence is done. Stage 0 then skips the
block's remaining steps and passes a "skip" header down the chain in place of the block's
next hidden states, so each stage drops the block at the same item and no receive is left
waiting. Every hidden-state message is preceded by that one-element header.

Clock: each stage splits its wall time by the item it is on, waiting for the item's input
included (prefill items count as prefill, the others as decode). The report uses the last
stage's split, where tokens come out: the pipeline's fill counts as prefill.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Sequence

import torch

from ..engine.beams import BeamConfig
from ..engine.blocks import BlockPlan, left_pad, pad_token
from ..engine.sampling import SamplingConfig
from ..engine.stage import StageEngine
from ..metrics import Timings
from .items import COLLECT, DECODE, PREFILL, Item, ItemStream
from .ledger import Choosers, Ledger
from .scores import BlockScores
from .ring import Ring
from .topology import DistContext

Progress = Callable[[int], Any]


class Pipeline:
    """One rank's view of the loop: its engine, its neighbours (if any), and the stream of
    items (see ``items.py``) over the blocks of one generate call."""

    def __init__(self, engine: StageEngine, blocks: list[BlockPlan], *, gen_len: int,
                 sampling: SamplingConfig, num_groups: int = 1, ctx: DistContext | None = None,
                 targets: list[list[int]] | None = None, keys: list[int] | None = None,
                 prefill: str = "block", ride: bool = False, limits: Sequence[int] | None = None,
                 samplings: Sequence[SamplingConfig] | None = None, stops: Any = None,
                 logprobs: int | None = None, seen: Sequence[Sequence[int]] | None = None,
                 guide: Any = None, embed: bool = False, beams: BeamConfig | None = None) -> None:
        self.engine, self.blocks, self.G = engine, blocks, num_groups
        # beam search (``engine/beams.py``): the last stage's searches choose each step's ids and
        # each row's parent row; every stage reorders its cache rows by them before the next
        # step (stage 0 gets them with the ids, the others in the hidden states' header)
        self.beams = beams
        self._parents: dict[int, torch.Tensor] = {}  # per beam block: the parents this stage passes on
        # per token: its log-probability and the ``logprobs`` most likely alternatives (None: off);
        # the last stage computes them beside the sampled ids, as (b, width) float64 rows
        self.logprobs = logprobs
        self._lp_width = 0 if logprobs is None else 1 + 2 * logprobs
        self.gen_len, self.sampling = gen_len, sampling
        self.targets = targets  # scoring: per sequence, the next id at each position (-1: not scored)
        # embedding: each sequence's last hidden state after the final norm, in the scores' place
        self.embed = embed
        self.scoring = targets is not None or embed  # rows of floats back to stage 0, no sampling
        self.prefill = prefill  # prefill items: one per block, or one per GPU batch
        self.ride = ride  # the overlapped schedule: next blocks' prefill rides on decode steps
        sends = 4 * num_groups * (engine.policy.num_gpu_batches if prefill == "batch" else 1) * (1 + ride) + 4
        self.ring = Ring(ctx, engine.device, max_sends=sends)
        self.first, self.last = self.ring.first, self.ring.last
        self.gbs = engine.policy.gpu_batch_size
        spec = engine.spec
        self.pad = pad_token(spec.pad_token_id, spec.eos_token_ids)
        self.hidden = spec.hidden_size
        self.timings = Timings()  # this stage's clock; token counts on stage 0
        # the prefill's share of the engine's compute and I/O wait and of the comm wait (the
        # decode's is the rest), split by item as the clock is
        self.prefill_split = {"compute_s": 0.0, "io_wait_s": 0.0, "comm_wait_s": 0.0}
        self._states: dict[int, Any] = {}  # per block in flight: its engine state
        # scoring: each block's rows (sums, per-token rows) on the last stage, and their layout
        self._scores = None if not self.scoring else \
            BlockScores(blocks, targets, gen_len, logprobs, embed_dim=spec.pooled_dim if embed else 0)
        dev, eos = engine.device, spec.eos_token_ids
        # stage 0: what it keeps of each block (``limits``: per sequence of the call, its own most
        # new tokens, None: gen_len; ``stops.hit(sequence, its new ids) -> bool`` for sequences
        # with stop strings, ``stops.has(sequence)``, None: no sequence has any)
        n = sum(len(b.lens) for b in blocks)
        ends = [c.ends(eos) for c in samplings] if samplings is not None else [sampling.ends(eos)] * n
        self.ledger = Ledger(blocks, device=dev, ends=ends, pad=self.pad, gen_len=gen_len,
                             limits=limits, stops=stops, logprobs=logprobs,
                             scores=self._scores, timings=self.timings, beams=beams, gbs=self.gbs) if self.first else None
        # the last stage's samplers (``samplings``: per sequence of the call, None: ``sampling`` for
        # all; ``seen``: per sequence, its prompt's ids where a repetition penalty needs them;
        # ``guide``: llguidance's tokenizer where a sequence has a structure; ``keys``: each
        # prompt's key for its random draws, its index in the job, default: in this call)
        self.choosers = Choosers(
            blocks, device=dev, eos=eos, pad=self.pad, gen_len=gen_len, gbs=self.gbs, sampling=sampling,
            samplings=samplings, limits=limits, seen=seen, guide=guide, logprobs=logprobs,
            keys=torch.tensor(list(range(n)) if keys is None else keys, dtype=torch.long, device=dev), beams=beams,
        ) if self.last and not self.scoring else None
        self._ride_share = 0.0  # the current item's share of prefill compute (a rider's)

    @property
    def comm_wait_s(self) -> float:
        """Seconds this stage waited for messages (0 with one stage)."""
        return self.ring.wait_s

    def stream(self) -> ItemStream:
        """This rank's items, in order (a fresh stream)."""
        return ItemStream([len(b.meta(self.gbs, 1).prompt_lens) for b in self.blocks], self.G, self.gen_len,
                          pieces=self.prefill, collect=self.first and not self.last, ride=self.ride)

    # --- the loop -----------------------------------------------------------------------
    def run(self, prompts: list[list[int]] | None,
            progress: Progress | None = None) -> Iterator[tuple[BlockPlan, list[list[int]]]]:
        """Run every block. Stage 0 yields ``(block, token lists of its rows)`` per block, in
        block order, as blocks finish; the other stages yield nothing. Exhaust the iterator:
        the last sends are awaited after the last block.

        Each stage's clock splits its wall time by the item it is on (waiting for its input
        included): prefill pieces count as prefill, the rest as decode."""
        if self.first:
            assert prompts is not None, "stage 0 needs the prompts"
            self.timings.prompt_tokens += sum(len(p) for p in prompts)
        self.ring.start_together()
        items = self.stream()
        finished: dict[int, list[Any]] = {}
        next_out = 0
        tm, clock = self.timings, time.perf_counter()
        item = items.next()
        pending = self._post_recv(item) if item is not None else None
        try:
            while item is not None:
                handle, pending = pending, None
                ahead = items.peek()
                if ahead is not None:
                    pending = self._post_recv(ahead)
                before = self._waits()
                done, units = self._item(items, item, handle, prompts)
                if self.ledger is not None:
                    for b in done:
                        finished[b] = self.ledger.outputs(b)
                now = time.perf_counter()
                share = 1.0 if item.kind == PREFILL else self._ride_share
                for k, v in self._waits().items():
                    self.prefill_split[k] += (v - before[k]) * share
                pre = (now - clock) * share
                tm.prefill_s += pre
                tm.decode_s += now - clock - pre
                clock = now
                if progress is not None and units:
                    progress(units)
                while next_out in finished:
                    yield self.blocks[next_out], finished.pop(next_out)
                    next_out += 1
                    clock = time.perf_counter()  # the caller's time is not the loop's
                item = items.next()
                if item is not None:
                    if ahead is None:
                        pending = self._post_recv(item)
                    else:
                        assert item == ahead, (item, ahead)
            self.ring.flush()
            tm.decode_s += time.perf_counter() - clock
        finally:
            self.engine.drop_prefetch()
            for st in self._states.values():
                self.engine.free_block(st)
            self._states.clear()

    def _waits(self) -> dict[str, float]:
        return {**self.engine.times.as_dict(), "comm_wait_s": self.comm_wait_s}

    def _item(self, items: ItemStream, item: Item, handle: Any,
              prompts: list[list[int]] | None) -> tuple[list[int], int]:
        """Run one item (with its rider, in one sweep). Returns the blocks the item ended here
        (stage 0 finishes a block at its last step, at its collect, or when it ended early)
        and the (block, step) units it settled for the progress bar (a step run, or the
        steps an early end skips)."""
        self._ride_share = 0.0
        if item.kind == COLLECT:  # stage 0 of several: the block's last tokens (or its scores)
            assert self.ledger is not None
            self.ledger.collect(item.block, self.ring.wait(handle[0]).cpu())
            return [item.block], 0
        parts = item.parts()
        xs = [self._input(p, h, prompts) for p, h in zip(parts, handle)]
        live = [(p, x) for p, x in zip(parts, xs) if x is not None]
        outs = self._run(live, more=items.more_sweeps())  # then the next sweep's first slot loads early
        done, units = [], 0
        for p, x in zip(parts, xs):
            if x is None:  # the block ended at step i - 1: drop it on every later stage
                items.end_block(p.slot, p.block)
                self._pass_skip(p)
                self._free(p.block)
                done.append(p.block)
                units += self.gen_len - p.i
                continue
            ended = self._emit(p, outs[p])
            units += int(p.last)
            if ended:
                items.end_block(p.slot, p.block)
                units += self.gen_len - 1 - p.i
            if ended or (p.last and p.i == self.gen_len - 1):
                self._free(p.block)
                if self.last:  # stage 0 of several waits for the collect
                    done.append(p.block)
        return done, units

    def _run(self, live: list[tuple[Item, torch.Tensor]], more: bool) -> dict[Item, list[torch.Tensor]]:
        """One engine sweep over the parts (``more``: another follows, see ``run_sweep``); with a
        rider, the share of the sweep's compute that went to its prefill (the clock splits the
        item's time by it)."""
        if not live:
            return {}
        states = [self._states[p.block] for p, _ in live]
        outs = self.engine.run_sweep([(st, p.i, list(torch.split(x, self.gbs)), p.batches[0])
                                      for st, (p, x) in zip(states, live)], more=more)
        if len(live) > 1:
            c = self.engine.sweep_compute
            total = sum(c)
            self._ride_share = sum(t for t, (p, _) in zip(c, live) if p.kind == PREFILL) / total if total > 0 else 0.5
        for p, _ in live:
            if p.last:
                self.timings.token_steps += 1
        return {p: o for (p, _), o in zip(live, outs)}

    def _free(self, b: int) -> None:
        self._parents.pop(b, None)
        if self.choosers is not None:
            self.choosers.drop(b)
        st = self._states.pop(b, None)
        if st is not None:
            self.engine.free_block(st)

    def _rows(self, item: Item) -> tuple[int, int]:
        n = len(self.blocks[item.block].lens)
        return min(n, item.batches[0] * self.gbs), min(n, item.batches[1] * self.gbs)

    def _meta(self, blk: BlockPlan) -> Any:
        # scoring feeds gen_len - 1 known ids after the prefill and samples none after them
        meta = blk.meta(self.gbs, self.gen_len if not self.scoring else self.gen_len - 1)
        meta.embed = self.embed and self.last
        if self.targets is not None and self._scores is not None and self.last:
            meta.targets = list(self._scores.targets_of(blk).to(self.engine.device).split(self.gbs))
            meta.score_k = self.logprobs
        return meta

    def _state(self, b: int, prompts: list[list[int]] | None) -> Any:
        st = self._states.get(b)
        if st is None:  # the block's first item on this stage
            st = self._states[b] = self.engine.new_block(self._meta(self.blocks[b]), tag=f"-blk{b}")
            if self.ledger is not None:
                self.ledger.open(b, prompts)
            if self.choosers is not None:
                self.choosers.open(b)
        return st

    def _emit(self, item: Item, outs: list[torch.Tensor]) -> bool:
        """Pass the item's result on: hidden states to the next stage, or (last stage) the
        sampled ids, with the early-stop flag, to stage 0. Returns whether the block has
        ended (one stage only: every sequence at EOS)."""
        b, i = item.block, item.i
        if not self.last:
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            if i == 0 and self.blocks[b].computes_prefix and item.batches[0] == 0:  # the prefix's row goes along
                st = self._states[b]
                out, st.prefix = torch.cat([out.reshape(-1), st.prefix.reshape(-1)]), None
            self.ring.send_hidden(out, self._parents.pop(b) if self._beam_step(item) else None)
            return False
        if self._scores is not None:  # summed over the block's steps, handed over after the last
            self._scores.add(b, i, *self._rows(item), torch.cat(outs))
            if item.last and i == self.gen_len - 1:
                acc = self._scores.pop(b)
                if self.ledger is not None:
                    self.ledger.collect(b, acc)
                else:
                    self.ring.send_scores(acc)
            return False
        (r0, r1), k0 = self._rows(item), item.batches[0]
        if i == 0:  # prefill: the engine runs the head once per block, at its last GPU batch
            if not item.last:
                return False
            outs = self.engine.prefill_logits(self._states[b], k0) + outs
            r0 = k0 = 0
        assert self.choosers is not None
        if self.beams is not None:
            step = self.choosers.choose_beams(b, i, (k0, item.batches[1]), outs, item.last)
            if self.ledger is None:
                self.ring.send_beams(step, self.gen_len)
                return False
            self.ledger.keep_beams(b, step)
            if not step.ended and i < self.gen_len - 1:
                self._reorder(b, step.perms)
            return step.ended
        nxt, lp, ended = self.choosers.choose(b, i, (r0, r1), (k0, item.batches[1]), outs, item.last)
        if self.ledger is not None:
            self.ledger.keep(b, nxt, lp)  # stays on the device: fed back in at i + 1
            return self.ledger.step(b, nxt, i) or ended  # nobody else to tell
        self.ring.send_tokens(nxt, ended, lp)
        return False

    def _input(self, item: Item, handle: Any, prompts: list[list[int]] | None) -> torch.Tensor | None:
        """This stage's input for the item, or None when its block has ended before step i."""
        b, i = item.block, item.i
        blk = self.blocks[b]
        if not self.first:
            x, parents = self.ring.hidden(handle)
            if x is None:
                return None
            st = self._state(b, None)
            if self._beam_step(item):  # the rows' parents: this stage's cache follows, the next stage's too
                self._reorder(b, self._split(b, parents))
                self._parents[b] = parents
            if i == 0 and blk.computes_prefix and item.batches[0] == 0:  # the rows, then the shared prefix's row
                r0, r1 = self._rows(item)
                n = (r1 - r0) * (blk.prompt_len - blk.shared) * self.hidden
                st.prefix = x[n:].view(1, blk.shared, self.hidden).to(self.engine.device)
                x = x[:n].view(r1 - r0, blk.prompt_len - blk.shared, self.hidden)
            return x.to(self.engine.device)
        st = self._state(b, prompts)
        if i == 0:
            assert prompts is not None
            r0, r1 = self._rows(item)
            mine = [prompts[m] for m in blk.members[r0:r1]]
            x = left_pad([p[:m] for p, m in zip(mine, blk.lens[r0:r1])], blk.prompt_len, self.pad)
            if blk.shared:  # the rows' own positions; the prefix runs once, as one row
                if item.batches[0] == 0 and blk.computes_prefix:
                    st.prefix = torch.tensor([prompts[blk.members[0]][:blk.shared]], dtype=torch.long)
                x = x[:, blk.shared:]
            return x
        assert self.ledger is not None
        if self.scoring or self.last:
            return self.ledger.fed(b, i)
        ids, ended = self.ledger.take(b, self.ring.wait(handle).cpu())
        ended = self.ledger.step(b, ids, i - 1) or ended
        if self.beams is not None and not ended:
            parents = self.ledger.parents.pop(b)
            self._reorder(b, self._split(b, parents))
            self._parents[b] = parents
        return None if ended else ids[:, None]

    # --- messages (``ring.py``) -----------------------------------------------------------
    def _hidden_shape(self, item: Item) -> tuple[int, ...]:
        """The hidden states of the item's rows; a prefill computes positions [L, s) of a block
        with a shared prefix (``BlockPlan.shared`` = L), and its first GPU batch's message
        brings the prefix's one row of L positions after them, flat."""
        r0, r1 = self._rows(item)
        blk = self.blocks[item.block]
        if item.i != 0:
            return (r1 - r0, 1, self.hidden)
        t = blk.prompt_len - blk.shared
        if blk.computes_prefix and item.batches[0] == 0:
            return ((r1 - r0) * t * self.hidden + blk.shared * self.hidden,)
        return (r1 - r0, t, self.hidden)

    def _post_recv(self, item: Item) -> list[Any]:
        """Post the receives this rank needs for the item, one entry per part (rider first)."""
        return [self._post_recv_part(p) for p in item.parts()]

    def _post_recv_part(self, item: Item) -> Any:
        """The receives of one part, or None if it needs none: the header and hidden states
        from the previous stage, or (stage 0) the token ids of step i - 1 with the last
        stage's early-stop flag appended (at a collect: of the last step, or the block's
        scores)."""
        if self.ring.comm is None:
            return None
        n = len(self.blocks[item.block].lens)
        if not self.first:
            return self.ring.post_hidden(self._hidden_shape(item), self.engine.dtype, self._tail(item))
        if item.kind == COLLECT and self._scores is not None:
            return self.ring.post_from_last(self._scores.shape(item.block), torch.float64)
        if item.kind == COLLECT or (item.kind == DECODE and not self.last and not self.scoring):
            width = 3 + self.gen_len if self.beams is not None else 1 + self._lp_width  # ``Ring.send_beams``
            return self.ring.post_from_last((n * width + 1,), torch.long)
        return None

    def _pass_skip(self, item: Item) -> None:
        """Tell the next stage to drop this block from this item on."""
        if not self.last:
            self.ring.send_skip(self._hidden_shape(item), self.engine.dtype, self._tail(item))
            self._parents.pop(item.block, None)

    # --- beam search ------------------------------------------------------------------------
    def _beam_step(self, item: Item) -> bool:
        """Whether the item is a beam block's decode step (its rows' parents travel with it)."""
        return self.beams is not None and item.kind == DECODE and item.i > 0

    def _tail(self, item: Item) -> int:
        """Ids after the hidden states' header: a beam step's parents, one per row of the block."""
        return len(self.blocks[item.block].lens) if self._beam_step(item) else 0

    def _split(self, b: int, parents: torch.Tensor) -> dict[int, torch.Tensor]:
        """The block's rows' parents (block rows) as each GPU batch's own (its rows from 0)."""
        out, a = {}, 0
        for kb, size in enumerate(self._states[b].meta.batch_sizes):
            out[kb] = parents[a:a + size] - a
            a += size
        return out

    def _reorder(self, b: int, perms: dict[int, torch.Tensor]) -> None:
        """This stage's cache rows and linear-attention states of block b follow their beams'
        parents (``BlockCache.reorder``, ``block_state.recurrent``); a GPU batch whose beams all
        continue themselves stays as it is."""
        st = self._states[b]
        moved = {kb: p for kb, p in perms.items()
                 if not torch.equal(p.cpu(), torch.arange(p.shape[0]))}
        if moved and st.cache is not None:
            st.cache.reorder(moved)
        if moved and st.states is not None:  # each linear layer's states as they are next used
            st.state_perm.update({(j, kb): p for j in st.states.tiers for kb, p in moved.items()})
