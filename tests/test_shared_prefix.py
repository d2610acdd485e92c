"""Shared prefixes (``engine/blocks.shared_prefixes``, ``engine/prefix.py``): where the
prompts of a block begin with the same tokens (a system prompt, few-shot examples), those
positions are computed once, as one row, and every row's prefill computes only its own. Greedy
tokens equal transformers' for every family shape the engine's attention varies by (GQA,
learned positions, sliding windows shorter than the prefix, chunked attention, softcaps, sinks,
experts) and every
placement, on one rank and two; what is saved is reported; sharing is off where it cannot be."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, TinyModel, local_ranks, read_jsonl, reference_generate, write_jsonl
from flexgen_dist import LLM
from flexgen_dist.engine.blocks import (BlockPlan, plan_blocks, prefill_positions, prefix_groupings, prefix_reuse,
                                        shared_prefixes)
from flexgen_dist.engine.footprint import predict_peaks
from flexgen_dist.engine.policy import Policy
from flexgen_dist.engine.prefix import shares_prefix

GEN = 6
PREFIX = 24  # longer than the sliding windows below: the prefix's own rows see a band
TAILS = (1, 5, 9, 3, 12, 2)


def prompts(vocab: int, seed: int = 3, tails: tuple[int, ...] = TAILS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (PREFIX,), generator=g).tolist()
    return [head + torch.randint(3, vocab, (n,), generator=g).tolist() for n in tails]


# two blocks of six: the second takes the first's prefix keys and values (``blocks.prefix_reuse``)
TWO_BLOCKS = TAILS + (4, 7, 1, 11, 6, 3)


def _mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(21)
    return MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                            sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _gemma2() -> torch.nn.Module:
    from test_gemma import _gemma2 as build

    return build()


def _gpt_oss(path: Path) -> TinyModel:
    from test_gpt_oss import _model

    return _model(path)


def _llama4(path: Path) -> TinyModel:
    from test_llama4 import _model

    return _model("interleaved", path)  # chunks of 4 (the prefix spans six), NoPE layers, temperature


def _qwen3_moe(path: Path) -> TinyModel:
    from test_moe import _model

    return _model("qwen3_moe", path)


def attention_shapes(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, TinyModel]
                     ) -> dict[str, TinyModel]:
    """The tiny models whose attention differs: GQA, learned positions, a sliding window
    shorter than the prompts, softcaps."""
    out = {k: tiny_models[k] for k in ("llama-gqa", "opt-pre-proj")}
    for name, build in (("mistral", _mistral), ("gemma2", _gemma2)):
        m = build().eval()
        d = tmp_path_factory.mktemp(name)
        m.save_pretrained(d)
        out[name] = TinyModel(name, d, m, 0)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, TinyModel]) -> dict[str, TinyModel]:
    out = attention_shapes(tmp_path_factory, tiny_models)
    out["gpt_oss"] = _gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    out["qwen3_moe"] = _qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))
    out["llama4"] = _llama4(tmp_path_factory.mktemp("llama4"))
    return out


PLACEMENTS = {
    "device": dict(gpu_batch_size=2, num_gpu_batches=3),
    "offloaded": dict(gpu_batch_size=3, num_gpu_batches=2, percent=(0, 50, 0, 50, 50, 50), compress_cache=True,
                      cpu_attention=True),
    "ram-merged": dict(gpu_batch_size=2, num_gpu_batches=3, percent=(0, 100, 0, 100, 100, 0), cpu_attention=True),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("kind", ["llama-gqa", "opt-pre-proj", "mistral", "gemma2", "gpt_oss", "qwen3_moe", "llama4"])
def test_greedy_tokens_equal_transformers_with_the_prefix_computed_once(models: dict, kind: str, placement: str,
                                                                         tmp_path: Path) -> None:
    """Two blocks of the same prefix: the first computes it, the second reuses its keys and values."""
    tm = models[kind]
    ps = prompts(tm.model.config.vocab_size, tails=TWO_BLOCKS)
    opts = dict(offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False, sort_window=0,
                **PLACEMENTS[placement])
    got = {}
    for share in (True, False):
        with LLM(str(tm.path), share_prefix=share, **opts) as llm:
            got[share] = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
            fraction = llm.metrics["shared_prefix_fraction"]
        # block 0 computes the prefix once for its six rows, block 1 not at all
        positions = 6 * (PREFIX + max(TWO_BLOCKS[:6])) + 6 * (PREFIX + max(TWO_BLOCKS[6:]))
        assert fraction == (pytest.approx(PREFIX * 11 / positions) if share else 0), fraction
    if placement == "offloaded":  # a compressed cache rounds: the same rounding with the prefix shared or not
        assert got[True] == got[False]
    else:  # each prompt alone: transformers' left-padded batch moves some tied rows of these models
        assert got[True] == got[False] == [reference_generate(tm, [p], GEN)[0] for p in ps]


def test_the_saved_share_is_what_the_rows_did_not_compute(models: dict, tmp_path: Path, capsys) -> None:
    tm = models["llama-gqa"]
    ps = prompts(256)
    with LLM(str(tm.path), gpu_batch_size=6, num_gpu_batches=1, ignore_eos=True, progress=False) as llm:
        llm.generate(ps, gen_len=GEN)
        m = llm.metrics
        assert "a shared prefix, computed once per block" in llm.summary()
    positions = 6 * (PREFIX + max(TAILS))
    assert m["shared_prefix_fraction"] == pytest.approx(PREFIX * 5 / positions)


def test_the_prefix_every_prompt_of_a_block_shares() -> None:
    head = list(range(100, 120))
    ps = [head + [1, 2], head + [1, 3, 4], head[:5] + [9] * 20, head + [7], head + [8, 8, 8]]

    def blocks(*groups: list[int], of: list[list[int]] = ps) -> list[BlockPlan]:
        return [BlockPlan(n, g, [len(of[m]) for m in g], max(len(of[m]) for m in g)) for n, g in enumerate(groups)]

    assert shared_prefixes(ps, blocks([0, 1, 3, 4])) == (20, 20, 0, 20, 20)
    assert shared_prefixes(ps, blocks([0, 1])) == (21, 21, 0, 0, 0)  # [1] too: up to one short of the shortest
    assert shared_prefixes(ps, blocks([0, 2], [1, 3])) == (0, 20, 0, 20, 0)  # 5 shared: under the minimum
    assert shared_prefixes(ps, blocks([0], [1], [3])) == (0,) * 5  # one prompt: nothing to share
    assert shared_prefixes(ps, blocks([0, 1, 3, 4]), longest=22) == (0,) * 5  # LongRoPE: a prompt past 22
    two = [head[:17], head[:17] + [1]]
    assert shared_prefixes(two, blocks([0, 1], of=two)) == (16, 16)  # the shorter's last position stays its own


def mixed_tasks(vocab: int, seed: int = 7, n: int = 12) -> list[list[int]]:
    """Three tasks interleaved in the input, each its own 20-token instruction after a common
    8-token header, before each request's own 2-10 tokens: blocks cut by length would mix the
    tasks (sharing the header only, under the minimum)."""
    g = torch.Generator().manual_seed(seed)
    header = torch.randint(3, vocab, (8,), generator=g).tolist()
    tasks = [header + torch.randint(3, vocab, (20,), generator=g).tolist() for _ in range(3)]
    return [tasks[k % 3] + torch.randint(3, vocab, (2 + (5 * k) % 9,), generator=g).tolist() for k in range(n)]


def test_requests_are_grouped_by_opening_where_that_computes_less() -> None:
    ps = mixed_tasks(256)
    lens = [len(p) for p in ps]
    candidates = prefix_groupings(ps, 4, 3)  # one window of 12
    assert candidates, "three tasks of four requests: a grouping"
    groups = candidates[0]
    assert sorted(groups) == [0] * 4 + [1] * 4 + [2] * 4 and len({groups[n] for n in (0, 3, 6, 9)}) == 1
    plain = plan_blocks(lens, 4, None, 3)
    grouped = plan_blocks(lens, 4, None, 3, groups)
    assert all(len({n % 3 for n in b.members}) == 1 for b in grouped)  # a block: one task
    assert all(b.members == sorted(b.members, key=lambda m: (-lens[m], m)) for b in grouped)  # by length within
    shared_plain, shared_grouped = shared_prefixes(ps, plain), shared_prefixes(ps, grouped)
    assert not any(shared_plain) and set(shared_grouped) == {28}
    assert prefill_positions(grouped, shared_grouped) < prefill_positions(plain, shared_plain)
    assert prefix_groupings(prompts(256) * 2, 3, 4) == []  # one opening for all: nothing to choose
    assert prefix_groupings(ps, 4, 0) == [] and prefix_groupings(ps[:7], 4, 3) == []  # input order; too few


def test_a_block_reuses_the_prefix_the_block_before_left() -> None:
    head = list(range(100, 130))
    ps = [head + [1], head + [2, 2], head[:20] + [3] * 5, head[:20] + [4] * 6, head + [5], head + [6],
          [9] * 40, [9] * 41, head + [7], head + [8]]

    def blocks(*groups: list[int]) -> list[BlockPlan]:
        return [BlockPlan(n, g, [len(ps[m]) for m in g], max(len(ps[m]) for m in g)) for n, g in enumerate(groups)]

    bl = blocks([0, 1], [2, 3], [4, 5], [6, 7], [8, 9])
    shared = shared_prefixes(ps, bl)
    assert shared == (30, 30, 20, 20, 30, 30, 39, 39, 30, 30)
    # [2, 3]: the first 20 of the kept 30; [4, 5]: 30 again, more than [2, 3] took but the same
    # source; [6, 7] another prefix (a new source); [8, 9] not [6, 7]'s: computed again
    assert prefix_reuse(ps, bl, shared) == (False, False, True, True, True, True, False, False, False, False)
    assert prefix_reuse(ps, blocks([0, 1], [6], [4, 5]), (30, 30, 0, 0, 30, 30, 0, 0, 0, 0)) == (False,) * 10
    grouped = blocks([0, 1], [2, 3], [4, 5])
    assert prefill_positions(grouped, shared, prefix_reuse(ps, grouped, shared)) == \
        prefill_positions(grouped, shared) - 20 - 30  # two prefix rows not computed


def test_grouped_blocks_give_transformers_tokens(models: dict, tmp_path: Path) -> None:
    """The tasks grouped (the fraction saved says so), two blocks a task, the second reusing
    the first's prefix; every request's greedy tokens are transformers', in input order;
    without sharing the blocks are cut by length alone."""
    tm = models["llama-gqa"]
    ps = mixed_tasks(256, n=24)
    opts = dict(gpu_batch_size=2, num_gpu_batches=2, sort_window=6, ignore_eos=True, progress=False)
    got = {}
    for share in (True, False):
        with LLM(str(tm.path), share_prefix=share, **opts) as llm:
            got[share] = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
            fraction = llm.metrics["shared_prefix_fraction"]
        assert (fraction > 0.6) == share, fraction  # 28 of each row's 30-38 positions, but one per task
    assert got[True] == got[False] == reference_generate(tm, ps, GEN)


def test_sharing_is_off_where_a_layer_cannot_start_mid_sequence(models: dict) -> None:
    with LLM(str(models["llama-gqa"].path), progress=False) as llm:
        spec = llm.model.spec
    assert shares_prefix(spec)

    class Other:  # what shares_prefix reads of a spec
        num_layers = 2

        def __init__(self, tensors: int, linear: bool) -> None:
            self.cache_tensors, self.lin = tensors, linear

        def linear(self, layer: int) -> bool:
            return self.lin and layer == 0

    assert shares_prefix(Other(2, False))  # type: ignore[arg-type]
    assert not shares_prefix(Other(1, False))  # type: ignore[arg-type]  # DeepSeek-V3's latent cache
    assert not shares_prefix(Other(2, True))  # type: ignore[arg-type]  # Qwen3-Next's recurrent state


def test_the_prefixs_keys_are_in_the_predicted_peak(models: dict) -> None:
    with LLM(str(models["llama-gqa"].path), progress=False) as llm:
        spec = llm.model.spec
    pol = Policy(gpu_batch_size=4, num_gpu_batches=2)
    kw = dict(has_embed=True, has_head=True, prompt_len=64, gen_len=8, dtype_bytes=4)
    base = predict_peaks(spec, pol, (0, spec.num_layers), **kw)
    more = predict_peaks(spec, pol, (0, spec.num_layers), shared=40, **kw)
    assert more["gpu"] - base["gpu"] == 40 * (2 * spec.kv_dim * 4 * spec.num_layers + 2 * spec.hidden_size * 4)


@pytest.mark.parametrize("decode_tokens", [0, 3])
def test_scoring_after_the_prefix_shares_it(models: dict, decode_tokens: int) -> None:
    """Few-shot scoring (``first_scored`` past a common context, as a log-likelihood request
    scores only its continuation): the context's positions are computed once per block (the
    prefix's row passes no head; it never covers a scored position), and the scores, the
    per-token log-probabilities and their ranks equal the unshared run's and transformers'."""
    from test_logprobs import assert_matches

    tm = models["llama-gqa"]
    seqs = prompts(256, tails=TWO_BLOCKS)
    first = [PREFIX] * len(seqs)  # from the context's last token (so the prefix stops one short), or
    first[1] = PREFIX + 3  # a few tokens later
    got, fraction = {}, {}
    for share in (True, False):
        with LLM(str(tm.path), share_prefix=share, gpu_batch_size=2, num_gpu_batches=3, progress=False) as llm:
            got[share] = llm.score(seqs, first_scored=first, decode_tokens=decode_tokens, logprobs=2)
            fraction[share] = llm.metrics["shared_prefix_fraction"]
    assert fraction[True] > 0.5 and fraction[False] == 0
    for a, b, seq, f in zip(got[True], got[False], seqs, first):
        with torch.no_grad():
            ref = tm.model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
        assert a.count == b.count == len(seq) - f and a.correct == b.correct and a.ranks == b.ranks
        assert a.nll == pytest.approx(b.nll, rel=1e-5)
        assert_matches(a.logprobs, seq[f:], ref[f - 1:len(seq) - 1], 2)
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=3, progress=False) as llm:  # scored from token 1
        llm.score(seqs)
        assert llm.metrics.get("shared_prefix_fraction", 0) == 0


def test_scoring_and_the_cli_switch(models: dict, tmp_path: Path) -> None:
    from flexgen_dist.run import main

    tm = models["llama-gqa"]
    ps = prompts(256)
    with LLM(str(tm.path), gpu_batch_size=3, num_gpu_batches=2, progress=False) as llm:
        scored = [(s.nll, s.count) for s in llm.score(ps)]  # every position scored: nothing shared
        assert llm.metrics.get("shared_prefix_fraction", 0) == 0
    with LLM(str(tm.path), gpu_batch_size=3, num_gpu_batches=2, progress=False, share_prefix=False) as llm:
        assert [(s.nll, s.count) for s in llm.score(ps)] == scored
    out, metrics = tmp_path / "o.jsonl", tmp_path / "m.json"
    base = ["--model", str(tm.path), "--prompts", str(write_jsonl(tmp_path / "p.jsonl", ps)), "--gen-len", str(GEN),
            "--ignore-eos", "--gpu-batch-size", "3", "--num-gpu-batches", "2", "--no-progress", "--output", str(out),
            "--metrics", str(metrics), "--overwrite"]
    assert main(base) == 0
    shared = [r["tokens"] for r in read_jsonl(out)]
    assert json.loads(metrics.read_text())["shared_prefix_fraction"] > 0
    assert main(base + ["--no-share-prefix"]) == 0
    assert [r["tokens"] for r in read_jsonl(out)] == shared == reference_generate(tm, ps, GEN)
    assert json.loads(metrics.read_text())["shared_prefix_fraction"] == 0


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("items", ["block", "batch", "grouped"])
def test_two_ranks_pass_the_prefix_on_with_the_first_batch(models: dict, items: str, tmp_path: Path) -> None:
    """Prefill items per block and per GPU batch, two blocks of one prefix (the second reuses
    the first's keys and values on each rank); and requests grouped by opening on rank 0, the
    groups sent to rank 1 with the lengths (both must cut the same blocks)."""
    tm = models["mistral"]
    ps = mixed_tasks(256, n=24) if items == "grouped" else prompts(256, tails=TWO_BLOCKS)
    shape = ["--num-gpu-batches", "2", "--sort-window", "6", "--prefill-items", "block"] if items == "grouped" else \
        ["--num-gpu-batches", "3", "--prefill-items", items, "--sort-window", "0"]
    out, metrics = tmp_path / "o.jsonl", tmp_path / "m.json"
    r = local_ranks(["-m", "flexgen_dist.run", "--model", str(tm.path), "--prompts",
                     str(write_jsonl(tmp_path / "p.jsonl", ps)), "--gen-len", str(GEN), "--ignore-eos",
                     "--gpu-batch-size", "2", *shape,
                     "--no-progress", "--output", str(out), "--metrics", str(metrics)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == [reference_generate(tm, [p], GEN)[0] for p in ps]
    assert json.loads(metrics.read_text())["shared_prefix_fraction"] > 0.6


@pytest.mark.gpu
def test_on_the_gpu_the_shared_prefix_gives_the_cpus_tokens(models: dict, gpu_device, tmp_path: Path) -> None:
    """float32 on the device, weights and cache partly on the host: the tokens of the CPU run
    (which equal transformers', above), with the prefix shared and without."""
    tm = models["mistral"]
    ps = prompts(256)
    outs = {}
    for dev, share in (("cpu", True), (gpu_device.type, True), (gpu_device.type, False)):
        with LLM(str(tm.path), device=dev, dtype="float32", share_prefix=share, gpu_batch_size=2, num_gpu_batches=3,
                 percent=(50, 50, 50, 50, 100, 0), ignore_eos=True, progress=False,
                 offload_dir=str(tmp_path / "off")) as llm:
            outs[(dev, share)] = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
    assert len({json.dumps(v) for v in outs.values()}) == 1


def test_the_planner_expects_what_the_prefixes_save(models: dict, tmp_path: Path) -> None:
    """The cost model counts a block's prefill as its rows' positions less what the shared
    prefixes save (``prefix_shape.PrefixShape``): one opening every prompt shares (the first block
    computes it once, the next take its keys), tasks interleaved each with its own prefix
    (which grouping by opening shares), a prompt that begins otherwise; nothing where scoring or
    with sharing off. ``explain``'s predicted prefill moves with it, and the planner's CLI takes
    a call-wide prefix (``--shared-prefix``)."""
    from flexgen_dist.config import RunConfig
    from flexgen_dist.planner.cli import main as planner
    from flexgen_dist.planner.sizes import WorkShape
    from flexgen_dist.workloads import build_workload

    with LLM(str(models["llama-gqa"].path), progress=False) as llm:
        spec, tok = llm.model.spec, llm.tokenizer
    ps = prompts(256)  # 6 prompts, 24 tokens in common
    shape = build_workload(ps, GEN, None, RunConfig(), spec, tok).prefix
    assert shape is not None
    assert shape.saved(6) == 5 * PREFIX  # one block: its prefix row computes them once
    assert shape.saved(2) == (PREFIX + 2 * PREFIX + 2 * PREFIX) / 3  # the 2nd and 3rd take the 1st's
    assert shape.saved(1) == 0  # a block of one prompt shares nothing
    assert build_workload(ps, GEN, None, RunConfig(share_prefix=False), spec, tok).prefix is None
    assert build_workload(ps, GEN, None, RunConfig(), spec, tok, scoring=True).prefix is None
    odd = build_workload([p[3:] if n else p for n, p in enumerate(ps)], GEN, None, RunConfig(), spec, tok).prefix
    assert odd is not None and odd.saved(6) == 0 and 0 < odd.saved(2) < shape.saved(2)
    mixed = build_workload(mixed_tasks(256), GEN, None, RunConfig(), spec, tok).prefix
    assert mixed is not None and mixed.saved(4) == 3 * 28  # each task's 28 tokens, once per block
    assert mixed.saved(12) == 0  # one block of three tasks: 8 tokens in common, under the minimum
    assert WorkShape(40, GEN, 4, prefix=mixed).prefill_rows(4) == 4 * 40 - 84
    assert WorkShape(40, GEN, 4).prefill_rows(4) == 160

    hw = str(REPO / "configs/hardware/cpu-2core.yaml")
    pre = {}
    for share in (True, False):
        with LLM(str(models["llama-gqa"].path), gpu_batch_size=4, num_gpu_batches=1, hardware=hw,
                 share_prefix=share, progress=False) as llm:
            pre[share] = llm.explain(mixed_tasks(256), gen_len=GEN).stages[0].prefill_s
    assert pre[True] < pre[False]

    pred = {}
    for shared in (0, 448):
        out = tmp_path / f"plan-{shared}.json"
        assert planner(["plan", "--model", "opt-6.7b", "--hardware", str(REPO / "configs/hardware/t4.yaml"), "--prompt-len", "512",
                        "--shared-prefix", str(shared), "--json", str(out)]) == 0
        pred[shared] = json.loads(out.read_text())[0]["predicted"]
    assert pred[448]["prefill_throughput"] > 3 * pred[0]["prefill_throughput"]
    # OPT holds the prefix once through decode (``engine/held.py``): each step reads each row's cache less it
    assert pred[448]["decode_throughput"] > 1.5 * pred[0]["decode_throughput"]
