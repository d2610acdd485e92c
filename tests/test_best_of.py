"""Batch requests' ``best_of`` (OpenAI's completions field, vLLM's too): ``best_of`` candidates
are sampled and the ``n`` with the highest mean log-probability per token come back, best
first; with ``use_beam_search`` it is the width, the n best beams returned. The candidates are
the choices an ``n = best_of`` request of the same seed draws (each prompt's prefill computed
once for all of them), and usage counts every candidate's tokens."""
from __future__ import annotations

import pytest

from conftest import PROMPTS
from flexgen_dist import LLM
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
    assert "best_of 2: give n (3) to 128" in out["few"]["error"]["message"]
    assert "best_of 500: give n (1) to 128" in out["many"]["error"]["message"]
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
