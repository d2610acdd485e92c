"""Frequency and presence penalties and logit biases (``SamplingConfig``, ``--frequency-penalty``,
``--presence-penalty``, the OpenAI Batch fields): greedy tokens equal a step-by-step
transformers loop that adjusts its float32 logits as OpenAI's API defines, per request (rows
of one GPU batch with different settings), on one rank and two."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, local_ranks, read_jsonl
from flexgen_dist import LLM, ConfigError, SamplingConfig
from flexgen_dist.run import main

GEN = 8
COMPL = "/v1/completions"


def reference(tm, prompt: list[int], cfg: SamplingConfig, gen_len: int) -> list[int]:
    """Greedy tokens of one prompt, the logits adjusted before each choice."""
    seq, out = list(prompt), []
    counts = torch.zeros(tm.model.config.vocab_size)
    for _ in range(gen_len):
        with torch.no_grad():
            lg = tm.model(torch.tensor([seq])).logits[0, -1].float()
        for i, b in cfg.logit_bias:
            lg[i] += b
        lg -= cfg.frequency_penalty * counts + cfg.presence_penalty * (counts > 0)
        t = int(lg.argmax())
        counts[t] += 1
        out.append(t)
        seq.append(t)
    return out


SETTINGS = [SamplingConfig(frequency_penalty=1.5), SamplingConfig(presence_penalty=2.0),
            SamplingConfig(), SamplingConfig(frequency_penalty=-0.5, presence_penalty=0.7),
            SamplingConfig(logit_bias={7: 100.0}), SamplingConfig(logit_bias={3: 4.0, 9: -100.0}, presence_penalty=1.0)]


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_each_row_adjusted_by_its_own_settings_matches_transformers(kind: str, tiny_models) -> None:
    tm = tiny_models[kind]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=3, ignore_eos=True, progress=False) as llm:
        mixed = llm.generate(PROMPTS, gen_len=GEN, sampling=SETTINGS, logprobs=0)
        plain = llm.generate(PROMPTS, gen_len=GEN)
    for p, cfg, c in zip(PROMPTS, SETTINGS, mixed):
        assert c.token_ids == reference(tm, p, cfg, GEN), cfg
    assert mixed[4].token_ids == [7] * GEN  # a +100 bias wins every step
    assert mixed[2].token_ids == plain[2].token_ids  # a row without settings is unchanged beside them
    assert mixed[0].token_ids != plain[0].token_ids  # the penalty really changed a completion
    # logprobs stay the model's own: the biased token is not certain under the model
    assert all(lp < -0.01 for lp in mixed[4].logprobs.token_logprobs)


def test_one_setting_for_all_rows_and_sampling_with_penalties(tiny_models) -> None:
    tm = tiny_models["llama-gqa"]
    cfg = SamplingConfig(frequency_penalty=0.8, presence_penalty=0.4)
    with LLM(str(tm.path), gpu_batch_size=3, num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        outs = llm.generate(PROMPTS, gen_len=GEN, sampling=cfg)
        hot = SamplingConfig(temperature=0.8, seed=5, presence_penalty=2.0)
        a = llm.generate(PROMPTS, gen_len=GEN, sampling=hot)
        b = llm.generate(PROMPTS, gen_len=GEN, sampling=hot)
    assert [c.token_ids for c in outs] == [reference(tm, p, cfg, GEN) for p in PROMPTS]
    assert [c.token_ids for c in a] == [c.token_ids for c in b]  # seeded: reproducible


def test_bad_settings_say_what_to_give(tiny_models, capsys) -> None:
    with pytest.raises(ValueError, match="--frequency-penalty 3.0: must be in"):
        SamplingConfig(frequency_penalty=3.0)
    with pytest.raises(ValueError, match="biases in"):
        SamplingConfig(logit_bias={5: 101})
    tm = tiny_models["opt-pre"]
    assert main(["--model", str(tm.path), "--num-prompts", "2", "--presence-penalty", "-2.5"]) == 2
    assert "--presence-penalty -2.5: must be in [-2, 2]" in capsys.readouterr().err
    with LLM(str(tm.path), progress=False) as llm:
        with pytest.raises(ConfigError, match="logit_bias token id 999 is outside the vocabulary"):
            llm.generate([[5, 6]], gen_len=2, sampling=SamplingConfig(logit_bias={999: 1.0}))


def test_batch_requests_with_penalties_and_biases(tiny_models) -> None:
    tm = tiny_models["opt-pre"]
    reqs = [{"custom_id": "f", "url": COMPL, "body": {"prompt": PROMPTS[0], "max_tokens": GEN,
                                                      "frequency_penalty": 1.5}},
            {"custom_id": "b", "url": COMPL, "body": {"prompt": PROMPTS[1], "max_tokens": GEN,
                                                      "logit_bias": {"7": 100}, "presence_penalty": 0}},
            {"custom_id": "far", "url": COMPL, "body": {"prompt": PROMPTS[1], "logit_bias": {"256": 1}}},
            {"custom_id": "big", "url": COMPL, "body": {"prompt": PROMPTS[1], "presence_penalty": 2.5}},
            {"custom_id": "key", "url": COMPL, "body": {"prompt": PROMPTS[1], "logit_bias": {"x": 1}}}]
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    ids = {k: out[k]["response"]["body"]["choices"][0]["token_ids"] for k in ("f", "b")}
    assert ids["f"] == reference(tm, PROMPTS[0], SamplingConfig(frequency_penalty=1.5), GEN)
    assert ids["b"] == [7] * GEN
    assert "outside the vocabulary [0, 256)" in out["far"]["error"]["message"]
    assert out["big"]["error"]["code"] == "invalid_value" and "presence_penalty" in out["big"]["error"]["message"]
    assert "not a token id" in out["key"]["error"]["message"]


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_apply_the_penalties_one_rank_applies(tiny_models, prompts_file: Path, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    args = ["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN), "--ignore-eos",
            "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--frequency-penalty", "1.2",
            "--presence-penalty", "0.3", "--no-progress"]
    two = tmp_path / "two.jsonl"
    r = local_ranks(["-m", "flexgen_dist.run", *args, "--output", str(two)], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = SamplingConfig(frequency_penalty=1.2, presence_penalty=0.3)
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    assert [x["tokens"] for x in read_jsonl(two)] == [reference(tm, p, cfg, GEN) for p in prompts]
    fp = json.loads((tmp_path / "two.jsonl.run.json").read_text())
    assert fp["frequency_penalty"] == 1.2 and fp["presence_penalty"] == 0.3


def test_adjust_entries_count_new_ids_once_and_leave_the_logits_alone() -> None:
    from flexgen_dist.engine.sampling import LogitAdjust
    cfgs = [SamplingConfig(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={2: 3.0}), SamplingConfig()]
    adj = LogitAdjust(cfgs, torch.device("cpu"), steps=3)
    logits = torch.zeros(2, 5)
    assert adj(logits).tolist() == [[0, 0, 3, 0, 0], [0] * 5] and logits.abs().sum() == 0
    adj.count(torch.tensor([1, 4]))
    adj.count(torch.tensor([1, 4]))
    adj.count(torch.tensor([2, 4]))
    assert adj(logits).tolist() == [[0, -2.5, 1.5, 0, 0], [0] * 5]
    with pytest.raises(RuntimeError, match="made for 3 steps"):
        adj.count(torch.tensor([0, 0]))


# --- the repetition penalty (transformers' and vLLM's) -------------------------------------
def hf_repetition(tm, prompt: list[int], penalty: float, gen_len: int) -> list[int]:
    """transformers' own greedy generation with ``repetition_penalty`` (one unpadded prompt)."""
    with torch.no_grad():
        out = tm.model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                dtype=torch.long), max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
                                repetition_penalty=penalty, pad_token_id=tm.pad_id)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_repetition_penalty_matches_transformers_per_row(kind: str, tiny_models) -> None:
    """Greedy tokens with ``repetition_penalty`` equal transformers' ``generate`` with it, for
    rows of one GPU batch with different penalties (and one without, unchanged beside them);
    the prompt's ids count, not its left padding."""
    tm = tiny_models[kind]
    pens = [1.8, 1.0, 0.7, 1.3, 2.5, 1.0]
    with LLM(str(tm.path), gpu_batch_size=2, num_gpu_batches=3, ignore_eos=True, progress=False) as llm:
        mixed = llm.generate(PROMPTS, gen_len=GEN, sampling=[SamplingConfig(repetition_penalty=p) for p in pens])
        plain = llm.generate(PROMPTS, gen_len=GEN)
        same = llm.generate(PROMPTS, gen_len=GEN, sampling=SamplingConfig(repetition_penalty=1.8))
    for p, pen, c in zip(PROMPTS, pens, mixed):
        assert c.token_ids == hf_repetition(tm, p, pen, GEN), pen
    assert mixed[1].token_ids == plain[1].token_ids
    assert [c.token_ids for c in same] == [hf_repetition(tm, p, 1.8, GEN) for p in PROMPTS]
    assert any(c.token_ids != q.token_ids for c, q in zip(same, plain))  # it changed some completion


def test_repetition_penalty_goes_before_the_openai_adjustments() -> None:
    """Divided where positive, multiplied where negative, on the prompt's and the generated
    ids, then the additive biases and penalties (vLLM's order)."""
    from flexgen_dist.engine.sampling import LogitAdjust
    cfg = SamplingConfig(repetition_penalty=2.0, logit_bias={1: 1.0}, presence_penalty=0.5)
    adj = LogitAdjust([cfg, SamplingConfig(logit_bias={0: 0.0})], torch.device("cpu"), steps=2,
                      prompts=[[1, 3, 3], [2]])
    logits = torch.tensor([[4.0, 4.0, 4.0, -4.0, 4.0], [4.0, 4.0, 4.0, -4.0, 4.0]])
    assert adj(logits).tolist() == [[4, 3, 4, -8, 4], [4, 4, 4, -4, 4]]
    adj.count(torch.tensor([4, 4]))
    assert adj(logits).tolist() == [[4, 3, 4, -8, 1.5], [4, 4, 4, -4, 4]]
    with pytest.raises(ValueError, match="needs each row's prompt ids"):
        LogitAdjust([cfg], torch.device("cpu"), steps=2)
    with pytest.raises(ValueError, match="--repetition-penalty 0.0: must be in"):
        SamplingConfig(repetition_penalty=0.0)


def test_repetition_penalty_from_the_cli_the_batch_and_two_ranks(tiny_models, prompts_file: Path,
                                                                 tmp_path: Path, capsys) -> None:
    tm = tiny_models["llama-gqa"]
    prompts = [json.loads(line)["input_ids"] for line in prompts_file.read_text().splitlines()]
    args = ["--model", str(tm.path), "--prompts", str(prompts_file), "--gen-len", str(GEN), "--ignore-eos",
            "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--repetition-penalty", "1.6", "--no-progress"]
    one = tmp_path / "one.jsonl"
    assert main([*args, "--output", str(one)]) == 0
    want = [hf_repetition(tm, p, 1.6, GEN) for p in prompts]
    assert [x["tokens"] for x in read_jsonl(one)] == want
    assert json.loads((tmp_path / "one.jsonl.run.json").read_text())["repetition_penalty"] == 1.6
    two = tmp_path / "two.jsonl"
    r = local_ranks(["-m", "flexgen_dist.run", *args, "--output", str(two)], timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(two)] == want  # the last stage got the prompts' ids
    assert main(["--model", str(tm.path), "--num-prompts", "2", "--repetition-penalty", "-1"]) == 2
    assert "--repetition-penalty -1.0: must be in (0, 10]" in capsys.readouterr().err
    reqs = [{"custom_id": "r", "url": COMPL, "body": {"prompt": prompts[0], "max_tokens": GEN,
                                                      "repetition_penalty": 1.6}},
            {"custom_id": "bad", "url": COMPL, "body": {"prompt": prompts[0], "repetition_penalty": 0}}]
    with LLM(str(tm.path), ignore_eos=True, progress=False) as llm:
        out = {line["custom_id"]: line for line in llm.batch(reqs)}
    assert out["r"]["response"]["body"]["choices"][0]["token_ids"] == want[0]
    assert out["bad"]["error"]["code"] == "invalid_value"
