"""Repeated prompts computed once (``engine/twins.py``): where rows of a GPU batch hold the same
prompt and adapter (a request's ``n`` choices, a beam search's beams, a question asked twice),
the prefill runs each prompt's first row only and copies its keys and values to the others.
Greedy tokens equal transformers' (each prompt alone) and the run without the copying, for the
families whose attention differs (GQA, learned positions, sliding windows, softcaps, a latent
cache, experts, linear-attention states) and every placement, with shared prefixes, per-request
adapters and sampling, on one rank and two; what was saved is reported; scoring computes each row."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import TinyModel, local_ranks, read_jsonl, reference_generate, write_jsonl
from flexgen_dist import LLM, SamplingConfig
from flexgen_dist.engine.blocks import BlockPlan, batch_twins, plan_blocks, repeated_prompts

GEN = 5


def repeated(vocab: int, seed: int = 5) -> list[list[int]]:
    """Eight requests of four prompts (lengths 5, 9, 3, 7): the first three times, apart in the input."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    return [base[n] for n in (0, 1, 0, 2, 1, 0, 3, 2)]


# sorted by length with a prompt's repeats together: [1 1 3 0 | 0 0 2 2]: 3 rows of 8 not computed
SAVED_ROWS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, TinyModel]) -> dict[str, TinyModel]:
    from test_latent_cache import _model
    from test_shared_prefix import attention_shapes

    out = attention_shapes(tmp_path_factory, tiny_models)
    out["deepseek_v3"] = _model("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))  # a latent cache, experts
    return out


PLACEMENTS = {
    "device": dict(percent=(100, 0, 100, 0, 100, 0)),
    "offloaded": dict(percent=(0, 50, 0, 50, 50, 50), cpu_attention=True),  # activations of the few rows on disk
    "compressed": dict(percent=(0, 100, 30, 30, 0, 100), compress_cache=True, cpu_attention=False),
    "ram-merged": dict(percent=(0, 100, 0, 100, 100, 0), cpu_attention=True),
    # a block's prefill pieces riding on the block before's decode steps (``run_sweep`` parts)
    "overlapped": dict(schedule="overlapped", gpu_batch_size=2, num_gpu_batches=2),  # [1 1|3 0] [0 0|2 2]
}


def _run(tm: TinyModel, ps: list[list[int]], tmp_path: Path, share: bool, **opts) -> tuple[list[list[int]], float]:
    kw = dict(gpu_batch_size=4, num_gpu_batches=2, offload_dir=str(tmp_path / "off"), ignore_eos=True,
              progress=False, share_prefix=share)
    with LLM(str(tm.path), **{**kw, **opts}) as llm:
        got = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
        return got, llm.metrics["repeated_prompt_fraction"]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_every_placement_gives_transformers_tokens(models: dict, placement: str, tmp_path: Path) -> None:
    tm = models["llama-gqa"]
    ps = repeated(256)
    want = [reference_generate(tm, [p], GEN)[0] for p in ps]
    got, fraction = _run(tm, ps, tmp_path, True, **PLACEMENTS[placement])
    plain, none = _run(tm, ps, tmp_path, False, **PLACEMENTS[placement])
    if placement == "compressed":  # the cache rounds: the same rounding either way
        assert got == plain
    else:
        assert got == plain == want
    # one block of 9-token rows, or (blocks of 4) [1 1|3 0] of 9 tokens and [0 0|2 2] of 5
    saved = 19 / 56 if placement == "overlapped" else SAVED_ROWS / 8
    assert fraction == pytest.approx(saved) and none == 0


@pytest.mark.parametrize("kind", ["opt-pre-proj", "mistral", "gemma2", "deepseek_v3"])
def test_every_family_shape_gives_transformers_tokens(models: dict, kind: str, tmp_path: Path) -> None:
    """Learned positions, a sliding window shorter than the prompts, softcaps, a latent cache
    (one tensor for keys and values) with experts."""
    tm = models[kind]
    ps = repeated(tm.model.config.vocab_size)
    got, fraction = _run(tm, ps, tmp_path, True)
    assert fraction > 0
    assert got == _run(tm, ps, tmp_path, False)[0] == [reference_generate(tm, [p], GEN)[0] for p in ps]


def test_with_a_shared_prefix_each_batch_computes_its_prompts_once(models: dict, tmp_path: Path) -> None:
    """A block's prefix computed once, and past it each repeated prompt once: both reported."""
    from test_shared_prefix import PREFIX

    tm = models["mistral"]
    head = torch.randint(3, 256, (PREFIX,), generator=torch.Generator().manual_seed(2)).tolist()
    ps = [head + p for p in repeated(256)]
    with LLM(str(tm.path), gpu_batch_size=4, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        got = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
        m = llm.metrics
    assert got == [reference_generate(tm, [p], GEN)[0] for p in ps]
    positions = 8 * (PREFIX + 9)
    assert m["shared_prefix_fraction"] == pytest.approx(7 * PREFIX / positions)
    assert m["repeated_prompt_fraction"] == pytest.approx(SAVED_ROWS * 9 / positions)
    assert "repeated another row's prompt, computed once" in llm.summary()


def test_sampled_repeats_draw_apart_as_without(models: dict, tmp_path: Path) -> None:
    """Each row keeps its own draws (``n`` choices of one prompt differ) and every token is the
    one it is when each row computes its prompt itself."""
    tm = models["llama-gqa"]
    ps = [repeated(256)[0]] * 8
    out = {}
    for share in (True, False):
        with LLM(str(tm.path), gpu_batch_size=4, num_gpu_batches=2, ignore_eos=True, progress=False,
                 share_prefix=share) as llm:
            out[share] = [c.token_ids for c in llm.generate(ps, gen_len=8, sampling=SamplingConfig(temperature=1.0,
                                                                                                   seed=3))]
            assert llm.metrics["repeated_prompt_fraction"] == (pytest.approx(6 / 8) if share else 0)
    assert out[True] == out[False]
    assert len({tuple(t) for t in out[True]}) > 4  # eight draws of one prompt, not one draw copied


def test_rows_of_different_adapters_are_computed_apart(tiny_models, tmp_path: Path) -> None:
    """One prompt under two adapters and the base model: only a repeat under the same adapter
    is copied; each row's tokens are PEFT's model's with its adapter."""
    from test_lora_modules import LLAMA_ALL, _expected, _two

    tm = tiny_models["llama-gqa"]
    modules, models = _two(tm, tmp_path, LLAMA_ALL)
    p = repeated(256)[1]
    choice = ["a1", "a2", None, "a1", None, "a2", "a1", None]
    want = _expected(models, choice, [p] * 8, 4)
    with LLM(str(tm.path), lora_modules=modules, gpu_batch_size=8, num_gpu_batches=1, ignore_eos=True,
             progress=False) as llm:
        assert llm.prepare([p] * 8, 4, lora=choice).twins == (0, 1, 2, 0, 2, 1, 0, 2)
        assert [c.token_ids for c in llm.generate([p] * 8, gen_len=4, lora=choice)] == want
        assert llm.metrics["repeated_prompt_fraction"] == pytest.approx(5 / 8)


def test_embeddings_of_repeated_inputs_equal_each_computed(models: dict) -> None:
    tm = models["llama-gqa"]
    ps = repeated(256)
    out = {}
    for share in (True, False):
        with LLM(str(tm.path), gpu_batch_size=4, num_gpu_batches=2, progress=False, share_prefix=share) as llm:
            out[share] = torch.tensor([e.embedding for e in llm.embed(ps)])
            assert llm.metrics["repeated_prompt_fraction"] == (pytest.approx(SAVED_ROWS / 8) if share else 0)
    assert torch.allclose(out[True], out[False], atol=1e-6)
    assert torch.equal(out[True][0], out[True][2]) and torch.equal(out[True][0], out[True][5])


def test_which_rows_repeat_which() -> None:
    ids = [[5, 6], [7], [5, 6], [5, 6, 1], [7]]
    assert repeated_prompts(ids) == (0, 1, 0, 3, 1)
    assert repeated_prompts(ids, adapters=[0, 0, 1, 0, 0]) == (0, 1, 2, 3, 1)  # another adapter: its own
    assert repeated_prompts([[1], [2]]) is None  # nothing repeats
    assert batch_twins([4, 9, 4, 4, 2]) == [0, 1, 0, 0, 4] and batch_twins([1, 2]) is None
    ids = [[5, 6], [7], [8, 9], [5, 6], [7]]
    lens = [len(p) for p in ids]
    blocks = plan_blocks(lens, 5, window_blocks=1, twins=repeated_prompts(ids))
    assert blocks[0].members == [0, 3, 2, 1, 4]  # longest first; among equals a prompt's repeats together
    assert plan_blocks(lens, 5, window_blocks=1)[0].members == [0, 2, 3, 1, 4]  # by index alone
    blk = BlockPlan(0, [0, 2, 1, 4], [2, 2, 1, 1], 2, twins=[0, 0, 1, 1])
    assert blk.meta(2, 3).twins == [[0, 0], [0, 0]] and blk.repeated(2) == 2 * 2
    assert blk.meta(1, 3).twins is None and blk.repeated(1) == 0  # one row a batch: nothing to copy
    blk.shared = 1
    assert blk.repeated(4) == 2 * 1  # past the shared prefix only


def test_scoring_and_sharing_off_compute_every_row(models: dict, tmp_path: Path) -> None:
    tm = models["llama-gqa"]
    ps = repeated(256)
    with LLM(str(tm.path), progress=False) as llm:
        assert llm.prepare(ps, 4).twins == (0, 1, 0, 3, 1, 0, 6, 3)
        llm.score(ps)
        assert llm.metrics["repeated_prompt_fraction"] == 0
    with LLM(str(tm.path), progress=False, share_prefix=False) as llm:
        assert llm.prepare(ps, 4).twins is None


@pytest.mark.parametrize("kind,states", [("next", (100, 0)), ("next", (0, 0)), ("3.5", (0, 100))])
def test_linear_attention_states_are_copied_to_the_repeats(kind: str, states: tuple[int, int],
                                                           tmp_path: Path) -> None:
    """Qwen3-Next and Qwen3.5: each linear layer's state after a repeated prompt is computed once
    and copied to its repeats' rows, on the device, staged from disk (``--state-percent 0 0``)
    and in RAM; prompts of 3 to 150 tokens, padded and past the delta rule's chunk."""
    from test_qwen3_next import PROMPTS, _model

    tm = _model(kind, tmp_path / kind)
    ps = [PROMPTS[n] for n in (1, 0, 1, 2, 2, 3, 1, 0)]
    got, fraction = _run(tm, ps, tmp_path, True, state_percent=states)
    assert fraction > 0
    assert got == _run(tm, ps, tmp_path, False, state_percent=states)[0] == \
        [reference_generate(tm, [p], GEN)[0] for p in ps]


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_copy_on_each_stage(models: dict, tmp_path: Path) -> None:
    """Each stage narrows its input rows and widens its output: the message between them holds
    every row."""
    tm = models["mistral"]
    ps = repeated(256)
    out, metrics = tmp_path / "o.jsonl", tmp_path / "m.json"
    r = local_ranks(["-m", "flexgen_dist.run", "--model", str(tm.path), "--prompts",
                     str(write_jsonl(tmp_path / "p.jsonl", ps)), "--gen-len", str(GEN), "--ignore-eos",
                     "--gpu-batch-size", "4", "--num-gpu-batches", "2", "--prefill-items", "batch",
                     "--no-progress", "--output", str(out), "--metrics", str(metrics)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == [reference_generate(tm, [p], GEN)[0] for p in ps]
    assert json.loads(metrics.read_text())["repeated_prompt_fraction"] == pytest.approx(SAVED_ROWS / 8)


def test_the_planner_expects_what_the_repeats_save(models: dict) -> None:
    """The cost model computes a batch's repeated prompt once (``PrefixShape.computed_share``):
    four requests of each of two prompts are 2 rows of 8 in batches of 4, 4 in batches of 2
    (none saved with a batch of one); ``explain``'s predicted prefill moves with it."""
    from flexgen_dist.engine.blocks import repeat_counts
    from flexgen_dist.engine.prefix_shape import PrefixShape
    from flexgen_dist.planner.sizes import WorkShape

    shape = PrefixShape(repeats=repeat_counts([0, 0, 0, 0, 4, 4, 4, 4]))
    assert shape.repeats == (4, 4)
    assert shape.computed_share(4) == 2 / 8 and shape.computed_share(2) == 4 / 8 and shape.computed_share(1) == 1
    assert PrefixShape(repeats=(3, 3)).computed_share(4) == 3 / 6  # the second straddles two batches
    assert WorkShape(10, GEN, 4, prefix=shape).prefill_rows(8, 4) == 8 * 10 * 2 / 8
    assert WorkShape(10, GEN, 4, prefix=shape).prefill_rows(8) == 80  # no batch size: every row
    hw = str(Path(__file__).resolve().parents[1] / "configs/hardware/cpu-2core.yaml")
    pre = {}
    for share in (True, False):
        with LLM(str(models["llama-gqa"].path), gpu_batch_size=4, num_gpu_batches=2, hardware=hw,
                 share_prefix=share, progress=False) as llm:
            work = llm.prepare([repeated(256)[1]] * 8, GEN)
            assert (work.prefix is not None and work.prefix.repeats == (8,)) == share
            pre[share] = llm.explain([repeated(256)[1]] * 8, gen_len=GEN).stages[0].prefill_s
    assert pre[True] < pre[False]
