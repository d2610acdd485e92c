"""DeepSeek-V3's latent attention caches one latent per token that attention reads as both its
keys and its values: the cache stores it once (``BlockCache(shared=True)``), on every tier, in
every layout, compressed or not. Greedy tokens equal transformers' in float32 wherever the
cache lives, equal a cache that stores the latent twice (compressed too), and the footprint
the planner and the budget check count is the half the engine allocates."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.engine.footprint import StageShape, stage_footprint
from flexgen_dist.engine.kvcache import BlockCache
from flexgen_dist.memory.tiers import MemoryTracker
from flexgen_dist.models.spec import ModelSpec
from test_moe import _model

GEN = 6


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _model("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))


POLICIES = [
    dict(percent=(100, 0, 100, 0, 100, 0)),                                    # all on the device
    dict(percent=(0, 100, 30, 30, 100, 0), cpu_attention=True),                # device, RAM and disk
    dict(percent=(0, 100, 0, 40, 100, 0), cpu_attention=False),                # off-device, to the device
    dict(percent=(0, 100, 0, 100, 100, 0), num_gpu_batches=3),                 # merged decode in RAM
]


def _run(tm: TinyModel, tmp_path: Path, tensors: int = 1, **policy) -> tuple[list[list[int]], int]:
    """Greedy tokens, and the disk bytes the run's cache took (measured = predicted)."""
    opts = dict(gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"), ignore_eos=True,
                progress=False)
    with LLM(str(tm.path), **{**opts, **policy}) as llm:
        assert llm.model.spec.cache_tensors == tensors
        tokens = [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)]
        disk = llm.metrics["peak_bytes"][0]["disk"]
        assert disk == llm.metrics["predicted"]["peak_bytes"][0]["disk"]
        return tokens, disk


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_tokens_match_transformers_wherever_the_latent_lives(deepseek: TinyModel, policy: dict,
                                                                    tmp_path: Path) -> None:
    assert _run(deepseek, tmp_path, **policy)[0] == reference_generate(deepseek, PROMPTS, GEN)


@pytest.mark.parametrize("compress", [False, True])
def test_one_copy_gives_the_tokens_of_two(deepseek: TinyModel, compress: bool, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The compressed cache is not transformers' arithmetic; against a cache holding the latent
    twice (keys and values quantized alike) it must give the same tokens, from half the disk."""
    policy = dict(percent=(0, 100, 30, 30, 100, 0), compress_cache=compress)
    one, disk_one = _run(deepseek, tmp_path / "one", **policy)
    monkeypatch.setattr(ModelSpec, "cache_tensors", property(lambda self: 2))
    two, disk_two = _run(deepseek, tmp_path / "two", tensors=2, **policy)
    assert two == one and 0 < disk_one == disk_two // 2


def _cache(shared: bool, compress: bool, tracker: MemoryTracker, disk=None,
           fractions=(0.0, 1.0, 0.0)) -> BlockCache:
    return BlockCache([0, 1], [2, 2], kv_heads=1, max_len=40, head_dim=40, fractions=fractions,
                      device=torch.device("cpu"), dtype=torch.float32, tracker=tracker, disk=disk,
                      cpu_attention=True, compress=compress, group_size=8, shared=shared)


@pytest.mark.parametrize("compress", [False, True])
def test_the_cache_holds_half_and_the_footprint_counts_it(compress: bool) -> None:
    spec = ModelSpec(name="mla", family="llama", num_layers=2, hidden_size=64, ffn_size=96, num_heads=4,
                     num_kv_heads=1, head_dim_override=40, vocab_size=256, max_positions=128, kv_lora_rank=32,
                     qk_nope_dim=16, qk_rope_dim=8, v_head_dim=16)
    assert spec.cache_tensors == 1 and spec.kv_numel_per_token() == spec.kv_dim == 40
    z = StageShape(num_layers=2, first_layer=0, has_embed=True, has_head=True, prompt_len=30, gen_len=10,
                   dtype_bytes=4, gpu_batch_size=2, num_gpu_batches=2, compress_cache=compress, comp_group_size=8)
    rows, per_row, copies = stage_footprint(spec, z).cache
    one, two = MemoryTracker(), MemoryTracker()
    for shared, tracker in ((True, one), (False, two)):
        _cache(shared, compress, tracker).free()
    assert rows * per_row * copies == one.peak_bytes()["cpu"] == two.peak_bytes()["cpu"] // 2


def test_a_disk_chunk_writes_and_reads_the_latent_once(tmp_path: Path) -> None:
    """On disk: one file per chunk, staged once, and what a decode step reads back is what the
    prefill and the step wrote."""
    from flexgen_dist.memory.disk import DiskStore

    store = DiskStore(str(tmp_path))
    tracker = MemoryTracker()
    cache = _cache(True, False, tracker, store, fractions=(0.0, 0.0, 1.0))
    try:
        ch = cache.chunks[(0, 1)][0]
        assert ch.v is ch.k and len(list(tmp_path.rglob("*.bin"))) == 4  # 2 layers x 2 GPU batches
        kv = torch.randn(2, 5, 1, 40)
        cache.write_prefill(0, 1, kv, kv)
        assert len(ch.pending) == 1 and ch.pending[0][1] is ch.pending[0][2]
        for f in cache.store(0, 1):
            f.result()
        cache.load(0, 1, 5)
        assert ch.staged[0] is ch.staged[1]
        new = torch.randn(2, 1, 40)
        q = torch.randn(2, 4, 1, 40)
        out = cache.attend(0, 1, q, new, new, torch.ones(2, 1, 1, 6, dtype=torch.bool), 5)
        keys = torch.cat([kv[:, :, 0], new], dim=1)  # (rows, 6, d)
        ref = torch.softmax(q @ keys[:, None].transpose(-1, -2) / 40 ** 0.5, dim=-1) @ keys[:, None]
        torch.testing.assert_close(out, ref)
    finally:
        cache.free()
        store.close()
