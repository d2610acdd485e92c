"""An assistant prefill: a conversation whose last message is the assistant's is continued
(transformers' ``continue_final_message``), in the API and prompt files by the last message's
role (as transformers' text-generation pipeline does), in batch files by vLLM's
``continue_final_message`` / ``add_generation_prompt``; the completion goes on from the
prefill, token for token as transformers' greedy generation does from the same ids."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import bpe_chat_model, read_jsonl
from flexgen_dist import LLM

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CONVO = [{"role": "user", "content": "The quick brown fox."}, {"role": "assistant", "content": '{"name": "'}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return bpe_chat_model(tmp_path_factory, "prefill", TEMPLATE)


def _greedy(m: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_the_api_and_prompt_files_continue_a_final_assistant_message(model, tmp_path: Path) -> None:
    d, m, tok = model
    cont = tok.apply_chat_template(CONVO, continue_final_message=True, tokenize=False)
    assert cont.endswith('{"name": "')  # transformers' rendering: the prefill, its turn left open
    ids = tok(cont, add_special_tokens=False)["input_ids"]
    opened = tok(tok.apply_chat_template(CONVO[:1], add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    with LLM(str(d), progress=False, ignore_eos=True) as llm:
        c, u = llm.chat([CONVO, CONVO[:1]], gen_len=5)
    assert c.prompt_ids == ids and c.token_ids == _greedy(m, ids, 5)
    assert u.prompt_ids == opened  # a user's last message: the assistant's turn opened, as before
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"id": "x", "messages": CONVO}) + "\n")
    from flexgen_dist.run import main

    out = tmp_path / "o.jsonl"
    assert main(["--model", str(d), "--prompts", str(p), "--gen-len", "5", "--ignore-eos", "--no-progress",
                 "--output", str(out)]) == 0
    assert read_jsonl(out)[0]["tokens"] == c.token_ids


def test_batch_requests_continue_as_vllm_asks(model) -> None:
    """``continue_final_message: true`` (with ``add_generation_prompt: false``) continues the
    prefill; without it the assistant's message is a past turn and a new one opens (vLLM's
    default); both true, or a continuation of a user's message, are error lines."""
    d, m, tok = model
    ids = tok(tok.apply_chat_template(CONVO, continue_final_message=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    new_turn = tok(tok.apply_chat_template(CONVO, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    reqs = [{"custom_id": "cont", "url": CHAT, "body": {"messages": CONVO, "max_tokens": 4,
                                                        "continue_final_message": True,
                                                        "add_generation_prompt": False}},
            {"custom_id": "cont-only", "url": CHAT, "body": {"messages": CONVO, "max_tokens": 4,
                                                             "continue_final_message": True}},
            {"custom_id": "turn", "url": CHAT, "body": {"messages": CONVO, "max_tokens": 4}},
            {"custom_id": "both", "url": CHAT, "body": {"messages": CONVO, "continue_final_message": True,
                                                        "add_generation_prompt": True}},
            {"custom_id": "user", "url": CHAT, "body": {"messages": CONVO[:1], "continue_final_message": True,
                                                        "add_generation_prompt": False}},
            {"custom_id": "compl", "url": "/v1/completions", "body": {"prompt": "hi", "continue_final_message": True}}]
    with LLM(str(d), progress=False, ignore_eos=True) as llm:
        lines = {x["custom_id"]: x for x in llm.batch(reqs)}
        api = llm.chat([CONVO], gen_len=4)[0]  # the API's continuation (transformers' tokens, tested above)
    assert api.token_ids == _greedy(m, ids, 4)
    for cid in ("cont", "cont-only"):
        b = lines[cid]["response"]["body"]
        assert b["usage"]["prompt_tokens"] == len(ids)
        assert b["choices"][0]["message"]["content"] == api.text
    assert lines["turn"]["response"]["body"]["usage"]["prompt_tokens"] == len(new_turn)
    assert "both true" in lines["both"]["error"]["message"]
    assert "end with the assistant's message" in lines["user"]["error"]["message"]
    assert "chat field" in lines["compl"]["error"]["message"]
