"""Batch jobs in the OpenAI Batch format (``python -m flexgen_dist.batch``, ``LLM.batch``):
chat and completions requests in one file, per-request limits, sampling and stop strings,
an error line per bad request while the others run, duplicate ids refused, finished
sequences ending their block, length-grouped blocks, and a request's greedy text not
depending on its batch-mates."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import PROMPTS, local_ranks, read_jsonl, reference_generate
from flexgen_dist import LLM
from flexgen_dist.batch import main as batch_main
from flexgen_dist.models.loader import bundled_model_path

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"


def chat(cid: str, text: str, **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": text}], **body}}


def compl(cid: str, prompt: object, **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": COMPL, "body": {"prompt": prompt, **body}}


def body(line: dict) -> dict:
    assert line["error"] is None, line["error"]
    assert line["response"]["status_code"] == 200
    return line["response"]["body"]


@pytest.fixture(scope="module")
def smol() -> LLM:
    with LLM(str(bundled_model_path()), progress=False) as llm:
        yield llm


@pytest.mark.bundled
def test_a_chat_request_about_france_answers_paris(smol: LLM) -> None:
    out = smol.batch([chat("fr", "What is the capital of France?", max_tokens=12)])
    b = body(out[0])
    assert out[0]["custom_id"] == "fr" and b["object"] == "chat.completion"
    msg = b["choices"][0]["message"]
    assert msg["role"] == "assistant" and "Paris" in msg["content"]
    assert b["usage"]["total_tokens"] == b["usage"]["prompt_tokens"] + b["usage"]["completion_tokens"]
    assert 1 <= b["usage"]["completion_tokens"] <= 12


@pytest.mark.bundled
def test_stop_strings_max_tokens_and_finish_reasons(smol: LLM) -> None:
    free = smol.batch([compl("free", "The capital of France is", max_tokens=16)])
    text = body(free[0])["choices"][0]["text"]
    assert "." in text  # the stop below is really crossed
    out = smol.batch([compl("stop", "The capital of France is", max_tokens=16, stop=["."]),
                      compl("one", "The capital of France is", max_tokens=1),
                      compl("two-stops", "The capital of France is", max_tokens=16, stop=["zzz", "."])])
    stop, one, two = (body(x)["choices"][0] for x in out)
    assert stop["text"] == text[:text.index(".")] and stop["finish_reason"] == "stop"
    assert two["text"] == stop["text"]
    assert one["finish_reason"] == "length" and body(out[1])["usage"]["completion_tokens"] == 1
    assert body(out[0])["usage"]["completion_tokens"] < body(free[0])["usage"]["completion_tokens"]


@pytest.mark.bundled
def test_n_choices_and_seeded_sampling_reproducible_per_request(smol: LLM) -> None:
    """A seeded request draws the same alone and in another job at another line. (Its logits
    may differ in the last bits between batch shapes, which can only flip a draw between two
    tokens whose probabilities nearly tie; with a nucleus cut that does not happen here.)"""
    req = chat("s", "Say something.", temperature=0.8, top_p=0.9, seed=7, n=3, max_tokens=8)
    alone = smol.batch([req])
    mixed = smol.batch([chat("x", "Tell me a story.", max_tokens=5), req,
                        compl("y", "Once upon a time", temperature=0.5, max_tokens=4)])
    a, m = body(alone[0])["choices"], body(mixed[1])["choices"]
    assert [c["index"] for c in a] == [0, 1, 2]
    assert [c["message"] for c in a] == [c["message"] for c in m]  # the same draws in any job
    assert len({c["message"]["content"] for c in a}) > 1  # the choices draw apart


@pytest.mark.bundled
def test_bad_requests_get_error_lines_and_the_others_run(smol: LLM) -> None:
    reqs = ["{not json", chat("ok1", "Hi", max_tokens=3), {"custom_id": "url", "url": "/v1/images", "body": {}},
            compl("field", "Hi", tools=[{"type": "function", "function": {"name": "f"}}]),
            compl("unknown", "Hi", frobnicate=1),
            chat("long", "word " * 9000, max_tokens=4), compl("bad-temp", "Hi", temperature=5),
            {"custom_id": "nobody", "url": COMPL}, compl("ok2", "Hello", max_tokens=2)]
    out = smol.batch(reqs)
    assert [x["custom_id"] for x in out] == ["line-1", "ok1", "url", "field", "unknown", "long", "bad-temp",
                                             "nobody", "ok2"]
    codes = [x["error"]["code"] if x["error"] else None for x in out]
    assert codes == ["invalid_json", None, "invalid_url", "unsupported_field", "unsupported_field",
                     "context_length_exceeded", "invalid_value", "invalid_request", None]
    for x in out:
        if x["error"]:
            assert x["response"]["status_code"] == 400 and "\n" not in x["error"]["message"]
    assert body(out[8])["usage"]["completion_tokens"] <= 2


@pytest.mark.bundled
def test_the_command_mixes_endpoints_refuses_duplicates_and_resumes(tmp_path: Path, capsys) -> None:
    reqs = [chat("c1", "What is the capital of France?", max_tokens=8), compl("p1", "To make tea,", max_tokens=4),
            "garbage", compl("p2", [504, 3458, 314], max_tokens=3)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in reqs))
    args = ["-i", str(inp), "-o", str(out), "--no-progress", "--model", str(bundled_model_path())]
    assert batch_main(args) == 0
    lines = read_jsonl(out)
    assert [x["custom_id"] for x in lines] == ["c1", "p1", "line-3", "p2"]
    assert body(lines[0])["object"] == "chat.completion" and body(lines[1])["object"] == "text_completion"
    assert lines[2]["error"]["code"] == "invalid_json"
    assert "4 requests written" in capsys.readouterr().out
    first = out.read_bytes()
    out.write_bytes(first[:first.index(b"\n") + 1] + b'{"id": "batch_req_torn')  # one line and a torn one
    assert batch_main(args + ["--resume"]) == 0
    assert [x["custom_id"] for x in read_jsonl(out)] == ["c1", "p1", "line-3", "p2"]
    assert [x["response"]["body"].get("choices") for x in read_jsonl(out)] == \
        [json.loads(ln)["response"]["body"].get("choices") for ln in first.decode().splitlines()]
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(compl("same", "a")) + "\n" + json.dumps(compl("same", "b")) + "\n")
    dout = tmp_path / "dup-out.jsonl"
    assert batch_main(["-i", str(dup), "-o", str(dout), "--no-progress", "--model", str(bundled_model_path())]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: line 2: custom_id 'same' is also on line 1; each request needs its own custom_id"
    assert not dout.exists()


def test_greedy_text_does_not_depend_on_batch_mates_and_blocks_end_when_done(tiny_models) -> None:
    """A request's greedy tokens are transformers' whether it runs alone or among others of
    other lengths and limits; a block whose requests all reached their max_tokens stops there."""
    tm = tiny_models["llama-gqa"]
    ref = reference_generate(tm, PROMPTS, 6)
    reqs = [compl(f"r{n}", p, max_tokens=6 - n % 3) for n, p in enumerate(PROMPTS)]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=1, progress=False, ignore_eos=True) as llm:
        mixed = llm.batch(reqs)
        alone = [llm.batch([r])[0] for r in reqs[:3]]
        short = llm.batch([compl(f"s{n}", p, max_tokens=2) for n, p in enumerate(PROMPTS)], max_tokens=10)
        steps = llm.metrics["stage_times"][0]["token_steps"]
    toks = [body(x)["choices"][0]["token_ids"] for x in mixed]
    assert toks == [r[:6 - n % 3] for n, r in enumerate(ref)]
    assert [body(x)["choices"][0]["token_ids"] for x in alone] == toks[:3]
    assert all(body(x)["choices"][0]["finish_reason"] == "length" for x in mixed)
    assert steps == 3 * 2  # 3 blocks of 2 requests, 2 steps each: not the 10 steps of the call
    assert [body(x)["choices"][0]["token_ids"] for x in short] == [r[:2] for r in ref]


def test_length_grouped_blocks_pad_less_and_give_the_same_tokens(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    prompts = [p * (1 + n % 4) for n, p in enumerate(PROMPTS * 3)]  # 2 to 36 tokens, mixed
    outs, pad = {}, {}
    for window in (0, 16):
        with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=2, progress=False, ignore_eos=True,
                 sort_window=window) as llm:
            outs[window] = [c.token_ids for c in llm.generate(prompts, gen_len=4)]
            pad[window] = llm.metrics["padding_fraction"]
    assert outs[0] == outs[16] == reference_generate(tm, prompts, 4)
    assert pad[16] < pad[0] / 2


@pytest.mark.slow
@pytest.mark.multinode
def test_the_command_on_two_ranks_writes_what_one_rank_writes(tmp_path: Path) -> None:
    reqs = [chat("c1", "What is the capital of France?", max_tokens=8), compl("p1", "Tea is", max_tokens=5, stop=["."]),
            compl("bad", "x", suffix="!"), chat("c2", "Name a color.", max_tokens=6, temperature=0.7, seed=3),
            compl("ll", "The capital of France is Paris", echo=True, max_tokens=0, logprobs=1)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    outs = []
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}.jsonl"
        r = local_ranks(["-m", "flexgen_dist.batch", "-i", str(inp), "-o", str(out), "--no-progress"], nproc=nproc, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append([(x["custom_id"], x["error"], x["response"]["body"].get("choices")) for x in read_jsonl(out)])
    lls = [o.pop()[2][0]["logprobs"] for o in outs]  # the echoed prompt's logprobs, from the last stage
    assert outs[0] == outs[1]
    assert outs[0][2][1]["code"] == "unsupported_field"
    assert lls[0]["tokens"] == lls[1]["tokens"] and lls[0]["token_logprobs"][0] is None
    assert lls[0]["token_logprobs"][1:] == pytest.approx(lls[1]["token_logprobs"][1:], abs=1e-5)


def test_blocks_group_by_length_then_limit_within_windows() -> None:
    from flexgen_dist.engine.blocks import plan_blocks

    lens = [100, 5, 900, 104, 7, 880, 30, 31, 60, 61, 62, 63]
    limits = [4, 50, 9, 60, 5, 8, 16, 2, 1, 9, 3, 7]
    blocks = plan_blocks(lens, 2, limits, window_blocks=4)  # windows of 8 requests
    assert [b.window for b in blocks] == [0, 0, 0, 0, 1, 1]
    assert sorted(m for b in blocks[:4] for m in b.members) == list(range(8))  # a window keeps its requests
    # by length: 2 5 3 0 | 7 6 4 1; then each 2 blocks' worth (4 requests) by limit
    assert [b.members for b in blocks[:4]] == [[3, 2], [5, 0], [1, 6], [4, 7]]
    assert [b.members for b in blocks[4:]] == [[9, 11], [10, 8]]
    assert blocks[0].padding == 900 - 104
    assert [b.members for b in plan_blocks(lens, 5)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]  # input order
    assert [b.members for b in plan_blocks(lens[:4], 2, None, window_blocks=2)] == [[2, 3], [0, 1]]  # no limits
