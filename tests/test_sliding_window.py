"""Sliding-window attention (Mistral, Phi-3, Qwen2's lower layers, Gemma's local layers): a
sliding layer attends to the last ``sliding_window`` positions only, in prefill and decode,
and keeps only those in its cache (a ring), on every tier, so its memory stops growing.
Greedy tokens equal transformers' in float32 for sequences far longer than the window."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.engine.cache_layout import ring_pieces
from flexgen_dist.engine.kvcache import BlockCache
from flexgen_dist.memory.tiers import MemoryTracker

WINDOW = 8
LONG = [p * 4 for p in PROMPTS]  # 8 to 36 tokens: most prompts exceed the window on their own
GEN = 10


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModel, dict]:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(21)
    path = tmp_path_factory.mktemp("mistral")
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = MistralForCausalLM(cfg).eval()
    m.save_pretrained(path)
    tm = TinyModel("mistral", path, m, 0)
    ref = reference_generate(tm, LONG, GEN)
    return tm, {"ref": ref}


def test_the_window_changes_the_reference(mistral: tuple[TinyModel, dict]) -> None:
    """The test below would prove nothing if the window did not matter for these lengths."""
    tm, ref = mistral
    full = type(tm.model)(type(tm.model.config)(**{**tm.model.config.to_dict(), "sliding_window": None}))
    full.load_state_dict(tm.model.state_dict())
    assert reference_generate(TinyModel("full", tm.path, full.eval(), 0), LONG, GEN) != ref["ref"]


@pytest.mark.parametrize("policy", [
    dict(percent=(100, 0, 100, 0, 100, 0)),                                  # all on the device
    dict(percent=(0, 50, 0, 50, 100, 0), cpu_attention=True),               # cache half on disk
    dict(percent=(0, 50, 0, 0, 100, 0), cpu_attention=False),               # cache all on disk
    dict(percent=(0, 100, 0, 100, 100, 0), num_gpu_batches=3),              # merged decode
])
def test_greedy_tokens_match_transformers_beyond_the_window(mistral: tuple[TinyModel, dict], policy: dict,
                                                            tmp_path: Path) -> None:
    tm, ref = mistral
    opts = dict(gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"),
                ignore_eos=True, progress=False)
    opts.update(policy)
    with LLM(str(tm.path), **opts) as llm:
        assert llm.model.spec.window(0) == WINDOW
        outs = llm.generate(LONG, gen_len=GEN)
    assert [c.token_ids for c in outs] == ref["ref"]


def test_compressed_cache_rings_too(mistral: tuple[TinyModel, dict], tmp_path: Path) -> None:
    """A 4-bit ring on disk and in RAM gives the same tokens as a 4-bit ring all in RAM (the
    quantization, not the placement, is what differs from the reference)."""
    tm, _ = mistral
    outs = []
    for pct in ((0, 100, 0, 100, 100, 0), (0, 100, 0, 50, 100, 0)):
        with LLM(str(tm.path), percent=pct, compress_cache=True, gpu_batch_size=2, num_gpu_batches=2,
                 offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
            outs.append([c.token_ids for c in llm.generate(LONG, gen_len=GEN)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("s,cap,pieces", [
    (5, 8, [(0, 0, 5)]), (8, 8, [(0, 0, 8)]), (11, 8, [(3, 3, 5), (8, 0, 3)]), (16, 8, [(8, 0, 8)]),
])
def test_a_prompt_lands_at_its_ring_slots(s: int, cap: int, pieces: list) -> None:
    assert ring_pieces(s, cap) == pieces
    slots = {}
    for p0, slot0, n in pieces:
        slots.update({slot0 + m: p0 + m for m in range(n)})
    assert slots == {p % cap: p for p in range(max(0, s - cap), s)}  # the last cap positions, each at p % cap


def test_sliding_layers_hold_only_the_window() -> None:
    tracker = MemoryTracker()
    cache = BlockCache([0, 1], [2], kv_heads=2, max_len=100, head_dim=16, fractions=(0.0, 1.0, 0.0),
                       device=torch.device("cpu"), dtype=torch.float32, tracker=tracker, disk=None,
                       cpu_attention=True, windows={0: WINDOW, 1: 0})
    assert [ch.cap for ch in cache.chunks[(0, 0)]] == [WINDOW]
    assert [ch.cap for ch in cache.chunks[(1, 0)]] == [100]
    per_pos = 2 * 2 * 2 * 16 * 4  # K and V, 2 sequences x 2 kv heads, 16 dims, float32
    assert tracker.peak_bytes()["cpu"] == per_pos * (WINDOW + 100)
    cache.free()


def test_qwen2_slides_only_on_the_layers_its_config_names(tmp_path: Path) -> None:
    """``use_sliding_window`` with ``max_window_layers``: the first layers attend to everything,
    the later ones to the window."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(23)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = Qwen2ForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path / "m")
    tm = TinyModel("qwen2", tmp_path / "m", m, 0)
    ref = reference_generate(tm, LONG, GEN)
    with LLM(str(tm.path), percent=(0, 50, 0, 50, 100, 0), gpu_batch_size=2, num_gpu_batches=2,
             offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [llm.model.spec.window(j) for j in range(4)] == [0, 0, WINDOW, WINDOW]
        assert [c.token_ids for c in llm.generate(LONG, gen_len=GEN)] == ref


def test_an_unknown_layer_type_is_refused_in_one_line(tmp_path: Path) -> None:
    import json

    from flexgen_dist.errors import ModelLoadError
    from flexgen_dist.models.loader import load_model

    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                      sliding_window=WINDOW, max_window_layers=1)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["layer_types"] = ["full_attention", "chunked_attention"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="chunked_attention not supported") as info:
        load_model(str(tmp_path), load_tokenizer=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("types", [(), ("full_attention", "sliding_attention") * 2])
def test_the_footprint_counts_the_cache_the_engine_allocates(types: tuple) -> None:
    """The budget check's cache term is what BlockCache allocates, ring by ring, and the
    windows bound it: a long run needs less than the same model without them."""
    from dataclasses import replace

    from flexgen_dist.engine.footprint import StageShape, stage_footprint
    from flexgen_dist.models.spec import ModelSpec

    spec = ModelSpec(name="sw", family="llama", num_layers=4, hidden_size=64, ffn_size=128, num_heads=4,
                     num_kv_heads=2, vocab_size=300, max_positions=4096, sliding_window=WINDOW,
                     layer_types=types)
    z = StageShape(num_layers=3, first_layer=1, has_embed=False, has_head=False, prompt_len=100,
                   gen_len=20, dtype_bytes=4, gpu_batch_size=2, num_gpu_batches=3)
    rows, per_row, copies = stage_footprint(spec, z).cache
    tracker = MemoryTracker()
    cache = BlockCache([1, 2, 3], [2] * 3, kv_heads=2, max_len=120, head_dim=16, fractions=(0.0, 1.0, 0.0),
                       device=torch.device("cpu"), dtype=torch.float32, tracker=tracker, disk=None,
                       cpu_attention=True, windows={j: spec.window(j) for j in (1, 2, 3)})
    assert rows * per_row * copies == tracker.peak_bytes()["cpu"]
    cache.free()
    full = stage_footprint(replace(spec, sliding_window=0, layer_types=()), z).cache
    assert rows * per_row * copies < full[0] * full[1] * full[2]


def test_short_prompts_in_a_long_block_fill_the_ring_as_they_go(mistral: tuple[TinyModel, dict],
                                                                 tmp_path: Path) -> None:
    """A block whose prompts are shorter than the window but whose generation crosses it: decode
    steps before the ring is full attend to the slots written so far only."""
    tm, _ = mistral
    short = [p[:3] for p in PROMPTS]
    ref = reference_generate(tm, short, GEN)
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(short, gen_len=GEN)] == ref
