"""The offloading engine: every placement gives the reference tokens; tiers, files, budgets."""
from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, copy_with_eos, read_jsonl, reference_generate, write_jsonl
from flexgen_dist.engine.footprint import predict_peaks
from flexgen_dist.distributed.local import generate
from flexgen_dist.engine.policy import Policy
from flexgen_dist.engine.sampling import SamplingConfig
from flexgen_dist.engine.stage import StageEngine
from flexgen_dist.memory.disk import DiskStore
from flexgen_dist.memory.tiers import Tier
from flexgen_dist.models.loader import load_model
from flexgen_dist.run import main

PLACEMENTS = {
    "all-compute": (100, 0, 100, 0, 100, 0),
    "weights-cpu": (0, 100, 0, 100, 0, 100),
    "all-disk": (0, 0, 0, 0, 0, 0),
    "mixed": (30, 30, 20, 50, 50, 50),
}
GEN = 6


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_every_placement_matches_transformers(kind: str, tiny_models, tmp_path: Path) -> None:
    tm = tiny_models[kind]
    lm = load_model(str(tm.path), load_tokenizer=False)
    ref = reference_generate(tm, PROMPTS, GEN)
    for (name, pct), overlap, cpu_att in itertools.product(PLACEMENTS.items(), [True, False], [True, False]):
        with DiskStore(tmp_path / "off") as disk:
            eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                              policy=Policy(2, 2, *pct, overlap=overlap, cpu_attention=cpu_att),
                              device=torch.device("cpu"), dtype=torch.float32, disk=disk)
            outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
            eng.close()
        assert outs == ref, (name, overlap, cpu_att)


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_unpadded_prefill_runs_causal_attention_without_a_mask(kind: str, tiny_models, tmp_path: Path,
                                                              monkeypatch) -> None:
    """A GPU batch whose prompts are all of the block's length attends with SDPA's causal
    kernel (no mask built); a padded one with its mask; the tokens equal transformers'."""
    from flexgen_dist.engine import attend

    tm = tiny_models[kind]
    prompts = [[30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52], [60, 61, 62, 63]]
    ref = reference_generate(tm, prompts, GEN)
    masks: list[bool] = []
    real = attend.prefill_attention
    monkeypatch.setattr(attend, "prefill_attention",
                        lambda q, k, v, mask, *a: masks.append(mask is None) or real(q, k, v, mask, *a))
    lm = load_model(str(tm.path), load_tokenizer=False)
    eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                      policy=Policy(2, 2), device=torch.device("cpu"), dtype=torch.float32)
    outs, _ = generate(eng, prompts, GEN, SamplingConfig(ignore_eos=True))
    eng.close()
    assert outs == ref
    layers = lm.spec.num_layers
    assert sorted(masks) == [False] * layers + [True] * layers  # one padded GPU batch, one not


def test_cli_offload_flags_match_and_leave_no_files(tiny_models, tmp_path: Path, capsys) -> None:
    tm = tiny_models["opt-post-proj"]
    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    off, out = tmp_path / "off", tmp_path / "o.jsonl"
    rc = main(["--model", str(tm.path), "--prompts", str(p), "--gen-len", str(GEN), "--ignore-eos",
               "--percent", "0", "0", "0", "0", "0", "0", "--gpu-batch-size", "2", "--num-gpu-batches", "3",
               "--offload-dir", str(off), "--output", str(out), "--no-progress", "--metrics", str(tmp_path / "m.json")])
    assert rc == 0
    assert [r["tokens"] for r in read_jsonl(out)] == reference_generate(tm, PROMPTS, GEN)
    assert off.is_dir() and list(off.iterdir()) == []  # the per-rank dir and its files are gone
    import json

    m = json.loads((tmp_path / "m.json").read_text())
    assert m["peak_bytes"][0]["disk"] > 0 and m["direct_io"] in (True, False)


def test_weight_tiers_follow_the_fractions(tmp_path: Path) -> None:
    lm = load_model("opt-125m", dummy_weights=True)
    with DiskStore(tmp_path / "off") as disk:
        eng = StageEngine(lm.spec, lm.source, (0, 4), has_embed=False, has_head=False,
                          policy=Policy(1, 1, 30, 30, 100, 0, 100, 0), device=torch.device("cpu"),
                          dtype=torch.float32, disk=disk)
        by_tier = eng.weights.bytes_per_tier()
        total = sum(by_tier.values())
        largest = max(p.nbytes for ws in eng.weights.placed.values() for p in ws.values())
        for tier, frac in (("gpu", 0.3), ("cpu", 0.3), ("disk", 0.4)):
            assert abs(by_tier[tier] - frac * total) <= 4 * largest / 2, (tier, by_tier)
        for slot, ws in eng.weights.placed.items():
            for name, p in ws.items():
                if p.tier == Tier.DISK:
                    assert Path(p.data.path).is_file()  # a real file per disk tensor
                elif p.tier == Tier.GPU:
                    assert isinstance(p.data, torch.Tensor)
        files = [f for f in Path(disk.dir).iterdir() if f.name != ".owner"]
        assert len(files) == sum(p.tier == Tier.DISK for ws in eng.weights.placed.values() for p in ws.values())
        eng.close()
        d = Path(disk.dir)
    assert not d.exists()


def test_budget_is_refused_with_predicted_peak(tiny_models, capsys) -> None:
    rc = main(["--model", str(tiny_models["opt-pre"].path), "--gpu-mem", "10KiB", "--no-progress", "--num-prompts", "2", "--prompt-len", "4"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: predicted ") and "exceeds --gpu-mem 10.00 KiB" in err
    assert err.count("\n") == 1  # one line


def test_unwritable_offload_dir_fails_before_generation(tiny_models, tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["--model", str(tiny_models["opt-pre"].path), "--percent", "0", "0", "100", "0", "100", "0",
               "--offload-dir", str(blocker / "sub"), "--no-progress", "--num-prompts", "2", "--prompt-len", "8", "--output", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 1 and "error:" in err and "offload" in err.lower()
    assert not (tmp_path / "o.jsonl").exists()


def test_full_disk_is_predicted(tiny_models, tmp_path: Path, capsys, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    rc = main(["--model", str(tiny_models["opt-pre"].path), "--percent", "0", "0", "100", "0", "100", "0",
               "--offload-dir", str(tmp_path / "off"), "--no-progress", "--num-prompts", "2", "--prompt-len", "8"])
    err = capsys.readouterr().err
    assert rc == 1 and "predicted disk peak" in err and "exceeds the 1000 B free in the offload directory" in err


def test_ctrl_c_removes_offload_files(tmp_path: Path) -> None:
    off = tmp_path / "off"
    out = tmp_path / "o.jsonl"
    # A suite started in the background by a non-interactive shell has SIGINT ignored, and an
    # ignored (or blocked) signal stays so across exec (Python then installs no Ctrl-C handler):
    # the run gets SIGINT's default disposition and an open mask, as from a terminal (a handler
    # resets on exec; the mask is the calling thread's).
    here = (signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        proc = subprocess.Popen([sys.executable, "-m", "flexgen_dist.run", "--model", "opt-125m", "--dummy-weights",
                                 "--num-prompts", "4", "--prompt-len", "16", "--gen-len", "400", "--ignore-eos",
                                 "--gpu-batch-size", "1", "--percent", "100", "0", "0", "0", "100", "0",
                                 "--offload-dir", str(off), "--output", str(out), "--no-progress"],
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    finally:
        signal.signal(signal.SIGINT, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (off.is_dir() and any(off.rglob("*-kv-*"))):
            time.sleep(0.2)
        assert any(off.rglob("*-kv-*")), "the run never wrote its KV cache to disk"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:  # where every thread is stuck (faulthandler), then fail
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            raise AssertionError(f"no exit within 150 s of Ctrl-C:\n{err[-6000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, f"(the suite's SIGINT handler and blocked: {here})\n{err}"
    assert "interrupted" in err
    assert list(off.iterdir()) == []


@pytest.mark.parametrize("w_pct", [(100, 0), (0, 100), (0, 0)])
def test_tied_head_is_stored_once_on_a_stage_with_the_embedding(tmp_path: Path, w_pct) -> None:
    from flexgen_dist.models.loader import DummySource
    from flexgen_dist.models.spec import ModelSpec

    spec = ModelSpec(name="t", family="llama", num_layers=2, hidden_size=64, ffn_size=128, num_heads=4,
                     vocab_size=300, max_positions=64, tie_word_embeddings=True)
    src = DummySource(spec, torch.float32)
    assert torch.equal(src.get("head")["tok.w"], src.get("embed")["tok.w"])  # a tied head is the embedding
    pol = Policy(1, 1, *w_pct, 100, 0, 100, 0)
    with DiskStore(tmp_path / "off") as disk:
        one = StageEngine(spec, src, (0, 2), has_embed=True, has_head=True, policy=pol,
                          device=torch.device("cpu"), dtype=torch.float32, disk=disk)
        assert one.weights.placed[("head", None)]["tok.w"] is one.weights.placed[("embed", None)]["tok.w"]
        assert sum(one.weights.bytes_per_tier().values()) == spec.total_numel() * 4
        if w_pct == (0, 0):  # one file for the shared matrix
            files = [f for f in Path(disk.dir).iterdir() if f.name != ".owner"]
            assert len(files) == len(one.weights.unique_placed())
        last = StageEngine(spec, src, (1, 2), has_embed=False, has_head=True, policy=pol,
                           device=torch.device("cpu"), dtype=torch.float32, disk=disk)
        assert "tok.w" in last.weights.placed[("head", None)]  # a head without the embedding keeps its copy
        peak = predict_peaks(spec, pol, (0, 2), has_embed=True, has_head=True, prompt_len=4, gen_len=2,
                             dtype_bytes=4)
        placed = one.weights.bytes_per_tier()
        for tier in ("cpu", "disk"):
            if placed[tier]:
                assert peak[tier] >= placed[tier]
        one.close()
        last.close()


@pytest.mark.parametrize("kind", ["opt-post-proj", "llama-gqa"])
@pytest.mark.parametrize("pct", [(100, 0, 100, 0, 100, 0), (0, 100, 0, 100, 100, 0), (30, 30, 20, 50, 50, 50)])
def test_merged_decode_equals_batch_major(kind: str, pct: tuple, tiny_models, tmp_path: Path,
                                          monkeypatch) -> None:
    """On a CPU device, decode runs each layer (and the head) once over the rows of all GPU
    batches of a block where no I/O sits between them: the same tokens as batch by batch (and
    as transformers), and the merged path is really taken exactly when the layer's cache is
    off disk and the activations are on the device."""
    tm = tiny_models[kind]
    lm = load_model(str(tm.path), load_tokenizer=False)
    ref = reference_generate(tm, PROMPTS, GEN)
    calls = []
    real = StageEngine._compute_merged
    monkeypatch.setattr(StageEngine, "_compute_merged",
                        lambda self, st, i, j, w, n: calls.append((self.slots[j][0], n)) or real(self, st, i, j, w, n))
    outs = {}
    for merged in (True, False):
        if not merged:
            monkeypatch.setattr(StageEngine, "_merged", lambda *a: False)
        with DiskStore(tmp_path / "off") as disk:
            eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                              policy=Policy(2, 3, *pct), device=torch.device("cpu"), dtype=torch.float32, disk=disk)
            outs[merged], _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
            eng.close()
    assert outs[True] == outs[False] == ref
    head = [("head", 3)] if pct[4] == 100 else []
    if pct[4] < 100:  # activations partly off the device: nothing is merged
        assert calls == []
    elif pct[2] + pct[3] < 100:  # the cache is partly on disk: only the head is merged
        assert calls == head * (GEN - 1)
    else:  # every decode step: every layer, then the head, each once with the 3 GPU batches
        assert calls == ([("layer", 3)] * lm.spec.num_layers + head) * (GEN - 1)


@pytest.mark.parametrize("pct,whole", [((100, 0, 100, 0, 100, 0), True), ((0, 100, 0, 100, 100, 0), True),
                                       ((100, 0, 50, 50, 100, 0), False)])
def test_merged_decode_attends_a_whole_layer_at_once(pct: tuple, whole: bool, tiny_models, tmp_path: Path,
                                                     monkeypatch) -> None:
    """Where each GPU batch's cache of a layer is one chunk on one in-memory tier, the chunks
    are slices of one buffer and merged decode writes and attends all of them in one call
    (``BlockCache.attend_layer``); a cache split over tiers keeps one call per batch. The
    tokens equal transformers' and the per-batch calls'."""
    from flexgen_dist.engine.kvcache import BlockCache

    tm = tiny_models["llama-gqa"]
    lm = load_model(str(tm.path), load_tokenizer=False)
    ref = reference_generate(tm, PROMPTS, GEN)
    calls = []
    real = BlockCache.attend_layer
    monkeypatch.setattr(BlockCache, "attend_layer", lambda self, j, *a: calls.append(j) or real(self, j, *a))

    def run(off: str) -> list[list[int]]:
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(2, 3, *pct), device=torch.device("cpu"), dtype=torch.float32)
        outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
        eng.close()
        return outs

    assert run("a") == ref
    assert len(calls) == (lm.spec.num_layers * (GEN - 1) if whole else 0)  # the 6 prompts are one block
    calls.clear()
    monkeypatch.setattr(BlockCache, "whole_layer", lambda self, j: False)
    assert run("b") == ref and calls == []


def test_first_slot_is_read_during_the_sweep_before(tiny_models, tmp_path: Path) -> None:
    """With weights on disk, each sweep's first slot (the embedding) is read while the sweep
    before it computes its last slot: once per sweep, none left over, tokens unchanged."""
    tm = tiny_models["opt-pre"]
    lm = load_model(str(tm.path), load_tokenizer=False)
    with DiskStore(tmp_path / "off") as disk:
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(2, 2, *PLACEMENTS["all-disk"]), device=torch.device("cpu"),
                          dtype=torch.float32, disk=disk)
        sweep, firsts = [0], []
        submit, run = eng._pool.submit, eng.run_sweep

        def counted_submit(fn, *args):  # counted when issued, not when the I/O thread gets to it
            if fn == eng.weights.queued_load and args[0] == ("embed", None):
                firsts.append(sweep[0])
            return submit(fn, *args)

        def counted_run(parts, more=False):
            sweep[0] += 1
            return run(parts, more)

        eng._pool.submit, eng.run_sweep = counted_submit, counted_run  # type: ignore[method-assign]
        outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
        eng.close()
    assert outs == reference_generate(tm, PROMPTS, GEN)
    n = sweep[0]
    assert n == 2 * GEN  # two blocks of 2 x 2 prompts, GEN sweeps each
    # sweep 1 reads its own; sweep s (s < n) reads sweep s + 1's; the last reads nothing ahead
    assert firsts == [1] + list(range(1, n)), firsts
    assert eng._ahead is None


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_overlapped_schedule_matches_transformers(kind: str, tiny_models, tmp_path: Path) -> None:
    """The next block's prefill riding on the current block's decode steps (one sweep per
    step for both) gives the reference tokens for every placement, with one or two groups,
    GPU batches of one or two, and the prefill cut finer or coarser than the decode steps."""
    tm = tiny_models[kind]
    lm = load_model(str(tm.path), load_tokenizer=False)
    for gen in (GEN, 3):
        ref = reference_generate(tm, PROMPTS, gen)
        for (name, pct), cpu_att, (gbs, ngb), groups in itertools.product(
                PLACEMENTS.items(), [True, False], [(1, 2), (1, 1)], [1, 2]):
            if (gbs, ngb) == (1, 1) and (cpu_att or gen == 3):
                continue  # fewer cases: one GPU batch per block runs one rider per step
            with DiskStore(tmp_path / "off") as disk:
                eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                                  policy=Policy(gbs, ngb, *pct, cpu_attention=cpu_att),
                                  device=torch.device("cpu"), dtype=torch.float32, disk=disk)
                sweeps, run = [], eng.run_sweep
                eng.run_sweep = lambda parts, more=False: sweeps.append(len(parts)) or run(parts, more)  # type: ignore[method-assign]
                outs, tm_ = generate(eng, PROMPTS, gen, SamplingConfig(ignore_eos=True), schedule="overlapped",
                                     num_groups=groups)
                eng.close()
            assert outs == ref, (name, cpu_att, gbs, ngb, groups, gen)
            assert tm_.prefill_s > 0 and tm_.decode_s > 0
            blocks = -(-len(PROMPTS) // (gbs * ngb))
            # every block after each group's first rode: its GPU batches spread over the steps of
            # the block before it, one piece on each of min(ngb, gen - 1) of them
            assert sweeps.count(2) == (blocks - groups) * min(ngb, gen - 1) > 0


def test_overlapped_equals_sequential_with_compression(tiny_models, tmp_path: Path) -> None:
    """Compressed weights and cache (lossy, so not the reference): the overlapped schedule
    gives exactly the sequential schedule's tokens."""
    tm = tiny_models["opt-pre"]
    lm = load_model(str(tm.path), load_tokenizer=False)
    got = {}
    for schedule in ("sequential", "overlapped"):
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(1, 2, 0, 100, 0, 100, 100, 0, compress_weight=True, compress_cache=True),
                          device=torch.device("cpu"), dtype=torch.float32)
        got[schedule], _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True), schedule=schedule)
        eng.close()
    assert got["overlapped"] == got["sequential"]


def test_overlapped_schedule_stops_at_eos(tiny_models, tmp_path: Path) -> None:
    """A riding block whose sequences all end at their first token leaves the stream at once,
    and blocks that end early leave their next block's unridden pieces to run alone: the
    outputs are the reference cut at EOS."""
    tm = tiny_models["llama-gqa"]
    gen = 8
    ref = reference_generate(tm, PROMPTS, gen)
    for eos in (ref[2][0], ref[0][3]):  # block 2 ends at its prefill (a rider); block 0 after step 3
        model = copy_with_eos(tm.path, tmp_path / f"model-{eos}", eos)
        lm = load_model(str(model), load_tokenizer=False)
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(1, 1, 0, 100, 100, 0, 100, 0), device=torch.device("cpu"),
                          dtype=torch.float32)
        outs, _ = generate(eng, PROMPTS, gen, SamplingConfig(), schedule="overlapped")
        eng.close()
        assert outs == [x[:x.index(eos) + 1] if eos in x else x for x in ref], eos


@pytest.mark.parametrize("kind,pct,compress", [("opt-pre", "all-disk", False), ("llama-gqa", "mixed", False),
                                                ("opt-pre", "mixed", True)])
def test_read_buffers_are_made_at_load(kind: str, pct: str, compress: bool, tiny_models, tmp_path: Path) -> None:
    """The host buffers that disk reads (and CPU dequantization) fill exist, their pages
    touched, once the engine is built; a whole run makes no more and the tokens are unchanged."""
    tm = tiny_models[kind]
    lm = load_model(str(tm.path), load_tokenizer=False)
    with DiskStore(tmp_path / "off") as disk:
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(2, 2, *PLACEMENTS[pct], compress_weight=compress),
                          device=torch.device("cpu"), dtype=torch.float32, disk=disk)
        sets = eng.weights._bufsets
        made = [{k: b.data_ptr() for k, b in bufs.items()} for bufs in sets]
        off_device = [s for s in eng.weights.placed if s not in eng.weights.resident]
        assert off_device and all(made), made  # both sets hold buffers before any load
        outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
        assert [{k: b.data_ptr() for k, b in bufs.items()} for bufs in sets] == made
        eng.close()
    if compress:  # compressed weights are not the reference's: the same codes held on the compute tier
        ref = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(2, 2, *PLACEMENTS["all-compute"], compress_weight=True),
                          device=torch.device("cpu"), dtype=torch.float32)
        assert outs == generate(ref, PROMPTS, GEN, SamplingConfig(ignore_eos=True))[0]
        ref.close()
    else:
        assert outs == reference_generate(tm, PROMPTS, GEN)
