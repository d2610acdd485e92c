"""Chat templates: a conversation is rendered through the model's own template exactly as
transformers renders it, in the API (``llm.chat``, or messages in ``generate``), in prompt
files (a ``messages`` field) and in the default job of an instruct model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexgen_dist import LLM, ConfigError
from flexgen_dist.models.loader import bundled_model_path
from flexgen_dist.prompts import DEFAULT_QUESTIONS, render_chat
from flexgen_dist.run import main

CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol() -> LLM:
    with LLM(str(bundled_model_path()), progress=False, ignore_eos=True) as llm:
        yield llm


@pytest.mark.bundled
def test_the_template_renders_as_transformers_renders_it(smol: LLM) -> None:
    tok = smol.tokenizer
    text, ids = render_chat(0, CHAT, tok)
    assert text == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "You answer in one word." in text
    ref = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert ids == list(ref)


@pytest.mark.bundled
def test_chat_equals_generate_on_the_rendered_ids(smol: LLM) -> None:
    _, ids = render_chat(0, CHAT, smol.tokenizer)
    reply = smol.chat([CHAT], gen_len=4)[0]
    assert reply.prompt_ids == ids
    assert reply.token_ids == smol.generate([ids], gen_len=4)[0].token_ids
    with pytest.raises(ConfigError, match="'messages' must be a non-empty list"):
        smol.chat([[{"role": "user"}]], gen_len=2)


@pytest.mark.bundled
def test_prompt_files_take_messages_and_the_default_job_asks_questions(tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "messages": CHAT}) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["--prompts", str(prompts), "--gen-len", "3", "--output", str(out), "--no-progress"]) == 0
    rec = json.loads(out.read_text())
    assert rec["messages"] == CHAT and rec["prompt"].endswith("<|im_start|>assistant\n")
    assert main(["--gen-len", "2", "--no-progress"]) == 0  # the default job
    printed = capsys.readouterr().out
    assert all(q in printed for q in DEFAULT_QUESTIONS)


def test_a_model_without_a_template_refuses_a_chat(tiny_models) -> None:
    with LLM(str(tiny_models["llama-gqa"].path), progress=False) as llm:
        with pytest.raises(ConfigError, match="no chat template"):
            llm.chat([CHAT], gen_len=2)
