"""Reasoning models (``reasoning.py``): a chat completion's thinking told from its answer
(``<think>`` ... ``</think>``, opened by the prompt or by the completion, and gpt-oss' harmony
channels); a structure held to the answer after the thinking, token for token a masked
transformers loop; the chat template's own variables (``chat_template_kwargs``,
``reasoning_effort``) from the CLI, the API and batch requests; their errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import bpe_chat_model, masked_reference, read_jsonl
from flexgen_dist import LLM, ConfigError, SamplingConfig, Structure
from flexgen_dist.tool_calls import harmony_calls
from flexgen_dist.reasoning import Reasoning, reasoning_of
from flexgen_dist.run import main

THINK = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and enable_thinking is false %}"
         "<think>\n\n</think>\n\n{% endif %}{% endif %}")
OPENED = THINK.replace("assistant: {%", "assistant: <think>\n{%")  # DeepSeek-R1-0528's: the prompt opens it
HARMONY = ("{# harmony: <|channel|> #}{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
           "<|end|>{% endfor %}{% if reasoning_effort is defined %}<|start|>system<|message|>Reasoning: "
           "{{ reasoning_effort }}<|end|>{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_MARKS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
CHAT = "/v1/chat/completions"
MSGS = [[{"role": "user", "content": "yes or no?"}], [{"role": "user", "content": "The quick brown fox"}]]
YES_NO = Structure.choice(["yes", "no"])


@pytest.fixture(scope="module")
def think(tmp_path_factory: pytest.TempPathFactory):
    return bpe_chat_model(tmp_path_factory, "think", THINK, added=("<think>", "</think>"))


@pytest.fixture(scope="module")
def opened(think, tmp_path_factory: pytest.TempPathFactory):
    """The think model with a template that opens the thinking in the prompt."""
    import shutil

    d = tmp_path_factory.mktemp("opened") / "model"
    shutil.copytree(think[0], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = OPENED
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template*"):
        f.unlink()
    return d, think[1], think[2]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory):
    return bpe_chat_model(tmp_path_factory, "harmony", HARMONY, specials=HARMONY_MARKS)


def test_the_thinking_and_the_answer_of_a_completion(think, harmony) -> None:
    _, _, tok = think
    r = reasoning_of(tok)
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert r == Reasoning("think", (start, end))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    plain = enc("assistant: ")
    opened = plain + [start] + enc("\n")
    closed = opened + enc("\n") + [end] + enc("\n\n")  # thinking switched off in the prompt
    done = enc("<think>\nThe quick fox.\n</think>\n\nyes")
    s = r.split(done + [1], plain, tok)
    assert (s.reasoning, s.content) == ("The quick fox.", "yes") and done[s.answer_from:] == enc("\n\nyes")
    s = r.split(enc("The quick fox.</think>\n\nno"), opened, tok)  # the prompt opened it
    assert (s.reasoning, s.content) == ("The quick fox.", "no")
    assert r.split(enc("The quick"), opened, tok).reasoning == "The quick"  # cut at its limit: all thinking
    assert r.split(enc("The quick"), opened, tok).content == ""
    assert r.split(enc("yes no"), plain, tok).reasoning is None  # no thinking: all answer
    assert r.split(enc("yes no"), closed, tok).content == "yes no"
    assert [r.opened(p) for p in (plain, opened, closed)] == [False, True, False]
    assert r.after(plain) == r.after(closed) != r.after(opened)
    assert r.after(plain).startswith(f"start: (<[{start}]> thinking <[{end}]> WS?)? @answer")
    assert r.after(opened).startswith(f"start: thinking <[{end}]> WS? @answer")  # inside the thinking already

    _, _, htok = harmony
    h = reasoning_of(htok)
    assert h is not None and h.syntax == "harmony" and '"final"' in h.after([])
    out = htok.encode("<|channel|>analysis<|message|>The quick fox.<|end|><|start|>assistant<|channel|>final"
                      "<|message|>yes", add_special_tokens=False)
    s = h.split(out + [1], [], htok)
    assert (s.reasoning, s.content) == ("The quick fox.", "yes")
    s = h.split(htok.encode("<|channel|>analysis<|message|>The quick", add_special_tokens=False), [], htok)
    assert (s.reasoning, s.content) == ("The quick", "")
    assert h.split(htok.encode("yes", add_special_tokens=False), [], htok).reasoning is None


@pytest.mark.parametrize("opened", [False, True], ids=["think", "opened"])
def test_every_kind_of_structure_compiles_after_the_thinking(opened: bool, think) -> None:
    """The thinking's grammar takes each kind of structure as its answer; the answer's own
    rules still hold (a matcher fed a thinking, its end and a wrong answer refuses it)."""
    import llguidance

    from flexgen_dist.engine.structure import check_structure, guide_tokenizer

    _, _, tok = think
    kinds = [Structure.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
             Structure.json_object(), Structure.regex(r"[ab]{2}-\d"), YES_NO,
             Structure.grammar('start: "x" NUMBER\n%import common.NUMBER')]
    answers = ['{"a":36}', '{"ok":true}', "ab-4", "no", "x12"]
    lt = guide_tokenizer(tok, 320, (1,))
    r = reasoning_of(tok)
    after = r.after([r.marks[0]] if opened else [])
    think_text = ("" if opened else "<think>") + "The quick fox.</think>\n\n"
    for st, good in zip(kinds, answers):
        st = Structure(st.kind, st.value, after)
        check_structure(st, tok, 320, (1,))
        for text, ok in ((think_text + good, True), (think_text + "maybe", False)):
            m = llguidance.LLMatcher(lt, st.grammar_text())
            fed = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
            assert (fed and m.is_accepting()) == ok, (st.kind, text)


def test_which_models_think_and_how() -> None:
    class Tok:  # what reasoning_of reads: a template, and how the markers encode
        def __init__(self, template: str, single: bool) -> None:
            self.chat_template, self.single = template, single

        def encode(self, s: str, add_special_tokens: bool = False) -> list[int]:
            return [len(s)] if self.single else [1, 2]

    assert reasoning_of(Tok(THINK, True)).syntax == "think"
    assert reasoning_of(Tok(HARMONY, True)).syntax == "harmony"
    for pair in (("[THINK]", "[/THINK]"), ("<seed:think>", "</seed:think>")):  # Magistral, Seed-OSS
        got = reasoning_of(Tok(THINK.replace("<think>", pair[0]).replace("</think>", pair[1]), True))
        assert got.syntax == "think" and got.marks == (len(pair[0]), len(pair[1]))
    assert reasoning_of(Tok("{{ messages }}", True)) is None  # a template that teaches no thinking
    assert reasoning_of(Tok(THINK, False)) is None  # markers that are not tokens of their own: not split
    assert reasoning_of(Tok(THINK, True), "none") is None and reasoning_of(None) is None
    assert reasoning_of(Tok("{{ messages }}", True), "think").syntax == "think"  # named, whatever the template
    with pytest.raises(ConfigError, match="no single tokens <think> </think>"):
        reasoning_of(Tok("{{ messages }}", False), "think")
    with pytest.raises(ConfigError, match="no single tokens <think> </think>"):
        reasoning_of(Tok(THINK, False), "think")
    with pytest.raises(ConfigError, match="--reasoning-parser 'r1'"):
        reasoning_of(Tok(THINK, True), "r1")


@pytest.mark.parametrize("case", ["think", "opened", "harmony"])
def test_a_structure_holds_the_answer_after_the_thinking(case: str, think, opened, harmony) -> None:
    """The completion thinks freely, then its answer follows the structure: token for token a
    transformers loop masked by the structure after the thinking; the thinking that never ends
    (no bias on its end) runs to the limit as reasoning, with no answer."""
    d, model, tok = {"think": think, "opened": opened, "harmony": harmony}[case]
    end = tok.convert_tokens_to_ids("<|end|>" if case == "harmony" else "</think>")
    gen = 80
    with LLM(str(d), progress=False) as llm:
        assert llm.reasoning is not None
        for bias in (0.0, 4.0):
            sc = SamplingConfig(structure=YES_NO, logit_bias=((end, bias),))
            out = llm.chat(MSGS, gen_len=gen, sampling=sc)
            for m, c in zip(MSGS, out):
                after = llm.reasoning.after(c.prompt_ids)
                assert llm.reasoning.opened(c.prompt_ids) == (case == "opened")
                ref = masked_reference(model, tok, c.prompt_ids, Structure("choice", YES_NO.value, after), gen,
                                       {end: bias})
                assert c.token_ids == ref, (case, bias)
                if c.reasoning is None:  # the completion answered at once (where the prompt did not open it)
                    assert case == "think" and c.text in ("yes", "no") and tok.decode(c.token_ids[0]) != "<think>"
                elif end in c.token_ids:  # the thinking ended: the answer is the structure
                    assert c.text in ("yes", "no") and c.finish_reason == "stop"
                else:  # it did not end: all of it is the thinking
                    assert c.text == "" and c.finish_reason == "length" and c.reasoning and not bias
        plain = llm.chat(MSGS, gen_len=gen, sampling=SamplingConfig(structure=YES_NO))
        assert [c.token_ids for c in plain] == [c.token_ids for c in llm.chat(MSGS, gen_len=gen, sampling=[
            SamplingConfig(structure=Structure("choice", YES_NO.value, llm.reasoning.after(c.prompt_ids)))
            for c in plain])]  # an already-placed structure is not wrapped twice
    with LLM(str(d), progress=False, reasoning_parser="none") as llm:  # unsplit: the structure is the completion
        out = llm.chat(MSGS, gen_len=gen, sampling=SamplingConfig(structure=YES_NO))
        assert [c.text for c in out] == [c.text for c in out if c.text in ("yes", "no")]
        assert all(c.reasoning is None for c in out)


def test_batch_requests_pass_the_templates_variables_and_return_the_reasoning(think, harmony) -> None:
    d, _, tok = think
    start, end = (str(i) for i in tok.convert_tokens_to_ids(["<think>", "</think>"]))
    msgs = MSGS[0]
    reqs = [
        {"custom_id": "yes", "url": CHAT, "body": {"messages": msgs, "max_tokens": 24, "logit_bias": {end: 4},
                                                  "structured_outputs": {"choice": ["yes", "no"]}}},
        {"custom_id": "off", "url": CHAT, "body": {"messages": msgs, "max_tokens": 4,
                                                  "chat_template_kwargs": {"enable_thinking": False}}},
        {"custom_id": "long", "url": CHAT, "body": {"messages": msgs, "max_tokens": 6, "logit_bias": {start: 9}}},
        {"custom_id": "compl", "url": "/v1/completions", "body": {"prompt": "yes", "reasoning_effort": "low"}},
        {"custom_id": "reserved", "url": CHAT, "body": {"messages": msgs, "chat_template_kwargs": {"tokenize": True}}},
        {"custom_id": "kwargs", "url": CHAT, "body": {"messages": msgs, "chat_template_kwargs": ["x"]}},
        {"custom_id": "effort", "url": CHAT, "body": {"messages": msgs, "reasoning_effort": "extreme"}},
    ]
    with LLM(str(d), progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    body = {k: v["response"]["body"] for k, v in out.items()}
    yes = body["yes"]["choices"][0]
    assert yes["message"]["content"] in ("yes", "no") and yes["message"]["reasoning"] == ""
    assert yes["finish_reason"] == "stop"
    closed = len(tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert body["off"]["usage"]["prompt_tokens"] == body["yes"]["usage"]["prompt_tokens"] + closed
    long = body["long"]["choices"][0]["message"]  # thinking cut at its limit: reasoning, no answer
    assert long["content"] == "" and long["reasoning"]
    assert "chat field" in out["compl"]["error"]["message"]
    assert "'tokenize' is set by the chat call itself" in out["reserved"]["error"]["message"]
    assert "object of template variables" in out["kwargs"]["error"]["message"]
    assert "reasoning_effort 'extreme'" in out["effort"]["error"]["message"]

    hd, _, htok = harmony
    efforts = [{"custom_id": e, "url": CHAT, "body": {"messages": msgs, "max_tokens": 2, "reasoning_effort": e}}
               for e in ("low", "high")]
    with LLM(str(hd), progress=False) as llm:
        lines = llm.batch(efforts + [{**efforts[0], "custom_id": "none", "body": {"messages": msgs, "max_tokens": 2}}])
    used = [line["response"]["body"]["usage"]["prompt_tokens"] for line in lines]
    effort_tokens = len(htok.encode("<|start|>system<|message|>Reasoning: low<|end|>", add_special_tokens=False))
    assert used[0] == used[2] + effort_tokens and used[1] > used[0]  # "high" takes more tokens than "low"


def test_gpt_oss_calls_are_read_from_its_commentary_messages() -> None:
    names = {"get_weather"}
    raw = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"unit": "c"}<|call|>')
    assert harmony_calls(raw, names) == (None, [("get_weather", '{"unit": "c"}')])
    called = raw.replace("<|channel|>commentary to=functions.get_weather", " to=functions.get_weather<|channel|>"
                                                                           "commentary")  # the recipient first
    assert harmony_calls(called, names)[1] == [("get_weather", '{"unit": "c"}')]
    said = "<|channel|>final<|message|>Sunny.<|return|>"
    assert harmony_calls(said, names) == (said, [])  # no call: the text stays the content
    assert harmony_calls(raw.replace("get_weather", "rm_rf"), names) == (raw.replace("get_weather", "rm_rf"), [])


def test_the_cli_options_the_config_file_and_the_job_fingerprint(opened, tmp_path: Path, capsys) -> None:
    d, _, _ = opened
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text("".join(json.dumps({"id": n, "messages": m}) + "\n" for n, m in enumerate(MSGS)))
    out = tmp_path / "out.jsonl"
    base = ["--model", str(d), "--prompts", str(prompts), "--gen-len", "4", "--no-progress", "--output", str(out)]
    assert main(base) == 0
    recs = read_jsonl(out)
    assert all(r["reasoning"] and r["text"] == "" for r in recs)  # the random model thinks past 4 tokens
    assert main(base + ["--overwrite", "--reasoning-parser", "none"]) == 0
    assert [r["text"] for r in read_jsonl(out)] == [r["reasoning"] for r in recs]  # unsplit: the thinking's text
    off = ["--chat-template-kwargs", '{"enable_thinking": false}']
    assert main(base + ["--overwrite"] + off) == 0
    assert all("reasoning" not in r for r in read_jsonl(out))  # thinking closed in the prompt: no thinking
    capsys.readouterr()
    assert main(base + ["--resume"]) == 1  # the job was made with other template variables
    assert "--overwrite" in capsys.readouterr().err
    cfg = tmp_path / "job.yaml"
    cfg.write_text("chat_template_kwargs:\n  enable_thinking: false\nreasoning_parser: think\n")
    assert main(base + ["--resume", "--config", str(cfg)]) == 1  # reasoning_parser differs from the job's auto
    cfg.write_text("chat_template_kwargs:\n  enable_thinking: false\n")
    assert main(base + ["--resume", "--config", str(cfg)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(base + ["--overwrite", "--chat-template-kwargs", "{enable"]) == 2
    assert "--chat-template-kwargs is not valid JSON" in capsys.readouterr().err
    assert main(base + ["--overwrite", "--chat-template-kwargs", '{"messages": []}']) == 2
    assert "'messages' is set by the chat call itself" in capsys.readouterr().err
    with LLM(str(d), progress=False, chat_template_kwargs={"enable_thinking": False}) as llm:  # a dict in the API
        [c] = llm.chat(MSGS[:1], gen_len=2)
    assert c.prompt_ids[-len(llm.tokenizer.encode("</think>\n\n", add_special_tokens=False)):] == \
        llm.tokenizer.encode("</think>\n\n", add_special_tokens=False)


def test_a_template_that_refuses_a_conversation_fails_that_request_alone(think, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "strict"
    shutil.copytree(think[0], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" \
        + THINK
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template*"):
        f.unlink()
    sys_turn = [{"role": "system", "content": "Be brief."}, *MSGS[0]]
    with LLM(str(d), progress=False) as llm:
        lines = llm.batch([{"custom_id": "sys", "url": CHAT, "body": {"messages": sys_turn, "max_tokens": 2}},
                           {"custom_id": "user", "url": CHAT, "body": {"messages": MSGS[0], "max_tokens": 2}}])
        assert "the model's chat template refused it (no system turns)" in lines[0]["error"]["message"]
        assert lines[1]["error"] is None
        with pytest.raises(ConfigError, match="refused it"):
            llm.chat([sys_turn], gen_len=2)
