"""Beam search (``LLM.beam_search``, batch requests' ``use_beam_search``): each prompt's best
hypotheses and their scores equal transformers' ``generate(num_beams=k)`` in float32, token
for token, for every beam width, length penalty and early stopping, with hypotheses that end
at EOS or a stop id mid-search, on the placements that reorder the cache in place (the
compute device, RAM with merged decode, disk, 4-bit groups), on one rank and two."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, local_ranks
from flexgen_dist import LLM, ConfigError, SamplingConfig

T = 8
EOS = 2


def hf_beams(tm, prompt: list[int], k: int, gen: int = T, *, lp: float = 1.0, early: bool | str = False,
             ends: tuple[int, ...] = (EOS,), returns: int | None = None, min_new: int = 0,
             bad: list[list[int]] | None = None) -> list[tuple[list[int], float]]:
    """transformers' beam search of one prompt: (ids up to and including its end, score), best first."""
    with torch.no_grad():
        out = tm.model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                dtype=torch.long), max_new_tokens=gen, num_beams=k, do_sample=False,
                                length_penalty=lp, early_stopping=early, num_return_sequences=returns or k,
                                eos_token_id=list(ends), pad_token_id=tm.pad_id, min_new_tokens=min_new,
                                bad_words_ids=bad, output_scores=True, return_dict_in_generate=True)
    res = []
    for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        n = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        res.append((row[:n], score))
    return res


def ours(outs) -> list[list[tuple[list[int], float]]]:
    return [[(c.token_ids, c.score) for c in o.sequences] for o in outs]


def same(got, want) -> None:
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [s for _, s in g] == pytest.approx([s for _, s in w], abs=1e-4)
    assert len(got) == len(want)


def stop_ids(tm, k: int) -> tuple[int, ...]:
    """Ids that end some hypotheses mid-search: the second token of each prompt's best beam."""
    return tuple(sorted({hf_beams(tm, p, k)[0][0][1] for p in PROMPTS[:3]}))


@pytest.mark.parametrize("k", [2, 3, 4])
def test_hypotheses_and_scores_equal_transformers(k: int, tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    with LLM(str(tm.path), gpu_batch_size=2 * k, num_gpu_batches=2, progress=False) as llm:
        got = ours(llm.beam_search(PROMPTS, beam_width=k, max_tokens=T))
    assert got == [[(t, pytest.approx(s, abs=1e-4)) for t, s in hf_beams(tm, p, k)] for p in PROMPTS]


@pytest.mark.parametrize("lp,early", [(1.0, False), (0.0, "never"), (2.0, True), (-1.0, False), (1.5, "never")])
def test_hypotheses_that_end_midway_rank_as_transformers_ranks_them(lp: float, early, tiny_models) -> None:
    tm = tiny_models["opt-post-proj"]
    ends = stop_ids(tm, 3)
    cfg = SamplingConfig(stop_token_ids=ends)
    with LLM(str(tm.path), gpu_batch_size=6, num_gpu_batches=1, progress=False) as llm:
        outs = llm.beam_search(PROMPTS, beam_width=3, max_tokens=T, length_penalty=lp, early_stopping=early,
                               sampling=cfg)
    want = [hf_beams(tm, p, 3, lp=lp, early=early, ends=(EOS, *ends)) for p in PROMPTS]
    same(ours(outs), want)
    short = [len(t) < T for w in want for t, _ in w]
    if lp > 1 and early == "never":  # a longer hypothesis is worth more: none that ended early is kept
        assert not any(short)
        return
    assert any(short)  # some hypotheses ended at a stop id
    assert {c.finish_reason for o in outs for c in o.sequences} == {"stop", "length"}


@pytest.mark.parametrize("policy", [
    dict(percent=(100, 0, 100, 0, 100, 0)),
    dict(percent=(0, 100, 0, 100, 100, 0), num_gpu_batches=3),  # RAM: merged decode over the batches
    dict(percent=(50, 50, 0, 0, 100, 0), cpu_attention=True),  # the cache on disk, rewritten when it moves
    dict(percent=(100, 0, 0, 100, 100, 0), compress_cache=True),  # 4-bit groups
], ids=["device", "ram-merged", "disk", "compressed"])
def test_each_cache_placement_follows_its_beams(policy: dict, tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    ends = stop_ids(tm, 2)
    with LLM(str(tm.path), gpu_batch_size=4, offload_dir=str(tmp_path / "off"), progress=False,
             **{"num_gpu_batches": 1, **policy}) as llm:
        outs = llm.beam_search(PROMPTS, beam_width=2, max_tokens=T, sampling=SamplingConfig(stop_token_ids=ends))
    got = ours(outs)
    if policy.get("compress_cache"):  # 4-bit keys and values move the scores a little: the same on any tier
        with LLM(str(tm.path), gpu_batch_size=4, offload_dir=str(tmp_path / "off2"), percent=(100, 0, 0, 0, 100, 0),
                 compress_cache=True, progress=False) as llm:
            on_disk = ours(llm.beam_search(PROMPTS, beam_width=2, max_tokens=T,
                                           sampling=SamplingConfig(stop_token_ids=ends)))
        # the same beams; the scores to rounding: each placement runs the products of its own
        # shapes, and the GEMM policy (timed on each machine) may pick another form for one
        same(on_disk, got)
        return
    same(got, [hf_beams(tm, p, 2, ends=(EOS, *ends)) for p in PROMPTS])


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"])
@pytest.mark.parametrize("compress", [False, True])
def test_a_reorder_moves_every_held_position_of_each_row(tier: str, compress: bool, tmp_path: Path,
                                                         monkeypatch) -> None:
    """``BlockCache.reorder`` then a decode write: row r holds what row perm[r] held (its
    compressed groups whole), the new position written after; the rows move a few positions
    at a time (a bounded temporary)."""
    from flexgen_dist.engine import cache_layout
    from flexgen_dist.engine.kvcache import BlockCache
    from flexgen_dist.memory.disk import DiskStore
    from flexgen_dist.memory.quant import dequantize
    from flexgen_dist.memory.tiers import MemoryTracker

    b, kvh, d, s = 4, 2, 16, 5
    monkeypatch.setattr(cache_layout, "PERMUTE_BYTES", 2 * b * kvh * d)  # two positions' rows a piece (dense)
    fractions = {"gpu": (1.0, 0.0, 0.0), "cpu": (0.0, 1.0, 0.0), "disk": (0.0, 0.0, 1.0)}[tier]
    disk = DiskStore(str(tmp_path)) if tier == "disk" else None
    cache = BlockCache([0], [b], kvh, s + 2, d, fractions, torch.device("cpu"), torch.float32, MemoryTracker(), disk,
                       cpu_attention=True, compress=compress, group_size=8)
    torch.manual_seed(0)
    k, v = torch.randn(b, s, kvh, d), torch.randn(b, s, kvh, d)
    cache.write_prefill(0, 0, k, v)
    if tier == "disk":
        for f in cache.store(0, 0):
            f.result()

    def held(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ch = cache.chunks[(0, 0)][0]
        if tier == "disk":
            cache.load(0, 0, n)
            for f in ch.futures:
                f.result()
            kk, vv = ch.staged
            out = tuple((dequantize(x, torch.device("cpu")) if compress else x)[:n].transpose(0, 1) for x in (kk, vv))
            cache.store(0, 0)
            return out
        return tuple((dequantize(x, torch.device("cpu")) if compress else x)[:, :n].clone() for x in (ch.k, ch.v))

    before = held(s)
    perm = torch.tensor([2, 2, 0, 3])
    cache.reorder({0: perm})
    rows = (perm[:, None] * kvh + torch.arange(kvh)).reshape(-1)
    if tier == "disk":
        cache.load(0, 0, s)
    q = torch.randn(b * kvh, 1, 1, d)
    kn, vn = torch.randn(b * kvh, 1, d), torch.randn(b * kvh, 1, d)
    cache.attend(0, 0, q, kn, vn, torch.ones(b * kvh, 1, 1, s + 1, dtype=torch.bool), s)
    if tier == "disk":
        for f in cache.store(0, 0):
            f.result()
    after = held(s + 1)
    for x, y in zip(before, after):
        assert torch.equal(y[:, :s], x[rows])
    if not compress:
        assert torch.equal(after[0][:, s], kn[:, 0]) and torch.equal(after[1][:, s], vn[:, 0])
    cache.free()


def test_long_prompts_share_their_prefix_across_beams(tiny_models) -> None:
    """A prompt's beams are the same prompt: its prefix is computed once for them (and for the
    block's other prompts where they share it), each beam computing its last position."""
    tm = tiny_models["llama-gqa"]
    opening = list(range(30, 60))
    prompts = [opening + [7, 8], opening + [9], list(range(100, 124)), opening + [5, 6, 7], opening + [11, 12],
               opening + [13]]
    with LLM(str(tm.path), gpu_batch_size=4, num_gpu_batches=1, progress=False) as llm:
        outs = llm.beam_search(prompts, beam_width=2, max_tokens=T)
        shared = llm.metrics["shared_prefix_fraction"]
    same(ours(outs), [hf_beams(tm, p, 2) for p in prompts])
    assert shared > 0.4


def test_returns_min_tokens_and_bad_words(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    best = hf_beams(tm, PROMPTS[0], 4)[0][0]
    cfg = SamplingConfig(min_tokens=3, stop_token_ids=(best[0], best[2]), bad_words_ids=((best[1],),))
    with LLM(str(tm.path), gpu_batch_size=4, progress=False) as llm:
        outs = llm.beam_search(PROMPTS[:3], beam_width=4, max_tokens=T, num_return_sequences=2, sampling=cfg)
    want = [hf_beams(tm, p, 4, returns=2, min_new=3, ends=(EOS, best[0], best[2]), bad=[[best[1]]])
            for p in PROMPTS[:3]]
    same(ours(outs), want)
    assert [len(o.sequences) for o in outs] == [2, 2, 2] and [o.index for o in outs] == [0, 1, 2]


@pytest.mark.parametrize("kind,opts", [
    ("next", dict(num_gpu_batches=1)),
    ("next", dict(num_gpu_batches=2, state_percent=(0, 0))),  # states staged from disk around their layer
    ("3.5", dict(num_gpu_batches=2, percent=(0, 100, 0, 100, 100, 0), state_percent=(0, 100))),  # merged decode
], ids=["device", "disk-states", "ram-merged"])
def test_linear_attention_states_follow_their_beams(kind: str, opts: dict, tmp_path: Path) -> None:
    """Qwen3-Next and Qwen3.5: after each step every linear layer's states move to the beams
    that continue them (as the attention layers' cache rows), wherever they live; hypotheses
    and scores equal transformers'."""
    from test_qwen3_next import PROMPTS as LONG, _model

    tm = _model(kind, tmp_path / kind)
    ps = [LONG[0], LONG[1], LONG[3], LONG[2][:40]]
    with LLM(str(tm.path), gpu_batch_size=4, offload_dir=str(tmp_path / "off"), progress=False, **opts) as llm:
        got = ours(llm.beam_search(ps, beam_width=2, max_tokens=T, sampling=SamplingConfig(stop_token_ids=(EOS,))))
    same(got, [hf_beams(tm, p, 2) for p in ps])  # (this config names no EOS: 2 as a stop id)


def test_the_planners_split_cache_is_put_on_one_tier(tiny_models, tmp_path: Path) -> None:
    """``policy="auto"`` under a budget where the cost model splits the cache over tiers: for a
    beam search the plan keeps it whole on the highest tier that fits (and says so), and the
    hypotheses are transformers'."""
    from flexgen_dist.engine.beams import one_tier_caches
    from flexgen_dist.engine.policy import Policy

    tm = tiny_models["llama-gqa"]
    opts = dict(policy="auto", hardware=str(Path(__file__).resolve().parents[1] / "configs/hardware/cpu-2core.yaml"),
                gpu_mem="1MB", cpu_mem="4MB", offload_dir=str(tmp_path / "off"), progress=False)
    with LLM(str(tm.path), **opts) as llm:  # the planner's own choice for these rows: 14 % / 86 % of the cache
        outs = llm.beam_search(PROMPTS * 4, beam_width=2, max_tokens=64)
        p = llm.plan.stages[0].policy
        why = [c for c in llm.plan.choices if c.name == "cache percent"]
    assert sum(1 for t in (p.cache_gpu_percent, p.cache_cpu_percent, p.cache_disk_percent) if t) == 1
    assert why and "a beam search reorders each GPU batch's cache on one tier" in why[0].why
    given = dict(gpu_batch_size=p.gpu_batch_size, num_gpu_batches=p.num_gpu_batches, percent=p.percent(),
                 cpu_attention=p.cpu_attention)
    with LLM(str(tm.path), offload_dir=str(tmp_path / "off2"), progress=False, **given) as llm:
        assert ours(llm.beam_search(PROMPTS * 4, beam_width=2, max_tokens=64)) == ours(outs)
        short = ours(llm.beam_search(PROMPTS, beam_width=2, max_tokens=T))  # the placement's searches are transformers'
    same(short, [hf_beams(tm, q, 2) for q in PROMPTS])
    assert one_tier_caches(Policy(cache_gpu_percent=30, cache_cpu_percent=50)) == [
        Policy(cache_gpu_percent=100, cache_cpu_percent=0), Policy(cache_gpu_percent=0, cache_cpu_percent=100),
        Policy(cache_gpu_percent=0, cache_cpu_percent=0)]
    assert one_tier_caches(Policy(cache_gpu_percent=0, cache_cpu_percent=40)) == [
        Policy(cache_gpu_percent=0, cache_cpu_percent=100), Policy(cache_gpu_percent=0, cache_cpu_percent=0)]
    assert one_tier_caches(Policy(cache_gpu_percent=0, cache_cpu_percent=100)) == [
        Policy(cache_gpu_percent=0, cache_cpu_percent=100)]


def test_what_a_beam_search_refuses(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    with LLM(str(tm.path), gpu_batch_size=4, progress=False) as llm:
        with pytest.raises(ConfigError, match="needs a GPU batch size that is a multiple of 3"):
            llm.beam_search(PROMPTS[:2], beam_width=3, max_tokens=4)
        with pytest.raises(ConfigError, match="give temperature 0"):
            llm.beam_search(PROMPTS[:2], beam_width=2, sampling=SamplingConfig(temperature=0.7))
        with pytest.raises(ConfigError, match="no penalties"):
            llm.beam_search(PROMPTS[:2], beam_width=2, sampling=SamplingConfig(presence_penalty=1.0))
        with pytest.raises(ConfigError, match="early_stopping 'soon'"):
            llm.beam_search(PROMPTS[:2], beam_width=2, early_stopping="soon")
        with pytest.raises(ConfigError, match="num_return_sequences 3"):
            llm.beam_search(PROMPTS[:2], beam_width=2, num_return_sequences=3)
    with LLM(str(tm.path), gpu_batch_size=2, percent=(100, 0, 50, 50, 100, 0), progress=False) as llm:
        with pytest.raises(ConfigError, match="on one tier"):
            llm.beam_search(PROMPTS[:2], beam_width=2, max_tokens=4)


def test_the_default_block_holds_whole_prompts(tiny_models) -> None:
    """Without a GPU batch size the plan's is a multiple of the beam width."""
    tm = tiny_models["llama-gqa"]
    with LLM(str(tm.path), progress=False) as llm:
        outs = llm.beam_search(PROMPTS, beam_width=3, max_tokens=4)
        assert llm.plan.stages[0].policy.gpu_batch_size % 3 == 0
    same(ours(outs), [hf_beams(tm, p, 3, gen=4) for p in PROMPTS])


def test_batch_requests_use_beam_search(tiny_models) -> None:
    """vLLM's ``use_beam_search``: a request's n choices are its n best beams, best first; the
    plan's GPU batch holds every width's beams; other requests run beside them."""
    tm = tiny_models["llama-gqa"]
    url = "/v1/completions"
    reqs = [{"custom_id": "b2", "url": url, "body": {"prompt": PROMPTS[0], "max_tokens": T, "n": 2,
                                                     "use_beam_search": True}},
            {"custom_id": "greedy", "url": url, "body": {"prompt": PROMPTS[1], "max_tokens": T}},
            {"custom_id": "b3", "url": url, "body": {"prompt": PROMPTS[2], "max_tokens": 6, "n": 3,
                                                     "use_beam_search": True, "length_penalty": 0.5}},
            {"custom_id": "b2-again", "url": url, "body": {"prompt": PROMPTS[3], "max_tokens": T, "n": 2,
                                                           "use_beam_search": True}},
            {"custom_id": "stop", "url": url, "body": {"prompt": PROMPTS[0], "n": 2, "use_beam_search": True,
                                                       "stop": ["x"]}},
            {"custom_id": "hot", "url": url, "body": {"prompt": PROMPTS[0], "n": 2, "use_beam_search": True,
                                                      "temperature": 0.8}},
            {"custom_id": "flag", "url": url, "body": {"prompt": PROMPTS[0], "use_beam_search": "yes"}}]
    with LLM(str(tm.path), progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
        assert llm.plan.stages[0].policy.gpu_batch_size % 6 == 0
    ids = {k: [c["token_ids"] for c in out[k]["response"]["body"]["choices"]] for k in ("b2", "b3", "b2-again")}
    assert ids["b2"] == [t for t, _ in hf_beams(tm, PROMPTS[0], 2)]
    assert ids["b3"] == [t for t, _ in hf_beams(tm, PROMPTS[2], 3, 6, lp=0.5)]
    assert ids["b2-again"] == [t for t, _ in hf_beams(tm, PROMPTS[3], 2)]
    greedy = out["greedy"]["response"]["body"]["choices"]
    assert len(greedy) == 1 and len(greedy[0]["token_ids"]) == T
    assert "use_beam_search does not take stop: give stop_token_ids" in out["stop"]["error"]["message"]
    assert "a sampling temperature" in out["hot"]["error"]["message"]
    assert "use_beam_search 'yes': true or false" in out["flag"]["error"]["message"]


def test_a_block_ends_once_every_search_is_over(tiny_models) -> None:
    """early_stopping=True: a prompt is done with its k hypotheses; the block's remaining steps
    are skipped when all of its prompts are."""
    tm = tiny_models["opt-post-proj"]
    ends = tuple(sorted({t for p in PROMPTS for t in hf_beams(tm, p, 2)[0][0][1:3]}))
    with LLM(str(tm.path), gpu_batch_size=4, num_gpu_batches=3, progress=False) as llm:
        outs = llm.beam_search(PROMPTS, beam_width=2, max_tokens=16, early_stopping=True,
                               sampling=SamplingConfig(stop_token_ids=ends))
        steps = llm.metrics["stage_times"][0]["token_steps"]
    same(ours(outs), [hf_beams(tm, p, 2, 16, early=True, ends=(EOS, *ends)) for p in PROMPTS])
    assert steps < 16  # one block of 12 rows, ended early


def test_the_planners_gpu_batch_holds_whole_prompts(tiny_models) -> None:
    """--policy auto: the planner's GPU batch size rounded to a multiple of the width."""
    tm = tiny_models["llama-gqa"]
    hw = Path(__file__).resolve().parents[1] / "configs" / "hardware" / "cpu-2core.yaml"
    with LLM(str(tm.path), policy="auto", hardware=str(hw), progress=False) as llm:
        outs = llm.beam_search(PROMPTS, beam_width=3, max_tokens=4)
        gbs = llm.plan.stages[0].policy.gpu_batch_size
    assert gbs % 3 == 0
    same(ours(outs), [hf_beams(tm, p, 3, gen=4) for p in PROMPTS])


@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.parametrize("opts", [{}, {"num_micro_batches": 2, "prefill_items": "batch", "early_stopping": True},
                                  {"schedule": "overlapped", "num_micro_batches": 2}],
                         ids=["plain", "groups-early", "overlapped"])
def test_two_ranks_pass_the_parents_along(opts: dict, tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["opt-post-proj"]
    ends = tuple(sorted({t for p in PROMPTS for t in hf_beams(tm, p, 2)[0][0][1:3]}))
    early = opts.pop("early_stopping", False)
    script = tmp_path / "beams.py"
    out = tmp_path / "out.json"
    script.write_text(f"""
import json
from flexgen_dist import LLM, SamplingConfig
with LLM({str(tm.path)!r}, gpu_batch_size=2, num_gpu_batches=1, progress=False, **{opts!r}) as llm:
    outs = llm.beam_search({PROMPTS!r}, beam_width=2, max_tokens=12, early_stopping={early!r},
                           sampling=SamplingConfig(stop_token_ids={ends!r}))
    if llm.is_driver:
        json.dump([[[c.token_ids, c.score] for c in o.sequences] for o in outs], open({str(out)!r}, "w"))
""")
    r = local_ranks([str(script)], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [[(t, s) for t, s in o] for o in json.loads(out.read_text())]
    same(got, [hf_beams(tm, p, 2, 12, early=early, ends=(EOS, *ends)) for p in PROMPTS])


@pytest.mark.slow
@pytest.mark.multinode
def test_a_batch_job_of_beam_searches_on_two_ranks(tiny_models, tmp_path: Path) -> None:
    """The batch CLI on two ranks: the other rank makes the same beam calls (one per setting),
    and a request the plan cannot hold gets its error line."""
    tm = tiny_models["llama-gqa"]
    url = "/v1/completions"
    reqs = [{"custom_id": "b2", "url": url, "body": {"prompt": PROMPTS[0], "max_tokens": T, "n": 2,
                                                     "use_beam_search": True}},
            {"custom_id": "g", "url": url, "body": {"prompt": PROMPTS[1], "max_tokens": T}},
            {"custom_id": "b3", "url": url, "body": {"prompt": PROMPTS[2], "max_tokens": T, "n": 3,
                                                     "use_beam_search": True}},
            {"custom_id": "b2-short", "url": url, "body": {"prompt": PROMPTS[4], "max_tokens": 4, "n": 2,
                                                           "use_beam_search": True, "early_stopping": True}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    r = local_ranks(["-m", "flexgen_dist.batch", "--model", str(tm.path), "-i", str(inp), "-o", str(out),
                     "--gpu-batch-size", "4", "--no-progress"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert [c["token_ids"] for c in lines["b2"]["response"]["body"]["choices"]] == \
        [t for t, _ in hf_beams(tm, PROMPTS[0], 2)]
    assert [c["token_ids"] for c in lines["b2-short"]["response"]["body"]["choices"]] == \
        [t for t, _ in hf_beams(tm, PROMPTS[4], 2, 4, early=True)]
    assert "multiple of 3" in lines["b3"]["error"]["message"] and "--gpu-batch-size" in lines["b3"]["error"]["message"]
    assert len(lines["g"]["response"]["body"]["choices"][0]["token_ids"]) == T


def test_the_cli_writes_the_best_and_its_rivals(tiny_models, prompts_file: Path, tmp_path: Path, capsys) -> None:
    from conftest import read_jsonl
    from flexgen_dist.run import main

    tm = tiny_models["llama-gqa"]
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    out = tmp_path / "out.jsonl"
    assert main(["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(T), "--beam-width", "3",
                 "--num-return-sequences", "2", "--length-penalty", "0.5", "--output", str(out),
                 "--no-progress"]) == 0
    for line, p in zip(read_jsonl(out), prompts):
        want = hf_beams(tm, p, 3, lp=0.5, returns=2)
        assert line["tokens"] == want[0][0] and line["score"] == pytest.approx(want[0][1], abs=1e-4)
        assert [b["tokens"] for b in line["beams"]] == [t for t, _ in want]
    fp = json.loads((tmp_path / "out.jsonl.run.json").read_text())
    assert fp["beams"] == {"width": 3, "length_penalty": 0.5, "early_stopping": False, "num_return": 2}
    assert "x 3 beams" in capsys.readouterr().out
    assert main(["--model", str(tm.path), "--num-prompts", "2", "--length-penalty", "2"]) == 2
    assert "give --beam-width K" in capsys.readouterr().err
