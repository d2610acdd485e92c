"""The zig-zag block schedule, as data.

Indices: i = token (0 is the prefill), j = layer slot of this stage (the embedding and the
head count as slots when the stage owns them), k = GPU batch of the block.

One block is num_gpu_batches GPU batches that share every loaded layer: for each token the
schedule walks the slots in order and, within a slot, all GPU batches, so each layer's weights
are loaded once per token for the whole block (not once per batch). With overlap, the step
that computes (i, j, k) is surrounded by the prefetch of the next slot's weights, the load of
the next batch's cache and activations, and the store of the previous batch's, all of which
run concurrently with the compute and are joined by ``sync``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator

@dataclass(frozen=True)
class Step:
    kind: str
    i: int
    j: int
    k: int


def _next(j: int, k: int, num_slots: int, num_gb: int) -> tuple[int, int] | None:
    k += 1
    if k == num_gb:
        j, k = j + 1, 0
    return None if j >= num_slots else (j, k)


def _prev(j: int, k: int, num_gb: int) -> tuple[int, int] | None:
    k -= 1
    if k < 0:
        j, k = j - 1, num_gb - 1
    return None if j < 0 else (j, k)


def token_schedule(i: int, num_slots: int, num_gb: int, overlap: bool = True) -> Iterator[Step]:
    """Steps for one token of one block (all slots, all GPU batches)."""
    if not overlap:
        for j in range(num_slots):
            for k in range(num_gb):
                if k == 0:
                    yield Step("load_weight", i, j, 0)
                yield Step("load_cache", i, j, k)
                yield Step("load_act", i, j, k)
                yield Step("compute", i, j, k)
                yield Step("store_cache", i, j, k)
                yield Step("store_act", i, j, k)
                yield Step("sync", i, j, k)
        return
    if num_gb == 1:
        # One batch: its next activation is the output of the compute in flight, so only
        # weights and cache are prefetched; the activation is loaded just before use.
        yield Step("load_weight", i, 0, 0)
        yield Step("load_cache", i, 0, 0)
        yield Step("sync", i, 0, -1)
        for j in range(num_slots):
            if j + 1 < num_slots:
                yield Step("load_weight", i, j + 1, 0)
                yield Step("load_cache", i, j + 1, 0)
            yield Step("load_act", i, j, 0)
            yield Step("compute", i, j, 0)
            if j > 0:
                yield Step("store_cache", i, j - 1, 0)
            yield Step("store_act", i, j, 0)
            yield Step("sync", i, j, 0)
        yield Step("store_cache", i, num_slots - 1, 0)
        yield Step("sync", i, num_slots, 0)
        return
    yield Step("load_weight", i, 0, 0)
    yield Step("load_cache", i, 0, 0)
    yield Step("load_act", i, 0, 0)
    yield Step("sync", i, 0, -1)
    for j in range(num_slots):
        for k in range(num_gb):
            if k == 0 and j + 1 < num_slots:
                yield Step("load_weight", i, j + 1, 0)
            prev = _prev(j, k, num_gb)
            if prev is not None:
                yield Step("store_act", i, *prev)
            nxt = _next(j, k, num_slots, num_gb)
            if nxt is not None:
                yield Step("load_cache", i, *nxt)
                yield Step("load_act", i, *nxt)
            yield Step("compute", i, j, k)
            if prev is not None:
                yield Step("store_cache", i, *prev)
            yield Step("sync", i, j, k)
    yield Step("store_act", i, num_slots - 1, num_gb - 1)
    yield Step("store_cache", i, num_slots - 1, num_gb - 1)
    yield Step("sync", i, num_slots, 0)


@functools.lru_cache(maxsize=64)
def sweep_steps(num_slots: int, num_gb: int, overlap: bool = True) -> tuple[Step, ...]:
    """``token_schedule`` of one sweep (token index 0; the engine passes the token itself),
    built once per shape: a decode step walks it for every token, and rebuilding it cost
    several microseconds a step of host time."""
    return tuple(token_schedule(0, num_slots, num_gb, overlap))


def block_schedule(gen_len: int, num_slots: int, num_gb: int, overlap: bool = True) -> Iterator[Step]:
    """All steps of one block, token by token."""
    for i in range(gen_len):
        yield from token_schedule(i, num_slots, num_gb, overlap)
