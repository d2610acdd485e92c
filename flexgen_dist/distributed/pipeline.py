"""The one generation loop: blocks of prompts through m stages (m = 1: one process, no comm).

Blocks of prompts are processed in waves of G groups (one block per group). For each token i
and group t, stage s receives the hidden states of (i, t) from s-1, runs its block schedule,
and sends them to s+1; the last stage samples and sends the new token ids of (i, t) back to
stage 0, which feeds them in at (i+1, t). With G >= m, stage 0 has other groups to work on
while a group's token travels round the ring, so every stage stays busy after the first
prefill. Stage 0 keeps every token id it receives, so it yields outputs in prompt order
without a separate gather. Receives are posted one item ahead so they overlap compute.

Scoring (``targets`` given): each sequence's first ``lens`` ids are its prefill, and its
next ids are fed one per step as teacher-forced decode steps (gen_len - 1 of them; a
sequence with fewer feeds padding, unscored), so decode attention reads the cache as it
does in generation (compressed, sparse). The last stage adds up per sequence the negative
log-likelihood of the targets, the positions scored and the top-1 hits, (b, 3) float64,
over every step and sends the sum to stage 0 after the group's last step, which yields it
in place of token lists. Stage 0 needs nothing back between steps: its inputs are known.

With one stage (the single process) the same loop runs with no communicator: stage 0 is
also the last, samples itself, and keeps the sampled ids on the compute device (no wire
copies, no per-step host sync beyond the EOS check).

Early stop: when every sequence of a group has reached EOS, the last stage flags it in the
token message it sends stage 0 (one extra element). Stage 0 then skips the group's
remaining steps and passes a "skip" header down the chain in place of the group's next
hidden states, so each stage drops the group at the same item and no receive is left
waiting. Every hidden-state message is preceded by that one-element header.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import torch

from ..engine.blocks import BlockPlan, left_pad, pad_token, plan_blocks, score_rows, trim
from ..engine.sampling import EosTracker, SamplingConfig, sample
from ..engine.stage import StageEngine
from ..metrics import Timings
from .comm import StageComm
from .topology import DistContext

Progress = Callable[[int], Any]


class Pipeline:
    """One rank's view of the loop: its engine, its neighbours (if any), and the schedule of
    (token, group) items over the blocks of one generate call."""

    def __init__(self, engine: StageEngine, blocks: list[BlockPlan], *, gen_len: int,
                 sampling: SamplingConfig, num_groups: int = 1, ctx: DistContext | None = None,
                 targets: list[list[int]] | None = None, keys: list[int] | None = None) -> None:
        self.engine, self.blocks, self.G = engine, blocks, num_groups
        # each prompt's key for its random draws (its index in the job; default: in this call)
        n = sum(len(b.lens) for b in blocks)
        self.keys = torch.tensor(list(range(n)) if keys is None else keys, dtype=torch.long, device=engine.device)
        self.gen_len, self.sampling = gen_len, sampling
        self.targets = targets  # scoring: per sequence, the next id at each position (-1: not scored)
        self._forced: list[torch.Tensor] = []  # scoring, stage 0: per group, (b, gen_len - 1) decode inputs
        self.ctx = ctx if ctx is not None and ctx.world_size > 1 else None
        if self.ctx is None:
            self.comm: StageComm | None = None
            self.first = self.last = True
            self.prev = self.next = None
            self.last_rank = 0
            self.wire = engine.device
        else:
            t = self.ctx.topology
            self.comm = StageComm(self.ctx)
            self.first, self.last = t.is_first, t.is_last
            self.prev, self.next = t.prev_rank, t.next_rank
            self.last_rank = t.world_size - 1
            self.wire = self.ctx.wire_device
        self.gbs = engine.policy.gpu_batch_size
        spec = engine.spec
        self.pad = pad_token(spec.pad_token_id, spec.eos_token_ids)
        self.hidden = spec.hidden_size
        self.comm_wait_s = 0.0
        self.timings = Timings()  # stage 0's clock; token_steps on every stage
        self._sends: list[Any] = []
        self._prefill_done: float | None = None
        # the header before each hidden-state message: go on, or skip the group from here
        self._go, self._skip = (torch.tensor([v], dtype=torch.long, device=self.wire) for v in (0, 1))

    # --- the loop -----------------------------------------------------------------------
    def run(self, prompts: list[list[int]] | None,
            progress: Progress | None = None) -> Iterator[tuple[int, list[list[int]]]]:
        """Run every block. Stage 0 yields ``(first prompt index, token lists)`` per block as its
        wave finishes; the other stages yield nothing. Exhaust the iterator: the last sends
        are awaited after the last block."""
        if self.first:
            assert prompts is not None, "stage 0 needs the prompts"
            self.timings.prompt_tokens += sum(len(p) for p in prompts)
        for w in range(0, len(self.blocks), self.G):
            yield from self._wave(self.blocks[w:w + self.G], prompts, progress)
        for h in self._sends:
            self._wait(h)
        self._sends.clear()

    def _wave(self, wave: list[BlockPlan], prompts: list[list[int]] | None,
              progress: Progress | None) -> Iterator[tuple[int, list[list[int]]]]:
        """G blocks in flight: every (token, group) item in order, skipping ended groups."""
        gen_len = self.gen_len
        states = [self.engine.new_block(self._meta(b), tag=f"-blk{b.index}") for b in wave]
        if self.first and self.targets is not None:
            assert prompts is not None
            self._forced = [self._forced_inputs(b, prompts) for b in wave]
        tokens: list[list[torch.Tensor]] = [[] for _ in wave]  # stage 0 and last: per group
        trackers = keys = None
        if self.last and self.targets is None:
            spec, dev = self.engine.spec, self.engine.device
            trackers = [[EosTracker(len(lens), spec.eos_token_ids, self.pad, self.sampling.ignore_eos, dev)
                         for lens in st.meta.prompt_lens] for st in states]
            keys = [self.keys[b.first:b.first + len(b.lens)].split(self.gbs) for b in wave]  # per GPU batch
        items = [(i, t) for i in range(gen_len) for t in range(len(wave))]
        done = [False] * len(wave)  # groups whose every sequence has ended (same on every rank)
        pending = self._post_recv(wave[0], 0)
        t_wave = time.perf_counter()
        self._prefill_done = None
        try:
            n = 0
            while n < len(items):
                i, t = items[n]
                blk = wave[t]
                handle, pending = pending, None
                nn = self._next_item(items, n, done)
                if nn < len(items):
                    ni, nt = items[nn]
                    if nt != t:  # a group's own next item is posted once its flag is known
                        pending = self._post_recv(wave[nt], ni)
                x = self._input(blk, i, t, handle, tokens, prompts)
                if x is None:  # the group ended at step i - 1: drop it on every later stage
                    done[t] = True
                    self._pass_skip(blk, i)
                else:
                    self._compute(states[t], i, t, x, tokens, trackers, keys, done)
                if i == 0 and t == len(wave) - 1 and self.first and self.last:
                    self._prefill_done = time.perf_counter()
                if progress is not None:
                    progress(1 if not done[t] else gen_len - i)
                if pending is None:
                    nn = self._next_item(items, n, done)
                    if nn < len(items):
                        pending = self._post_recv(wave[items[nn][1]], items[nn][0])
                n = nn
            if self.first and not self.last:
                self._last_tokens(wave, tokens, done)
        finally:
            for st in states:
                self.engine.free_block(st)
        if self.first:
            yield from self._finish_wave(wave, tokens, t_wave)

    def _meta(self, blk: BlockPlan) -> Any:
        # scoring feeds gen_len - 1 known ids after the prefill and samples none after them
        meta = blk.meta(self.gbs, self.gen_len if self.targets is None else self.gen_len - 1)
        if self.targets is not None and self.last:
            mine = self.targets[blk.first:blk.first + len(blk.lens)]
            rows = score_rows(mine, blk.lens, blk.prompt_len, blk.prompt_len + meta.gen_len)
            meta.targets = list(rows.to(self.engine.device).split(self.gbs))
        return meta

    def _forced_inputs(self, blk: BlockPlan, prompts: list[list[int]]) -> torch.Tensor:
        """Scoring, stage 0: (b, gen_len - 1) ids fed at decode steps 1.. (padding past a sequence's end)."""
        n = self.gen_len - 1
        rows = [p[m:m + n] for p, m in zip(prompts[blk.first:blk.first + len(blk.lens)], blk.lens)]
        return torch.tensor([r + [self.pad] * (n - len(r)) for r in rows], dtype=torch.long, device=self.engine.device)

    def _last_tokens(self, wave: list[BlockPlan], tokens: list[list[torch.Tensor]], done: list[bool]) -> None:
        """Stage 0 of several: receive the last token (or the scores) of each group still running."""
        for t, blk in enumerate(wave):
            if done[t]:
                continue
            if self.targets is not None:
                buf = torch.empty((len(blk.lens), 3), dtype=torch.float64, device=self.wire)
                tokens[t].append(self._wait(self.comm.irecv(buf, self.last_rank)).cpu())  # type: ignore[union-attr]
                continue
            buf = torch.empty((len(blk.lens) + 1,), dtype=torch.long, device=self.wire)
            tokens[t].append(self._wait(self.comm.irecv(buf, self.last_rank))[:-1].cpu())  # type: ignore[union-attr]

    def _finish_wave(self, wave: list[BlockPlan], tokens: list[list[torch.Tensor]],
                     t_wave: float) -> Iterator[tuple[int, list[list[int]]]]:
        """Stage 0: clock the wave (prefill until every group's first token, decode after), then
        yield each block's token lists, cut after EOS."""
        tm = self.timings
        t_end = time.perf_counter()
        pd = (self._prefill_done or t_end) - t_wave
        tm.prefill_s += pd
        tm.decode_s += t_end - t_wave - pd
        if self.targets is not None:  # one (b, 3) score row per sequence
            for t, blk in enumerate(wave):
                yield blk.first, tokens[t][0].tolist()
            return
        outs_of = []
        for t in range(len(wave)):
            seqs = torch.stack(tokens[t], 1).tolist()
            outs = [trim(q, self.engine.spec.eos_token_ids, self.sampling.ignore_eos) for q in seqs]
            tm.generated_tokens += sum(len(o) for o in outs)
            tm.decode_tokens += sum(max(0, len(o) - 1) for o in outs)
            outs_of.append(outs)
        for blk, outs in zip(wave, outs_of):
            yield blk.first, outs

    def _compute(self, st: Any, i: int, t: int, x: torch.Tensor, tokens: list[list[torch.Tensor]],
                 trackers: Any, keys: Any, done: list[bool]) -> None:
        """Run (i, t) on this stage and pass the result on: hidden states to the next stage,
        or (last stage) the sampled ids, with the early-stop flag, to stage 0."""
        outs = self.engine.run_token(st, i, list(torch.split(x, self.gbs)))
        self.timings.token_steps += 1
        if not self.last:
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
            self._send(self._go, self.next)  # type: ignore[arg-type]
            self._send(y, self.next)  # type: ignore[arg-type]
            return
        if self.targets is not None:  # summed over the group's steps, handed over after the last
            scores = torch.cat(outs)
            if i == 0:
                tokens[t].append(scores)
            else:
                tokens[t][0] += scores
            if not self.first and i == self.gen_len - 1:
                self._send(tokens[t][0].to(self.wire), 0)
            return
        parts = [trk.update(sample(lg.float(), self.sampling, k, i))
                 for trk, lg, k in zip(trackers[t], outs, keys[t])]
        nxt = parts[0] if len(parts) == 1 else torch.cat(parts)
        ended = all(trk.all_done() for trk in trackers[t])
        if self.first:
            tokens[t].append(nxt)  # stays on the device: fed back in at i + 1
            done[t] = ended  # nobody else to tell
        else:
            flag = self._skip if ended else self._go
            self._send(torch.cat([nxt.to(self.wire), flag]), 0)

    def _input(self, blk: BlockPlan, i: int, t: int, handle: Any, tokens: list[list[torch.Tensor]],
               prompts: list[list[int]] | None) -> torch.Tensor | None:
        """This stage's input for (i, t), or None when the group has ended before step i."""
        if not self.first:
            header, body = handle
            go = int(self._wait(header).item()) == 0
            x = self._wait(body)
            return x.to(self.engine.device) if go else None
        if i == 0:
            assert prompts is not None
            mine = prompts[blk.first:blk.first + len(blk.lens)]
            return left_pad([p[:m] for p, m in zip(mine, blk.lens)], blk.prompt_len, self.pad)
        if self.targets is not None:
            return self._forced[t][:, i - 1:i]
        if self.last:
            return tokens[t][i - 1][:, None]
        msg = self._wait(handle).cpu()
        ids, ended = msg[:-1], bool(msg[-1])
        tokens[t].append(ids)
        if i == 1 and t == len(tokens) - 1:  # stage 0's prefill ends when every group's first token is back
            self._prefill_done = time.perf_counter()
        return None if ended else ids[:, None]

    # --- messages -----------------------------------------------------------------------
    def _hidden_shape(self, blk: BlockPlan, i: int) -> tuple[int, ...]:
        return (len(blk.lens), blk.prompt_len if i == 0 else 1, self.hidden)

    def _post_recv(self, blk: BlockPlan, i: int) -> Any:
        """Post the receives this rank needs for (i, blk), or None if it needs none: the header
        and hidden states from the previous stage, or (stage 0) the token ids of step i - 1
        with the last stage's early-stop flag appended."""
        if self.comm is None:
            return None
        if not self.first:
            header = torch.empty((1,), dtype=torch.long, device=self.wire)
            buf = torch.empty(self._hidden_shape(blk, i), dtype=self.engine.dtype, device=self.wire)
            return self.comm.irecv(header, self.prev), self.comm.irecv(buf, self.prev)  # type: ignore[arg-type]
        if i > 0 and not self.last and self.targets is None:
            buf = torch.empty((len(blk.lens) + 1,), dtype=torch.long, device=self.wire)
            return self.comm.irecv(buf, self.last_rank)
        return None

    @staticmethod
    def _next_item(items: list[tuple[int, int]], n: int, done: list[bool]) -> int:
        """Index of the first item after n whose group is still running (len(items) if none)."""
        n += 1
        while n < len(items) and done[items[n][1]]:
            n += 1
        return n

    def _pass_skip(self, blk: BlockPlan, i: int) -> None:
        """Tell the next stage to drop this group from item (i, blk) on."""
        if not self.last:
            self._send(self._skip, self.next)  # type: ignore[arg-type]
            self._send(torch.empty(self._hidden_shape(blk, i), dtype=self.engine.dtype, device=self.wire),
                       self.next)  # type: ignore[arg-type]

    def _wait(self, handle: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.comm.wait(handle)  # type: ignore[union-attr]
        self.comm_wait_s += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def _send(self, x: torch.Tensor, dst: int) -> None:
        self._sends.append(self.comm.isend(x, dst))  # type: ignore[union-attr]
        if len(self._sends) > 4 * self.G + 4:  # bound the sends in flight
            self._wait(self._sends.pop(0))


def generate(engine: StageEngine, prompts: list[list[int]], gen_len: int, sampling: SamplingConfig,
             progress: Progress | None = None, keys: list[int] | None = None) -> tuple[list[list[int]], Timings]:
    """The loop on one engine that owns the whole model (no ranks, no files): token lists in
    input order and the timings. For engines built by hand (tests, benchmarks); users call
    ``flexgen_dist.LLM``."""
    blocks = plan_blocks([len(p) for p in prompts], engine.policy.block_size)
    pipe = Pipeline(engine, blocks, gen_len=gen_len, sampling=sampling, keys=keys)
    outs: list[list[int]] = []
    for _, block_outs in pipe.run(prompts, progress):
        outs.extend(block_outs)
    return outs, pipe.timings
