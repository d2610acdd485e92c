"""Batch requests' ``best_of`` (OpenAI's completions field, vLLM's too): ``best_of`` candidates
are sampled and the ``n`` with the highest mean log-probability per token come back, best
first; with ``use_beam_search`` it is the width, the n best beams returned. The candidates are
the choices an ``n = best_of`` request of the same seed draws (each prompt's prefill computed
once for all of them), and usage counts every candidate's tokens."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import PROMPTS
from flexgen_dist import LLM, ConfigError, SamplingConfig
from test_beams import hf_beams

URL = "/v1/completions"
T = 6


def _choices(line: dict) -> list[dict]:
    return line["response"]["body"]["choices"]


def test_the_best_of_the_candidates_by_mean_logprob(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    hot = {"temperature": 1.2, "seed": 4, "max_tokens": T}
    reqs = [{"custom_id": "all", "url": URL, "body": {"prompt": PROMPTS[0], "n": 5, "logprobs": 0, **hot}},
            {"custom_id": "best", "url": URL, "body": {"prompt": PROMPTS[0], "n": 2, "best_of": 5, **hot}},
            {"custom_id": "best-lp", "url": URL, "body": {"prompt": PROMPTS[0], "best_of": 5, "logprobs": 1, **hot}},
            {"custom_id": "stops", "url": URL, "body": {"prompt": PROMPTS[1], "n": 1, "best_of": 3, "min_tokens": 2,
                                                        **hot}},
            {"custom_id": "greedy", "url": URL, "body": {"prompt": PROMPTS[1], "best_of": 4, "max_tokens": T}},
            {"custom_id": "few", "url": URL, "body": {"prompt": PROMPTS[0], "n": 3, "best_of": 2, **hot}},
            {"custom_id": "many", "url": URL, "body": {"prompt": PROMPTS[0], "best_of": 500, **hot}},
            {"custom_id": "word", "url": URL, "body": {"prompt": PROMPTS[0], "best_of": "two", **hot}}]
    with LLM(str(tm.path), progress=False, gpu_batch_size=8) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
        assert llm.metrics["repeated_prompt_fraction"] > 0  # a prompt's candidates share its prefill
    every = _choices(out["all"])
    mean = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in every]
    assert len(set(mean)) == 5  # five different draws
    ranked = sorted(range(5), key=lambda j: -mean[j])
    assert ranked[:2] != [0, 1]  # the best are not the first drawn: the ranking shows
    best = _choices(out["best"])
    assert [c["token_ids"] for c in best] == [every[j]["token_ids"] for j in ranked[:2]]
    assert [c["index"] for c in best] == [0, 1] and all(c["logprobs"] is None for c in best)  # none asked
    body = out["best"]["response"]["body"]
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in every)  # all five generated
    lp = _choices(out["best-lp"])
    assert len(lp) == 1 and lp[0]["token_ids"] == every[ranked[0]]["token_ids"]
    assert lp[0]["logprobs"]["token_logprobs"] == pytest.approx(every[ranked[0]]["logprobs"]["token_logprobs"])
    assert len(lp[0]["logprobs"]["top_logprobs"][0]) == 1
    assert len(_choices(out["stops"])) == 1
    greedy = out["greedy"]["response"]["body"]  # every candidate the greedy one: generated once
    assert len(greedy["choices"]) == 1 and greedy["usage"]["completion_tokens"] == T
    assert "n 3, best_of 2: give 1 <= n <= best_of <= 128" in out["few"]["error"]["message"]
    assert "n 1, best_of 500: give 1 <= n <= best_of <= 128" in out["many"]["error"]["message"]
    assert "best_of" in out["word"]["error"]["message"]


def test_best_of_beams_are_the_search_width(tiny_models) -> None:
    """vLLM's ``use_beam_search`` with ``best_of``: ``best_of`` beams, the ``n`` best returned."""
    tm = tiny_models["llama-gqa"]
    reqs = [{"custom_id": "w3", "url": URL, "body": {"prompt": PROMPTS[2], "max_tokens": T, "n": 2, "best_of": 3,
                                                     "use_beam_search": True}}]
    with LLM(str(tm.path), progress=False) as llm:
        out = llm.batch(reqs)[0]
    want = [t for t, _ in hf_beams(tm, PROMPTS[2], 3, T)]
    assert [c["token_ids"] for c in _choices(out)] == want[:2]


HOT = SamplingConfig(temperature=1.1, seed=9)


def test_the_library_gives_n_choices_of_each_prompt(tiny_models) -> None:
    """``generate(n=)``: each prompt's choices in a row (``index`` its prompt, ``choice`` its
    place), candidate j of prompt i drawing with key ``i * MAX_CHOICES + j`` (what a call of
    the rows with those keys draws); ``best_of``: the n best of them by mean logprob, whatever
    windows cut the candidates apart."""
    from flexgen_dist.choices import MAX_CHOICES

    tm = tiny_models["llama-gqa"]
    ps = PROMPTS[:3]
    with LLM(str(tm.path), progress=False, gpu_batch_size=4, ignore_eos=True) as llm:
        three = llm.generate(ps, gen_len=T, sampling=HOT, n=3, logprobs=0)
        rows = llm.generate([p for p in ps for _ in range(3)], gen_len=T, sampling=HOT,
                            keys=[i * MAX_CHOICES + j for i in range(3) for j in range(3)])
        best = llm.generate(ps, gen_len=T, sampling=HOT, n=2, best_of=3)
        assert llm.metrics["candidates_per_prompt"] == 3 and llm.metrics["choices_per_prompt"] == 2
        assert "(3 prompts x 3 candidates," in llm.summary()
        greedy = llm.generate(ps, gen_len=T, n=2, best_of=5)
        assert llm.metrics["num_prompts"] == 6  # greedy: no candidate beyond n is drawn
    assert [(c.index, c.choice) for c in three] == [(i, j) for i in range(3) for j in range(3)]
    assert [c.token_ids for c in three] == [c.token_ids for c in rows]
    assert len({tuple(c.token_ids) for c in three}) == 9
    for i in range(3):
        cands = three[3 * i:3 * i + 3]
        mean = [sum(c.logprobs.token_logprobs) / len(c.token_ids) for c in cands]
        order = sorted(range(3), key=lambda j: -mean[j])
        assert [c.token_ids for c in best[2 * i:2 * i + 2]] == [cands[j].token_ids for j in order[:2]]
    assert all(c.logprobs is None for c in best)  # ranked with them, returned without: none asked
    assert [c.token_ids for c in greedy[0::2]] == [c.token_ids for c in greedy[1::2]]
    with LLM(str(tm.path), progress=False, gpu_batch_size=2, num_gpu_batches=1, sort_window=1,
             ignore_eos=True) as llm:  # windows of two rows: a prompt's three candidates straddle them
        parts = list(llm.stream(ps, gen_len=T, sampling=HOT, n=2, best_of=3))
    assert len(parts) > 1 and [c.token_ids for part in parts for c in part] == [c.token_ids for c in best]
    with LLM(str(tm.path), progress=False) as llm:
        with pytest.raises(ConfigError, match="give 1 <= n <= best_of <= 128"):
            llm.generate(ps, n=3, best_of=2)
        with pytest.raises(ConfigError, match="give 1 <= n <= best_of <= 128"):
            llm.generate(ps, n=0)
        with pytest.raises(ConfigError, match="non-empty list of prompts"):
            llm.generate("one prompt", n=2)


def test_the_command_line_writes_each_prompts_choices(tiny_models, tmp_path: Path, capsys) -> None:
    from conftest import read_jsonl, write_jsonl
    from flexgen_dist.run import main

    tm = tiny_models["llama-gqa"]
    out = tmp_path / "o.jsonl"
    args = ["--model", str(tm.path), "--prompts", str(write_jsonl(tmp_path / "p.jsonl", PROMPTS[:3])),
            "--gen-len", str(T), "--temperature", "1.1", "--seed", "9", "--ignore-eos", "--no-progress",
            "--output", str(out)]
    assert main([*args, "--n", "2", "--best-of", "3"]) == 0
    lines = read_jsonl(out)
    with LLM(str(tm.path), progress=False, ignore_eos=True) as llm:
        want = llm.generate(PROMPTS[:3], gen_len=T, sampling=HOT, n=2, best_of=3,
                            keys=range(3))
    assert [[c["tokens"] for c in x["choices"]] for x in lines] == \
        [[c.token_ids for c in want[2 * i:2 * i + 2]] for i in range(3)]
    assert all(x["tokens"] == x["choices"][0]["tokens"] for x in lines)
    assert main([*args, "--overwrite", "--n", "2", "--beam-width", "2"]) == 2
    assert "drop --beam-width" in capsys.readouterr().err
    assert main([*args, "--overwrite", "--n", "3", "--best-of", "2"]) == 2
    assert "--n 3 --best-of 2: give 1 <= N <= M <= 128" in capsys.readouterr().err


def test_the_default_batch_holds_whole_prompts_candidates(tiny_models) -> None:
    """Without a GPU batch size the plan's is a multiple of the candidates per prompt, so no
    prompt's candidates straddle two batches and each is computed once: 20 prompts x 5 are two
    blocks of 60 (not of 56, which would cut a prompt's five apart)."""
    tm = tiny_models["llama-gqa"]
    ps = [PROMPTS[k % 6] + [3 + k] for k in range(20)]  # 20 different prompts
    with LLM(str(tm.path), progress=False, ignore_eos=True) as llm:
        llm.generate(ps, gen_len=2, sampling=HOT, n=5)
        assert llm.plan.stages[0].policy.gpu_batch_size == 60
        assert llm.metrics["repeated_prompt_fraction"] == pytest.approx(4 / 5)
        assert any("each prompt's 5 candidates in one GPU batch" in c.why for c in llm.plan.choices)
    with LLM(str(tm.path), progress=False, ignore_eos=True, gpu_batch_size=56) as llm:
        llm.generate(ps, gen_len=2, sampling=HOT, n=5)
        assert llm.metrics["repeated_prompt_fraction"] < 4 / 5  # a prompt cut apart: computed twice
