"""The host-memory pool of block caches: blocks reuse freed (and reserved) cache memory."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, reference_generate
from flexgen_dist.distributed.pipeline import generate
from flexgen_dist.engine.kvcache import HostPool
from flexgen_dist.engine.policy import Policy
from flexgen_dist.engine.sampling import SamplingConfig
from flexgen_dist.engine.stage import StageEngine
from flexgen_dist.memory.disk import DiskStore
from flexgen_dist.models.loader import load_model

GEN = 5


def test_pool_hands_back_the_smallest_buffer_that_fits() -> None:
    pool = HostPool()
    small, _ = pool.take((2, 3), torch.float32)
    big, _ = pool.take((4, 5), torch.float32)
    pool.give(small)
    pool.give(big)
    base, view = pool.take((2, 2), torch.float32)  # both fit: the smaller one
    assert base.data_ptr() == small.data_ptr() and view.shape == (2, 2)
    assert view.data_ptr() == small.data_ptr()
    base2, view2 = pool.take((3, 5), torch.float32)  # only the big one fits
    assert base2.data_ptr() == big.data_ptr() and view2.shape == (3, 5)
    assert pool.made == 2
    pool.give(base)
    pool.give(base2)
    # a request larger than any idle buffer makes a new one and drops the ones too small for it
    base3, _ = pool.take((3, 4), torch.float32)
    assert pool.made == 2 and base3.data_ptr() == big.data_ptr()
    pool.give(base3)
    pool.take((5, 5), torch.float32)
    assert pool.made == 3 and pool.idle_bytes() == 0


def test_pool_keeps_dtypes_apart_and_zeroes_on_request() -> None:
    pool = HostPool()
    b, v = pool.take((8,), torch.float32)
    v.fill_(3.0)
    pool.give(b)
    b8, _ = pool.take((8,), torch.uint8)
    assert b8.dtype == torch.uint8 and pool.made == 2
    again, z = pool.take((4,), torch.float32, zero=True)
    assert again.data_ptr() == b.data_ptr() and torch.equal(z, torch.zeros(4))
    assert torch.equal(again[4:], torch.full((4,), 3.0))  # only the view is zeroed


@pytest.mark.parametrize("compress", [False, True])
def test_blocks_reuse_the_reserved_cache_memory(compress: bool, tiny_models, tmp_path: Path) -> None:
    """A call reserves the cache memory of the blocks it holds at once before its clock
    starts; every block then writes into it (no fresh buffer during the loop, none in a
    second call), and tokens still match transformers, the reused memory's stale contents
    never read (dense) or zeroed (compressed)."""
    tm = tiny_models["opt-pre"]
    lm = load_model(str(tm.path), load_tokenizer=False)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]  # 4 blocks of 2 x 2 prompts, G = 1
    with DiskStore(tmp_path / "off") as disk:
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(2, 2, 100, 0, 50, 0, 100, 0, compress_cache=compress),
                          device=torch.device("cpu"), dtype=torch.float32, disk=disk)
        made = []
        reserve = eng.reserve_caches
        eng.reserve_caches = lambda meta, n: (reserve(meta, n), made.append(eng.cache_pool.made))  # type: ignore[method-assign]
        outs, _ = generate(eng, prompts, GEN, SamplingConfig(ignore_eos=True))
        after_first = eng.cache_pool.made
        outs2, _ = generate(eng, prompts, GEN, SamplingConfig(ignore_eos=True))
        assert eng.times.cache_reserve_s > 0
        eng.close()
    ref = reference_generate(tm, prompts, GEN)
    assert outs == ref and outs2 == ref
    per_buffer = 3 if compress else 1  # a QTensor is codes, mins and scales
    # half of each chunk's rows in RAM, half on disk (not pooled): one K and one V in RAM
    assert made[0] == lm.spec.num_layers * 2 * 2 * per_buffer  # reserved: layers x GPU batches x (K, V)
    assert after_first == made[0] == made[1] == eng.cache_pool.made
