"""The compressed KV cache (--compress-cache): smaller on every tier, close to the dense cache."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, read_jsonl, write_jsonl
from flexgen_dist.engine.footprint import predict_peaks
from flexgen_dist.distributed.local import generate
from flexgen_dist.engine.blocks import left_pad, pad_token, plan_blocks
from flexgen_dist.engine.policy import Policy
from flexgen_dist.engine.sampling import SamplingConfig
from flexgen_dist.engine.stage import StageEngine
from flexgen_dist.memory.disk import DiskStore
from flexgen_dist.models.loader import load_model
from flexgen_dist.run import main

GEN = 5
# percent WG WC CG CC HG HC; weights and activations stay on the compute device so the
# cache's tier holds only the cache (all-compute is measured against cache-cpu's gpu peak)
PLACEMENTS = {
    "all-compute": ((100, 0, 100, 0, 100, 0), "gpu"),
    "cache-cpu": ((100, 0, 0, 100, 100, 0), "cpu"),
    "cache-disk": ((100, 0, 0, 0, 100, 0), "disk"),
}


def _engine(lm, pct, disk, compress: bool, cpu_attention: bool = True, **kw) -> StageEngine:
    pol = Policy(2, 3, *pct, cpu_attention=cpu_attention, compress_cache=compress, **kw)
    return StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                       policy=pol, device=torch.device("cpu"), dtype=torch.float32, disk=disk)


def _run(lm, pct, tmp_path: Path, compress: bool, cpu_attention: bool = True,
         **kw) -> tuple[list[list[int]], dict[str, int]]:
    with DiskStore(tmp_path / "off") as disk:
        eng = _engine(lm, pct, disk, compress, cpu_attention, **kw)
        outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
        eng.close()
    return outs, eng.peak_bytes()


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_compressed_cache_is_small_on_every_tier(kind: str, tiny_models, tmp_path: Path) -> None:
    lm = load_model(str(tiny_models[kind].path), load_tokenizer=False)
    base_gpu = {}  # gpu peak without any cache on it (cache-cpu), per compress setting
    cache_bytes: dict[tuple[str, bool, bool], int] = {}
    for name, (pct, tier) in PLACEMENTS.items():
        for cpu_att in ([True, False] if name == "cache-cpu" else [True]):
            for compress in (False, True):
                outs, peak = _run(lm, pct, tmp_path, compress, cpu_att)
                assert len(outs) == len(PROMPTS) and all(len(o) == GEN for o in outs)
                cache_bytes[(name, cpu_att, compress)] = peak[tier]
                if name == "cache-cpu":
                    base_gpu[compress] = peak["gpu"]
                # the budget prediction mirrors the allocation (one full block in flight)
                pol = Policy(2, 3, *pct, compress_cache=compress)
                pred = predict_peaks(lm.spec, pol, (0, lm.spec.num_layers), has_embed=True,
                                     has_head=True, prompt_len=max(map(len, PROMPTS)),
                                     gen_len=GEN, dtype_bytes=4)
                if tier != "gpu":
                    assert pred[tier] == peak[tier], (name, compress)
    for c in (False, True):
        cache_bytes[("all-compute", True, c)] -= base_gpu[c]
    for (name, cpu_att, compress), n in cache_bytes.items():
        if compress:
            dense = cache_bytes[(name, cpu_att, False)]
            assert 0 < n < 0.3 * dense, (name, cpu_att, n, dense)


def _step_logits(lm, pct, disk, compress: bool, steps: int,
                 forced: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Logits of each step of one block of 2 GPU batches; inputs forced to ``forced`` if given."""
    eng = _engine(lm, pct, disk, compress)
    pol = eng.policy
    blk = plan_blocks([len(p) for p in PROMPTS[:6]], pol.block_size)[0]
    st = eng.new_block(blk.meta(pol.gpu_batch_size, steps))
    pad = pad_token(lm.spec.pad_token_id, lm.spec.eos_token_ids)
    inputs = list(left_pad(PROMPTS[:len(blk.lens)], blk.prompt_len, pad).split(pol.gpu_batch_size))
    out = []
    for i in range(steps):
        logits = torch.cat(eng.run_token(st, i, inputs))
        out.append(logits)
        nxt = forced[i] if forced is not None else logits.argmax(-1)
        inputs = list(nxt[:, None].split(pol.gpu_batch_size))
    eng.free_block(st)
    eng.close()
    return out


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_compressed_cache_logits_are_close(kind: str, tiny_models, tmp_path: Path) -> None:
    lm = load_model(str(tiny_models[kind].path), load_tokenizer=False)
    steps = 4
    pct = (100, 0, 30, 30, 100, 0)  # cache rows on all three tiers
    with DiskStore(tmp_path / "off") as disk:
        dense = _step_logits(lm, pct, disk, False, steps)
        forced = [lg.argmax(-1) for lg in dense]
        comp = _step_logits(lm, pct, disk, True, steps, forced)
    # prefill attends over the fresh k/v, not the cache
    assert torch.equal(dense[0], comp[0])
    for i in range(1, steps):
        rel = ((comp[i] - dense[i]).abs().max() / dense[i].abs().max()).item()
        assert 0 < rel < 0.1, (i, rel)  # > 0: decode really read the quantized cache


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_decode_reads_the_codes_and_matches_the_expanded_cache(kind: str, tiny_models, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step on the CPU attends straight over the compressed cache's codes (rows in RAM
    and staged from disk alike), and its logits are bit for bit those of expanding the cache
    first and attending over the expansion."""
    import shutil

    from flexgen_dist.engine import attention
    from flexgen_dist.kernels import library

    if shutil.which("g++") is None or library() is None:
        pytest.skip("no native kernels here: the compressed cache is always expanded")
    lm = load_model(str(tiny_models[kind].path), load_tokenizer=False)
    pct, steps = (100, 0, 30, 30, 100, 0), 4  # cache rows on all three tiers
    packed = attention.native.attention_packed
    calls = []

    def counted(*a, **kw):
        got = packed(*a, **kw)
        calls.append(got is not None)
        return got

    with DiskStore(tmp_path / "off") as disk:
        monkeypatch.setattr(attention.native, "attention_packed", counted)
        read = _step_logits(lm, pct, disk, True, steps)
        assert calls and all(calls)  # every decode chunk read as codes
        monkeypatch.setattr(attention.native, "attention_packed", lambda *a, **kw: None)
        expanded = _step_logits(lm, pct, disk, True, steps, [lg.argmax(-1) for lg in read])
    assert all(torch.equal(a, b) for a, b in zip(read, expanded))


def test_compressed_placements_agree_and_cli_runs(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    lm = load_model(str(tm.path), load_tokenizer=False)
    runs = {}
    for name, pct, cpu_att, overlap in [
            ("all-compute", (100, 0, 100, 0, 100, 0), True, True),
            ("cache-cpu", (100, 0, 0, 100, 100, 0), True, True),
            ("cache-cpu", (100, 0, 0, 100, 100, 0), False, True),
            ("all-disk", (0, 0, 0, 0, 0, 0), True, True),
            ("all-disk", (0, 0, 0, 0, 0, 0), False, False),
            ("mixed", (30, 30, 20, 50, 50, 50), True, True)]:
        runs[(name, cpu_att, overlap)] = _run(lm, pct, tmp_path, True, cpu_att, overlap=overlap)[0]
    first = next(iter(runs.values()))
    assert all(r == first for r in runs.values()), runs

    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out, met, off = tmp_path / "o.jsonl", tmp_path / "m.json", tmp_path / "cli-off"
    rc = main(["--model", str(tm.path), "--prompts", str(p), "--gen-len", str(GEN), "--ignore-eos",
               "--percent", "0", "100", "0", "50", "0", "0", "--gpu-batch-size", "2",
               "--num-gpu-batches", "3", "--compress-cache", "--compress-weight",
               "--offload-dir", str(off), "--output", str(out), "--no-progress", "--metrics", str(met)])
    assert rc == 0
    toks = [r["tokens"] for r in read_jsonl(out)]
    assert len(toks) == len(PROMPTS) and all(len(t) == GEN for t in toks)
    peak = json.loads(met.read_text())["peak_bytes"][0]
    assert peak["disk"] > 0 and peak["cpu"] > 0
    assert list(off.iterdir()) == []


@pytest.mark.parametrize("kind", ["opt-pre", "llama-tied"])
def test_compressed_weights_stay_compressed_on_every_tier(kind: str, tiny_models, tmp_path: Path) -> None:
    """--compress-weight keeps weights packed on the compute device, in RAM and on disk (files
    of packed codes and group metadata, read back as they are): the same tokens on every tier,
    each tier holding ~1/4 of the float32 bytes, as the budget predicts."""
    lm = load_model(str(tiny_models[kind].path), load_tokenizer=False)
    outs, stored = {}, {}
    for tier, pct in [("gpu", (100, 0, 100, 0, 100, 0)), ("cpu", (0, 100, 100, 0, 100, 0)),
                      ("disk", (0, 0, 100, 0, 100, 0))]:
        with DiskStore(tmp_path / f"off-{tier}") as disk:
            pol = Policy(2, 3, *pct, compress_weight=True, comp_group_size=16)
            eng = StageEngine(lm.spec, load_model(str(tiny_models[kind].path), load_tokenizer=False).source,
                              (0, lm.spec.num_layers), has_embed=True, has_head=True, policy=pol,
                              device=torch.device("cpu"), dtype=torch.float32, disk=disk)
            outs[tier], _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
            stored[tier] = eng.weights.bytes_per_tier()
            if tier == "disk":
                assert disk.allocated_bytes >= stored["disk"]["disk"] > 0  # really in files
            eng.close()
            peak = predict_peaks(lm.spec, pol, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                                 prompt_len=max(map(len, PROMPTS)), gen_len=GEN, dtype_bytes=4)
        assert stored[tier][tier] <= peak[tier]
        others = [t for t in ("gpu", "cpu", "disk") if t != tier]
        assert all(stored[tier][t] == 0 for t in others), stored
    assert outs["cpu"] == outs["gpu"] and outs["disk"] == outs["gpu"]
    dense = predict_peaks(lm.spec, Policy(2, 3, 0, 0, 100, 0, 100, 0), (0, lm.spec.num_layers), has_embed=True,
                          has_head=True, prompt_len=8, gen_len=1, dtype_bytes=4)["disk"]
    assert 0.15 * dense < stored["disk"]["disk"] < 0.4 * dense
