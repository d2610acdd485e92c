"""Greedy generation equals transformers' generate() for every supported model shape."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import MODEL_KINDS, PROMPTS, read_jsonl, reference_generate
from flexgen_dist.distributed.local import generate
from flexgen_dist.engine.blocks import left_pad, pad_token, plan_blocks
from flexgen_dist.engine.policy import Policy
from flexgen_dist.engine.sampling import SamplingConfig
from flexgen_dist.engine.stage import StageEngine
from flexgen_dist.models.loader import load_model
from flexgen_dist.run import main

GEN = 8


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_cli_greedy_matches_transformers(kind: str, tiny_models, prompts_file: Path, tmp_path: Path,
                                         capsys) -> None:
    tm = tiny_models[kind]
    out = tmp_path / "out.jsonl"
    rc = main(["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN),
               "--output", str(out), "--gpu-batch-size", "4", "--ignore-eos", "--no-progress"])
    assert rc == 0
    recs = read_jsonl(out)
    assert [r["id"] for r in recs] == [f"p{i}" for i in range(len(PROMPTS))]
    assert [r["tokens"] for r in recs] == reference_generate(tm, PROMPTS, GEN)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_first_step_logits_match(kind: str, tiny_models) -> None:
    tm = tiny_models[kind]
    lm = load_model(str(tm.path))
    pol = Policy(gpu_batch_size=len(PROMPTS))
    eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                      policy=pol, device=torch.device("cpu"), dtype=torch.float32)
    blk = plan_blocks([len(p) for p in PROMPTS], pol.block_size)[0]
    st = eng.new_block(blk.meta(pol.gpu_batch_size, 1))
    pad = pad_token(lm.spec.pad_token_id, lm.spec.eos_token_ids)
    ids = left_pad(PROMPTS, blk.prompt_len, pad)
    logits = eng.run_token(st, 0, [ids])[0]
    s = ids.shape[1]
    mask = (torch.arange(s)[None] >= torch.tensor([s - len(p) for p in PROMPTS])[:, None]).long()
    with torch.no_grad():
        ref = tm.model(input_ids=ids, attention_mask=mask).logits[:, -1]
    rel = (logits - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4
    eng.close()


def test_prefill_head_runs_once_per_block(tiny_models, monkeypatch) -> None:
    """Prefill pieces of one GPU batch each: the head waits for the block's last batch, runs
    once over every batch's rows, and the logits equal a whole-block prefill's."""
    tm = tiny_models["opt-post-proj"]  # the head with its project-out
    lm = load_model(str(tm.path))
    pol = Policy(gpu_batch_size=2, num_gpu_batches=2)
    eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                      policy=pol, device=torch.device("cpu"), dtype=torch.float32)
    calls: list[int] = []
    head = eng.family.head
    monkeypatch.setattr(eng.family, "head", lambda spec, w, x: calls.append(x.shape[0]) or head(spec, w, x))
    prompts = PROMPTS[:4]
    blk = plan_blocks([len(p) for p in prompts], pol.block_size)[0]
    pad = pad_token(lm.spec.pad_token_id, lm.spec.eos_token_ids)
    ids = left_pad(prompts, blk.prompt_len, pad)
    whole = eng.new_block(blk.meta(2, 1))
    ref = eng.run_token(whole, 0, [ids[:2], ids[2:]])
    assert calls == [4]  # one head over both batches' rows
    st = eng.new_block(blk.meta(2, 1))
    first = eng.run_token(st, 0, [ids[:2]], first_batch=0)
    assert first == [None] and calls == [4]  # batch 0's logits wait for batch 1
    second = eng.run_token(st, 0, [ids[2:]], first_batch=1)
    assert calls == [4, 4]
    got = eng.prefill_logits(st, 1) + second
    assert not st.logits and not st.head_rows
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    eng.free_block(whole)
    eng.free_block(st)
    eng.close()


def test_blocks_and_gpu_batches_do_not_change_tokens(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    lm = load_model(str(tm.path))
    ref = reference_generate(tm, PROMPTS, GEN)
    for gbs, ngb in [(1, 1), (2, 3), (4, 2), (6, 1)]:
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(gbs, ngb), device=torch.device("cpu"), dtype=torch.float32)
        outs, tm_ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
        eng.close()
        assert outs == ref, (gbs, ngb)
        assert tm_.generated_tokens == GEN * len(PROMPTS)


def test_sampling_is_reproducible_with_a_seed(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    lm = load_model(str(tm.path))

    def run(seed: int, top_p: float = 0.9) -> list[list[int]]:
        eng = StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(2, 2), device=torch.device("cpu"), dtype=torch.float32)
        outs, _ = generate(eng, PROMPTS, 12, SamplingConfig(temperature=1.5, top_p=top_p, seed=seed,
                                                            ignore_eos=True))
        eng.close()
        return outs

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    greedy = reference_generate(tm, PROMPTS, 12)
    assert a != greedy  # temperature 1.5 on a random model does not collapse to greedy
    assert run(7, top_p=1e-6) == greedy  # a vanishing nucleus keeps only the top token


def test_eos_stops_each_sequence(tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["llama-tied"]
    ref = reference_generate(tm, PROMPTS, 16)
    # pick as EOS a token the reference emits mid-way for one prompt but not at the start of others
    eos = ref[0][3]
    lm = load_model(str(tm.path))
    spec = lm.spec.__class__(**{**lm.spec.__dict__, "eos_token_ids": (eos,)})
    for gbs, ngb in ((3, 2), (1, 1)):  # one block of all prompts; a block per prompt
        eng = StageEngine(spec, lm.source, (0, spec.num_layers), has_embed=True, has_head=True,
                          policy=Policy(gbs, ngb), device=torch.device("cpu"), dtype=torch.float32)
        outs, tm = generate(eng, PROMPTS, 16, SamplingConfig())
        eng.close()
        for o, r in zip(outs, ref):
            cut = r.index(eos) + 1 if eos in r else len(r)
            assert o == r[:cut]
        assert len(outs[0]) == ref[0].index(eos) + 1 <= 4
        # a block stops at the step where its last sequence ends
        n = gbs * ngb
        assert tm.token_steps == sum(max(len(o) for o in outs[a:a + n]) for a in range(0, len(outs), n))
    assert tm.token_steps < 16 * len(PROMPTS)  # the first prompt's block stopped early


def test_generation_config_names_the_stop_ids(tiny_models, tmp_path: Path) -> None:
    """A directory's ``generation_config.json`` gives the stop ids, as transformers' generate
    takes them (an instruct model's end-of-turn token is often there alone): the outputs stop
    at its token; an unparsable file or an id outside the vocabulary is refused in one line."""
    import json
    import shutil

    from flexgen_dist import LLM
    from flexgen_dist.errors import ModelLoadError

    tm = tiny_models["llama-tied"]
    ref = reference_generate(tm, PROMPTS, 16)
    eos = ref[0][3]
    d = tmp_path / "m"
    shutil.copytree(tm.path, d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 10 ** 6 % 97]}))
    spec = load_model(str(d), load_tokenizer=False).spec
    assert spec.eos_token_ids == (eos, 10 ** 6 % 97) and load_model(str(tm.path)).spec.eos_token_ids != spec.eos_token_ids
    with LLM(str(d), progress=False) as llm:
        outs = [c.token_ids for c in llm.generate(PROMPTS, gen_len=16)]
    for o, r in zip(outs, ref):
        stops = [i for i, t in enumerate(r) if t in spec.eos_token_ids]
        assert o == r[:stops[0] + 1] if stops else o == r
    assert len(outs[0]) < 16  # the reference emits the stop token early in the first prompt
    for text, match in (("{not json", "generation_config.json: cannot parse"),
                        (json.dumps({"eos_token_id": 10 ** 9}), "is not a token id")):
        (d / "generation_config.json").write_text(text)
        with pytest.raises(ModelLoadError, match=match) as info:
            load_model(str(d), load_tokenizer=False)
        assert "\n" not in str(info.value)
