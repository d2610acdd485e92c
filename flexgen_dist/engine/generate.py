"""Single-process generation: blocks of prompts through one StageEngine that owns everything.

The pipeline runtime (dist/pipeline.py) drives the same StageEngine API across ranks; this
module is the world-size-1 driver and the shared pieces (blocking, padding, result records).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .policy import Policy
from .sampling import EosTracker, SamplingConfig, make_generator, sample
from .stage import BlockMeta, StageEngine


@dataclass
class Timings:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # generated tokens after the first of each sequence
    token_steps: int = 0  # token steps run over all blocks (fewer than gen_len each after EOS)

    def metrics(self) -> dict[str, float]:
        tot = self.prefill_s + self.decode_s
        return {
            "prefill_time_s": self.prefill_s, "decode_time_s": self.decode_s,
            "prefill_throughput": self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0,
            "decode_throughput": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            "total_throughput": self.generated_tokens / tot if tot else 0.0,
            "prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
        }


@dataclass
class Block:
    index: int
    prompt_ids: list[list[list[int]]]  # per GPU batch, per sequence
    first: int  # index of the block's first prompt in the input order
    meta: BlockMeta = field(init=False)

    def __post_init__(self) -> None:
        s = max(len(p) for b in self.prompt_ids for p in b)
        self.meta = BlockMeta([[len(p) for p in b] for b in self.prompt_ids], s, 0)

    def padded(self, k: int, pad_id: int) -> torch.Tensor:
        s = self.meta.prompt_len
        return torch.tensor([[pad_id] * (s - len(p)) + p for p in self.prompt_ids[k]], dtype=torch.long)


def make_blocks(prompts: list[list[int]], policy: Policy, gen_len: int) -> list[Block]:
    """Cut prompts, in input order, into blocks of num_gpu_batches GPU batches."""
    gbs, bls = policy.gpu_batch_size, policy.block_size
    blocks = []
    for bi, start in enumerate(range(0, len(prompts), bls)):
        chunk = prompts[start:start + bls]
        batches = [chunk[a:a + gbs] for a in range(0, len(chunk), gbs)]
        blk = Block(bi, batches, start)
        blk.meta.gen_len = gen_len
        blocks.append(blk)
    return blocks


def pad_token(spec_pad: int | None, eos: tuple[int, ...]) -> int:
    if spec_pad is not None:
        return spec_pad
    return eos[0] if eos else 0


def generate(engine: StageEngine, prompts: list[list[int]], gen_len: int, sampling: SamplingConfig,
             on_block: Callable[[int, list[list[int]]], None] | None = None,
             progress: Callable[[int], None] | None = None) -> tuple[list[list[int]], Timings]:
    """Generate up to gen_len tokens per prompt. Returns token lists in input order.

    ``on_block(first_index, outputs)`` is called as soon as a block finishes (so output is
    written incrementally); ``progress(n)`` advances a progress bar by n token steps.
    """
    spec = engine.spec
    pad = pad_token(spec.pad_token_id, spec.eos_token_ids)
    results: list[list[int]] = []
    tm = Timings()
    for blk in make_blocks(prompts, engine.policy, gen_len):
        outs = run_block(engine, blk, sampling, pad, tm, progress)
        results.extend(outs)
        if on_block is not None:
            on_block(blk.first, outs)
    return results, tm


def run_block(engine: StageEngine, blk: Block, sampling: SamplingConfig, pad: int, tm: Timings,
              progress: Callable[[int], None] | None = None) -> list[list[int]]:
    spec, meta = engine.spec, blk.meta
    st = engine.new_block(meta, tag=f"-blk{blk.index}")
    try:
        gens = make_generator(sampling.seed, blk.index, engine.device)
        trackers = [EosTracker(len(b), spec.eos_token_ids, pad, sampling.ignore_eos, engine.device)
                    for b in blk.prompt_ids]
        inputs = [blk.padded(k, pad) for k in range(len(blk.prompt_ids))]
        tokens: list[list[torch.Tensor]] = [[] for _ in inputs]
        tm.prompt_tokens += sum(len(p) for b in blk.prompt_ids for p in b)
        steps = 0
        for i in range(meta.gen_len):
            t0 = time.perf_counter()
            logits = engine.run_token(st, i, inputs)
            inputs = []
            for k, lg in enumerate(logits):
                nxt = trackers[k].update(sample(lg.float(), sampling, gens))
                tokens[k].append(nxt)
                inputs.append(nxt[:, None])
            dt = time.perf_counter() - t0
            if i == 0:
                tm.prefill_s += dt
            else:
                tm.decode_s += dt
            steps += 1
            if progress is not None:
                progress(1)
            if all(t.all_done() for t in trackers):
                break
        tm.token_steps += steps
        if progress is not None and steps < meta.gen_len:
            progress(meta.gen_len - steps)
        outs = [trim(seq, spec.eos_token_ids, sampling.ignore_eos)
                for k in range(len(tokens)) for seq in torch.stack(tokens[k], 1).tolist()]
        tm.generated_tokens += sum(len(o) for o in outs)
        tm.decode_tokens += sum(max(0, len(o) - 1) for o in outs)
        return outs
    finally:
        engine.free_block(st)


def trim(seq: list[int], eos: tuple[int, ...], ignore_eos: bool) -> list[int]:
    """Generated ids up to and including the first EOS."""
    if not ignore_eos:
        for n, t in enumerate(seq):
            if t in eos:
                return seq[: n + 1]
    return seq


def chunks(xs: list, n: int) -> Iterator[list]:
    for a in range(0, len(xs), n):
        yield xs[a:a + n]
