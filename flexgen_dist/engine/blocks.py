"""Blocks of prompts: how the input is cut, grouped, padded and trimmed, the same on every stage.

A block is ``num_gpu_batches`` GPU batches of ``gpu_batch_size`` prompts; it shares each
loaded layer across its batches (the zig-zag schedule), and every prompt of a block is
left-padded to its longest. So that little of a block is padding, requests are grouped by
length: the input is cut into *windows* of ``window_blocks`` blocks' worth of requests, and
within a window the requests are sorted by length, then neighbouring blocks' worth of them by
their own limit of new tokens (``_window_order``), before being cut into blocks. Outputs still go out in input order, a
window at a time: a window is what a run writes at once, and a resumed run starts at a window
boundary, so it forms the same blocks. Every stage of a pipeline plans the same blocks from
the lengths and limits alone, so only those travel (with, where the prompts of a block begin
alike, the length of what they share: ``shared_prefixes``).

Where a window mixes prompts that open differently (a batch file of several tasks, each its
own instructions before each document), blocks cut by length alone would share little; rank
0 then also groups the window's requests by their opening first (``prefix_groupings``: runs
of the window's prompts in token order whose neighbours share at least a threshold of
leading tokens), each group cut by length as above, and keeps whichever grouping computes the
fewest prefill positions (``prefill_positions``: padded rows minus what the prefixes save).
The group of each request travels with the lengths (``plan_blocks``' ``groups``).

A prompt that repeats another (a request's ``n`` choices, a beam search's beams, the same
question asked twice) is computed once per GPU batch at the prefill: ``repeated_prompts`` gives
each request the first request with the same ids and adapter, ``plan_blocks`` puts a length's
repeats next to each other, and ``BlockMeta.twins`` tells every stage which row of a GPU batch
each row copies (``engine/twins.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

# a block's prompts that share at least this many leading tokens have them computed once (the
# prefix pass, ``StageEngine``); a shorter prefix is computed with the rest
MIN_SHARED = 16


@dataclass
class BlockMeta:
    """What every stage must know about one block: its GPU batches and their prompt lengths."""

    prompt_lens: list[list[int]]  # per GPU batch, the true length of each (left-padded) prompt
    prompt_len: int  # s: padded prompt length of the block
    gen_len: int  # n
    # Scoring mode: per GPU batch, (b, s + gen_len) ids of the token that follows each cache
    # position (-1 where it is not scored); decode steps are teacher-forced, so step i's input
    # sits at position s + i - 1. The head then returns per sequence (b, 3) float64 [sum of
    # -log p(target), positions scored, top-1 hits] over the step's positions instead of
    # last-position logits.
    targets: list[torch.Tensor] | None = None
    # scoring with per-token log-probabilities: that many alternatives per position (None:
    # the sums alone); the head then returns (b, 3 + t * (1 + 2k)) (``head.score``)
    score_k: int | None = None
    # L > 0: every prompt of the block begins with the same L tokens, computed once as the
    # block's prefix (one row); the GPU batches' prefill computes the last s - L positions
    shared: int = 0
    # reuse: the prefix's keys and values are those an earlier block computed and left (its
    # first L); keep: leave this block's (or the reused) keys and values for the next block
    reuse: bool = False
    keep: bool = False
    # embedding: the head gives each sequence's last hidden state after the final norm,
    # (b, embed_dim) float64, at the prefill (``head.embed``), instead of logits
    embed: bool = False
    # per GPU batch, each row's LoRA adapter served per request (0: the base model; None: every
    # row the base model; ``models/lora_rows.py``)
    adapters: list[list[int]] | None = None
    # per GPU batch, the row each row repeats (its first row with the same prompt and adapter;
    # None: no row of the batch repeats another): the prefill computes the first of each once
    # (``engine/twins.py``). None: no batch has a repeat
    twins: list[list[int] | None] | None = None

    @property
    def batch_sizes(self) -> list[int]:
        return [len(p) for p in self.prompt_lens]


@dataclass
class BlockPlan:
    """One block as every rank sees it: its index, its prompts (their indices in the call's
    input order, one per row) and their lengths, and the window it belongs to."""

    index: int
    members: list[int]
    lens: list[int]
    prompt_len: int  # s: the longest prompt of the block; the others are left-padded to it
    window: int = 0
    shared: int = 0  # L: the leading tokens every prompt of the block shares, computed once (0: none)
    reuse: bool = False  # its prefix's keys and values are the previous block's (``prefix_reuse``)
    keep: bool = False  # the next block reuses its prefix's keys and values
    adapters: list[int] | None = None  # per prompt, its LoRA adapter (``Workload.adapters``; None: none has one)
    # per prompt, the first request of the call with the same prompt (``Workload.twins``; None:
    # no prompt of the block repeats another)
    twins: list[int] | None = None

    def meta(self, gbs: int, gen_len: int) -> BlockMeta:
        cut = range(0, len(self.lens), gbs)
        adapters = [self.adapters[a:a + gbs] for a in cut] if self.adapters is not None and any(self.adapters) else None
        twins = None
        if self.twins is not None:
            twins = [batch_twins(self.twins[a:a + gbs]) for a in cut]
            twins = twins if any(t is not None for t in twins) else None
        return BlockMeta([self.lens[a:a + gbs] for a in cut], self.prompt_len, gen_len,
                         shared=self.shared, reuse=self.reuse, keep=self.keep, adapters=adapters, twins=twins)

    def repeated(self, gbs: int) -> int:
        """Prompt positions the block's prefill does not compute because a row repeats an
        earlier row of its GPU batch (past a shared prefix, which is computed once anyway)."""
        if self.twins is None:
            return 0
        rows = sum(len(t) - len(set(t)) for t in (self.twins[a:a + gbs] for a in range(0, len(self.twins), gbs)))
        return rows * (self.prompt_len - self.shared)

    @property
    def saved(self) -> int:
        """Prompt positions the block does not compute thanks to its shared prefix."""
        return saved_positions(len(self.members), self.shared, self.reuse)

    @property
    def computes_prefix(self) -> bool:
        """Whether the block runs its shared prefix's row (shared, and not reused)."""
        return self.shared > 0 and not self.reuse

    @property
    def padding(self) -> int:
        """Prompt positions of the block that are padding."""
        return self.prompt_len * len(self.lens) - sum(self.lens)


def plan_blocks(lens: list[int], block_size: int, limits: list[int] | None = None,
                window_blocks: int = 0, groups: Sequence[int] | None = None,
                twins: Sequence[int] | None = None) -> list[BlockPlan]:
    """Cut prompts (given by their lengths) into blocks of ``block_size``: in input order with
    ``window_blocks`` 0, else grouped by length within windows of that many blocks (module
    doc; ``limits``: each request's own most new tokens, the second sort key; ``groups``: each
    request's prefix group in its window, -1 for none: the groups in order, then the rest,
    each ordered so; ``twins``: each request's ``repeated_prompts``, which puts repeats of a
    prompt next to each other among its length)."""
    n = len(lens)
    span = n if window_blocks <= 0 else window_blocks * block_size
    out: list[BlockPlan] = []
    for w, a in enumerate(range(0, n, span if window_blocks > 0 else max(n, 1))):
        idx = list(range(a, min(n, a + span)))
        if window_blocks > 0 and groups is not None:
            ids = sorted({groups[m] for m in idx}, key=lambda g: (g < 0, g))
            idx = [m for g in ids for m in _window_order([m for m in idx if groups[m] == g], lens, limits, block_size,
                                                              twins)]
        elif window_blocks > 0:
            idx = _window_order(idx, lens, limits, block_size, twins)
        for b in range(0, len(idx), block_size):
            members = idx[b:b + block_size]
            ls = [lens[m] for m in members]
            out.append(BlockPlan(len(out), members, ls, max(ls), w if window_blocks > 0 else len(out)))
    return out


def shared_prefixes(prompts: Sequence[Sequence[int]], blocks: list[BlockPlan], minimum: int = MIN_SHARED,
                    longest: int | None = None) -> tuple[int, ...]:
    """Per prompt, how many leading tokens every prompt of its block shares with it (0 where
    fewer than ``minimum``, or its block has one prompt): at most one less than the block's
    shortest prompt, so each row keeps a position of its own to compute (its last, whose
    logits are the first token's). ``longest``: none in a block with a longer prompt (LongRoPE
    turns a row past its original context with other frequencies, its prefix included, which
    the prefix's own row, shorter, would not)."""
    out = [0] * len(prompts)
    for blk in blocks:
        if len(blk.members) < 2 or (longest is not None and blk.prompt_len > longest):
            continue
        n = common_opening([prompts[m] for m in blk.members], minimum)
        for m in blk.members:
            out[m] = n
    return tuple(out)


def unscored_prefixes(blocks: list[BlockPlan], shared: Sequence[int], lens: Sequence[int],
                      targets: Sequence[Sequence[int]], minimum: int = MIN_SHARED) -> tuple[int, ...]:
    """Scoring: ``shared`` cut so that no block's prefix holds a scored position (its logits
    are never computed: the prefix's row passes no head) nor a row's last prefill position;
    0 where under ``minimum``. Row r, left-padded by p_r, scores from position j_r (its first
    target), which sits at slot j_r + p_r of the block: the prefix may cover slots [0, L) up to
    the first such slot."""
    out = list(shared)
    for blk in blocks:
        n = shared[blk.members[0]]
        if not n:
            continue
        for m in blk.members:
            first = next((j for j, t in enumerate(targets[m]) if t >= 0), len(targets[m]))
            n = min(n, lens[m] - 1, first + blk.prompt_len - lens[m])
        for m in blk.members:
            out[m] = n if n >= minimum else 0
    return tuple(out)


def prefix_reuse(prompts: Sequence[Sequence[int]], blocks: list[BlockPlan], shared: Sequence[int]) -> tuple[bool, ...]:
    """Per prompt, whether its block takes its prefix's keys and values from an earlier block
    instead of computing them: in block order, a block reuses where its prefix (L tokens) is
    the first L of the last one a block computed (the block before it, or the one that block
    took its own from); a block sharing nothing ends the chain."""
    out = [False] * len(prompts)
    source: Sequence[int] | None = None
    for blk in blocks:
        n = shared[blk.members[0]]
        head = prompts[blk.members[0]][:n]
        if n and source is not None and n <= len(source) and list(source[:n]) == list(head):
            for m in blk.members:
                out[m] = True
        else:
            source = head if n else None
    return tuple(out)


def common_opening(prompts: Sequence[Sequence[int]], minimum: int = MIN_SHARED) -> int:
    """The leading tokens all ``prompts`` share, at most one less than the shortest; 0 where
    fewer than ``minimum``."""
    ref = np.asarray(prompts[0], dtype=np.int64)
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        if n < minimum:
            break
        diff = np.flatnonzero(np.asarray(p[:n], dtype=np.int64) != ref[:n])
        n = int(diff[0]) if diff.size else n
    return n if n >= minimum else 0


def repeated_prompts(ids: Sequence[Sequence[int]], adapters: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """Per request, the first request with the same prompt ids (and LoRA adapter): itself
    where none before has them. None where no prompt repeats another. The prompts are keyed by
    their hash (a job's prompts are not copied), equal ids confirmed on a match."""
    firsts: dict[tuple[int, int, int], list[int]] = {}  # (adapter, length, hash) -> distinct prompts' first
    out = []
    for n, p in enumerate(ids):
        seen = firsts.setdefault((adapters[n] if adapters is not None else 0, len(p), hash(tuple(p))), [])
        m = next((m for m in seen if list(ids[m]) == list(p)), None)
        if m is None:
            seen.append(n)
        out.append(n if m is None else m)
    return tuple(out) if any(m != n for n, m in enumerate(out)) else None


def repeat_counts(twins: Sequence[int]) -> tuple[int, ...]:
    """From ``repeated_prompts``: how many requests ask each prompt, in the order of each
    prompt's first request (``PrefixShape.repeats``)."""
    counts: dict[int, int] = {}
    for t in twins:
        counts[t] = counts.get(t, 0) + 1
    return tuple(counts.values())


def batch_twins(twins: Sequence[int]) -> list[int] | None:
    """One GPU batch's rows from their requests' ``repeated_prompts``: per row, the batch's
    first row of the same prompt (None: every row a prompt of its own)."""
    at: dict[int, int] = {}
    out = [at.setdefault(t, r) for r, t in enumerate(twins)]
    return out if len(at) < len(out) else None


def saved_positions(rows: int, shared: int, reuse: bool) -> int:
    """Prompt positions a block of ``rows`` does not compute with a prefix of ``shared`` tokens:
    every row's but the one prefix row, or every row's where it ``reuse``s an earlier block's."""
    return shared * (rows - (0 if reuse else 1)) if shared else 0


def prefill_positions(blocks: list[BlockPlan], shared: Sequence[int], reuse: Sequence[bool] | None = None) -> int:
    """The prompt positions the blocks' prefill computes: each row padded to its block's
    longest, less what the prefixes save (``saved_positions``)."""
    return sum(len(b.members) * b.prompt_len - saved_positions(len(b.members), shared[b.members[0]],
                                                               reuse is not None and reuse[b.members[0]])
               for b in blocks)


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading tokens ``a`` and ``b`` share, at most one less than the shorter."""
    n = min(len(a), len(b)) - 1
    if n <= 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def prefix_groupings(prompts: Sequence[Sequence[int]], block_size: int, window_blocks: int,
                     minimum: int = MIN_SHARED) -> list[tuple[int, ...]]:
    """Candidate prefix groups (module doc), one tuple per threshold t = minimum x 4^k up to
    the longest prompt: per request, its group (-1: none), a group being a run of at least
    ``block_size`` of its window's prompts, in token order, each sharing at least t leading
    tokens with the next. Groupings that leave every request in one group or in none are not
    candidates (they cut the blocks as length alone does)."""
    n = len(prompts)
    if window_blocks <= 0 or block_size < 2 or n < 2 * block_size:
        return []
    span = window_blocks * block_size
    windows = []
    for a in range(0, n, span):
        order = sorted(range(a, min(n, a + span)), key=lambda m: (list(prompts[m]), m))
        windows.append((order, [lcp(prompts[x], prompts[y]) for x, y in zip(order, order[1:])]))
    out: list[tuple[int, ...]] = []
    t, longest = minimum, max(len(p) for p in prompts)
    while t < longest:
        groups, gid = [-1] * n, 0
        for order, common in windows:
            start = 0
            for i in range(1, len(order) + 1):
                if i == len(order) or common[i - 1] < t:  # a run ends
                    if i - start >= block_size:
                        for m in order[start:i]:
                            groups[m] = gid
                        gid += 1
                    start = i
        ones = [g for g in groups if g >= 0]
        whole = len(windows) == gid and len(ones) == n  # each window one group: no change
        if ones and not whole and tuple(groups) not in out:
            out.append(tuple(groups))
        t *= 4
    return out


LIMIT_GROUP = 2  # blocks whose requests, adjacent by length, are ordered by limit


def _window_order(idx: list[int], lens: list[int], limits: list[int] | None, block_size: int,
                  twins: Sequence[int] | None = None) -> list[int]:
    """The requests of one window in block order: by prompt length, longest first; then each
    run of ``LIMIT_GROUP`` blocks' worth of them by limit, largest first. Length order makes a
    block pad little; ordering a few neighbouring blocks by limit lets each block's requests
    finish together (a decode step costs about as much for one live row as for all of them
    when the weights stream from RAM or disk), at the cost of a little more padding: on
    uniform lengths 16-2048 and limits 16-256, blocks of 32 from 768 requests pad 7 % of the
    prompt positions instead of 4 % and run 24 % fewer decode steps. Among equals, a prompt's
    repeats (``twins``) follow it, so that they share GPU batches."""
    first = (lambda m: m) if twins is None else twins.__getitem__
    out = sorted(idx, key=lambda m: (-lens[m], first(m), m))
    if limits is None:
        return out
    span = LIMIT_GROUP * block_size
    return [m for g in range(0, len(out), span)
            for m in sorted(out[g:g + span], key=lambda m: (-limits[m], -lens[m], first(m), m))]


def left_pad(prompts: list[list[int]], length: int, pad_id: int) -> torch.Tensor:
    """(len(prompts), length) token ids, each prompt right-aligned after padding."""
    return torch.tensor([[pad_id] * (length - len(p)) + p for p in prompts], dtype=torch.long)


def score_rows(targets: list[list[int]], lens: list[int], prompt_len: int, width: int) -> torch.Tensor:
    """Scoring: (len(targets), width) targets laid out like the block's cache positions.

    ``targets[r]`` holds the id after each position of sequence r (-1: not scored); its first
    ``lens[r]`` positions are the left-padded prefix, the rest follow at ``prompt_len`` on."""
    rows = [[-1] * (prompt_len - n) + t[:width - prompt_len + n] for t, n in zip(targets, lens)]
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


def pad_token(spec_pad: int | None, eos: tuple[int, ...]) -> int:
    if spec_pad is not None:
        return spec_pad
    return eos[0] if eos else 0


def trim(seq: list[int], ends: Sequence[int]) -> list[int]:
    """Generated ids up to and including the first of ``ends`` (EOS, a stop id)."""
    for n, t in enumerate(seq):
        if t in ends:
            return seq[: n + 1]
    return seq


def finished_rows(seqs: list[list[int]], members: Sequence[int], ends: Sequence[Sequence[int]],
                  limits: Sequence[int] | None, stopped: dict[int, int]) -> list[list[int]]:
    """A finished block's rows of sampled ids (``seqs``, one per member) as the caller gets
    them: each cut after the first id that ends it (``trim``; ``ends``: per sequence of the
    call), at its request's limit of new tokens, and where its stop string completed
    (``stopped``: row -> tokens it keeps)."""
    outs = [trim(q, ends[m]) for q, m in zip(seqs, members)]
    if limits is not None:
        outs = [o[:limits[m]] for m, o in zip(members, outs)]
    for n, kept in stopped.items():
        outs[n] = outs[n][:kept]
    return outs
