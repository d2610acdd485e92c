"""A GPU batch's repeated prompts kept once in its cache through decode (``engine/prompt_groups.py``):
a request's ``n`` rows (or a beam search's beams) keep only the positions they generate, and
each distinct prompt's keys and values are kept once, attended once per step for all its rows
and merged by log-sum-exps. Greedy tokens equal transformers' on every tier the cache can be
on, compressed or not, merged decode, ragged groups, a shared prefix, beams, sampling and two
ranks; the cache holds fewer bytes where it lives, within the prediction."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import TinyModel, reference_generate
from flexgen_dist import LLM, SamplingConfig
from flexgen_dist.engine import prompt_groups as prompt_groups_mod
from flexgen_dist.engine.attention import attend_rows
from flexgen_dist.engine.blocks import BlockMeta
from flexgen_dist.engine.prompt_groups import PromptGroups, kept_positions, prompt_groups
from test_held_prefix import PLACEMENTS, held_models

GEN = 6


def _prompts(vocab: int, lens: tuple[int, ...] = (5, 9, 3, 7, 11, 4), seed: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, TinyModel]) -> dict[str, TinyModel]:
    return held_models(tmp_path_factory, tiny_models)


@pytest.fixture(autouse=True)
def in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-memory placements keep prompts once here as on a GPU device (a CPU device does so
    only with part of its cache on disk: ``test_a_cpu_device_keeps_prompts_once_only_with_disk``)."""
    monkeypatch.setattr(prompt_groups_mod, "IN_CPU_MEMORY", True)


@pytest.fixture
def ungrouped(monkeypatch: pytest.MonkeyPatch):
    """Switches keeping prompts once off (every row's cache keeps its prompt)."""
    def off() -> None:
        # what the stages make (``cache_layout``), and what the memory check counts (``kept_positions``)
        monkeypatch.setattr(prompt_groups_mod, "prompt_groups", lambda *a: None)
    return off


def _generate(tm: TinyModel, ps: list[list[int]], n: int, opts: dict, **kw) -> tuple[list[list[int]], dict]:
    with LLM(str(tm.path), **opts) as llm:
        got = llm.generate(ps, gen_len=GEN, n=n, **kw)
        return [c.token_ids for c in got], llm.metrics


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("kind", ["llama-gqa", "opt-pre-proj"])
def test_greedy_tokens_equal_transformers_with_each_prompt_kept_once(models: dict, kind: str, placement: str,
                                                                   tmp_path: Path, ungrouped) -> None:
    """Three choices of each prompt: every row's tokens are transformers' for its prompt, the
    cache holds fewer bytes where it lives than with each row keeping its prompt, and the
    peaks stay within the prediction."""
    tm = models[kind]
    ps = _prompts(tm.model.config.vocab_size)
    opts = dict(offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False, **PLACEMENTS[placement])
    opts["gpu_batch_size"] = 6
    got, peaks, predicted = {}, {}, {}
    for grouped in (True, False):
        if not grouped:
            ungrouped()
        got[grouped], m = _generate(tm, ps, 3, opts)
        peaks[grouped], predicted[grouped] = m["peak_bytes"][0], m["predicted"]["peak_bytes"][0]
        assert (m["cache_spared_fraction"] > 0) == grouped
        for tier, b in peaks[grouped].items():
            assert b <= predicted[grouped][tier], (grouped, tier, b)
    ref = reference_generate(tm, ps, GEN)
    if "compressed" in placement:  # a compressed cache rounds: the prompts' cache rounds the same
        assert got[True] == got[False]
    else:
        assert got[True] == got[False] == [r for r in ref for _ in range(3)]
    for tier in {"device": ["gpu"], "disk-compressed": ["disk"], "split-disk": ["cpu", "disk"]}.get(placement, ["cpu"]):
        assert peaks[True][tier] < peaks[False][tier], (peaks, tier)
        assert predicted[True][tier] < predicted[False][tier], (predicted, tier)  # the memory check counts it


def test_ragged_groups_and_a_shared_prefix(models: dict) -> None:
    """Prompts asked 4, 3 and 1 times in one GPU batch (padded queries dropped), all opening
    with the same 16 tokens (the prefix computed once, then kept with each prompt: short enough
    that keeping each prompt once saves more than holding the prefix alone)."""
    tm = models["llama-gqa"]
    head = _prompts(256, (16,), seed=1)[0]
    a, b, c = (head + t for t in _prompts(256, (50, 30, 2), seed=2))
    ps = [a, a, a, a, b, b, b, c]
    opts = dict(gpu_batch_size=8, num_gpu_batches=1, percent=(100, 0, 0, 100, 100, 0), cpu_attention=True,
                ignore_eos=True, progress=False, sort_window=0)
    with LLM(str(tm.path), **opts) as llm:
        got = [x.token_ids for x in llm.generate(ps, gen_len=GEN)]
        m = llm.metrics
    assert m["repeated_prompt_fraction"] > 0 and m["shared_prefix_fraction"] > 0
    # 8 rows of 66 + 6 positions, 3 prompts' 66 kept once: 5 rows' prompts spared
    assert m["cache_spared_fraction"] == pytest.approx(66 * 5 / (8 * 72))
    assert got == reference_generate(tm, ps, GEN)


def test_sampling_draws_as_with_each_row_keeping_its_prompt(models: dict, ungrouped) -> None:
    tm = models["llama-gqa"]
    ps = _prompts(256)
    opts = dict(gpu_batch_size=8, num_gpu_batches=2, progress=False, ignore_eos=True,
                percent=(100, 0, 0, 100, 100, 0), cpu_attention=True)
    out = {}
    for grouped in (True, False):
        if not grouped:
            ungrouped()
        out[grouped], _ = _generate(tm, ps, 4, opts, sampling=SamplingConfig(temperature=1.0, seed=3))
    assert out[True] == out[False] and len(out[True]) == 4 * len(ps)


def test_beam_search_with_each_prompt_kept_once(models: dict) -> None:
    """Beams follow their parents in the positions they generate; the prompt is every beam's."""
    from test_beams import hf_beams, ours, same

    tm = models["llama-gqa"]
    ps = _prompts(256, (5, 9, 4))
    with LLM(str(tm.path), gpu_batch_size=6, num_gpu_batches=1, progress=False,
             percent=(100, 0, 0, 100, 100, 0), cpu_attention=True) as llm:
        outs = llm.beam_search(ps, beam_width=2, max_tokens=GEN)
    same(ours(outs), [hf_beams(tm, p, 2, gen=GEN) for p in ps])


def test_a_cpu_device_keeps_prompts_once_only_with_disk(models: dict, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU device the decode attention over a cache in memory costs the same arithmetic for
    a prompt's one row as for its rows, and the merge adds to it: each row keeps its prompt there
    (the same peaks as with keeping switched off); with part of the cache on disk, the reads it
    saves count, and the disk's peak is smaller."""
    monkeypatch.setattr(prompt_groups_mod, "IN_CPU_MEMORY", False)
    meta = _meta([[0, 0, 2, 2]], [[7, 7, 5, 5]], 7)
    assert kept_positions(meta, 4, 1, (0.0, 1.0, 0.0), cuda=False) is None
    assert kept_positions(meta, 4, 1, (0.0, 1.0, 0.0), cuda=True) == 3
    assert kept_positions(meta, 4, 1, (0.0, 0.0, 1.0), cuda=False) == 3
    tm = models["llama-gqa"]
    ps = _prompts(256)
    peaks = {}
    for placement in ("ram-cpu-attention", "disk-compressed"):
        opts = dict(offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False, **PLACEMENTS[placement])
        for grouped in (True, False):
            if not grouped:
                monkeypatch.setattr(prompt_groups_mod, "prompt_groups", lambda *a: None)
            peaks[placement, grouped] = _generate(tm, ps, 3, opts)[1]["peak_bytes"][0]
            monkeypatch.undo()
            monkeypatch.setattr(prompt_groups_mod, "IN_CPU_MEMORY", False)
    assert peaks["ram-cpu-attention", True] == peaks["ram-cpu-attention", False]
    assert peaks["disk-compressed", True]["disk"] < peaks["disk-compressed", False]["disk"]


def _meta(twins: list[list[int] | None], lens: list[list[int]], s: int, **kw) -> BlockMeta:
    return BlockMeta(prompt_lens=lens, prompt_len=s, gen_len=4, twins=twins, **kw)


def test_which_blocks_keep_their_prompts_once() -> None:
    lens = [[5, 5, 5, 5], [3, 3, 7, 7]]
    twice = _meta([[0, 0, 2, 2], [0, 0, 2, 2]], lens, 7)
    assert prompt_groups(twice) == [[0, 0, 1, 1], [0, 0, 1, 1]]
    # a batch without repeats keeps each row as a prompt of its own
    eight = _meta([[0] * 8, None], [[5] * 8, [3, 3, 7, 7]], 7)  # 5 prompts of 12 rows
    assert prompt_groups(eight) == [[0] * 8, [0, 1, 2, 3]]
    assert prompt_groups(_meta([[0, 0, 2, 3], None], lens, 7)) is None  # 5 prompts of 8 rows: too few repeats
    assert prompt_groups(twice, held=4) is None  # a held shared prefix of 4 of 7 positions saves more
    assert prompt_groups(_meta(None, lens, 7)) is None
    assert prompt_groups(_meta(twice.twins, lens, 7, embed=True)) is None


def test_what_the_memory_check_counts_a_row_leaving_out() -> None:
    """Against full GPU batches, tier by tier as rows split: two prompts of 7 positions for 4
    rows generating 4 each, one kv head: the rows take 4 x 4 and the prompts 2 x 7, 30 of a
    full batch's 4 x 11 slots, so a row leaves out 11 - ceil(30 / 4) = 3 positions."""
    meta = _meta([[0, 0, 2, 2]], [[7, 7, 5, 5]], 7)
    assert kept_positions(meta, 4, 1, (1.0, 0.0, 0.0)) == 3
    assert kept_positions(_meta([[0, 0, 2, 2]], [[7, 7, 5, 5]], 7), 4, 2, (1.0, 0.0, 0.0)) == 3  # per kv head alike
    # half the rows in RAM: 2 rows' 4 and 1 prompt's 7 there, 15 of 2 x 11 (8 slots for a row there)
    assert kept_positions(meta, 4, 1, (0.5, 0.5, 0.0)) == 11 - 8
    # a quarter on disk rounds to one row of 4, but to one of the 2 prompts' rows: 4 + 7 of 11, and
    # where a batch's 4 rows put none on a tier, none of the prompts' may go there
    assert kept_positions(meta, 4, 1, (0.5, 0.25, 0.25)) == 0
    # 8 rows split 2 / 0 / 6, the 2 prompts' rows 0 / 1 / 1: RAM would hold a row no full batch has there
    eight = _meta([[0, 0, 0, 0, 4, 4, 4, 4]], [[7] * 8], 7)
    assert prompt_groups(eight) is not None and kept_positions(eight, 8, 1, (0.2, 0.1, 0.7)) is None
    # 2 / 0 / 6 and 0 / 0 / 2: the disk's 6 rows hold 6 x 4 + 2 x 7 of 6 x 11 slots
    assert kept_positions(eight, 8, 1, (0.25, 0.0, 0.75)) == 11 - -(-(6 * 4 + 2 * 7) // 6)
    assert kept_positions(_meta([[0, 0, 2, 3]], [[7, 7, 5, 5]], 7), 4, 1, (1.0, 0.0, 0.0)) is None  # too few repeats


@pytest.mark.parametrize("ragged", [False, True])
def test_gathered_queries_attend_as_each_row_would(ragged: bool) -> None:
    """A prompt's rows' queries attend its one row of keys: each row's output and log-sum-exp
    equal its own attention over the same keys (a cache row per row)."""
    g = torch.Generator().manual_seed(0)
    kvh, G, d, s = 2, 3, 8, 6
    rows = [0, 1, 0, 2, 1, 0] if ragged else [0, 1, 1, 0]
    lens = [[6, 4, 6, 3, 4, 6]] if ragged else [[6, 4, 4, 6]]
    groups = PromptGroups.of([rows], lens, s, kvh, torch.device("cpu"))
    u, b = max(rows) + 1, len(rows)
    k, v = (torch.randn(u * kvh, s, d, generator=g) for _ in range(2))
    q = torch.randn(b * kvh, G, 1, d, generator=g)
    from flexgen_dist.engine.attention import attend_rows_lse

    o, lse = groups.scatter(*attend_rows_lse(groups.gather(q, 0), k, v, groups.mask(0), 0.4), 0)
    per_row = torch.tensor(rows).repeat_interleave(kvh) * kvh + torch.arange(kvh).repeat(b)
    m = torch.arange(s)[None] >= s - torch.tensor(lens[0])[:, None]
    mask = m.repeat_interleave(kvh, 0)[:, None, None]
    want, want_lse = attend_rows_lse(q, k[per_row], v[per_row], mask, 0.4)
    torch.testing.assert_close(o, want)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(o, attend_rows(q, k[per_row], v[per_row], mask, scale=0.4).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_keep_each_prompt_once(models: dict, tmp_path: Path) -> None:
    import json

    from conftest import local_ranks, read_jsonl, write_jsonl

    tm = models["llama-gqa"]
    ps = [p for p in _prompts(256) for _ in range(2)]
    out, metrics = tmp_path / "o.jsonl", tmp_path / "m.json"
    r = local_ranks(["-m", "flexgen_dist.run", "--model", str(tm.path), "--prompts",
                     str(write_jsonl(tmp_path / "p.jsonl", ps)), "--gen-len", str(GEN), "--ignore-eos",
                     "--gpu-batch-size", "4", "--num-gpu-batches", "2", "--percent", "100", "0", "0", "100", "100",
                     "0", "--cpu-attention", "--no-progress", "--output", str(out), "--metrics", str(metrics)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == [reference_generate(tm, [p], GEN)[0] for p in ps]
    assert json.loads(metrics.read_text())["repeated_prompt_fraction"] == pytest.approx(0.5)


def test_the_cost_model_reads_each_prompt_once_a_batch(models: dict) -> None:
    """Four requests of each prompt in batches of 4: a row's cache leaves out its prompt but
    for its quarter of the prompt's one copy (``PrefixShape.kept_once``), and the predicted
    decode reads that much less; a block whose held prefix saves more keeps its rows' prompts."""
    from flexgen_dist.config import RunConfig
    from flexgen_dist.engine.blocks import repeat_counts
    from flexgen_dist.engine.prefix_shape import PrefixShape
    from flexgen_dist.planner.hardware import load_hardware_stages
    from flexgen_dist.planner.sizes import WorkShape, stage_sizes
    from flexgen_dist.workloads import build_workload

    from conftest import REPO

    shape = PrefixShape(repeats=repeat_counts([0] * 4 + [4] * 4), held=True)
    assert shape.kept_once(40, 4) == 30 and shape.kept_once(40, 4, held=25) == 0
    assert PrefixShape(repeats=(4, 4)).kept_once(40, 4) == 0  # a model that keeps every row's copy
    hw = load_hardware_stages(str(REPO / "configs/hardware/cpu-2core.yaml"))[0]
    ps = [p for p in _prompts(256, (30, 34)) for _ in range(4)]
    with LLM(str(models["llama-gqa"].path), progress=False) as llm:
        spec, tok = llm.model.spec, llm.tokenizer
    work = build_workload(ps, GEN, None, RunConfig(), spec, tok)
    assert work.prefix is not None and work.prefix.held
    kept = dataclasses.replace(work.prefix, repeats=repeat_counts([0] * 4 + [4] * 4))
    sizes = {p is kept: stage_sizes(spec, spec.num_layers, hw, WorkShape(34, GEN, 4, prefix=p), gpu_batch_size=4,
                                    num_gpu_batches=2, cpu_attention=True, has_embed=True, has_head=True)
             for p in (kept, work.prefix)}
    # each row reads 34 - 34 * 3 / 4 of its prompt's positions and its GEN / 2 own on average
    assert sizes[True].c_avg / sizes[False].c_avg == pytest.approx((34 / 4 + GEN / 2) / (34 + GEN / 2))


@pytest.mark.parametrize("kind", ["mistral-wide", "deepseek_v3", "next"])
def test_other_families_keep_each_prompt_once(models: dict, kind: str, tmp_path: Path, ungrouped) -> None:
    """A sliding window longer than the sequences, a latent cache (keys and values one tensor:
    the prompts' cache stores it once too) with experts, and Qwen3-Next (its attention layers'
    prompts kept once, its linear layers' states each row's)."""
    if kind == "deepseek_v3":
        from test_latent_cache import _model

        tm = _model("deepseek_v3", tmp_path / kind)
    elif kind == "next":
        from test_qwen3_next import _model

        tm = _model("next", tmp_path / kind)
    else:
        tm = models[kind]
    ps = _prompts(tm.model.config.vocab_size, (5, 9, 3, 7))
    opts = dict(gpu_batch_size=8, num_gpu_batches=1, percent=(100, 0, 0, 100, 100, 0), cpu_attention=True,
                ignore_eos=True, progress=False)
    got, peaks = {}, {}
    for grouped in (True, False):
        if not grouped:
            ungrouped()
        got[grouped], m = _generate(tm, ps, 2, opts)
        peaks[grouped] = m["peak_bytes"][0]["cpu"]
    assert got[True] == got[False] == [t for t in reference_generate(tm, ps, GEN) for _ in range(2)]
    assert peaks[True] < peaks[False]
