"""The block schedule as data: zig-zag order, one weight load per layer per token, overlap shape."""
from __future__ import annotations

import pytest

from flexgen_dist.engine.schedule import block_schedule, token_schedule


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("num_gb", [1, 2, 4])
def test_zig_zag_order(overlap: bool, num_gb: int) -> None:
    slots, gen = 5, 3
    steps = list(block_schedule(gen, slots, num_gb, overlap))
    computes = [(s.i, s.j, s.k) for s in steps if s.kind == "compute"]
    # every (layer, batch) of a token before the next token; within a token, layer-major
    assert computes == [(i, j, k) for i in range(gen) for j in range(slots) for k in range(num_gb)]
    loads = [(s.i, s.j) for s in steps if s.kind == "load_weight"]
    assert loads == [(i, j) for i in range(gen) for j in range(slots)]  # once per layer per token
    for i in range(gen):
        for j in range(slots):
            li = steps.index(next(s for s in steps if s.kind == "load_weight" and (s.i, s.j) == (i, j)))
            ci = steps.index(next(s for s in steps if s.kind == "compute" and (s.i, s.j, s.k) == (i, j, 0)))
            assert li < ci  # a layer is loaded before its first use
            if overlap and j > 0:
                prev = steps.index(next(s for s in steps if s.kind == "compute" and (s.i, s.j, s.k) == (i, j - 1, 0)))
                assert li < prev  # ... and prefetched while the previous layer computes


def test_overlap_interleaves_io_with_compute() -> None:
    steps = list(token_schedule(0, 3, 3, overlap=True))
    kinds = [s.kind for s in steps]
    c = [n for n, k in enumerate(kinds) if k == "compute"]
    for a, b in zip(c, c[1:]):
        between = kinds[a + 1:b]
        assert "sync" in between  # one compute per sync window
    # the next batch's cache and activations are requested before the current compute
    first = steps.index(next(s for s in steps if s.kind == "compute" and (s.j, s.k) == (1, 1)))
    window = steps[first - 6:first]
    assert any(s.kind == "load_cache" and (s.j, s.k) == (1, 2) for s in window)
    assert any(s.kind == "store_cache" and (s.j, s.k) == (1, 0) for s in steps[first:first + 3])


def test_every_store_follows_its_compute() -> None:
    for num_gb in (1, 2, 3):
        steps = list(token_schedule(1, 4, num_gb, overlap=True))
        seen = set()
        for s in steps:
            if s.kind == "compute":
                seen.add((s.j, s.k))
            if s.kind in ("store_cache", "store_act"):
                assert (s.j, s.k) in seen, (num_gb, s)
