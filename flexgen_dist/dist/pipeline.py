"""The micro-batch pipeline loop around StageEngine.

Blocks of prompts are processed in waves of G groups (one block per group). For each token i
and group t, stage s receives the hidden states of (i, t) from s-1, runs its block schedule,
and sends them to s+1; the last stage samples and sends the new token ids of (i, t) back to
stage 0, which feeds them in at (i+1, t). With G >= m, stage 0 has other groups to work on
while a group's token travels round the ring, so every stage stays busy after the first
prefill. Stage 0 keeps every token id it receives, so it writes outputs in prompt order
without a separate gather. Receives are posted one item ahead so they overlap compute.

Early stop: when every sequence of a group has reached EOS, the last stage flags it in the
token message it sends stage 0 (one extra element). Stage 0 then skips the group's
remaining steps and passes a "skip" header down the chain in place of the group's next
hidden states, so each stage drops the group at the same item and no receive is left
waiting. Every hidden-state message is preceded by that one-element header.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, RunConfig
from ..engine.budget import check_budgets, predict_peaks
from ..engine.generate import pad_token, trim
from ..engine.sampling import EosTracker, make_generator, sample
from ..engine.stage import BlockMeta, StageEngine
from .comm import FailureMonitor, StageComm
from .partition import partition_layers
from .topology import DistContext, Topology, setup_rank_logging

log = logging.getLogger("flexgen_dist")


@dataclass
class BlockPlan:
    """One block as every rank sees it: its index, first prompt, and prompt lengths."""

    index: int
    first: int
    lens: list[int]
    prompt_len: int

    def meta(self, gbs: int, gen_len: int) -> BlockMeta:
        return BlockMeta([self.lens[a:a + gbs] for a in range(0, len(self.lens), gbs)], self.prompt_len, gen_len)


def plan_blocks(lens: list[int], block_size: int) -> list[BlockPlan]:
    out = []
    for bi, a in enumerate(range(0, len(lens), block_size)):
        chunk = lens[a:a + block_size]
        out.append(BlockPlan(bi, a, chunk, max(chunk)))
    return out


class Pipeline:
    """One rank's view of the pipeline: its engine, its neighbours, and the loop."""

    def __init__(self, ctx: DistContext, engine: StageEngine, cfg: RunConfig, blocks: list[BlockPlan],
                 num_groups: int) -> None:
        self.ctx, self.engine, self.cfg, self.blocks, self.G = ctx, engine, cfg, blocks, num_groups
        self.comm = StageComm(ctx)
        t = ctx.topology
        self.first, self.last = t.is_first, t.is_last
        self.prev, self.next = t.prev_rank, t.next_rank
        self.last_rank = t.world_size - 1
        self.gbs = engine.policy.gpu_batch_size
        spec = engine.spec
        self.pad = pad_token(spec.pad_token_id, spec.eos_token_ids)
        self.hidden = spec.hidden_size
        self.comm_wait_s = 0.0
        self.token_steps = 0  # (token, group) items this stage computed (fewer than all after an early stop)
        self._sends: list[Any] = []
        # the header before each hidden-state message: go on, or skip the group from here
        self._go, self._skip = (torch.tensor([v], dtype=torch.long, device=ctx.wire_device) for v in (0, 1))

    # --- messages -----------------------------------------------------------------------
    def _hidden_shape(self, blk: BlockPlan, i: int) -> tuple[int, ...]:
        return (len(blk.lens), blk.prompt_len if i == 0 else 1, self.hidden)

    def _post_recv(self, blk: BlockPlan, i: int) -> Any:
        """Post the receives this rank needs for (i, blk), or None if it needs none: the header
        and hidden states from the previous stage, or (stage 0) the token ids of step i - 1
        with the last stage's early-stop flag appended."""
        if not self.first:
            header = torch.empty((1,), dtype=torch.long, device=self.ctx.wire_device)
            buf = torch.empty(self._hidden_shape(blk, i), dtype=self.engine.dtype, device=self.ctx.wire_device)
            return self.comm.irecv(header, self.prev), self.comm.irecv(buf, self.prev)  # type: ignore[arg-type]
        if i > 0 and not self.last:
            buf = torch.empty((len(blk.lens) + 1,), dtype=torch.long, device=self.ctx.wire_device)
            return self.comm.irecv(buf, self.last_rank)
        return None

    def _next_item(self, items: list[tuple[int, int]], n: int, done: list[bool]) -> int:
        """Index of the first item after n whose group is still running (len(items) if none)."""
        n += 1
        while n < len(items) and done[items[n][1]]:
            n += 1
        return n

    def _pass_skip(self, blk: BlockPlan, i: int) -> None:
        """Tell the next stage to drop this group from item (i, blk) on."""
        if not self.last:
            self._send(self._skip, self.next)
            self._send(torch.empty(self._hidden_shape(blk, i), dtype=self.engine.dtype,
                                   device=self.ctx.wire_device), self.next)

    def _wait(self, handle: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.comm.wait(handle)
        self.comm_wait_s += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    def _send(self, x: torch.Tensor, dst: int) -> None:
        self._sends.append(self.comm.isend(x, dst))
        if len(self._sends) > 4 * self.G + 4:  # bound the sends in flight
            self._wait(self._sends.pop(0))

    # --- the loop -----------------------------------------------------------------------
    def run(self, prompts: list[list[int]] | None, on_block: Any = None, progress: Any = None) -> dict[str, float]:
        """Run every block; stage 0 calls on_block(first, token lists) as blocks finish."""
        gen_len, sampling = self.cfg.gen_len, self.cfg.sampling
        prefill_s = decode_s = 0.0
        generated = decode_tokens = 0
        for w in range(0, len(self.blocks), self.G):
            wave = self.blocks[w:w + self.G]
            states = [self.engine.new_block(b.meta(self.gbs, gen_len), tag=f"-blk{b.index}") for b in wave]
            tokens: list[list[torch.Tensor]] = [[] for _ in wave]  # stage 0 and last: per group
            trackers = gens = None
            if self.last:
                spec = self.engine.spec
                trackers = [EosTracker(len(b.lens), spec.eos_token_ids, self.pad, sampling.ignore_eos,
                                       self.engine.device) for b in wave]
                gens = [make_generator(sampling.seed, b.index, self.engine.device) for b in wave]
            items = [(i, t) for i in range(gen_len) for t in range(len(wave))]
            done = [False] * len(wave)  # groups whose every sequence has ended (same on every rank)
            pending = self._post_recv(wave[0], 0)
            t_wave = time.perf_counter()
            self._prefill_done: float | None = None
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
                        self._compute(states[t], blk, i, t, x, tokens, trackers, gens, done)
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
                    for t, blk in enumerate(wave):  # the last token of each group still running
                        if done[t]:
                            continue
                        buf = torch.empty((len(blk.lens) + 1,), dtype=torch.long, device=self.ctx.wire_device)
                        tokens[t].append(self._wait(self.comm.irecv(buf, self.last_rank))[:-1].cpu())
            finally:
                for st in states:
                    self.engine.free_block(st)
            t_end = time.perf_counter()
            if self.first:
                pd = (self._prefill_done or t_end) - t_wave
                prefill_s += pd
                decode_s += t_end - t_wave - pd
                for t, blk in enumerate(wave):
                    seqs = torch.stack(tokens[t], 1).tolist()
                    outs = [trim(q, self.engine.spec.eos_token_ids, sampling.ignore_eos) for q in seqs]
                    generated += sum(len(o) for o in outs)
                    decode_tokens += sum(max(0, len(o) - 1) for o in outs)
                    if on_block is not None:
                        on_block(blk.first, outs)
        for h in self._sends:
            self._wait(h)
        self._sends.clear()
        return {"prefill_s": prefill_s, "decode_s": decode_s, "generated": generated,
                "decode_tokens": decode_tokens}

    def _compute(self, st: Any, blk: BlockPlan, i: int, t: int, x: torch.Tensor,
                 tokens: list[list[torch.Tensor]], trackers: Any, gens: Any, done: list[bool]) -> None:
        """Run (i, t) on this stage and send the result on: hidden states to the next stage,
        or (last stage) the sampled ids, with the early-stop flag, to stage 0."""
        outs = self.engine.run_token(st, i, list(torch.split(x, self.gbs)))
        self.token_steps += 1
        if not self.last:
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
            self._send(self._go, self.next)
            self._send(y, self.next)  # type: ignore[arg-type]
            return
        sampling = self.cfg.sampling
        nxt = torch.cat([trackers[t].update(sample(lg.float(), sampling, gens[t])) for lg in outs]) \
            if len(outs) > 1 else trackers[t].update(sample(outs[0].float(), sampling, gens[t]))
        ended = trackers[t].all_done()
        if self.first:
            tokens[t].append(nxt.cpu())
            done[t] = ended  # nobody else to tell
        else:
            flag = self._skip if ended else self._go
            self._send(torch.cat([nxt.to(self.ctx.wire_device), flag]), 0)

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
            s = blk.prompt_len
            rows = [[self.pad] * (s - len(p)) + p for p in prompts[blk.first:blk.first + len(blk.lens)]]
            return torch.tensor(rows, dtype=torch.long)
        if self.last:
            return tokens[t][i - 1][:, None]
        msg = self._wait(handle).cpu()
        ids, ended = msg[:-1], bool(msg[-1])
        tokens[t].append(ids)
        if i == 1 and t == len(tokens) - 1:  # stage 0's prefill ends when every group's first token is back
            self._prefill_done = time.perf_counter()
        return None if ended else ids[:, None]


def run_pipeline(cfg: RunConfig, topo: Topology) -> int:
    """Entry for world size > 1 (and usable with 1): one stage per rank."""
    from ..memory.disk import DiskStore
    from ..models.loader import describe, load_model
    from ..prompts import OutputWriter, read_prompts
    from ..run import (_progress, _report, budgets_of, check_prompt_lengths, close_all, needs_disk,
                       resolve_device, resolve_dtype)

    device = resolve_device(cfg.device, topo.local_rank)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.log_dir:
        setup_rank_logging(cfg.log_dir, topo.rank)
    ctx = DistContext.init(topo, device.type, cfg.backend, cfg.dist_timeout)
    disk = engine = writer = None
    # the monitor reports an exception to the other ranks, then stops (rank 0 lingers until
    # its peers are done, so they read its own error, not a vanished store)
    try:
        with FailureMonitor(ctx) as monitor:
            m, rank = topo.world_size, topo.rank
            loaded = load_model(cfg.model, dummy_weights=cfg.dummy_weights, dtype=dtype, seed=cfg.seed,
                                load_tokenizer=topo.is_first)
            spec = loaded.spec
            ranges = partition_layers(spec.num_layers, m, cfg.stage_layers)
            comm = StageComm(ctx)
            prompts = None
            if topo.is_first:
                prompts = read_prompts(cfg.prompts, cfg.num_prompts, cfg.prompt_len, loaded.tokenizer,
                                       spec.vocab_size, cfg.seed)
                check_prompt_lengths(prompts, cfg.gen_len, spec.max_positions)
                max_len = max(len(p.ids) for p in prompts)
                # only rank 0 reads policy files: the other nodes get the policies below
                policies = cfg.stage_policies(m) if not cfg.auto_policy else None
                predicted: dict[str, Any] = {}
                if policies is None:
                    from ..planner.auto import auto_policies

                    policies, predicted, ranges = auto_policies(cfg, spec, ranges, max_len, torch.finfo(dtype).bits // 8,
                                                                device, len(prompts))
                sizes = {p.block_size for p in policies}
                if len(sizes) != 1:
                    raise ConfigError(f"stage policies have block sizes {sorted(sizes)} (gpu_batch_size x "
                                      "num_gpu_batches): every stage must use the same block size")
                G = cfg.num_micro_batches or m
                blocks = plan_blocks([len(p.ids) for p in prompts], policies[0].block_size)
                header = {"blocks": blocks, "policies": [p.to_dict() for p in policies], "G": G, "ranges": ranges,
                          "max_len": max_len, "predicted": predicted}
                for r in range(1, m):
                    comm.send_obj(header, r)
            else:
                header = comm.recv_obj(0)
            from ..engine.policy import Policy

            policies = [Policy.from_dict(d) for d in header["policies"]]
            policy, blocks, G, ranges = policies[rank], header["blocks"], header["G"], header["ranges"]
            lo, hi = ranges[rank]
            peak = predict_peaks(spec, policy, (lo, hi), has_embed=topo.is_first, has_head=topo.is_last,
                                 prompt_len=header["max_len"], gen_len=cfg.gen_len,
                                 dtype_bytes=torch.finfo(dtype).bits // 8, num_blocks_in_flight=G)
            check_budgets(peak, budgets_of(cfg), stage=rank)
            if needs_disk([policy]):
                disk = DiskStore(Path(cfg.offload_dir).expanduser(), rank=rank, direct_io=cfg.direct_io)
                disk.check_space(peak["disk"])
                monitor.add_cleanup(disk.close)
            engine = StageEngine(spec, loaded.source, (lo, hi), has_embed=topo.is_first, has_head=topo.is_last,
                                 policy=policy, device=device, dtype=dtype, disk=disk)
            log.info("stage %d: layers [%d, %d) weights %s", rank, lo, hi, engine.describe())
            pipe = Pipeline(ctx, engine, cfg, blocks, G)
            records: list[dict[str, Any]] = []
            bar = None
            on_block = None
            if topo.is_first:
                print(f"model: {describe(loaded)}; {m} stages {ranges}; G={G}", file=sys.stderr)
                writer = OutputWriter(cfg.output, loaded.tokenizer)
                bar = _progress(cfg, len(prompts), policy.block_size)  # type: ignore[arg-type]

                def on_block(first: int, outs: list[list[int]]) -> None:
                    recs = [writer.record(prompts[first + n], toks) for n, toks in enumerate(outs)]  # type: ignore[index, union-attr]
                    writer.write(recs)  # type: ignore[union-attr]
                    records.extend(recs)

            tm = pipe.run([p.ids for p in prompts] if prompts else None, on_block,
                          bar.update if bar is not None else None)
            if bar is not None:
                bar.close()
            mine = {"stage": rank, "layers": [lo, hi], "policy": policy.to_dict(), "peak_bytes": engine.peak_bytes(),
                    "predicted_peak_bytes": peak, **engine.times.as_dict(), "comm_wait_s": pipe.comm_wait_s,
                    "token_steps": pipe.token_steps}
            if cfg.metrics:
                p = Path(cfg.metrics).expanduser()
                p.parent.mkdir(parents=True, exist_ok=True)
                p.with_name(p.stem + f".rank{rank}.json").write_text(json.dumps(mine, indent=2) + "\n")
            if rank != 0:
                comm.send_obj(mine, 0)
            else:
                stages = [mine] + [comm.recv_obj(r) for r in range(1, m)]
                _report(cfg, records,
                        merged_metrics(cfg, describe(loaded), device, dtype, prompts, tm, stages, header))
            return 0
    finally:
        close_all(engine, disk, writer)
        ctx.close()


def merged_metrics(cfg: RunConfig, model: str, device: torch.device, dtype: torch.dtype, prompts: Any,
                   tm: dict[str, float], stages: list[dict[str, Any]], header: dict[str, Any]) -> dict[str, Any]:
    prompt_tokens = sum(len(p.ids) for p in prompts)
    gen = tm["generated"]
    pre, dec = tm["prefill_s"], tm["decode_s"]
    return {
        "model": model, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "num_prompts": len(prompts), "prompt_len": header["max_len"], "gen_len": cfg.gen_len,
        "world_size": len(stages), "num_micro_batches": header["G"],
        "prefill_time_s": pre, "decode_time_s": dec,
        "prefill_throughput": prompt_tokens / pre if pre else 0.0,
        "decode_throughput": tm["decode_tokens"] / dec if dec else 0.0,
        "total_throughput": gen / (pre + dec) if pre + dec else 0.0,
        "prompt_tokens": prompt_tokens, "generated_tokens": gen,
        "policy": [s["policy"] for s in stages], "peak_bytes": [s["peak_bytes"] for s in stages],
        "stage_times": [{k: s[k] for k in ("stage", "layers", "compute_s", "io_wait_s", "comm_wait_s", "token_steps")}
                        for s in stages],
        "predicted": {**header.get("predicted", {}), "peak_bytes": [s["predicted_peak_bytes"] for s in stages]},
    }
