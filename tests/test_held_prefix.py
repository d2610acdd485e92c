"""A block's shared prefix held once through decode (``engine/held.py``): each row's cache
leaves the prefix's positions out, and a decode step attends to the prefix once per kv head
for every row, merged with each row's own positions by their log-sum-exps. Greedy tokens
equal transformers' on every tier the cache can be on (the device, RAM with the CPU attending,
RAM copied to the device, disk), compressed or not, merged decode, repeated prompts, beam
search and two ranks; the cache holds L positions a row fewer, as the footprint predicts."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TinyModel, reference_generate, saved
from flexgen_dist import LLM, SamplingConfig
from flexgen_dist.engine import prompt_groups as prompt_groups_mod
from flexgen_dist.engine.attention import attend_rows, attend_rows_lse, merge_lse, prefix_attention
from flexgen_dist.engine.held import HeldPrefix, holds_prefix
from flexgen_dist.memory.tiers import MemoryTracker
from flexgen_dist import run_plan, worker, workloads
from test_shared_prefix import GEN, TWO_BLOCKS, attention_shapes, prompts

PLACEMENTS = {
    "device": dict(gpu_batch_size=2, num_gpu_batches=3),
    "ram-cpu-attention": dict(gpu_batch_size=3, num_gpu_batches=2, percent=(100, 0, 0, 100, 100, 0),
                              cpu_attention=True),
    "ram-to-device": dict(gpu_batch_size=3, num_gpu_batches=2, percent=(100, 0, 0, 100, 100, 0),
                          cpu_attention=False),
    "split-disk": dict(gpu_batch_size=2, num_gpu_batches=3, percent=(100, 0, 30, 30, 100, 0), cpu_attention=True),
    "disk-compressed": dict(gpu_batch_size=3, num_gpu_batches=2, percent=(0, 100, 0, 0, 0, 100),
                            compress_cache=True, cpu_attention=True),
    "ram-merged": dict(gpu_batch_size=2, num_gpu_batches=3, percent=(0, 100, 0, 100, 100, 0), cpu_attention=True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, TinyModel]) -> dict[str, TinyModel]:
    return held_models(tmp_path_factory, tiny_models)


def held_models(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, TinyModel]) -> dict[str, TinyModel]:
    """The attention shapes of ``test_shared_prefix``, and a Mistral whose window outlasts every sequence."""
    from transformers import MistralConfig, MistralForCausalLM

    out = attention_shapes(tmp_path_factory, tiny_models)
    torch.manual_seed(22)  # a sliding window longer than any sequence here: its ring never drops a position
    out["mistral-wide"] = saved(tmp_path_factory, "mistral-wide", MistralForCausalLM(MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)).eval())
    return out


@pytest.fixture
def unheld(monkeypatch: pytest.MonkeyPatch):
    """Switches holding off (every row's cache keeps its prefix, as before holding existed)."""
    def off() -> None:
        for mod in (prompt_groups_mod, run_plan, workloads, worker):
            monkeypatch.setattr(mod, "holds_prefix", lambda *a: False)
    return off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [None, 5])  # a chunk boundary inside a sequence's kv heads
def test_prefix_and_rows_merge_to_attention_over_both(dtype: torch.dtype, split: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    b, kvh, G, d, L, T = 3, 2, 3, 16, 7, 5
    q = torch.randn(b * kvh, G, 1, d, generator=g).to(dtype)
    pk, pv = (torch.randn(kvh, L, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b * kvh, T, d, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(b * kvh, 1, 1, T, dtype=torch.bool)
    mask[:kvh, ..., :2] = False  # the first sequence's first two own positions: its prefix's place
    # the reference: every row over the prefix's keys of its kv head, then its own
    rows = torch.arange(b * kvh) % kvh
    full_k, full_v = torch.cat([pk[rows], k], 1), torch.cat([pv[rows], v], 1)
    full_mask = torch.cat([torch.ones(b * kvh, 1, 1, L, dtype=torch.bool), mask], -1)
    want = attend_rows(q.float(), full_k.float(), full_v.float(), full_mask, scale=0.3)
    pre = prefix_attention(q, pk.float(), pv.float(), 0.3)  # held in float32
    bounds = [(0, b * kvh)] if split is None else [(0, split), (split, b * kvh)]
    got = torch.cat([merge_lse((pre[0][a:z], pre[1][a:z]), attend_rows_lse(q[a:z], k[a:z], v[a:z], mask[a:z], 0.3),
                               dtype)
                     for a, z in bounds])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # the native kernel's log-sum-exp (a decode on the CPU) is torch's
    o, lse = attend_rows_lse(q, k, v, mask, 0.3)
    scores = (q.float() @ k.float()[:, None].transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-4)


def _spec(tm: TinyModel):
    with LLM(str(tm.path), progress=False) as llm:
        return llm.model.spec


def test_which_models_hold_their_prefix(models: dict) -> None:
    specs = {name: _spec(tm) for name, tm in models.items()}
    assert holds_prefix(specs["llama-gqa"], 1.0) and holds_prefix(specs["opt-pre-proj"], 1.0)
    assert not holds_prefix(specs["llama-gqa"], 0.5)  # top-k attention picks over all of a row's keys
    assert not holds_prefix(specs["mistral"], 1.0)  # a sliding window's ring drops the prefix
    assert holds_prefix(specs["mistral"], 1.0, 6) and not holds_prefix(specs["mistral"], 1.0, 7)  # its window: 6
    assert holds_prefix(specs["mistral-wide"], 1.0, 64) and not holds_prefix(specs["mistral-wide"], 1.0)
    assert not holds_prefix(specs["gemma2"], 1.0)  # softcaps (and windows)


def test_a_decode_before_the_prefix_is_held_says_so() -> None:
    hp = HeldPrefix(4, torch.device("cpu"), torch.float32, MemoryTracker())
    q = torch.randn(4, 1, 1, 8)
    with pytest.raises(RuntimeError, match="before the block's prefill left its shared prefix"):
        hp.attend(0, q, [], 1.0)
    hp.hold(0, torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8))
    assert hp.kv[0][0].shape == (2, 4, 8)  # the first L of a longer kept prefix, kv heads first
    hp.free()
    assert not hp.kv


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("kind", ["llama-gqa", "opt-pre-proj", "mistral-wide"])
def test_greedy_tokens_equal_transformers_with_the_prefix_held(models: dict, kind: str, placement: str,
                                                               tmp_path: Path, unheld) -> None:
    """Two blocks of the same prefix (the second reuses the first's keys); the cache holds
    PREFIX positions a row fewer than with each row keeping its prefix."""
    tm = models[kind]
    ps = prompts(tm.model.config.vocab_size, tails=TWO_BLOCKS)
    opts = dict(offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False, sort_window=0,
                **PLACEMENTS[placement])
    got, peaks, predicted = {}, {}, {}
    for hold in (True, False):
        if not hold:
            unheld()
        with LLM(str(tm.path), **opts) as llm:
            got[hold] = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
            m = llm.metrics
        peaks[hold], predicted[hold] = m["peak_bytes"][0], m["predicted"]["peak_bytes"][0]
        assert (m["cache_spared_fraction"] > 0) == hold  # the held prefix's positions, reported
        for tier, n in peaks[hold].items():
            assert n <= predicted[hold][tier], (hold, tier, n, predicted[hold][tier])
    if "compressed" in placement:  # a compressed cache rounds: the held prefix rounds the same
        assert got[True] == got[False]
    else:
        assert got[True] == got[False] == [reference_generate(tm, [p], GEN)[0] for p in ps]
    # where the cache is: PREFIX positions a row fewer
    for tier in {"device": ["gpu"], "disk-compressed": ["disk"], "split-disk": ["cpu", "disk"]}.get(placement, ["cpu"]):
        assert peaks[True][tier] < peaks[False][tier], (peaks, tier)
        assert predicted[True][tier] < predicted[False][tier]


def test_repeated_prompts_and_sampling_with_the_prefix_held(models: dict, unheld) -> None:
    """Two samples of each prompt (a prefill computing each prompt once, ``twins.py``): the same
    draws with the prefix held as with every row keeping it."""
    tm = models["llama-gqa"]
    ps = prompts(256, seed=5)
    opts = dict(gpu_batch_size=4, num_gpu_batches=3, progress=False, ignore_eos=True, sort_window=0,
                percent=(100, 0, 0, 100, 100, 0), cpu_attention=True)
    out = {}
    for hold in (True, False):
        if not hold:
            unheld()
        with LLM(str(tm.path), **opts) as llm:
            got = llm.generate(ps, gen_len=GEN, sampling=SamplingConfig(temperature=1.0, seed=3), n=2)
            out[hold] = [c.token_ids for c in got]
            assert llm.metrics["repeated_prompt_fraction"] > 0 and llm.metrics["shared_prefix_fraction"] > 0
    assert out[True] == out[False] and len(out[True]) == 2 * len(ps)


def test_beam_search_with_the_prefix_held(models: dict) -> None:
    """Beams follow their parents in the rows' own positions; the prefix is every beam's."""
    from test_beams import hf_beams, ours, same

    tm = models["llama-gqa"]
    ps = prompts(256, seed=9)[:3]
    with LLM(str(tm.path), gpu_batch_size=6, num_gpu_batches=1, progress=False,
             percent=(100, 0, 0, 100, 100, 0), cpu_attention=True) as llm:
        outs = llm.beam_search(ps, beam_width=2, max_tokens=GEN)
        assert llm.metrics["shared_prefix_fraction"] > 0
    same(ours(outs), [hf_beams(tm, p, 2, gen=GEN) for p in ps])


def test_the_footprint_leaves_the_held_positions_out(models: dict) -> None:
    from flexgen_dist.engine.footprint import predict_peaks
    from flexgen_dist.engine.policy import Policy
    spec = _spec(models["llama-gqa"])
    pol = Policy(gpu_batch_size=8, num_gpu_batches=4, w_gpu_percent=100, w_cpu_percent=0, cache_gpu_percent=0,
                 cache_cpu_percent=100, act_gpu_percent=100, act_cpu_percent=0)
    args = dict(has_embed=True, has_head=True, prompt_len=64, gen_len=16, dtype_bytes=4)
    plain = predict_peaks(spec, pol, (0, spec.num_layers), shared=40, **args)
    held = predict_peaks(spec, pol, (0, spec.num_layers), shared=40, held=40, **args)
    none = predict_peaks(spec, pol, (0, spec.num_layers), shared=40, held=0, **args)  # a block sharing nothing
    per_pos = spec.num_kv_heads * spec.head_dim * 4 * 2 * spec.num_layers  # K and V of every layer
    assert plain["cpu"] - held["cpu"] == 8 * 4 * 40 * per_pos  # every row: 40 positions fewer
    assert none["cpu"] == plain["cpu"] and held["gpu"] > plain["gpu"]  # the held copies on the device


def test_the_cost_model_reads_each_row_without_its_prefix(models: dict) -> None:
    """The planner's decode reads each row's cache less its block's prefix where the model
    holds it (``PrefixShape.held_positions``); not where a window keeps every row's copy."""
    from flexgen_dist.config import RunConfig
    from flexgen_dist.planner.hardware import load_hardware_stages
    from flexgen_dist.planner.sizes import WorkShape, stage_sizes
    from flexgen_dist.workloads import build_workload

    from conftest import REPO

    hw = load_hardware_stages(str(REPO / "configs/hardware/cpu-2core.yaml"))[0]
    ps = prompts(256)  # 6 prompts, 24 tokens in common
    for name, holds in (("llama-gqa", True), ("mistral", False)):
        with LLM(str(models[name].path), progress=False) as llm:
            spec, tok = llm.model.spec, llm.tokenizer
        shape = build_workload(ps, GEN, None, RunConfig(), spec, tok).prefix
        assert shape is not None and shape.held == holds
        assert shape.held_positions(6) == (5 * 24 / 6 if holds else 0)
        s = max(len(p) for p in ps)
        sizes = {p is None: stage_sizes(spec, spec.num_layers, hw, WorkShape(s, GEN, 4, prefix=p), gpu_batch_size=6,
                                        num_gpu_batches=1, cpu_attention=True, has_embed=True, has_head=True)
                 for p in (shape, None)}
        if holds:
            assert sizes[False].c_avg < sizes[True].c_avg and sizes[False].c_pre < sizes[True].c_pre
        else:
            assert sizes[False].c_avg == sizes[True].c_avg
        if holds:  # top-k attention keeps every row's copy
            off = build_workload(ps, GEN, None, RunConfig(attn_sparsity=0.5), spec, tok).prefix
            assert off is not None and not off.held


def test_the_default_block_grows_where_the_prefix_is_held(tmp_path_factory: pytest.TempPathFactory,
                                                        unheld) -> None:
    """Planning counts on the opening every prompt shares being held (``PrefixShape.floor``):
    under a memory budget the cache binds, the default GPU batch is twice as large as where
    every row keeps its prefix; the same tokens, the peaks within the prediction and the budget."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    tm = saved(tmp_path_factory, "kv4", LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval())
    g = torch.Generator().manual_seed(0)
    head = torch.randint(3, 256, (100,), generator=g).tolist()
    ps = [head + torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (64,), generator=g)]
    gbs, tokens = {}, {}
    for hold in (True, False):
        if not hold:
            unheld()
        with LLM(str(tm.path), ignore_eos=True, progress=False, gpu_mem="5MB") as llm:
            plan = llm.explain(ps, gen_len=GEN)
            gbs[hold] = plan.stages[0].policy.gpu_batch_size
            why = next(c.why for c in plan.choices if c.name == "gpu_batch_size")
            assert ("100-token opening every prompt shares (held once)" in why) == hold, why
            tokens[hold] = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
            m = llm.metrics
        assert m["peak_bytes"][0]["gpu"] <= m["predicted"]["peak_bytes"][0]["gpu"]
    assert gbs[True] == 2 * gbs[False], gbs
    assert tokens[True] == tokens[False]


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_hold_the_prefix_on_each_stage(models: dict, tmp_path: Path) -> None:
    """Each stage holds its own layers' prefix keys; the second block reuses the first's on
    each rank: transformers' tokens, with the cache in RAM and the CPU attending."""
    import json

    from conftest import local_ranks, read_jsonl, write_jsonl

    tm = models["llama-gqa"]
    ps = prompts(256, tails=TWO_BLOCKS)
    out, metrics = tmp_path / "o.jsonl", tmp_path / "m.json"
    r = local_ranks(["-m", "flexgen_dist.run", "--model", str(tm.path), "--prompts",
                     str(write_jsonl(tmp_path / "p.jsonl", ps)), "--gen-len", str(GEN), "--ignore-eos",
                     "--gpu-batch-size", "2", "--num-gpu-batches", "3", "--sort-window", "0",
                     "--percent", "100", "0", "0", "100", "100", "0", "--cpu-attention",
                     "--no-progress", "--output", str(out), "--metrics", str(metrics)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == [reference_generate(tm, [p], GEN)[0] for p in ps]
    assert json.loads(metrics.read_text())["shared_prefix_fraction"] > 0.6
