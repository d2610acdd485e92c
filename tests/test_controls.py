"""vLLM's per-request sampling controls (``SamplingConfig``, the batch fields, the CLI flags):
``min_tokens``, ``stop_token_ids``, ``ignore_eos`` per request, ``bad_words`` /
``bad_words_ids``, ``allowed_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``. Greedy tokens equal a step-by-step loop over transformers' float32
logits that applies vLLM's rules, rows of one GPU batch each with its own settings, on one
rank and two; transformers' own ``generate`` agrees where its processors mean the same."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, local_ranks, read_jsonl
from flexgen_dist import LLM, ConfigError, SamplingConfig
from flexgen_dist.engine.bans import TokenBans, bad_word_ids
from flexgen_dist.prompts import StopStrings
from flexgen_dist.run import main

GEN = 10
COMPL, CHAT = "/v1/completions", "/v1/chat/completions"
EOS = 2  # the tiny models'


def reference(tm, prompt: list[int], cfg: SamplingConfig, gen_len: int, eos: tuple[int, ...] = (EOS,)) -> list[int]:
    """Greedy tokens of one prompt under vLLM's rules: before ``min_tokens`` new tokens no EOS
    or stop id; a bad word's last token never follows the rest of it among the generated
    tokens; only ``allowed_token_ids``; the completion ends at its first ending id."""
    seq, out = list(prompt), []
    ends = cfg.ends(eos)
    for _ in range(gen_len):
        with torch.no_grad():
            lg = tm.model(torch.tensor([seq])).logits[0, -1].float()
        if len(out) < cfg.min_tokens:
            lg[list({*eos, *cfg.stop_token_ids})] = float("-inf")
        for w in cfg.bad_words_ids:
            if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == list(w[:-1])):
                lg[w[-1]] = float("-inf")
        if cfg.allowed_token_ids:
            keep = lg[list(cfg.allowed_token_ids)].clone()
            lg[:] = float("-inf")
            lg[list(cfg.allowed_token_ids)] = keep
        t = int(lg.argmax())
        out.append(t)
        seq.append(t)
        if t in ends:
            break
    return out


def plain(tm, prompt: list[int]) -> list[int]:
    return reference(tm, prompt, SamplingConfig(ignore_eos=True), GEN)


def new_at(seq: list[int]) -> int:
    """Where ``seq`` first has an id it had not had before (past its start)."""
    return next(n for n in range(1, len(seq)) if seq[n] not in seq[:n])


def settings(tm) -> list[SamplingConfig]:
    """One setting per prompt of ``PROMPTS``, each made to change its own completion."""
    first = [plain(tm, p) for p in PROMPTS]
    return [
        SamplingConfig(stop_token_ids=(first[0][new_at(first[0])],)),  # ends early, at that id
        SamplingConfig(min_tokens=4, stop_token_ids=(first[1][0],), ignore_eos=True),  # not before 4 tokens
        SamplingConfig(bad_words_ids=((first[2][0],), tuple(first[2][1:3]))),  # a word of one and of two
        SamplingConfig(allowed_token_ids=(3, 4, 5, 200)),
        SamplingConfig(ignore_eos=True),
        SamplingConfig(min_tokens=GEN, stop_token_ids=tuple(first[5][:3])),  # never: masked to the end
    ]


@pytest.mark.parametrize("kind", ["opt-post-proj", "llama-gqa"])
def test_each_row_follows_its_own_controls_as_vllm_defines_them(kind: str, tiny_models) -> None:
    tm = tiny_models[kind]
    cfgs = settings(tm)
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=3, progress=False) as llm:
        mixed = llm.generate(PROMPTS, gen_len=GEN, sampling=cfgs, logprobs=0)
    want = [reference(tm, p, c, GEN) for p, c in zip(PROMPTS, cfgs)]
    assert [c.token_ids for c in mixed] == want
    first = [plain(tm, p) for p in PROMPTS]
    k = new_at(first[0])
    assert want[0] == first[0][:k + 1] and mixed[0].finish_reason == "stop" and mixed[0].stop_reason == first[0][k]
    assert want[1] != first[1] and first[1][0] not in want[1][:4]  # the stop id came back only after 4 tokens
    assert want[2][0] != first[2][0] and set(want[3]) <= {3, 4, 5, 200}
    assert len(want[5]) == GEN and mixed[5].finish_reason == "length"
    # the log-probabilities stay the model's own, banned or not
    assert all(lp < 0 for c in mixed for lp in c.logprobs.token_logprobs)


def test_transformers_generate_agrees_on_min_new_tokens_stop_ids_and_bad_words(tiny_models) -> None:
    """transformers' ``min_new_tokens``, an ``eos_token_id`` list and ``bad_words_ids`` (whose
    prefixes the prompt does not end with) mean what vLLM's fields do."""
    tm = tiny_models["llama-gqa"]
    p = PROMPTS[0]
    first = plain(tm, p)
    cfg = SamplingConfig(min_tokens=3, stop_token_ids=(first[0], first[4]), bad_words_ids=((first[1],),))
    with LLM(str(tm.path), progress=False) as llm:
        ours = llm.generate([p], gen_len=GEN, sampling=cfg)[0].token_ids
    with torch.no_grad():
        hf = tm.model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=GEN, min_new_tokens=3, do_sample=False, pad_token_id=tm.pad_id,
                               eos_token_id=[EOS, first[0], first[4]], bad_words_ids=[[first[1]]])
    assert ours == hf[0, len(p):].tolist() == reference(tm, p, cfg, GEN)
    assert ours != first[:len(ours)]


def test_bans_leave_the_logits_alone_and_move_their_window() -> None:
    bans = TokenBans([SamplingConfig(bad_words_ids=((1, 2, 3), (4,))), SamplingConfig(min_tokens=2, stop_token_ids=(0,))],
                     torch.device("cpu"), eos_ids=(5,))
    logits = torch.zeros(2, 6)
    inf = float("-inf")
    assert bans(logits, 0).tolist() == [[0, 0, 0, 0, inf, 0], [inf, 0, 0, 0, 0, inf]] and logits.abs().sum() == 0
    bans.count(torch.tensor([1, 3]))
    bans.count(torch.tensor([2, 3]))
    assert bans(logits, 2).tolist() == [[0, 0, 0, inf, inf, 0], [0] * 6]  # 1 2 then 3 is banned; min passed
    bans.count(torch.tensor([0, 3]))
    assert bans(logits, 3).tolist() == [[0, 0, 0, 0, inf, 0], [0] * 6]


def test_bad_controls_say_what_to_give(tiny_models, capsys) -> None:
    with pytest.raises(ValueError, match="min_tokens -1: must be an int >= 0"):
        SamplingConfig(min_tokens=-1)
    with pytest.raises(ValueError, match="stop_token_ids 'ab': give a list of token ids"):
        SamplingConfig(stop_token_ids="ab")
    with pytest.raises(ValueError, match="bad_words"):
        SamplingConfig(bad_words=("",))
    assert SamplingConfig(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # lists work too
    tm = tiny_models["opt-pre"]
    with LLM(str(tm.path), progress=False) as llm:
        with pytest.raises(ConfigError, match="stop_token_ids 300 is outside the vocabulary"):
            llm.generate([[5, 6]], gen_len=2, sampling=SamplingConfig(stop_token_ids=(300,)))
        with pytest.raises(ConfigError, match="bad_words need the model's tokenizer"):
            llm.generate([[5, 6]], gen_len=2, sampling=SamplingConfig(bad_words=("no",)))
    assert main(["--model", str(tm.path), "--num-prompts", "2", "--min-tokens", "-3"]) == 2
    assert "min_tokens -3: must be an int >= 0" in capsys.readouterr().err
    from flexgen_dist import Structure
    with LLM(str(tiny_models["llama-gqa"].path), progress=False) as llm:
        with pytest.raises(ConfigError, match="drop min_tokens"):
            llm.generate([[5, 6]], gen_len=2, sampling=SamplingConfig(min_tokens=1, structure=Structure.regex("a+")))


def test_batch_requests_carry_their_own_controls(tiny_models) -> None:
    tm = tiny_models["opt-post-proj"]
    cfgs = settings(tm)

    def body(n: int, **kw) -> dict:
        return {"prompt": PROMPTS[n], "max_tokens": GEN, **kw}
    c = cfgs
    reqs = [{"custom_id": "stop", "url": COMPL, "body": body(0, stop_token_ids=list(c[0].stop_token_ids))},
            {"custom_id": "min", "url": COMPL, "body": body(1, min_tokens=4, ignore_eos=True,
                                                            stop_token_ids=list(c[1].stop_token_ids))},
            {"custom_id": "allowed", "url": COMPL, "body": body(3, allowed_token_ids=[3, 4, 5, 200])},
            {"custom_id": "space", "url": COMPL, "body": body(4, spaces_between_special_tokens=True, ignore_eos=True)},
            {"custom_id": "far", "url": COMPL, "body": body(0, stop_token_ids=[256])},
            {"custom_id": "empty", "url": COMPL, "body": body(0, allowed_token_ids=[])},
            {"custom_id": "neg", "url": COMPL, "body": body(0, min_tokens=-1)},
            {"custom_id": "slow", "url": COMPL, "body": body(0, spaces_between_special_tokens=False)},
            {"custom_id": "words", "url": COMPL, "body": body(0, bad_words=["x"])},
            {"custom_id": "flag", "url": COMPL, "body": body(0, ignore_eos="yes")}]
    with LLM(str(tm.path), progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    ch = {k: out[k]["response"]["body"]["choices"][0] for k in ("stop", "min", "allowed", "space")}
    assert ch["stop"]["token_ids"] == reference(tm, PROMPTS[0], c[0], GEN)
    assert ch["stop"]["finish_reason"] == "stop" and ch["stop"]["stop_reason"] == c[0].stop_token_ids[0]
    assert ch["min"]["token_ids"] == reference(tm, PROMPTS[1], c[1], GEN)
    assert ch["allowed"]["token_ids"] == reference(tm, PROMPTS[3], c[3], GEN)
    assert ch["space"]["token_ids"] == plain(tm, PROMPTS[4]) and ch["space"]["stop_reason"] is None
    err = {k: out[k]["error"] for k in ("far", "empty", "neg", "slow", "words", "flag")}
    assert "stop_token_ids must be a list of token ids in [0, 256)" in err["far"]["message"]
    assert "allowed_token_ids must not be empty" in err["empty"]["message"]
    assert "min_tokens -1" in err["neg"]["message"]
    assert err["slow"]["code"] == "unsupported_field"
    assert "bad_words need the model's tokenizer" in err["words"]["message"]
    assert "ignore_eos 'yes': true or false" in err["flag"]["message"]


def test_the_run_ignore_eos_is_a_batch_request_default(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    reqs = [{"custom_id": str(n), "url": COMPL, "body": {"prompt": p, "max_tokens": GEN}} for n, p in enumerate(PROMPTS)]
    reqs.append({"custom_id": "own", "url": COMPL, "body": {"prompt": PROMPTS[0], "max_tokens": GEN,
                                                           "ignore_eos": False, "min_tokens": GEN}})
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        out = {line["custom_id"]: line["response"]["body"]["choices"][0] for line in llm.batch(reqs)}
    assert [out[str(n)]["token_ids"] for n in range(len(PROMPTS))] == [plain(tm, p) for p in PROMPTS]
    assert out["own"]["token_ids"] == reference(tm, PROMPTS[0], SamplingConfig(min_tokens=GEN), GEN)


# --- text: the bundled model's tokenizer ---------------------------------------------------
@pytest.mark.bundled
def test_stop_ids_text_special_tokens_and_bad_words_on_the_bundled_model() -> None:
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    with LLM(progress=False) as llm:
        tok = llm.tokenizer
        base = llm.chat([msgs], gen_len=24)[0]
        assert "Paris" in base.text and base.finish_reason == "stop" and base.stop_reason is None
        dot = tok.encode(".", add_special_tokens=False)[0]
        cut, kept, raw = llm.generate([msgs] * 3, gen_len=24, sampling=[
            SamplingConfig(stop_token_ids=(dot,)), SamplingConfig(stop_token_ids=(dot,), include_stop_str_in_output=True),
            SamplingConfig(skip_special_tokens=False, include_stop_str_in_output=True)])
        words = bad_word_ids(["Paris"], tok)
        banned = llm.generate([msgs], gen_len=24, sampling=SamplingConfig(bad_words=("Paris",)))[0]
    assert cut.token_ids[-1] == dot and cut.stop_reason == dot and cut.finish_reason == "stop"
    assert not cut.text.endswith(".") and kept.text == cut.text + "."
    assert raw.token_ids == base.token_ids and raw.text == base.text + tok.decode([base.token_ids[-1]])
    assert raw.text.endswith("<|im_end|>")
    # vLLM's ids: the word alone, and after a space where that is another first token
    assert words == (tuple(tok.encode("Paris", add_special_tokens=False)),
                     tuple(tok.encode(" Paris", add_special_tokens=False)))
    assert "Paris" not in banned.text
    assert not any(banned.token_ids[n:n + len(w)] == list(w) for w in words for n in range(len(banned.token_ids)))


@pytest.mark.bundled
def test_a_stop_string_counts_only_past_min_tokens() -> None:
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    with LLM(progress=False) as llm:
        tok = llm.tokenizer
        free = llm.generate([prompt], gen_len=16, sampling=SamplingConfig(ignore_eos=True))[0]
        assert free.text.count(",") >= 3, free.text
        early, late = llm.generate([prompt] * 2, gen_len=16, stop=[[","], [","]], sampling=[
            SamplingConfig(ignore_eos=True), SamplingConfig(ignore_eos=True, min_tokens=4)])
        both = llm.generate([prompt], gen_len=16, stop=[[","]],
                            sampling=SamplingConfig(ignore_eos=True, min_tokens=4, include_stop_str_in_output=True))[0]
    floor = len(tok.decode(free.token_ids[:4]))
    at = free.text.find(",", floor)  # the first comma ending past the first 4 tokens' text
    assert early.text == free.text[:free.text.find(",")] and early.stop_reason == ","
    assert late.text == free.text[:at] and len(late.text) > len(early.text)
    assert both.text == free.text[:at + 1] and both.finish_reason == "stop"


def test_stop_strings_floor_by_characters() -> None:
    class Chars:  # one character per id
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)
    s = StopStrings(((",",),), Chars(), floors=[3])
    ids = [ord(c) for c in "a,bc,d"]
    assert not s.hit(0, ids[:3])  # within the floor
    assert not s.hit(0, ids[:4])  # the comma at 1 ends inside the first 3 tokens' text
    assert s.hit(0, ids[:5])
    assert s.cut(0, "a,bc,d", floor=3) == ("a,bc", ",")
    assert s.cut(0, "a,bc,d", floor=3, include=True) == ("a,bc,", ",")
    assert s.cut(0, "a,bc,d") == ("a", ",")


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_and_the_cli_flags(tiny_models, prompts_file: Path, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    first = plain(tm, prompts[0])
    cfg = SamplingConfig(min_tokens=2, stop_token_ids=(first[0], first[3]))
    args = ["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN), "--gpu-batch-size", "2",
            "--num-gpu-batches", "2", "--min-tokens", "2", "--stop-token-ids", str(first[0]), str(first[3]),
            "--no-progress"]
    want = [reference(tm, p, cfg, GEN) for p in prompts]
    assert want[0] != first[:len(want[0])]  # the controls changed it
    one = tmp_path / "one.jsonl"
    assert main([*args, "--output", str(one)]) == 0
    assert [x["tokens"] for x in read_jsonl(one)] == want
    fp = json.loads((tmp_path / "one.jsonl.run.json").read_text())
    assert fp["min_tokens"] == 2 and fp["stop_token_ids"] == [first[0], first[3]]
    two = tmp_path / "two.jsonl"
    r = local_ranks(["-m", "flexgen_dist.run", *args, "--output", str(two)], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(two)] == want


# --- vLLM's request extras: add_special_tokens, return_tokens_as_token_ids -----------------
@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A ``bpe_chat_model`` whose tokenizer puts a BOS (``<s>``) before every text, as Llama's."""
    from tokenizers import processors

    from conftest import bpe_chat_model
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    d, model, tok = bpe_chat_model(tmp_path_factory, "bos", template, specials=("<s>",))
    bos = tok.convert_tokens_to_ids("<s>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save_pretrained(d)
    return d, tok, bos


def test_add_special_tokens_and_tokens_as_ids(bos_model) -> None:
    d, tok, bos = bos_model
    text = "The quick brown fox."
    msgs = [{"role": "user", "content": "yes no maybe"}]
    reqs = [{"custom_id": "plain", "url": COMPL, "body": {"prompt": text, "max_tokens": 3, "logprobs": 2,
                                                         "return_tokens_as_token_ids": True}},
            {"custom_id": "bare", "url": COMPL, "body": {"prompt": text, "max_tokens": 3, "add_special_tokens": False}},
            {"custom_id": "chat", "url": CHAT, "body": {"messages": msgs, "max_tokens": 3, "logprobs": True,
                                                       "top_logprobs": 1, "return_tokens_as_token_ids": True}},
            {"custom_id": "chat-bos", "url": CHAT, "body": {"messages": msgs, "max_tokens": 3,
                                                           "add_special_tokens": True, "priority": 3}},
            {"custom_id": "bad", "url": COMPL, "body": {"prompt": text, "add_special_tokens": "no"}}]
    with LLM(str(d), progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    body = {k: out[k]["response"]["body"] for k in ("plain", "bare", "chat", "chat-bos")}
    ids = tok(text)["input_ids"]
    assert ids[0] == bos and tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
    assert body["plain"]["usage"]["prompt_tokens"] == len(ids)
    assert body["bare"]["usage"]["prompt_tokens"] == len(ids) - 1
    assert body["chat-bos"]["usage"]["prompt_tokens"] == body["chat"]["usage"]["prompt_tokens"] + 1
    lp = body["plain"]["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"]) and all(
        k.startswith("token_id:") for alts in lp["top_logprobs"] for k in alts)
    content = body["chat"]["choices"][0]["logprobs"]["content"]
    assert content and all(e["token"].startswith("token_id:") and e["bytes"] == list(e["token"].encode())
                           for e in content)
    assert "add_special_tokens 'no': true or false" in out["bad"]["error"]["message"]
