"""``/v1/responses`` batch requests (OpenAI's Responses API): each is answered as the chat
completion it amounts to (the same tokens as the equivalent chat request, greedy), in the
Responses format: output items (reasoning, function calls, a message of output_text with its
logprobs), status, usage; what needs state or input this runtime does not keep is an error
line of its own."""
from __future__ import annotations

import json

import pytest

from conftest import bpe_chat_model
from flexgen_dist import LLM

PLAIN = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['tool_calls'] is defined %}"
         "{{ m['tool_calls'] | tojson }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
THINK = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # a template that thinks
         "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and enable_thinking is false %}"
         "<think>\n\n</think>\n\n{% endif %}{% endif %}")
CHAT, RESP = "/v1/chat/completions", "/v1/responses"
TOOLS = [{"type": "function", "name": "lookup", "description": "find a person",
          "parameters": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                         "required": ["name", "age"], "additionalProperties": False}}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory):
    return bpe_chat_model(tmp_path_factory, "plain", PLAIN)


@pytest.fixture(scope="module")
def think(tmp_path_factory: pytest.TempPathFactory):
    return bpe_chat_model(tmp_path_factory, "think-resp", THINK, added=("<think>", "</think>"))


def _req(cid: str, url: str, **body: object) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def _body(line: dict) -> dict:
    assert line["error"] is None, line["error"]
    return line["response"]["body"]


def test_a_response_is_the_chat_completion_it_amounts_to(plain) -> None:
    """instructions + input, a limit, logprobs, a JSON schema, a named function tool over a
    conversation with an earlier call and its output: the same tokens as the chat request, in
    the Responses shape."""
    d, _, _ = plain
    convo = [{"role": "user", "content": [{"type": "input_text", "text": "who is Ada?"}]},
             {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"name\": \"Ada\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "36, London"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "user", "content": "and Bob?"}]
    chat_convo = [{"role": "user", "content": "who is Ada?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"name\": \"Ada\"}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "36, London"},
                  {"role": "user", "content": "and Bob?"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    reqs = [_req("r-text", RESP, instructions="be brief", input="The quick brown fox", max_output_tokens=6,
                 include=["message.output_text.logprobs"], top_logprobs=2),
            _req("c-text", CHAT, messages=[{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "The quick brown fox"}],
                 max_tokens=6, logprobs=True, top_logprobs=2),
            _req("r-json", RESP, input="where?", max_output_tokens=40,
                 text={"format": {"type": "json_schema", "name": "place", "schema": SCHEMA}}),
            _req("c-json", CHAT, messages=[{"role": "user", "content": "where?"}], max_tokens=40,
                 response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}),
            _req("r-tool", RESP, input=convo, tools=TOOLS, tool_choice={"type": "function", "name": "lookup"},
                 max_output_tokens=60),
            _req("c-tool", CHAT, messages=chat_convo, tools=chat_tools,
                 tool_choice={"type": "function", "function": {"name": "lookup"}}, max_tokens=60)]
    with LLM(str(d), progress=False, gpu_batch_size=3) as llm:
        lines = {x["custom_id"]: x for x in llm.batch(reqs)}
        name = llm.model.spec.name
    r, c = _body(lines["r-text"]), _body(lines["c-text"])
    assert r["object"] == "response" and r["id"].startswith("resp_") and r["model"] == name
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    (msg,) = r["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["status"] == "incomplete"
    assert msg["content"][0]["type"] == "output_text"
    assert msg["content"][0]["text"] == c["choices"][0]["message"]["content"]
    assert msg["content"][0]["logprobs"] == c["choices"][0]["logprobs"]["content"]
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert r["usage"]["output_tokens"] == c["usage"]["completion_tokens"] == 6
    assert r["usage"]["total_tokens"] == c["usage"]["total_tokens"]
    rj, cj = _body(lines["r-json"]), _body(lines["c-json"])
    text = rj["output"][0]["content"][0]["text"]
    assert text == cj["choices"][0]["message"]["content"] and set(json.loads(text)) == {"city"}
    assert rj["status"] == "completed" and rj["incomplete_details"] is None
    rt, ct = _body(lines["r-tool"]), _body(lines["c-tool"])
    (call,) = rt["output"]
    want = ct["choices"][0]["message"]["tool_calls"][0]
    assert call["type"] == "function_call" and call["name"] == "lookup" and call["status"] == "completed"
    assert call["arguments"] == want["function"]["arguments"] and call["call_id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"name", "age"}
    assert rt["usage"]["input_tokens"] == ct["usage"]["prompt_tokens"]


def test_a_reasoning_models_response_has_its_reasoning_item(think) -> None:
    d, _, tok = think
    end = str(tok.convert_tokens_to_ids("</think>"))
    reqs = [_req("r", RESP, input="yes or no?", max_output_tokens=24, reasoning={"effort": "low"},
                 text={"format": {"type": "json_object"}}, top_logprobs=0),
            _req("c", CHAT, messages=[{"role": "user", "content": "yes or no?"}], max_tokens=24,
                 reasoning_effort="low", response_format={"type": "json_object"}, logprobs=True)]
    for q in reqs:
        q["body"]["logit_bias"] = {end: 4}  # vLLM's extension: end the thinking soon
    with LLM(str(d), progress=False) as llm:
        r, c = (_body(x) for x in llm.batch(reqs))
    reasoning, msg = r["output"]
    cm = c["choices"][0]["message"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == cm["reasoning"]
    assert msg["content"][0]["text"] == cm["content"]
    thought = r["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert 0 < thought < r["usage"]["output_tokens"] == c["usage"]["completion_tokens"]


def test_what_a_response_request_cannot_ask(plain) -> None:
    d, _, _ = plain
    bad = [("prev", {"input": "hi", "previous_response_id": "resp_1"}, "unsupported_field", "state"),
           ("image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "unsupported_field", "input_image"),
           ("empty", {"input": []}, "invalid_request", "'input'"),
           ("field", {"input": "hi", "modalities": ["audio"]}, "unsupported_field", "modalities"),
           ("stream", {"input": "hi", "stream": True}, "unsupported_field", "stream"),
           ("web", {"input": "hi", "tools": [{"type": "web_search"}]}, "unsupported_field", "web_search"),
           ("include", {"input": "hi", "include": ["file_search_call.results"]}, "unsupported_field", "include"),
           ("format", {"input": "hi", "text": {"format": {"type": "xml"}}}, "invalid_value", "text.format")]
    with LLM(str(d), progress=False) as llm:
        lines = {x["custom_id"]: x for x in llm.batch([_req(cid, RESP, **b) for cid, b, _, _ in bad]
                                                       + [_req("ok", RESP, input="hi", max_output_tokens=2,
                                                               store=False, metadata={"k": "v"})])}
    for cid, _, code, words in bad:
        err = lines[cid]["error"]
        assert err is not None and err["code"] == code and words in err["message"], (cid, err)
    assert _body(lines["ok"])["usage"]["output_tokens"] == 2


def test_a_chat_choice_has_its_message_alone(plain) -> None:
    """A chat completion's choice carries ``message`` and no completions ``text`` (OpenAI's
    shape); a completions choice ``text`` and no ``message``."""
    d, _, _ = plain
    with LLM(str(d), progress=False) as llm:
        c, p = (_body(x)["choices"][0] for x in llm.batch([
            _req("c", CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=2),
            _req("p", "/v1/completions", prompt="hi", max_tokens=2)]))
    assert set(c) == {"index", "message", "logprobs", "finish_reason", "stop_reason"}  # the last: vLLM's
    assert set(p) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}


def test_truncation_auto_drops_the_first_turns_until_the_conversation_fits(plain) -> None:
    """``truncation: "auto"``: the instructions stay, whole turns go from the start (a turn's
    call and output together) until the prompt and max_output_tokens fit; the answer is the
    chat completion of what is left. Without it, or where one turn alone is too long, the
    request's error says so."""
    d, _, tok = plain
    long = " ".join(["The quick brown fox. yes no maybe 123-4567 abc"] * 30)  # a turn of a few hundred tokens
    turns = []
    for n in range(6):
        turns += [{"role": "user", "content": f"{n} {long}"}, {"role": "assistant", "content": f"ok {n}"}]
    items = turns + [{"role": "user", "content": "yes no maybe"}]
    body = dict(instructions="be brief", input=items, max_output_tokens=8)
    with LLM(str(d), progress=False) as llm:
        limit = llm.model.spec.max_positions
        kept = list(turns)
        def size(msgs: list) -> int:
            return len(tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)["input_ids"])
        while size([{"role": "system", "content": "be brief"}, *kept, items[-1]]) + 8 > limit:
            kept = kept[2:]
        assert 0 < len(kept) < len(turns)  # some turns had to go, not all
        out = llm.batch([_req("auto", RESP, truncation="auto", **body), _req("off", RESP, **body),
                         _req("chat", CHAT, messages=[{"role": "system", "content": "be brief"}, *kept, items[-1]],
                              max_tokens=8),
                         _req("one", RESP, truncation="auto", input=" ".join([long] * 8), max_output_tokens=8)])
    auto, off, chat, one = out
    assert _body(auto)["output"][-1]["content"][0]["text"] == _body(chat)["choices"][0]["message"]["content"]
    assert _body(auto)["usage"]["input_tokens"] == _body(chat)["usage"]["prompt_tokens"] <= limit - 8
    assert off["error"]["code"] == "context_length_exceeded"
    assert one["error"]["code"] == "context_length_exceeded"
