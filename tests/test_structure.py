"""Structured output (``engine/structure.py``): completions held to a JSON schema, any JSON
object, a regex, a choice of strings or a Lark grammar. Greedy tokens equal a step-by-step
transformers loop whose float32 logits get the same llguidance mask before each argmax, per
request (rows of one GPU batch with different structures, and rows without), on one rank and
two; sampled completions all match; the OpenAI Batch fields, the CLI options and their errors."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import bpe_chat_model, local_ranks, masked_reference, read_jsonl
from flexgen_dist import LLM, ConfigError, SamplingConfig, Structure
from flexgen_dist.run import main

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "boolean"}},
          "required": ["answer", "n"], "additionalProperties": False}
GEN = 24


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory: pytest.TempPathFactory):
    """A random Llama of 320 logits with a byte-level BPE tokenizer of 300 tokens, EOS id 1."""
    return bpe_chat_model(tmp_path_factory, "structured",
                          "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
                          "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")


def reference(model, tok, prompt: list[int], structure: Structure | None, gen_len: int) -> list[int]:
    return masked_reference(model, tok, prompt, structure, gen_len)


STRUCTURES = [Structure.json_schema(SCHEMA), None, Structure.regex(r"[ab]{2,5}-\d"),
              Structure.choice(["yes", "no", "maybe"]), Structure.json_object(),
              Structure.grammar('start: "x" NUMBER ("," NUMBER)*\n%import common.NUMBER')]


def prompts(tok) -> list[list[int]]:
    return [tok.encode(t)[:9] for t in ["Answer:", "The quick", "yes no", "[1, 2", "{", "Name"]]


@pytest.mark.parametrize("opts", [dict(gpu_batch_size=2, num_gpu_batches=3),
                                  dict(gpu_batch_size=3, num_gpu_batches=2, percent=(0, 100, 0, 100, 100, 0),
                                       cpu_attention=True)], ids=["device", "ram-merged"])
def test_each_row_follows_its_own_structure_as_a_masked_transformers_loop(tok_model, opts, tmp_path: Path) -> None:
    d, model, tok = tok_model
    ps = prompts(tok)
    cfgs = [SamplingConfig(structure=s) for s in STRUCTURES]
    with LLM(str(d), progress=False, offload_dir=str(tmp_path / "off"), **opts) as llm:
        got = llm.generate(ps, gen_len=GEN, sampling=cfgs)
        plain = llm.generate(ps, gen_len=GEN)
    for p, s, c in zip(ps, STRUCTURES, got):
        assert c.token_ids == reference(model, tok, p, s, GEN), s
    assert got[1].token_ids == plain[1].token_ids  # a row without a structure is unchanged beside them
    assert got[0].token_ids != plain[0].token_ids  # the structure really changed a completion
    assert json.loads(got[0].text)["answer"] in ("yes", "no") and got[0].token_ids[-1] == 1
    assert re.fullmatch(r"[ab]{2,5}-\d", got[2].text) and got[3].text in ("yes", "no", "maybe")
    assert got[5].text.startswith("x")


def test_sampled_completions_match_their_structure_and_repeat_by_seed(tok_model) -> None:
    d, _, tok = tok_model
    ps = prompts(tok) * 2
    hot = [SamplingConfig(temperature=1.0, seed=3, structure=Structure.json_schema(SCHEMA)),
           SamplingConfig(temperature=1.5, top_p=0.9, structure=Structure.regex(r"[ab]{2,5}-\d"))] * 6
    with LLM(str(d), progress=False, gpu_batch_size=4, num_gpu_batches=3) as llm:
        a = llm.generate(ps, gen_len=24, sampling=hot, logprobs=0)
        b = llm.generate(ps, gen_len=24, sampling=hot)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for n, c in enumerate(a):
        if n % 2 == 0:
            assert set(json.loads(c.text)) == {"answer", "n"}
        else:
            assert re.fullmatch(r"[ab]{2,5}-\d", c.text)
        assert c.token_ids[-1] == 1 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert len({c.text for c in a[1::2]}) > 1  # sampled: not one string for every seed


def test_a_structure_with_penalties_and_a_token_limit(tok_model) -> None:
    d, model, tok = tok_model
    ps = prompts(tok)[:2]
    st = Structure.json_object()
    with LLM(str(d), progress=False) as llm:
        cut = llm.generate(ps, gen_len=2, sampling=SamplingConfig(structure=st))
        pen = llm.generate(ps, gen_len=GEN, sampling=SamplingConfig(presence_penalty=2.0, structure=st))
    assert [c.token_ids for c in cut] == [reference(model, tok, p, st, 2) for p in ps]
    assert all(c.finish_reason == "length" for c in cut)  # an unfinished object, cut at the limit
    for c in pen:  # penalised, still an object while it goes
        assert c.text.startswith("{")


def test_bad_structures_and_settings_say_what_to_do(tok_model, tiny_models) -> None:
    d, _, _ = tok_model
    with pytest.raises(ValueError, match="choice takes a non-empty list"):
        Structure.choice([])
    with pytest.raises(ValueError, match="not valid JSON"):
        Structure("json", "{nope")
    with pytest.raises(ValueError, match="give a Structure"):
        SamplingConfig(structure={"type": "json_object"})  # type: ignore[arg-type]
    with LLM(str(d), progress=False) as llm:
        with pytest.raises(ConfigError, match="regex"):
            llm.generate([[5, 6]], gen_len=2, sampling=SamplingConfig(structure=Structure.regex("[a-")))
        with pytest.raises(ConfigError, match="drop --ignore-eos"):
            llm.generate([[5, 6]], gen_len=2, sampling=SamplingConfig(ignore_eos=True,
                                                                       structure=Structure.json_object()))
    with LLM(str(tiny_models["opt-pre"].path), progress=False) as llm:  # no tokenizer
        with pytest.raises(ConfigError, match="needs the model's tokenizer"):
            llm.generate([[5, 6]], gen_len=2, sampling=SamplingConfig(structure=Structure.json_object()))


COMPL = "/v1/completions"


def test_batch_requests_take_response_format_and_vllms_structured_outputs(tok_model) -> None:
    d, model, tok = tok_model
    p = prompts(tok)[0]
    reqs = [{"custom_id": "schema", "url": COMPL, "body": {
                "prompt": p, "max_tokens": GEN,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}},
            {"custom_id": "object", "url": COMPL, "body": {"prompt": p, "max_tokens": GEN,
                                                           "response_format": {"type": "json_object"}}},
            {"custom_id": "choice", "url": COMPL, "body": {"prompt": p, "max_tokens": GEN,
                                                           "structured_outputs": {"choice": ["yes", "no", "maybe"]}}},
            {"custom_id": "regex", "url": COMPL, "body": {"prompt": p, "max_tokens": GEN,
                                                          "guided_regex": r"[ab]{2,5}-\d"}},
            {"custom_id": "text", "url": COMPL, "body": {"prompt": p, "max_tokens": GEN,
                                                         "response_format": {"type": "text"}}},
            {"custom_id": "two", "url": COMPL, "body": {"prompt": p, "guided_regex": "a", "guided_choice": ["b"]}},
            {"custom_id": "badre", "url": COMPL, "body": {"prompt": p, "structured_outputs": {"regex": "[a-"}}},
            {"custom_id": "kind", "url": COMPL, "body": {"prompt": p, "response_format": {"type": "yaml"}}}]
    with LLM(str(d), progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    choice = {k: out[k]["response"]["body"]["choices"][0] for k in ("schema", "object", "choice", "regex", "text")}
    def text(st: Structure | None) -> str:
        return tok.decode(reference(model, tok, p, st, GEN), skip_special_tokens=True)

    assert choice["schema"]["text"] == text(Structure.json_schema(SCHEMA))
    assert choice["regex"]["text"] == text(Structure.regex(r"[ab]{2,5}-\d"))
    assert choice["text"]["text"] == text(None)
    assert set(json.loads(choice["schema"]["text"])) == {"answer", "n"}
    assert choice["choice"]["text"] in ("yes", "no", "maybe") and choice["choice"]["finish_reason"] == "stop"
    assert choice["object"]["text"].startswith("{")
    assert "one structure" in out["two"]["error"]["message"]
    assert out["badre"]["error"]["code"] == "invalid_value" and "regex" in out["badre"]["error"]["message"]
    assert "use type text, json_object or json_schema" in out["kind"]["error"]["message"]


def test_the_cli_options_the_config_file_and_the_job_fingerprint(tok_model, tmp_path: Path, capsys) -> None:
    d, model, tok = tok_model
    ps = prompts(tok)
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"id": n, "input_ids": p}) + "\n" for n, p in enumerate(ps)))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "o.jsonl"
    base = ["--model", str(d), "--prompts", str(pf), "--gen-len", str(GEN), "--no-progress"]
    assert main([*base, "--json-schema", str(schema), "--output", str(out)]) == 0
    st = Structure.json_schema(SCHEMA)
    assert [r["tokens"] for r in read_jsonl(out)] == [reference(model, tok, p, st, GEN) for p in ps]
    fp = json.loads((tmp_path / "o.jsonl.run.json").read_text())
    assert fp["structure"]["kind"] == "json" and json.loads(fp["structure"]["value"]) == SCHEMA
    # another structure is another job: resuming this one with it is refused
    assert main([*base, "--choice", "yes", "no", "--output", str(out), "--resume"]) == 1
    assert "structure" in capsys.readouterr().err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("choice: [yes, no, maybe]\n")
    assert main([*base, "--config", str(cfg)]) == 2
    assert "quote the words YAML reads as true/false" in capsys.readouterr().err
    cfg.write_text("choice: ['yes', 'no', maybe]\n")
    out2 = tmp_path / "o2.jsonl"
    assert main([*base, "--config", str(cfg), "--output", str(out2)]) == 0
    assert all(r["text"] in ("yes", "no", "maybe") for r in read_jsonl(out2))
    assert main([*base, "--regex", "a", "--choice", "b"]) == 2
    assert "--regex and --choice exclude each other" in capsys.readouterr().err
    assert main([*base, "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_mask_on_the_last_stage(tok_model, tmp_path: Path) -> None:
    d, model, tok = tok_model
    ps = prompts(tok)
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"id": n, "input_ids": p}) + "\n" for n, p in enumerate(ps)))
    out = tmp_path / "two.jsonl"
    r = local_ranks(["-m", "flexgen_dist.run", "--model", str(d), "--prompts", str(pf), "--gen-len", str(GEN),
                     "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--regex", r"[ab]{2,5}-\d",
                     "--no-progress", "--output", str(out)], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    st = Structure.regex(r"[ab]{2,5}-\d")
    assert [x["tokens"] for x in read_jsonl(out)] == [reference(model, tok, p, st, GEN) for p in ps]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"], "additionalProperties": False}}}
CHAT = "/v1/chat/completions"


def test_chat_requests_call_a_named_function_or_any_required(tok_model) -> None:
    """tool_choice naming a function holds the completion to its parameters' schema,
    ``required`` to a list of calls of the tools; the tools go to the chat template; each
    output is what the masked transformers loop gives for the rendered prompt."""
    from flexgen_dist.openai_tools import REQUIRED, ToolChoice
    from flexgen_dist.prompts import render_chat

    d, model, tok = tok_model
    msgs = [{"role": "user", "content": "The weather?"}]
    body = {"messages": msgs, "tools": [WEATHER, ALARM], "max_tokens": GEN}
    named = {"type": "function", "function": {"name": "get_weather"}}
    reqs = [{"custom_id": "named", "url": CHAT, "body": {**body, "tool_choice": named}},
            {"custom_id": "required", "url": CHAT, "body": {**body, "tool_choice": "required", "max_tokens": 48}},
            {"custom_id": "none", "url": CHAT, "body": {**body, "tool_choice": "none", "max_tokens": 4}},
            {"custom_id": "plain", "url": CHAT, "body": {"messages": msgs, "max_tokens": 4}},
            {"custom_id": "auto", "url": CHAT, "body": body},
            {"custom_id": "unknown", "url": CHAT, "body": {**body, "tool_choice": {"type": "function",
                                                                                 "function": {"name": "nope"}}}},
            {"custom_id": "compl", "url": COMPL, "body": {"prompt": "x", "tools": [WEATHER], "tool_choice": "required"}},
            {"custom_id": "two", "url": CHAT, "body": {**body, "tool_choice": named,
                                                      "response_format": {"type": "json_object"}}},
            {"custom_id": "turns", "url": CHAT, "body": {**body, "tool_choice": "none", "max_tokens": 2, "messages": [
                *msgs, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]}}]
    with LLM(str(d), progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    ids = render_chat(0, msgs, tok, [WEATHER, ALARM])[1]
    assert "TOOLS" in tok.decode(ids) and "get_weather" in tok.decode(ids)
    for key, call, limit in (("named", "get_weather", GEN), ("required", REQUIRED, 48)):
        choice = out[key]["response"]["body"]["choices"][0]
        ref = reference(model, tok, ids, ToolChoice((WEATHER, ALARM), call).structure(), limit)
        text = tok.decode(ref, skip_special_tokens=True)
        if ref[-1] != 1:  # cut at its limit: the text as it is, no calls
            assert choice["message"]["content"] == text and choice["finish_reason"] == "length"
            continue
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        if call == REQUIRED:
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
                [(c["name"], c["arguments"]) for c in json.loads(text)]
        else:
            assert calls[0]["function"]["name"] == "get_weather" and calls[0]["function"]["arguments"] == text
            assert json.loads(text)["unit"] in ("c", "f") and calls[0]["id"].startswith("call_")
    body_none = out["none"]["response"]["body"]
    assert isinstance(body_none["choices"][0]["message"]["content"], str)
    assert "tool_calls" not in body_none["choices"][0]["message"]
    # the tools are in the prompt of a request that has them, whatever it chooses
    assert body_none["usage"]["prompt_tokens"] > out["plain"]["response"]["body"]["usage"]["prompt_tokens"]
    assert out["auto"]["error"]["code"] == "unsupported_field" and "tool_choice 'auto'" in out["auto"]["error"]["message"]
    assert "name one of the tools (get_weather, set_alarm)" in out["unknown"]["error"]["message"]
    assert "tools is a chat field" in out["compl"]["error"]["message"]
    assert "one structure" in out["two"]["error"]["message"]
    assert out["turns"]["error"] is None  # a call and its result in the conversation render


AUTO_CASES = {  # what a template writes -> what the model answers (forced here) -> the content read
    "hermes": ("{# calls in <tool_call></tool_call> blocks #}",
               'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>',
               "Let me see."),
    "mistral-v3": ("{# [TOOL_CALLS] #}", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"unit": "c"}}]', None),
    "mistral-v11": ("{# [TOOL_CALLS] #}", '[TOOL_CALLS]get_weather[ARGS]{"unit": "c"}', None),
    "glm": ("{# <tool_call>name <arg_key>k</arg_key> <arg_value>v</arg_value> #}",
            "Checking. <tool_call>get_weather\n<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>",
            "Checking."),
    "deepseek-v3.1": ("{# <｜tool▁calls▁begin｜> #}",
                      '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"unit": "c"}'
                      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None),
    "qwen3-coder": ("{# <tool_call> <function=name> <parameter=k> #}",
                    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=unit>\nc\n</parameter>\n</function>\n"
                    "</tool_call>", "Checking."),
    "kimi-k2": ("{# <|tool_calls_section_begin|> #}",
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"unit": "c"}<|tool_call_end|><|tool_calls_section_end|>', None),
    "minimax-m2": ("{# <minimax:tool_call> <invoke name=...> <parameter name=...> #}",
                   'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="unit">c</parameter>\n'
                   "</invoke>\n</minimax:tool_call>", "Checking."),
    "granite": ("{# respond only with <|tool_call|> followed by a JSON list of tools used #}",
                'Sure. <|tool_call|>[{"name": "get_weather", "arguments": {"unit": "c"}}]', "Sure."),
    "llama4-pythonic": ("{# respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...)] #}",
                        '[get_weather(unit="c")]', None),
    "llama3": ('{# "parameters": dictionary of argument name and its value #}',
               '<|python_tag|>{"name": "get_weather", "parameters": {"unit": "c"}}', None),
}


@pytest.mark.parametrize("case", sorted(AUTO_CASES))
def test_auto_tool_choice_reads_the_calls_the_template_teaches(case: str, tok_model, tmp_path: Path) -> None:
    """A template that teaches a call syntax (``<tool_call>`` blocks, ``[TOOL_CALLS]``, Llama 3's
    JSON) lets the model choose: its calls become tool_calls, its text before them the content;
    a completion without one is plain content. (A choice structure makes this random model
    write what a trained one would.)"""
    import shutil

    d, _, tok = tok_model
    marker, answer, content = AUTO_CASES[case]
    model = tmp_path / case
    shutil.copytree(d, model)
    for f in model.glob("chat_template*"):
        f.unlink()
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = tok.chat_template + marker
    cfg_path.write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "The weather?"}]
    reqs = [{"custom_id": "call", "url": CHAT, "body": {"messages": msgs, "tools": [WEATHER], "max_tokens": 240,
                                                       "structured_outputs": {"choice": [answer]}}},
            {"custom_id": "text", "url": CHAT, "body": {"messages": msgs, "tools": [WEATHER], "max_tokens": 8,
                                                       "structured_outputs": {"choice": ["Sunny."]}}}]
    with LLM(str(model), progress=False) as llm:
        out = {line["custom_id"]: line["response"]["body"]["choices"][0] for line in llm.batch(reqs)}
    call = out["call"]
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in call["message"]["tool_calls"]] \
        == [("get_weather", {"unit": "c"})]
    assert out["text"]["message"] == {"role": "assistant", "content": "Sunny."} and out["text"]["finish_reason"] == "stop"


PHI4_MINI_TEMPLATE = (  # Phi-4-mini-instruct's own: the tools come on the system message
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")


def test_phi4_mini_takes_its_tools_on_the_system_message_and_calls_with_functools(tok_model, tmp_path: Path) -> None:
    """Phi-4-mini's template ignores the ``tools`` it is given and writes the ones its system
    message carries: the request's functions go there (a system message opened where the
    conversation has none), and its ``functools[...]`` list is read back under ``auto``."""
    import shutil

    from flexgen_dist.tool_calls import phi4_calls, reads_auto
    from flexgen_dist.prompts import render_chat

    d, _, tok = tok_model
    model = tmp_path / "phi4"
    shutil.copytree(d, model)
    for f in model.glob("chat_template*"):
        f.unlink()
    cfg_path = model / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": PHI4_MINI_TEMPLATE}))
    from transformers import AutoTokenizer

    phi = AutoTokenizer.from_pretrained(model)
    assert reads_auto(phi) == "phi4"
    msgs = [{"role": "user", "content": "The weather?"}]
    listed = json.dumps([WEATHER["function"], ALARM["function"]], ensure_ascii=False)
    text = render_chat(0, msgs, phi, [WEATHER, ALARM])[0]
    assert text == f"<|system|><|tool|>{listed}<|/tool|><|end|><|user|>The weather?<|end|><|assistant|>"
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert render_chat(0, sys_msgs, phi, [WEATHER])[0].startswith(
        f"<|system|>Be brief.<|tool|>{json.dumps([WEATHER['function']])}<|/tool|><|end|><|user|>")
    assert render_chat(0, sys_msgs, phi)[0].startswith("<|system|>Be brief.<|end|>")  # no tools: as written
    turns = [*msgs, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    assert ('<|assistant|>functools[{"name": "get_weather", "arguments": {"unit": "c"}}]<|end|><|tool|>22 C<|end|>'
            in render_chat(0, turns, phi, [WEATHER])[0])  # its earlier call as it wrote it
    names = {"get_weather": {}, "set_alarm": {}}
    two = 'functools[{"name": "get_weather", "arguments": {"unit": "c"}}, {"name": "set_alarm", "parameters": {"on": [true]}}]'
    assert phi4_calls("Let me check. " + two + "<|end|>", names) == (
        "Let me check.", [("get_weather", '{"unit": "c"}'), ("set_alarm", '{"on": [true]}')])
    assert phi4_calls("Use functools.lru_cache. " + two, names)[0] == "Use functools.lru_cache."  # prose may name it
    for bad in (two.replace("set_alarm", "nope"), two + " and then prose", "functools[", "functools[]", "It is sunny.",
                "import functools\nfunctools.reduce(f, [1, 2])"):
        assert phi4_calls(bad, names) == (bad, []), bad
    answer = 'functools[{"name": "get_weather", "arguments": {"unit": "c"}}]'
    reqs = [{"custom_id": "call", "url": CHAT, "body": {"messages": msgs, "tools": [WEATHER], "max_tokens": 240,
                                                       "structured_outputs": {"choice": [answer]}}}]
    with LLM(str(model), progress=False) as llm:
        call = llm.batch(reqs)[0]["response"]["body"]["choices"][0]
    assert call["finish_reason"] == "tool_calls" and call["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in call["message"]["tool_calls"]] \
        == [("get_weather", {"unit": "c"})]


def test_the_call_readers_take_whole_calls_of_known_functions_only() -> None:
    from flexgen_dist.tool_calls import (deepseek_calls, glm_calls, hermes_calls, kimi_calls, llama3_calls,
                                           mistral_calls, xml_calls)

    names = {"get_weather", "set_alarm"}
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>'
    two = hermes_calls(block + "\n" + block.replace('"c"', '"f"'), names)
    assert two[0] is None and [json.loads(a)["unit"] for _, a in two[1]] == ["c", "f"]
    assert hermes_calls(block.replace("get_weather", "other"), names)[1] == []  # an unknown function
    assert hermes_calls(block[:30], names)[1] == []  # cut
    pair = '[TOOL_CALLS]get_weather[ARGS]{"unit": "f"}[TOOL_CALLS]set_alarm[ARGS]{"on": true}</s>'
    assert mistral_calls(pair, names) == (None, [("get_weather", '{"unit": "f"}'), ("set_alarm", '{"on": true}')])
    assert mistral_calls("Sure. [TOOL_CALLS] [{\"name\": \"set_alarm\", \"arguments\": {}}]", names)[0] == "Sure."
    assert mistral_calls("[TOOL_CALLS] [{\"name\": \"nope\"}]", names)[1] == []
    assert llama3_calls('{"name": "set_alarm", "parameters": {"on": false}}; {"name": "get_weather", '
                        '"parameters": {"unit": "c"}}<|eom_id|>', names)[1] == \
        [("set_alarm", '{"on": false}'), ("get_weather", '{"unit": "c"}')]
    assert llama3_calls('{"name": "set_alarm", "parameters": {}} and then some prose', names)[1] == []
    assert llama3_calls("It is sunny.", names) == ("It is sunny.", [])
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>set_alarm\n```json\n"
          '{"on": true}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert deepseek_calls(v3, names) == (None, [("set_alarm", '{"on": true}')])
    assert deepseek_calls("No calls here.", names)[1] == []
    glm = "<tool_call>set_alarm\n<arg_key>on</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"
    assert glm_calls(glm, names) == (None, [("set_alarm", '{"on": true}')])
    assert glm_calls(glm.replace("set_alarm", "nope"), names)[1] == []
    xml = ("<tool_call>\n<function=set_alarm>\n<parameter=on>\ntrue\n</parameter>\n<parameter=label>\nwake up\n"
           "</parameter>\n</function>\n</tool_call>")
    assert xml_calls(xml, names) == (None, [("set_alarm", '{"on": true, "label": "wake up"}')])
    assert xml_calls(xml.replace("set_alarm", "nope"), names)[1] == []
    kimi = ('Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
            '<|tool_call_argument_begin|>{"unit": "c"}<|tool_call_end|><|tool_call_begin|>functions.set_alarm:1'
            '<|tool_call_argument_begin|>{"on": true}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    assert kimi_calls(kimi, names) == ("Let me check.", [("get_weather", '{"unit": "c"}'), ("set_alarm", '{"on": true}')])
    assert kimi_calls(kimi.replace("set_alarm", "nope"), names) == (kimi.replace("set_alarm", "nope"), [])


def test_tagged_arguments_follow_their_schemas_and_minimax_and_granite_calls_are_read() -> None:
    """A tag's text is a string argument where the parameter's schema says so (``"42"`` stays
    text), else its JSON value (``42``); MiniMax-M2's ``<invoke>`` elements, several in one block, are
    calls of known functions only; so are Granite's ``<|tool_call|>`` lists and pythonic lists
    (Llama 4; literals only, read without evaluating anything); a template's marker picks its
    reader."""
    from types import SimpleNamespace

    from flexgen_dist.tool_calls import granite_calls, minimax_calls, pythonic_calls, reads_auto, xml_calls

    tools = {"set_alarm": {"on": {"type": "boolean"}, "label": {"type": "string"}}, "get_weather": {}}
    mm = ('Let me look.\n<minimax:tool_call>\n<invoke name="set_alarm">\n<parameter name="on">true</parameter>\n'
          '<parameter name="label">42</parameter>\n</invoke>\n<invoke name="get_weather">\n'
          '<parameter name="unit">c</parameter>\n</invoke>\n</minimax:tool_call>')
    assert minimax_calls(mm, tools) == ("Let me look.", [("set_alarm", '{"on": true, "label": "42"}'),
                                                         ("get_weather", '{"unit": "c"}')])
    assert minimax_calls(mm.replace("get_weather", "nope"), tools) == (mm.replace("get_weather", "nope"), [])
    assert minimax_calls("No calls.", tools) == ("No calls.", [])
    xml = "<tool_call>\n<function=set_alarm>\n<parameter=label>\n42\n</parameter>\n</function>\n</tool_call>"
    assert xml_calls(xml, tools)[1] == [("set_alarm", '{"label": "42"}')]
    assert xml_calls(xml, {"set_alarm": {}})[1] == [("set_alarm", '{"label": 42}')]  # no schema: its JSON value
    gr = '<|tool_call|>[{"name": "set_alarm", "arguments": {"on": true}}, {"name": "get_weather", "arguments": {}}]'
    assert granite_calls(gr + "<|end_of_text|>", tools) == (None, [("set_alarm", '{"on": true}'), ("get_weather", "{}")])
    assert granite_calls("Sure. " + gr, tools)[0] == "Sure."
    assert granite_calls(gr + " and more words", tools)[1] == []  # prose after the list: not a call message
    assert granite_calls(gr.replace("set_alarm", "nope"), tools)[1] == []
    assert granite_calls('[{"name": "get_weather", "arguments": {"unit": "c"}}]', tools)[1] == [("get_weather", '{"unit": "c"}')]
    assert granite_calls("It is sunny.", tools) == ("It is sunny.", [])
    py = '<|python_start|>[set_alarm(on=True, label="7"), get_weather()]<|python_end|><|eot|>'
    assert pythonic_calls(py, tools) == (None, [("set_alarm", '{"on": true, "label": "7"}'), ("get_weather", "{}")])
    assert pythonic_calls("[get_weather(unit=[1, {'a': None}])]", tools)[1] == [("get_weather", '{"unit": [1, {"a": null}]}')]
    for bad in ("[get_weather(unit=__import__('os'))]", "[nope(unit='c')]", "[get_weather('c')]",
                "Sure: [get_weather()]", "[get_weather()] then prose", "[]", "[get_weather(**x)]"):
        assert pythonic_calls(bad, tools) == (bad, []), bad  # nothing evaluated; not a call message
    template = "{% for t in tools %}<minimax:tool_call><invoke name=...>{% endfor %}"
    assert reads_auto(SimpleNamespace(chat_template=template)) == "minimax"


@pytest.mark.gpu
def test_structures_on_the_gpu_choose_what_the_cpu_chooses(tok_model, gpu_device) -> None:
    """The masks reach the device from pinned bits and are applied there: float32 tokens equal
    the CPU's (which equal the masked transformers loop, above)."""
    d, _, tok = tok_model
    ps, cfgs = prompts(tok), [SamplingConfig(structure=s) for s in STRUCTURES]
    outs = {}
    for dev in ("cpu", gpu_device.type):
        with LLM(str(d), device=dev, dtype="float32", gpu_batch_size=2, num_gpu_batches=3, progress=False) as llm:
            outs[dev] = [c.token_ids for c in llm.generate(ps, gen_len=GEN, sampling=cfgs)]
    assert outs["cpu"] == outs[gpu_device.type]


@pytest.mark.bundled
def test_the_extraction_example_prints_json_that_parses(tmp_path: Path) -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, str(repo / "examples" / "extract.py")], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4
    rows = [json.loads(line.split("  <-", 1)[0]) for line in lines]
    assert all(set(row) == {"person", "city", "year"} and 1900 <= row["year"] <= 2100 for row in rows)
    assert rows[0] == {"person": "Maria", "city": "Paris", "year": 1998}  # the bundled model's answer here
