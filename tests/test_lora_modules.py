"""LoRA adapters served per request (``--lora-modules NAME=DIR``, ``LLM(lora_modules=...)``):
one call mixes prompts of several adapters and of the base model, in the same GPU batches, and
each prompt's greedy tokens equal transformers' on PEFT's model with its adapter (float32), on
every placement, with merged decode, a compressed base, two pipeline stages and shared
prefixes; batch files choose the adapter by ``model``; bad names are refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.config import ConfigError
from flexgen_dist.errors import ModelLoadError
from test_lora import _adapted

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPT_ALL = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
CHOICE = ["a1", None, "a2", "a1", "a2", None]  # PROMPTS' adapters: rows of each in every GPU batch


def _two(tm: TinyModel, tmp_path: Path, targets: list[str]) -> tuple[dict[str, str], dict[str | None, TinyModel]]:
    """Two adapters of ``tm`` (the second with another rank and fewer matrices), their
    directories by name, and the model each request runs on by its adapter (None: the base)."""
    m1 = _adapted(tm, tmp_path / "a1", targets, seed=3)
    m2 = _adapted(tm, tmp_path / "a2", targets[::2], seed=4, r=2, lora_alpha=5)
    return {"a1": str(tmp_path / "a1"), "a2": str(tmp_path / "a2")}, {"a1": m1, "a2": m2, None: tm}


def _expected(models: dict[str | None, TinyModel], choice: list[str | None], prompts: list[list[int]],
              gen_len: int) -> list[list[int]]:
    refs = {name: reference_generate(m, prompts, gen_len) for name, m in models.items()}
    assert refs["a1"] != refs[None] and refs["a2"] != refs[None] and refs["a1"] != refs["a2"]  # none a no-op
    return [refs[name][n] for n, name in enumerate(choice)]


@pytest.mark.parametrize("kind", ["llama-gqa", "opt-pre"])
def test_each_prompt_gets_its_own_adapter_on_every_placement(kind: str, tiny_models, tmp_path: Path) -> None:
    """Adapters and the base model mixed within every GPU batch: each prompt's tokens are
    transformers' on PEFT's model with its adapter, with the weights (and the stacked adapters)
    on the compute device, half on disk, in RAM with merged decode, and under a compressed base."""
    tm = tiny_models[kind]
    modules, models = _two(tm, tmp_path, LLAMA_ALL if kind.startswith("llama") else OPT_ALL)
    want = _expected(models, CHOICE, PROMPTS, 6)
    for pol in (dict(percent=(100, 0, 100, 0, 100, 0)), dict(percent=(0, 50, 0, 50, 100, 0), cpu_attention=True),
                dict(percent=(0, 100, 0, 100, 100, 0), num_gpu_batches=3)):
        with LLM(str(tm.path), lora_modules=modules, offload_dir=str(tmp_path / "off"), ignore_eos=True,
                 progress=False, gpu_batch_size=2, **{"num_gpu_batches": 1, **pol}) as llm:
            got = [c.token_ids for c in llm.generate(PROMPTS, gen_len=6, lora=CHOICE)]
            assert got == want, pol
            w = llm.engine.weights.placed[("layer", 0)]
            assert w["q.w.lora_a"].shape == (2, 4, tm.model.config.hidden_size)  # both adapters, the larger rank


def test_one_name_for_every_prompt_and_none(tiny_models, tmp_path: Path) -> None:
    """``lora="a2"`` runs every prompt with it; no ``lora`` runs the base model, untouched by
    the stacks the layers hold."""
    tm = tiny_models["llama-gqa"]
    modules, models = _two(tm, tmp_path, LLAMA_ALL)
    with LLM(str(tm.path), lora_modules=modules, ignore_eos=True, progress=False, gpu_batch_size=3) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=5, lora="a2")] == \
            reference_generate(models["a2"], PROMPTS, 5)
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=5)] == reference_generate(tm, PROMPTS, 5)


def test_a_compressed_base_keeps_its_codes_under_the_adapters(tiny_models, tmp_path: Path) -> None:
    """--compress-weight compresses the base matrices as always and the stacks stay dense (an
    adapter is never merged into codes): a prompt's tokens are the same whatever the other rows
    of its batch run with: those of a call where every prompt has its adapter (or none)."""
    from flexgen_dist.memory.quant import QTensor

    tm = tiny_models["llama-gqa"]
    modules, _ = _two(tm, tmp_path, LLAMA_ALL)
    with LLM(str(tm.path), lora_modules=modules, compress_weight=True, ignore_eos=True, progress=False,
             gpu_batch_size=2) as llm:
        alone = {name: [c.token_ids for c in llm.generate(PROMPTS, gen_len=6, lora=name)]
                 for name in ("a1", "a2", None)}
        w = llm.engine.weights.placed[("layer", 1)]
        assert isinstance(w["q.w"].data, QTensor) and isinstance(w["q.w.lora_a"].data, torch.Tensor)
        got = [c.token_ids for c in llm.generate(PROMPTS, gen_len=6, lora=CHOICE)]
    assert got == [alone[name][n] for n, name in enumerate(CHOICE)]
    assert alone["a1"] != alone[None] and alone["a2"] != alone[None]


def test_a_batch_file_chooses_the_adapter_by_model(tiny_models, tmp_path: Path) -> None:
    """A request whose ``model`` names a served adapter runs with it (and its line names it as
    the model), any other model name with the base model; an echoed prompt's logprobs come from
    its adapter too."""
    from test_batch import body, compl

    tm = tiny_models["llama-gqa"]
    modules, models = _two(tm, tmp_path, LLAMA_ALL)
    names = ["a1", "gpt-4o-mini", "a2", "a1", "a2", "gpt-4o-mini"]
    want = _expected(models, [n if n in modules else None for n in names], PROMPTS, 5)
    reqs = [compl(f"r{n}", p, max_tokens=5, model=m) for n, (p, m) in enumerate(zip(PROMPTS, names))]
    echo = [compl("e1", PROMPTS[0], max_tokens=0, echo=True, logprobs=0, model="a1"),
            compl("e0", PROMPTS[0], max_tokens=0, echo=True, logprobs=0)]
    with LLM(str(tm.path), lora_modules=modules, gpu_batch_size=2, progress=False, ignore_eos=True) as llm:
        lines = llm.batch(reqs)
        echoed = llm.batch(echo)
        base = llm.model.spec.name
    assert [body(x)["choices"][0]["token_ids"] for x in lines] == want
    assert [body(x)["model"] for x in lines] == ["a1", base, "a2", "a1", "a2", base]
    lp = [body(x)["choices"][0]["logprobs"]["token_logprobs"][1:] for x in echoed]
    with torch.no_grad():
        for x, m in zip(lp, (models["a1"], tm)):
            logits = m.model(torch.tensor([PROMPTS[0]])).logits.log_softmax(-1)[0]
            assert x == pytest.approx([logits[j, t].item() for j, t in enumerate(PROMPTS[0][1:])], abs=1e-4)


def test_shared_prefixes_are_shared_within_an_adapter_only(tiny_models, tmp_path: Path) -> None:
    """Prompts that open alike but run with different adapters compute their openings apart
    (their keys differ); prompts of one adapter still share theirs. Tokens equal PEFT's either way."""
    tm = tiny_models["llama-gqa"]
    modules, models = _two(tm, tmp_path, LLAMA_ALL)
    opening = list(range(30, 50))
    prompts = [opening + p for p in PROMPTS]
    choice = ["a1", "a1", "a2", "a2", None, None]  # blocks of 2: each of one adapter, sharing the opening
    want = _expected(models, choice, prompts, 4)
    with LLM(str(tm.path), lora_modules=modules, gpu_batch_size=2, num_gpu_batches=1, sort_window=0,
             progress=False, ignore_eos=True) as llm:
        assert [c.token_ids for c in llm.generate(prompts, gen_len=4, lora=choice)] == want
        mixed = ["a1", "a2", "a1", "a2", None, "a1"]  # every block mixes adapters: nothing shared
        assert [c.token_ids for c in llm.generate(prompts, gen_len=4, lora=mixed)] == _expected(models, mixed,
                                                                                                prompts, 4)
        work = llm.prepare(prompts, 4, lora=mixed)
        assert not any(work.shared or ())
        work = llm.prepare(prompts, 4, lora=choice)
        assert set(work.shared) == {len(opening)}


@pytest.mark.parametrize("opts,call,match", [
    (dict(lora_modules=["a1"]), None, r"--lora-modules 'a1': give NAME=DIR"),
    (dict(lora_modules=["a=x", "a=y"]), None, "the name 'a' is given twice"),
    (dict(lora_modules=["a=/nonexistent"]), None, "not a LoRA adapter directory"),
    ({}, "a1", "unknown LoRA adapter 'a1': this LLM serves none; load them with --lora-modules"),
    ("modules", "zz", "unknown LoRA adapter 'zz': this LLM serves a1, a2"),
    ("modules", ["a1"], "lora has 1 names for 6 prompts"),
])
def test_bad_adapter_names_are_refused_in_one_line(opts, call, match: str, tiny_models, tmp_path: Path) -> None:
    tm = tiny_models["llama-gqa"]
    if opts == "modules":
        opts = {"lora_modules": _two(tm, tmp_path, ["q_proj"])[0]}
    with pytest.raises((ConfigError, ModelLoadError), match=match) as info:
        with LLM(str(tm.path), progress=False, **opts) as llm:
            llm.generate(PROMPTS, gen_len=2, lora=call)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.multinode
def test_two_stages_and_a_prompt_file_name_each_lines_adapter(tiny_models, tmp_path: Path) -> None:
    """``--lora-modules`` on two pipeline stages (each holds its layers' stacks), the adapters
    chosen by the prompt file's ``lora`` field: tokens equal PEFT's per line."""
    from conftest import local_ranks, read_jsonl

    tm = tiny_models["llama-gqa"]
    modules, models = _two(tm, tmp_path, LLAMA_ALL)
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": n, "input_ids": ids, **({"lora": c} if c else {})}) + "\n"
                         for n, (ids, c) in enumerate(zip(PROMPTS, CHOICE))))
    out = tmp_path / "o.jsonl"
    r = local_ranks(["-m", "flexgen_dist.run", "--no-progress", "--model", str(tm.path), "--prompts", str(p),
                     "--gen-len", "5", "--ignore-eos", "--gpu-batch-size", "2", "--num-gpu-batches", "2",
                     "--output", str(out), "--lora-modules", *(f"{k}={v}" for k, v in modules.items())],
                    nproc=2, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == _expected(models, CHOICE, PROMPTS, 5)


def test_the_budget_check_counts_the_stacked_adapters(tiny_models, tmp_path: Path) -> None:
    """The stacks are weights the planner sizes: two layers' predicted RAM equals what the
    engine stores, adapters included, and exceeds the base model's by the stacks' bytes."""
    from flexgen_dist.engine.footprint import predict_peaks
    from flexgen_dist.engine.policy import Policy
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.models.loader import load_model
    from flexgen_dist.models.lora_stack import with_lora_modules

    tm = tiny_models["llama-gqa"]
    modules, _ = _two(tm, tmp_path, LLAMA_ALL)
    base = load_model(str(tm.path), load_tokenizer=False)
    lm = with_lora_modules(base, list(modules.items()))
    pol = Policy(1, 1, 0, 100, 100, 0, 100, 0)  # weights alone in RAM
    peaks = {}
    for name, m in (("base", base), ("lora", lm)):
        peaks[name] = predict_peaks(m.spec, pol, (0, 2), has_embed=False, has_head=False, prompt_len=4, gen_len=1,
                                    dtype_bytes=4)["cpu"]
    eng = StageEngine(lm.spec, lm.source, (0, 2), has_embed=False, has_head=False, policy=pol,
                      device=torch.device("cpu"), dtype=torch.float32)
    stored = eng.weights.bytes_per_tier()["cpu"]
    eng.close()
    assert peaks["lora"] == stored
    assert peaks["lora"] - peaks["base"] == 2 * lm.spec.lora_numel() * 4 > 0


def test_each_run_of_rows_gets_its_adapters_update() -> None:
    """``LoraRows`` finds each run of rows of one adapter (base rows in none), and
    ``linear`` adds ``(x A_a^T) B_a^T`` to exactly the rows of adapter a, whatever their order
    and the positions per row."""
    from flexgen_dist.models.common import linear
    from flexgen_dist.models.lora_rows import LoraRows, LoraWeight

    ids = [2, 2, 0, 1, 1, 2, 0]
    rows = LoraRows.of(ids)
    assert rows.runs == ((1, 0, 2), (0, 3, 5), (1, 5, 6)) and rows.rows == 7
    torch.manual_seed(0)
    w, a, b = torch.randn(6, 5), torch.randn(2, 3, 5), torch.randn(2, 6, 3)
    x = torch.randn(7, 4, 5)
    y = linear(x, LoraWeight(w, a, b, rows))
    want = torch.stack([x[n] @ w.t() + (x[n] @ a[i - 1].t() @ b[i - 1].t() if i else 0) for n, i in enumerate(ids)])
    torch.testing.assert_close(y, want)
    assert LoraRows.of([0, 0]).runs == ()


def test_the_option_from_the_command_line_yaml_and_python(tmp_path: Path) -> None:
    """``--lora-modules a=X b=Y``, a YAML mapping or list, and ``LLM(lora_modules={...})`` all
    give the same ``NAME=DIR`` items."""
    from flexgen_dist.config import build_config
    from flexgen_dist.flags import parse_config

    want = ("a=/x", "b=/y")
    assert parse_config(["--lora-modules", "a=/x", "b=/y"]).lora_modules == want
    for value in ("{a: /x, b: /y}", "[a=/x, b=/y]"):
        y = tmp_path / "c.yaml"
        y.write_text(f"lora_modules: {value}\n")
        assert parse_config(["--config", str(y)]).lora_modules == want
    assert build_config(None, None, {"lora_modules": {"a": "/x", "b": "/y"}}).lora_modules == want
    assert build_config(None, None, {"lora_modules": ["a=/x", "b=/y"]}).lora_modules == want


def test_eval_scores_with_a_served_adapter(tiny_models, tmp_path: Path) -> None:
    """``eval ppl --lora-name NAME`` scores with the served adapter: the perplexity of the same
    adapter merged (``--lora``), not the base model's."""
    from flexgen_dist.eval import main as eval_main

    tm = tiny_models["llama-gqa"]
    modules, _ = _two(tm, tmp_path, LLAMA_ALL)
    text = tmp_path / "ids.jsonl"
    text.write_text("".join(json.dumps({"input_ids": p * 3}) + "\n" for p in PROMPTS))
    res = {}
    for name, extra in (("base", []), ("merged", ["--lora", modules["a1"]]),
                        ("served", ["--lora-modules", *(f"{k}={v}" for k, v in modules.items()), "--lora-name", "a1"])):
        out = tmp_path / f"{name}.json"
        assert eval_main(["ppl", "--model", str(tm.path), "--text", str(text), "--window", "16", "--json", str(out),
                          "--no-progress", *extra]) == 0
        res[name] = json.loads(out.read_text())["ppl"]
    assert res["served"] == pytest.approx(res["merged"], rel=1e-5)
    assert abs(res["served"] - res["base"]) > 1e-3


@pytest.mark.parametrize("name", ["llama3.1", "qwen3", "phi3", "granite", "olmo3", "cohere2", "glm4", "gemma2",
                                  "gemma3"])
def test_every_family_serves_adapters_per_request(name: str, tmp_path: Path) -> None:
    """Every linear layer adapted (PEFT's "all-linear"; Phi-3's fused qkv_proj and gate_up_proj
    whole), two adapters and the base model mixed in one call: each prompt's tokens equal
    transformers' on PEFT's model with its adapter."""
    from test_families_pipeline import FAMILIES

    torch.manual_seed(31)
    m = FAMILIES[name]().eval()
    m.save_pretrained(tmp_path / "m")
    tm = TinyModel(name, tmp_path / "m", m, 0)
    # B larger than elsewhere: a few of these models' greedy tokens shrug off a small update
    m1 = _adapted(tm, tmp_path / "a1", "all-linear", seed=3, b_scale=0.5)
    m2 = _adapted(tm, tmp_path / "a2", "all-linear", seed=4, b_scale=0.5, r=2, lora_alpha=5)
    want = _expected({"a1": m1, "a2": m2, None: tm}, CHOICE, PROMPTS, 5)
    with LLM(str(tm.path), lora_modules={"a1": str(tmp_path / "a1"), "a2": str(tmp_path / "a2")}, gpu_batch_size=3,
             num_gpu_batches=2, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=5, lora=CHOICE)] == want


def test_a_mixture_serves_attention_adapters_and_refuses_expert_ones(tmp_path: Path) -> None:
    """A mixture of experts (Qwen3-MoE): adapters of attention served per request equal PEFT's;
    PEFT's "all-linear" adapts the fused experts tensor, refused in one line naming why."""
    from test_moe import _model

    tm = _model("qwen3_moe", tmp_path / "m")
    targets = ["q_proj", "v_proj", "o_proj"]
    m1 = _adapted(tm, tmp_path / "a1", targets, seed=3, b_scale=0.5)
    m2 = _adapted(tm, tmp_path / "a2", targets, seed=4, b_scale=0.5, r=2, lora_alpha=5)
    want = _expected({"a1": m1, "a2": m2, None: tm}, CHOICE, PROMPTS, 4)
    modules = {"a1": str(tmp_path / "a1"), "a2": str(tmp_path / "a2")}
    with LLM(str(tm.path), lora_modules=modules, gpu_batch_size=3, num_gpu_batches=2, ignore_eos=True,
             progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=4, lora=CHOICE)] == want
    _adapted(tm, tmp_path / "e", "all-linear", seed=5)
    with pytest.raises(ModelLoadError, match=r"experts.*\(a mixture's experts: PEFT's target_parameters"):
        LLM(str(tm.path), lora_modules={"e": str(tmp_path / "e")}, progress=False)
