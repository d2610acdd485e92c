"""The block schedule as data: zig-zag order, one weight load per layer per token, overlap shape."""
from __future__ import annotations

import pytest

from flexgen_dist.distributed.items import ItemStream
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


# ------------------------------------------------------------ the pipeline's item stream

def _names(stream) -> str:
    return " ".join(map(str, stream.order()))


def test_item_stream_order_one_item_per_block() -> None:
    """G slots take the blocks round-robin; a slot whose block ends starts the next block's
    prefill while the other slot still decodes (no wave boundary)."""
    s = ItemStream([2, 2, 2], 2, 3, pieces="block")
    assert _names(s) == ("P(b0,k0..1) P(b1,k0..1) D(b0,i1) D(b1,i1) D(b0,i2) D(b1,i2) "
                         "P(b2,k0..1) D(b2,i1) D(b2,i2)")


def test_item_stream_prefill_pieces_and_collects() -> None:
    """One prefill item per GPU batch; stage 0 of several collects a block's last tokens after
    its slot's next prefill (or at once when the slot has no next block)."""
    s = ItemStream([2, 2, 2, 2], 2, 3, pieces="batch", collect=True)
    assert _names(s) == ("P(b0,k0) P(b0,k1) P(b1,k0) P(b1,k1) D(b0,i1) D(b1,i1) D(b0,i2) D(b1,i2) "
                         "P(b2,k0) P(b2,k1) C(b0) P(b3,k0) P(b3,k1) C(b1) D(b2,i1) D(b3,i1) "
                         "D(b2,i2) D(b3,i2) C(b2) C(b3)")
    # a collect only adds items: every other rank sees the same order without them
    plain = [str(it) for it in ItemStream([2, 2, 2, 2], 2, 3, pieces="batch").order()]
    assert [x for x in _names(ItemStream([2, 2, 2, 2], 2, 3, pieces="batch", collect=True)).split()
            if not x.startswith("C")] == plain


def test_item_stream_peek_is_the_next_item_and_early_end_drops_only_that_block() -> None:
    s = ItemStream([1, 1, 1], 2, 4, pieces="batch", collect=True)
    seen = []
    while (it := s.next()) is not None:
        ahead = s.peek()
        if it.block == 0 and it.i == 1:
            s.end_block(it.slot, it.block)  # every sequence of block 0 ended at step 1
        nxt_ok = ahead
        seen.append(str(it))
        if nxt_ok is not None:
            # peeked items never depend on what the current item reveals
            assert nxt_ok.slot != it.slot or it.kind == "prefill"
    assert "D(b0,i2)" not in seen and "C(b0)" not in seen  # dropped; nothing left to collect
    assert seen.index("P(b2,k0)") < seen.index("D(b1,i2)")  # block 2 entered as block 0 ended
    for b in (1, 2):
        assert f"D(b{b},i3)" in seen and f"C(b{b})" in seen


@pytest.mark.parametrize("ride", [False, True])
def test_item_stream_peek_matches_next_whenever_given(ride: bool) -> None:
    for pieces in ("block", "batch"):
        for collect in (False, True):
            s = ItemStream([3, 2, 3, 1, 2], 3, 4, pieces=pieces, collect=collect, ride=ride)
            it, peeked, total = s.next(), 0, 0
            while it is not None:
                ahead = s.peek()
                nxt = s.next()
                if ahead is not None:
                    assert ahead == nxt
                    peeked += 1
                total += 1
                it = nxt
            assert total == len(ItemStream([3, 2, 3, 1, 2], 3, 4, pieces=pieces, collect=collect, ride=ride).order())
            assert peeked >= total - 3  # only a slot's own follow-up is left unknown (here: the tail)


@pytest.mark.parametrize("gen_len", [1, 2, 3])
@pytest.mark.parametrize("pieces", ["block", "batch"])
def test_item_stream_collects_every_block_once(gen_len: int, pieces: str) -> None:
    items = [str(it) for it in ItemStream([2, 1, 2, 2, 1], 2, gen_len, pieces=pieces, collect=True).order()]
    assert sorted(x for x in items if x.startswith("C")) == [f"C(b{b})" for b in range(5)]
    for b in range(5):  # after the block's last step
        last = f"D(b{b},i{gen_len - 1})" if gen_len > 1 else [x for x in items if x.startswith(f"P(b{b},")][-1]
        assert items.index(last) < items.index(f"C(b{b})")


def test_item_stream_riders_spread_the_next_prefill_over_the_decode_steps() -> None:
    """Overlapped: a slot's next block is prefilled in pieces riding on its current block's
    decode steps (floor(i * nb / (n - 1)) batches done after step i, so the last piece rides
    on the last step), and then starts at its first decode step; every GPU batch of every
    block is prefilled exactly once, before that block's first decode step."""
    s = ItemStream([2, 4, 1], 1, 3, ride=True, collect=True)
    assert _names(s) == ("P(b0,k0..1) D(b0,i1)+P(b1,k0..1) D(b0,i2)+P(b1,k2..3) D(b1,i1) C(b0) "
                         "D(b1,i2)+P(b2,k0) D(b2,i1) C(b1) D(b2,i2) C(b2)")
    for nb, G, gen in (([3, 2, 3, 1, 2], 2, 4), ([5, 5, 5], 1, 3), ([1, 1, 1, 1], 3, 2)):
        items = ItemStream(nb, G, gen, ride=True).order()
        done: dict[int, list[int]] = {}
        for it in items:
            for p in it.parts():
                if p.kind == "prefill":
                    done.setdefault(p.block, []).extend(range(*p.batches))
                elif p.i == 1:
                    assert sorted(done[p.block]) == list(range(nb[p.block])), (p, done)
                if p is not it:  # a rider: the next block of the same slot
                    assert p.slot == it.slot and p.block == it.block + G
        assert {b: sorted(k) for b, k in done.items()} == {b: list(range(n)) for b, n in enumerate(nb)}


def test_item_stream_early_end_runs_the_unridden_pieces_on_their_own() -> None:
    """A block that ends early drops its remaining decode steps; the next block's pieces that
    were to ride on them run as one prefill item, then that block decodes from step 1."""
    s = ItemStream([1, 4, 4], 1, 5, ride=True)
    seen = []
    while (it := s.next()) is not None:
        seen.append(str(it))
        if it.block == 1 and it.i == 3:
            s.end_block(it.slot, it.block)  # block 1 ended at step 3: two of block 2's pieces rode
    assert "D(b1,i3)+P(b2,k2)" in seen and "D(b1,i4)+P(b2,k3)" not in seen
    rest = seen[seen.index("D(b1,i3)+P(b2,k2)") + 1:]
    assert rest == ["P(b2,k3)", "D(b2,i1)", "D(b2,i2)", "D(b2,i3)", "D(b2,i4)"]

    s = ItemStream([1, 1, 1], 1, 3, ride=True)
    seen = []
    while (it := s.next()) is not None:
        seen.append(str(it))
        if it.ride is not None and it.ride.block == 1:
            s.end_block(it.slot, 1)  # block 1's sequences all ended at their first token
    assert seen == ["P(b0,k0)", "D(b0,i1)", "D(b0,i2)+P(b1,k0)", "P(b2,k0)", "D(b2,i1)", "D(b2,i2)"]


def test_default_schedule_without_a_profile() -> None:
    """Overlapped only on a GPU whose weights stream from off the device, with a next block
    for some group to ride on; a CPU device keeps the sequential order (its reads take the
    same cores' time: the cost model decides there, with a profile)."""
    import torch

    from flexgen_dist.run_plan import default_schedule
    from flexgen_dist.engine.policy import Policy

    streamed, resident = [Policy(2, 2, 20, 80, 100, 0, 100, 0)], [Policy(2, 2, 100, 0, 100, 0, 100, 0)]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_schedule(streamed, cuda, num_blocks=3, num_groups=1, gen_len=8)[0] == "overlapped"
    assert default_schedule(resident, cuda, num_blocks=3, num_groups=1, gen_len=8)[0] == "sequential"
    assert default_schedule(streamed, cuda, num_blocks=2, num_groups=2, gen_len=8)[0] == "sequential"
    assert default_schedule(streamed, cuda, num_blocks=3, num_groups=1, gen_len=1)[0] == "sequential"
    assert default_schedule([Policy(2, 2, 0, 20, 100, 0, 100, 0)], cpu, num_blocks=3, num_groups=1,
                            gen_len=8)[0] == "sequential"


def test_weights_go_through_a_load_stream_on_a_gpu_unless_told_not_to(monkeypatch) -> None:
    """On a GPU the weights' copies are queued on a load stream by default (an H200 measured it
    ahead of the compute stream); ``FLEXGEN_CUDA_LOAD_STREAM=0`` keeps them on the compute
    stream; a CPU device never has one; another value is one line naming the two."""
    import torch

    from flexgen_dist.engine.streams import LOAD_STREAM_ENV, load_stream, uses_load_stream

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(LOAD_STREAM_ENV, raising=False)
    assert uses_load_stream(cuda) and not uses_load_stream(cpu) and load_stream(cpu) is None
    monkeypatch.setenv(LOAD_STREAM_ENV, "0")
    assert not uses_load_stream(cuda) and load_stream(cuda) is None
    monkeypatch.setenv(LOAD_STREAM_ENV, "yes")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        uses_load_stream(cuda)
