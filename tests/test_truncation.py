"""``truncate_prompt_tokens`` (vLLM's option; ``--truncate-prompt-tokens``, a batch request's
own field): a longer prompt is cut to its last K tokens (-1: as many as fit with its
generation) instead of being refused; the result is the cut prompt's, token for token
(transformers' greedy tokens, float32)."""
from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, reference_generate
from flexgen_dist import LLM
from flexgen_dist.config import ConfigError

LONG = [(7 * i) % 200 + 20 for i in range(150)]  # longer than the tiny models' 128 positions


def test_generation_and_embeddings_of_cut_prompts(tiny_models) -> None:
    """-1: the last (128 - gen_len) tokens; K: the last K; embeddings of a cut input are its
    last K tokens' (the run's option applies to every call but score())."""
    tm = tiny_models["llama-gqa"]
    with LLM(str(tm.path), progress=False, ignore_eos=True, truncate_prompt_tokens=-1) as llm:
        got = llm.generate([LONG, PROMPTS[0]], gen_len=3)
        with pytest.raises(ConfigError, match="positions"):
            llm.score([LONG])  # scoring counts positions: never cut
    assert [c.token_ids for c in got] == reference_generate(tm, [LONG[-125:], PROMPTS[0]], 3)
    assert got[0].prompt_ids == LONG[-125:]
    with LLM(str(tm.path), progress=False, truncate_prompt_tokens=16) as llm:
        cut = llm.embed([LONG, PROMPTS[1]], normalize=False)
    with LLM(str(tm.path), progress=False) as llm:
        whole = llm.embed([LONG[-16:], PROMPTS[1]], normalize=False)
        with pytest.raises(ConfigError, match="exceeds the model's 128 positions"):
            llm.generate([LONG], gen_len=2)
    torch.testing.assert_close(torch.tensor([e.embedding for e in cut]), torch.tensor([e.embedding for e in whole]),
                               atol=1e-6, rtol=1e-5)
    assert cut[0].prompt_tokens == 16
    with pytest.raises(ConfigError, match="--truncate-prompt-tokens 0"):
        LLM(str(tm.path), progress=False, truncate_prompt_tokens=0)


def test_a_call_cuts_as_it_says(tiny_models) -> None:
    """A call's own: a prompt's SamplingConfig(truncate_prompt_tokens=K) (vLLM's SamplingParams
    field) for generation and beam search, truncate_prompt_tokens=K for the pooled calls; each
    wins over the LLM's setting."""
    from flexgen_dist import SamplingConfig

    tm = tiny_models["llama-gqa"]
    with LLM(str(tm.path), progress=False, ignore_eos=True, truncate_prompt_tokens=-1) as llm:
        got = llm.generate([LONG, LONG, PROMPTS[0]], gen_len=3, sampling=[
            SamplingConfig(ignore_eos=True, truncate_prompt_tokens=20), SamplingConfig(ignore_eos=True),
            SamplingConfig(ignore_eos=True, truncate_prompt_tokens=2)])
        cut = llm.embed([LONG], normalize=False, truncate_prompt_tokens=16)
        beams = llm.beam_search([LONG], beam_width=2, max_tokens=3,
                                sampling=SamplingConfig(truncate_prompt_tokens=30))
    assert [c.prompt_ids for c in got] == [LONG[-20:], LONG[-125:], PROMPTS[0][-2:]]
    assert [c.token_ids for c in got] == reference_generate(tm, [LONG[-20:], LONG[-125:], PROMPTS[0][-2:]], 3)
    assert cut[0].prompt_tokens == 16 and beams[0].prompt_ids == LONG[-30:]
    with LLM(str(tm.path), progress=False) as llm:
        whole = llm.embed([LONG[-16:]], normalize=False)
        with pytest.raises(ConfigError, match="truncate_prompt_tokens 0"):
            llm.embed([LONG], truncate_prompt_tokens=0)
    assert cut[0].embedding == pytest.approx(whole[0].embedding, abs=1e-5)
    with pytest.raises(ValueError, match="truncate_prompt_tokens -2"):
        SamplingConfig(truncate_prompt_tokens=-2)


def test_batch_requests_cut_as_they_ask(tiny_models) -> None:
    """A request's own truncate_prompt_tokens (completions, chat-less models' embeddings), the
    run's for the others; a bad value is that request's error line."""
    tm = tiny_models["llama-gqa"]

    def compl(cid: str, **body: object) -> dict:
        return {"custom_id": cid, "url": "/v1/completions", "body": {"prompt": LONG, "max_tokens": 2, **body}}

    reqs = [compl("own", truncate_prompt_tokens=5), compl("fit", truncate_prompt_tokens=-1), compl("run"),
            compl("bad", truncate_prompt_tokens=0),
            {"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": [LONG, PROMPTS[0]],
                                                                   "truncate_prompt_tokens": 8}}]
    with LLM(str(tm.path), progress=False, ignore_eos=True, truncate_prompt_tokens=40) as llm:
        lines = {x["custom_id"]: x for x in llm.batch(reqs)}
    body = {k: v["response"]["body"] for k, v in lines.items() if v["error"] is None}
    assert body["own"]["usage"]["prompt_tokens"] == 5 and body["fit"]["usage"]["prompt_tokens"] == 126
    assert body["run"]["usage"]["prompt_tokens"] == 40
    want = reference_generate(tm, [LONG[-5:], LONG[-126:], LONG[-40:]], 2)
    assert [body[k]["choices"][0]["token_ids"] for k in ("own", "fit", "run")] == want
    assert lines["bad"]["error"]["code"] == "invalid_value" and "truncate_prompt_tokens 0" in lines["bad"]["error"]["message"]
    assert body["emb"]["usage"]["prompt_tokens"] == 8 + len(PROMPTS[0])


def test_the_run_command_cuts_a_prompt_file(tiny_models, tmp_path, capsys) -> None:
    """``--truncate-prompt-tokens -1``: a prompt-file prompt too long for the model is cut to
    what fits with --gen-len and generated from (without the flag: the one-line refusal)."""
    import json

    from conftest import read_jsonl
    from flexgen_dist.run import main

    tm = tiny_models["llama-gqa"]
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "long", "input_ids": LONG}) + "\n" + json.dumps({"id": "short", "input_ids": PROMPTS[2]}) + "\n")
    out = tmp_path / "o.jsonl"
    args = ["--model", str(tm.path), "--prompts", str(p), "--gen-len", "4", "--ignore-eos", "--no-progress",
            "--output", str(out)]
    assert main(args) == 1
    assert "exceeds the model's 128 positions: shorten it, lower --gen-len or give --truncate-prompt-tokens" \
        in capsys.readouterr().err
    assert main(args + ["--truncate-prompt-tokens", "-1"]) == 0
    rows = read_jsonl(out)
    assert [r["tokens"] for r in rows] == reference_generate(tm, [LONG[-124:], PROMPTS[2]], 4)


def test_pair_scores_cut_as_the_run_says(tmp_path) -> None:
    """``score_pairs`` / ``rerank`` cut each pair's tokens as the run's truncate_prompt_tokens
    says (a cross-encoder's pair: its last K tokens)."""
    from test_pairs import Q, _logit, _model

    d, m, tok = _model(tmp_path, "Qwen2ForSequenceClassification")
    long_doc = "yes no maybe " * 200
    cut = tok(text=Q, text_pair=long_doc)["input_ids"][-24:]
    with LLM(str(d), progress=False, truncate_prompt_tokens=24) as llm:
        got = llm.score_pairs(Q, [long_doc])
    with LLM(str(d), progress=False) as llm:
        with pytest.raises(ConfigError, match="truncate_prompt_tokens"):
            llm.rerank(Q, [long_doc])
    assert got[0] == pytest.approx(float(torch.tensor(_logit(m, cut)).sigmoid()), abs=1e-5)
