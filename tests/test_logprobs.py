"""Log-probabilities of generated tokens (``logprobs=K``, ``--logprobs K``, the OpenAI Batch
fields): equal to transformers' log-softmax of its own logits in float32, cut with the
tokens (EOS, per-request limits, stop strings), unchanged by sampling, carried to rank 0 on
several ranks, and in each endpoint's response format."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, left_padded, local_ranks, read_jsonl
from flexgen_dist import LLM, ConfigError, SamplingConfig, TokenLogprobs
from flexgen_dist.batch import main as batch_main
from flexgen_dist.engine.sampling import token_logprobs
from flexgen_dist.openai_fields import RequestError
from flexgen_dist.openai_fields import logprobs as request_logprobs
from flexgen_dist.plan import Workload
from flexgen_dist.run import main

GEN = 6
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"


def reference_logprobs(tm, prompts: list[list[int]], gen_len: int) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy tokens and the log-softmax of its logits at each step (b, steps, V)."""
    ids, mask = left_padded(tm, prompts)
    with torch.no_grad():
        out = tm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len,
                                do_sample=False, pad_token_id=tm.pad_id, output_logits=True,
                                return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:].tolist(), torch.stack(out.logits, 1).float().log_softmax(-1)


def assert_matches(lps: TokenLogprobs, toks: list[int], ref: torch.Tensor, k: int) -> None:
    """``lps`` of tokens ``toks`` against one sequence's reference log-softmax (steps, V)."""
    assert len(lps.token_logprobs) == len(lps.top) == len(toks)
    want = ref[torch.arange(len(toks)), torch.tensor(toks)]
    assert torch.allclose(torch.tensor(lps.token_logprobs, dtype=torch.float32), want, atol=1e-4)
    for step, alts in enumerate(lps.top):
        vals, top = ref[step].topk(k)
        assert [i for i, _ in alts] == top.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in alts], dtype=torch.float32), vals, atol=1e-4)


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_logprobs_match_transformers_and_leave_the_tokens_alone(kind: str, tiny_models) -> None:
    tm = tiny_models[kind]
    toks, ref = reference_logprobs(tm, PROMPTS, GEN)
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        outs = llm.generate(PROMPTS, gen_len=GEN, logprobs=3)
        plain = llm.generate(PROMPTS, gen_len=GEN)
    assert [c.token_ids for c in outs] == toks == [c.token_ids for c in plain]
    assert all(c.logprobs is None for c in plain)
    for b, c in enumerate(outs):
        assert_matches(c.logprobs, c.token_ids, ref[b], 3)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        # greedy: the chosen token is the most likely one
        assert [t[0][0] for t in c.logprobs.top] == c.token_ids


def test_logprobs_are_cut_with_the_tokens_and_zero_alternatives(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    toks, ref = reference_logprobs(tm, PROMPTS, GEN)
    limits = [1, 2, 3, 4, 5, 6]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=3, ignore_eos=True, progress=False) as llm:
        outs = llm.generate(PROMPTS, gen_len=GEN, max_new_tokens=limits, logprobs=0)
    for b, (c, m) in enumerate(zip(outs, limits)):
        assert c.token_ids == toks[b][:m]
        assert c.logprobs.top == [[] for _ in range(m)]
        assert_matches(c.logprobs, c.token_ids, ref[b], 0)


def test_sampled_tokens_do_not_change_and_report_the_models_distribution(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    hot = SamplingConfig(temperature=0.9, top_p=0.8, seed=3)
    with LLM(str(tm.path), gpu_batch_size=3, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        with_lp = llm.generate(PROMPTS, gen_len=GEN, sampling=hot, logprobs=2)
        without = llm.generate(PROMPTS, gen_len=GEN, sampling=hot)
    assert [c.token_ids for c in with_lp] == [c.token_ids for c in without]
    for c in with_lp:  # teacher-forced: the raw model's log-softmax after each prefix
        seq = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = tm.model(seq).logits[0, len(c.prompt_ids) - 1:-1].float().log_softmax(-1)
        assert_matches(c.logprobs, c.token_ids, logits, 2)


def test_token_logprobs_rows() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 0.0]])
    rows = token_logprobs(logits, torch.tensor([1, 0]), 2)
    lsm = logits.log_softmax(-1).double()
    assert rows.shape == (2, 5) and rows.dtype == torch.float64
    assert torch.allclose(rows[:, 0], lsm[[0, 1], [1, 0]])
    assert rows[0, 1:3].tolist() == [3.0, 2.0] and rows[1, 1] == 0.0
    lp = TokenLogprobs.of_rows(rows, 2)
    assert lp.top[0] == [(3, pytest.approx(lsm[0, 3].item())), (2, pytest.approx(lsm[0, 2].item()))]
    assert lp.trimmed(1).top[0] == lp.top[0][:1] and token_logprobs(logits, torch.tensor([1, 0]), 0).shape == (2, 1)


def test_bad_logprobs_say_what_to_give(tiny_models, tmp_path: Path, capsys) -> None:
    assert main(["--model", str(tiny_models["opt-pre"].path), "--num-prompts", "2", "--logprobs", "21"]) == 2
    assert "--logprobs 21: give 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="logprobs 21: give 0"):
        LLM(str(tiny_models["opt-pre"].path), logprobs=21)
    with pytest.raises(ValueError, match="logprobs 21: give 0"):
        Workload((3,), 2, logprobs=21, targets=((1, 2, 3),))
    req = tmp_path / "r.jsonl"
    req.write_text(json.dumps({"custom_id": "a", "url": COMPL, "body": {"prompt": [5, 6]}}) + "\n")
    assert batch_main(["--model", str(tiny_models["opt-pre"].path), "-i", str(req), "-o",
                       str(tmp_path / "o.jsonl"), "--logprobs", "2"]) == 2
    assert "--logprobs is for prompt files" in capsys.readouterr().err


def test_cli_writes_logprobs_and_resume_checks_them(tiny_models, prompts_file: Path, tmp_path: Path,
                                                    capsys) -> None:
    tm = tiny_models["opt-pre"]
    toks, ref = reference_logprobs(tm, PROMPTS, GEN)
    out = tmp_path / "o.jsonl"
    args = ["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN), "--ignore-eos",
            "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--output", str(out), "--no-progress"]
    assert main([*args, "--logprobs", "2"]) == 0
    for b, rec in enumerate(read_jsonl(out)):
        assert rec["tokens"] == toks[b]
        lp = rec["logprobs"]
        alts = [[(a["id"], a["logprob"]) for a in step] for step in lp["top_logprobs"]]
        assert_matches(TokenLogprobs(lp["token_logprobs"], alts), rec["tokens"], ref[b], 2)
    capsys.readouterr()
    assert main([*args, "--resume"]) != 0
    assert "logprobs (2 -> None) changed" in capsys.readouterr().err


def test_batch_logprobs_in_each_endpoints_format(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    toks, ref = reference_logprobs(tm, PROMPTS[:2], GEN)
    reqs = [{"custom_id": "c", "url": COMPL, "body": {"prompt": PROMPTS[0], "max_tokens": GEN, "logprobs": 2}},
            {"custom_id": "p", "url": COMPL, "body": {"prompt": PROMPTS[1], "max_tokens": GEN}},
            {"custom_id": "z", "url": COMPL, "body": {"prompt": PROMPTS[1], "max_tokens": GEN, "logprobs": 0}},
            {"custom_id": "big", "url": COMPL, "body": {"prompt": PROMPTS[1], "logprobs": 21}},
            {"custom_id": "top", "url": COMPL, "body": {"prompt": PROMPTS[1], "top_logprobs": 2}},
]
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    choice = out["c"]["response"]["body"]["choices"][0]
    assert choice["token_ids"] == toks[0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [str(t) for t in toks[0]]  # no tokenizer: a token is spelled as its id
    assert lp["text_offset"] == [sum(len(str(t)) for t in toks[0][:n]) for n in range(GEN)]
    alts = [[(int(t), v) for t, v in step.items()] for step in lp["top_logprobs"]]
    assert_matches(TokenLogprobs(lp["token_logprobs"], alts), toks[0], ref[0], 2)
    assert out["p"]["response"]["body"]["choices"][0]["logprobs"] is None
    zero = out["z"]["response"]["body"]["choices"][0]["logprobs"]
    assert zero["top_logprobs"] == [{}] * GEN
    assert zero["token_logprobs"] == pytest.approx(ref[1][torch.arange(GEN), torch.tensor(toks[1])].tolist(),
                                                   abs=1e-4)
    assert out["big"]["error"]["code"] == "invalid_value" and "at most 20" in out["big"]["error"]["message"]
    assert out["top"]["error"]["code"] == "unsupported_field"
    for chat_body, why in (({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
                           ({"logprobs": 2}, "a chat request takes true or false"),
                           ({"logprobs": True, "top_logprobs": 21}, "at most 20")):
        with pytest.raises(RequestError, match=why):
            request_logprobs(CHAT, chat_body)
    assert request_logprobs(CHAT, {"logprobs": True}) == 0 and request_logprobs(CHAT, {"logprobs": False}) is None


@pytest.mark.bundled
def test_batch_chat_logprobs_with_the_bundled_model() -> None:
    from flexgen_dist.models.loader import bundled_model_path
    req = {"custom_id": "fr", "url": CHAT, "body": {"messages": [{"role": "user", "content":
                                                                   "What is the capital of France?"}],
                                                     "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
                                                     "prompt_logprobs": 1}}
    with LLM(str(bundled_model_path()), progress=False) as llm:
        line = llm.batch([req])[0]
    pl = line["response"]["body"]["prompt_logprobs"]  # vLLM's: the rendered chat's tokens, once per response
    assert len(pl) == line["response"]["body"]["usage"]["prompt_tokens"] and pl[0] is None
    assert all(1 <= len(d) <= 2 and all(e["rank"] >= 1 and isinstance(e["decoded_token"], str) for e in d.values())
               for d in pl[1:])
    choice = line["response"]["body"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == line["response"]["body"]["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content).startswith(choice["message"]["content"])
    for e in content:
        assert e["bytes"] == list(e["token"].encode("utf-8")) and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]  # greedy
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_write_the_logprobs_one_rank_writes(tiny_models, prompts_file: Path, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    args = ["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN),
            "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--logprobs", "3", "--no-progress"]
    one = tmp_path / "one.jsonl"
    assert main([*args, "--output", str(one)]) == 0
    two = tmp_path / "two.jsonl"
    r = local_ranks(["-m", "flexgen_dist.run", *args, "--output", str(two), "--num-micro-batches", "2"], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_jsonl(one), read_jsonl(two)
    assert [x["tokens"] for x in a] == [x["tokens"] for x in b]
    for x, y in zip(a, b):
        assert x["logprobs"]["top_logprobs"] == y["logprobs"]["top_logprobs"] or all(
            [t["id"] for t in s] == [t["id"] for t in u]
            for s, u in zip(x["logprobs"]["top_logprobs"], y["logprobs"]["top_logprobs"]))
        assert x["logprobs"]["token_logprobs"] == pytest.approx(y["logprobs"]["token_logprobs"], abs=1e-5)


@pytest.mark.bundled
def test_the_multiple_choice_example_answers_within_its_options(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo / "examples"))
    try:
        from classify import QUESTIONS
    finally:
        sys.path.pop(0)
    r = subprocess.run([sys.executable, str(repo / "examples" / "classify.py")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == len(QUESTIONS)
    for line, (question, options) in zip(lines, QUESTIONS):
        m = re.fullmatch(r"\s*(\w+) \((\d+)% of its options' probability\)  (.+)", line)
        assert m is not None, line
        assert m.group(1) in options and 0 < int(m.group(2)) <= 100 and m.group(3) == question
    assert lines[0].split()[0] == "Paris"  # 96 % of its options' probability on the development VM


# --- the log-probabilities of given tokens: scoring, and echo ---------------------------------
@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
@pytest.mark.parametrize("decode_tokens", [0, 2])
def test_scored_tokens_logprobs_match_transformers(kind: str, decode_tokens: int, tiny_models) -> None:
    """``LLM.score(logprobs=K)``: each scored token's log-probability and its K most likely
    alternatives, equal to transformers' log-softmax of its logits at the token's prefix,
    for the tokens a prefill scores and those decode steps predict, from ``first_scored`` on;
    their sum is the score's -nll."""
    tm = tiny_models[kind]
    seqs, first = [PROMPTS[0] + PROMPTS[3], PROMPTS[1], PROMPTS[2]], [1, 2, 4]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, progress=False) as llm:
        scores = llm.score(seqs, first_scored=first, decode_tokens=decode_tokens, logprobs=3)
        plain = llm.score(seqs, first_scored=first, decode_tokens=decode_tokens)
    for sc, pl, seq, f in zip(scores, plain, seqs, first):
        with torch.no_grad():
            ref = tm.model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
        assert sc.logprobs is not None and pl.logprobs is None
        assert (sc.nll, sc.count, sc.correct) == (pl.nll, pl.count, pl.correct) and sc.count == len(seq) - f
        assert_matches(sc.logprobs, seq[f:], ref[f - 1:len(seq) - 1], 3)
        assert -sum(sc.logprobs.token_logprobs) == pytest.approx(sc.nll, abs=1e-9)
        rows = ref[f - 1:len(seq) - 1]
        want = [int((r > r[t]).sum()) + 1 for r, t in zip(rows, seq[f:])]
        assert sc.ranks == want and sc.correct == want.count(1) and pl.ranks is None
    with LLM(str(tm.path), progress=False) as llm:
        with pytest.raises(ConfigError, match="logprobs 21: give 0"):
            llm.score(seqs, logprobs=21)


def test_batch_echo_gives_the_prompts_logprobs_then_the_completions(tiny_models) -> None:
    """A completions request with ``echo``: the prompt comes back before the completion,
    its first token with null logprobs and each later one with its own and its alternatives
    (as a prefix gives them); ``max_tokens`` 0 generates nothing (a loglikelihood request);
    echo without logprobs echoes the ids; a chat request has no echo."""
    tm = tiny_models["llama-gqa"]
    p, q = PROMPTS[0], PROMPTS[2]
    toks, gen_ref = reference_logprobs(tm, [q], 3)
    reqs = [{"custom_id": "ll", "url": COMPL, "body": {"prompt": p, "echo": True, "max_tokens": 0, "logprobs": 2}},
            {"custom_id": "both", "url": COMPL, "body": {"prompt": q, "echo": True, "max_tokens": 3, "logprobs": 1}},
            {"custom_id": "ids", "url": COMPL, "body": {"prompt": q, "echo": True, "max_tokens": 2}},
            {"custom_id": "zero", "url": COMPL, "body": {"prompt": q, "max_tokens": 0}},
            {"custom_id": "chat", "url": CHAT, "body": {"messages": [{"role": "user", "content": "x"}],
                                                        "echo": True}},
            {"custom_id": "odd", "url": COMPL, "body": {"prompt": q, "echo": "yes"}}]
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    with torch.no_grad():
        ref_p = tm.model(torch.tensor([p])).logits[0].float().log_softmax(-1)
        ref_q = tm.model(torch.tensor([q])).logits[0].float().log_softmax(-1)
    ll = out["ll"]["response"]["body"]
    assert ll["usage"]["completion_tokens"] == 0 and ll["choices"][0]["token_ids"] == p
    lp = ll["choices"][0]["logprobs"]
    assert lp["tokens"] == [str(t) for t in p] and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    alts = [[(int(t), v) for t, v in step.items()] for step in lp["top_logprobs"][1:]]
    assert_matches(TokenLogprobs(lp["token_logprobs"][1:], alts), p[1:], ref_p[:-1], 2)
    assert lp["text_offset"] == [sum(len(str(t)) for t in p[:n]) for n in range(len(p))]
    both = out["both"]["response"]["body"]["choices"][0]
    assert both["token_ids"] == q + toks[0]
    lp = both["logprobs"]
    assert len(lp["tokens"]) == len(q) + 3 and lp["token_logprobs"][0] is None
    alts = [[(int(t), v) for t, v in step.items()] for step in lp["top_logprobs"][1:len(q)]]
    assert_matches(TokenLogprobs(lp["token_logprobs"][1:len(q)], alts), q[1:], ref_q[:-1], 1)
    gen = [[(int(t), v) for t, v in step.items()] for step in lp["top_logprobs"][len(q):]]
    assert_matches(TokenLogprobs(lp["token_logprobs"][len(q):], gen), toks[0], gen_ref[0], 1)
    ids = out["ids"]["response"]["body"]["choices"][0]
    assert ids["token_ids"][:len(q)] == q and len(ids["token_ids"]) == len(q) + 2 and ids["logprobs"] is None
    assert out["zero"]["error"]["code"] == "invalid_value" and "max_tokens 0" in out["zero"]["error"]["message"]
    assert out["chat"]["error"]["code"] == "unsupported_field" and "no echo" in out["chat"]["error"]["message"]
    assert out["odd"]["error"]["code"] == "invalid_value"


def test_two_ranks_score_what_one_rank_scores(tiny_models, tmp_path: Path) -> None:
    """Per-token scores on two ranks (the last stage's rows carried to rank 0 with the sums):
    the same tokens and values as on one."""
    tm = tiny_models["opt-pre"]
    reqs = [{"custom_id": f"r{i}", "url": COMPL, "body": {"prompt": s, "echo": True, "max_tokens": i % 2,
                                                          "logprobs": 2}} for i, s in enumerate(PROMPTS)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    outs = []
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}.jsonl"
        r = local_ranks(["-m", "flexgen_dist.batch", "-i", str(inp), "-o", str(out), "--no-progress", "--model", str(tm.path),
                         "--gpu-batch-size", "2", "--num-gpu-batches", "2"], nproc=nproc, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append([x["response"]["body"]["choices"][0] for x in read_jsonl(out)])
    for a, b in zip(*outs):
        assert a["token_ids"] == b["token_ids"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_a_batch_that_scores_first_plans_for_its_generation(tiny_models) -> None:
    """The plan is made at an LLM's first call: a batch with echoed prompts plans for its
    generation (``LLM.prepare``), as the same batch without echo does, not for the shorter
    scoring call that runs first."""
    tm = tiny_models["opt-pre"]
    gen = [{"custom_id": f"g{i}", "url": COMPL, "body": {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 12}}
           for i in range(24)]
    echo = {"custom_id": "e", "url": COMPL, "body": {"prompt": PROMPTS[0], "echo": True, "max_tokens": 0,
                                                      "logprobs": 1}}
    plain = {"custom_id": "e", "url": COMPL, "body": {"prompt": PROMPTS[0], "max_tokens": 1}}
    plans = []
    for last in (echo, plain):
        with LLM(str(tm.path), progress=False, ignore_eos=True) as llm:
            lines = llm.batch([*gen, last])
            plans.append(llm.plan.stages[0].policy)
        assert all(x["error"] is None for x in lines)
    alone = LLM(str(tm.path), progress=False)
    with alone:
        alone.score([PROMPTS[0]], logprobs=1)
        scored_first = alone.plan.stages[0].policy
    assert plans[0] == plans[1]
    assert plans[0].block_size > scored_first.block_size  # what the scoring call alone would have planned


@pytest.mark.bundled
def test_the_perplexity_filter_example_keeps_the_natural_texts(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in [
        "The capital of France is Paris, a city known for its museums and cafes.",
        "qzx vvb plork ghh tnnn wq zzzp lorm vvvt xqq"]))
    kept = tmp_path / "kept.jsonl"
    r = subprocess.run([sys.executable, str(repo / "examples" / "perplexity_filter.py"), "--input", str(docs),
                        "--output", str(kept)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = read_jsonl(kept)
    assert [x["text"] for x in out] == ["The capital of France is Paris, a city known for its museums and cafes."]
    assert 1 < out[0]["ppl"] < 200 and "kept 1 of 2 documents" in r.stdout
    assert re.search(r"drop\s+ppl\s+\d+", r.stdout)  # the garbled one, with its figure
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 1}\n')
    r = subprocess.run([sys.executable, str(repo / "examples" / "perplexity_filter.py"), "--input", str(bad)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode != 0 and "must be a JSON object with a 'text' field" in r.stderr


def test_batch_prompt_logprobs_in_vllms_format(tiny_models) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token null for the first, then the token itself
    and its K most likely alternatives, each ``{logprob, rank, decoded_token}`` (completions:
    in each choice; chat: once in the response body); the completion is generated as usual."""
    tm = tiny_models["llama-gqa"]
    p = PROMPTS[2]
    toks, _ = reference_logprobs(tm, [p], 2)
    reqs = [{"custom_id": "c", "url": COMPL, "body": {"prompt": p, "max_tokens": 2, "prompt_logprobs": 2}},
            {"custom_id": "big", "url": COMPL, "body": {"prompt": p, "prompt_logprobs": 21}}]
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    with torch.no_grad():
        ref = tm.model(torch.tensor([p])).logits[0].float().log_softmax(-1)
    choice = out["c"]["response"]["body"]["choices"][0]
    assert choice["token_ids"] == toks[0] and choice["logprobs"] is None
    pl = choice["prompt_logprobs"]
    assert len(pl) == len(p) and pl[0] is None
    for j, d in enumerate(pl[1:], start=1):
        own = d[str(p[j])]
        assert own["logprob"] == pytest.approx(float(ref[j - 1, p[j]]), abs=1e-4)
        assert own["rank"] == int((ref[j - 1] > ref[j - 1, p[j]]).sum()) + 1 and own["decoded_token"] == str(p[j])
        top = ref[j - 1].topk(2).indices.tolist()
        assert all(d[str(i)]["rank"] == n + 1 for n, i in enumerate(top)) and set(d) == {str(i) for i in top} | {str(p[j])}
    assert out["big"]["error"]["code"] == "invalid_value" and "prompt_logprobs 21" in out["big"]["error"]["message"]
