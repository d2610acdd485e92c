"""Top-k and min-p sampling (``SamplingConfig``, ``--top-k``, ``--min-p``, vLLM's batch
fields): applied as transformers applies them (top-k, then top-p of what it left, then
min-p), every drawn token inside its row's set (read off the logprobs), one kept token
equal to greedy, and a row's draws the same beside other settings as alone."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import PROMPTS
from flexgen_dist import LLM, SamplingConfig
from flexgen_dist.engine.sampling import RowSampling, sample
from flexgen_dist.run import main

GEN = 10
COMPL = "/v1/completions"


def test_filters_keep_the_sets_transformers_keeps() -> None:
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 3
    keys = torch.arange(6)
    for cfg in (SamplingConfig(temperature=0.7, top_k=5), SamplingConfig(temperature=1.3, top_k=8, top_p=0.6),
                SamplingConfig(temperature=0.9, min_p=0.2), SamplingConfig(temperature=1.0, top_k=12, top_p=0.8,
                                                                            min_p=0.1)):
        scores = TemperatureLogitsWarper(cfg.temperature)(None, logits.clone())
        if cfg.top_k:
            scores = TopKLogitsWarper(cfg.top_k)(None, scores)
        if cfg.top_p < 1:
            scores = TopPLogitsWarper(cfg.top_p)(None, scores)
        if cfg.min_p:
            scores = MinPLogitsWarper(cfg.min_p)(None, scores)
        allowed = torch.isfinite(scores)
        drawn = torch.stack([sample(logits, cfg, keys, step) for step in range(300)], 1)  # (6, 300)
        assert allowed.gather(1, drawn).all(), cfg
        seen = torch.zeros_like(allowed).scatter_(1, drawn, True)
        likely = torch.softmax(scores, -1) >= 0.05  # each missed by 300 draws with odds < 1e-6
        assert seen[likely].all() and likely.sum() > 6, cfg
        rows = RowSampling([cfg] * 3 + [SamplingConfig(temperature=0.5)] * 3, torch.device("cpu"))
        mixed = torch.stack([rows.sample(logits, keys, step) for step in range(40)], 1)
        assert (mixed[:3] == drawn[:3, :40]).all()  # beside other settings, as alone


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.5, top_k=1, seed=2),
                                 SamplingConfig(temperature=1.5, min_p=1.0, seed=2)])
def test_one_kept_token_is_greedy(cfg: SamplingConfig, tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=3, ignore_eos=True, progress=False) as llm:
        hot = llm.generate(PROMPTS, gen_len=GEN, sampling=cfg)
        greedy = llm.generate(PROMPTS, gen_len=GEN)
    assert [c.token_ids for c in hot] == [c.token_ids for c in greedy]


def test_drawn_tokens_stay_in_their_rows_sets(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    cfgs = [SamplingConfig(temperature=2.0, top_k=3, seed=1), SamplingConfig(temperature=2.0, min_p=0.5, seed=1),
            SamplingConfig(temperature=2.0, seed=1), SamplingConfig(temperature=2.0, top_k=4, top_p=0.5, seed=1),
            SamplingConfig(temperature=2.0, top_k=2, seed=1), SamplingConfig(temperature=2.0, min_p=0.3, seed=1)]
    with LLM(str(tm.path), gpu_batch_size=3, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        outs = llm.generate(PROMPTS, gen_len=GEN, sampling=cfgs, logprobs=4)
        alone = [llm.generate([p], gen_len=GEN, sampling=c, keys=[n])[0]
                 for n, (p, c) in enumerate(zip(PROMPTS, cfgs))]
    assert [c.token_ids for c in outs] == [c.token_ids for c in alone]
    for cfg, c in zip(cfgs, outs):
        for tok, lp, top in zip(c.token_ids, c.logprobs.token_logprobs, c.logprobs.top):
            if cfg.top_k:
                assert tok in [i for i, _ in top[:cfg.top_k]]
            if cfg.min_p:  # as likely as min_p of the most likely, at the sampling temperature
                assert (lp - top[0][1]) / cfg.temperature >= math.log(cfg.min_p) - 1e-5
    free = [set(c.token_ids) for c in outs]
    assert len(free[2]) > 3  # a row without limits does wander at this temperature


def test_bad_values_and_the_batch_fields(tiny_models, capsys) -> None:
    with pytest.raises(ValueError, match="--top-k -2: must be >= 0"):
        SamplingConfig(top_k=-2)
    with pytest.raises(ValueError, match=r"--min-p 1.5: must be in \[0, 1\]"):
        SamplingConfig(min_p=1.5)
    tm = tiny_models["opt-pre"]
    assert main(["--model", str(tm.path), "--num-prompts", "2", "--min-p", "2"]) == 2
    assert "--min-p 2.0: must be in [0, 1]" in capsys.readouterr().err
    reqs = [{"custom_id": "k1", "url": COMPL, "body": {"prompt": PROMPTS[0], "max_tokens": GEN, "top_k": 1}},
            {"custom_id": "off", "url": COMPL, "body": {"prompt": PROMPTS[0], "max_tokens": GEN, "top_k": -1,
                                                        "temperature": 0}},
            {"custom_id": "bad", "url": COMPL, "body": {"prompt": PROMPTS[0], "min_p": -0.1}}]
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
        greedy = llm.generate([PROMPTS[0]], gen_len=GEN)[0].token_ids
    for k in ("k1", "off"):  # top_k 1 at the default temperature of 1: greedy; -1: every token
        assert out[k]["response"]["body"]["choices"][0]["token_ids"] == greedy
    assert out["bad"]["error"]["code"] == "invalid_value" and "min_p" in out["bad"]["error"]["message"]
