"""LoRA adapters in PEFT's saved format, merged into the weights as they are read (``--lora``):
greedy tokens equal transformers' on PEFT's own merged model (``merge_and_unload``, float32), on
every placement and with the weights compressed around the adapted ones; rsLoRA's and
``rank_pattern``'s scales; a fused checkpoint tensor (Phi-3's qkv_proj) adapted as a whole; and
what is not merged refused in one line before anything is placed."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist import LLM
from flexgen_dist.errors import ModelLoadError
from flexgen_dist.run import main


def _adapted(tm: TinyModel, path: Path, targets: list[str] | str, seed: int = 0, b_scale: float = 0.05,
             **cfg) -> TinyModel:
    """A random (not a no-op) PEFT LoRA adapter of ``tm`` saved at ``path``, and the model PEFT
    merges it into, as a TinyModel over the base model's directory."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    opts = dict(r=4, lora_alpha=8, init_lora_weights=False)
    opts.update(cfg)
    peft_model = get_peft_model(copy.deepcopy(tm.model), LoraConfig(target_modules=targets, **opts))
    with torch.no_grad():  # B small enough that the base model still matters
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    peft_model.save_pretrained(path)
    return TinyModel(tm.name, tm.path, peft_model.merge_and_unload().eval(), tm.pad_id)


@pytest.mark.parametrize("kind", ["llama-gqa", "opt-pre"])
def test_an_adapter_merged_as_read_matches_peft_on_every_placement(kind: str, tiny_models, tmp_path: Path) -> None:
    """Every linear layer of attention and the MLP adapted: tokens equal transformers' on PEFT's
    merged model with the weights on the compute device, half on disk, and in RAM with merged
    decode; and they differ from the base model's (the adapter is not a no-op)."""
    tm = tiny_models[kind]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] if kind.startswith("llama") \
        else ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    merged = _adapted(tm, tmp_path / "adapter", targets)
    ref = reference_generate(merged, PROMPTS, 6)
    assert ref != reference_generate(tm, PROMPTS, 6)
    for pol in (dict(percent=(100, 0, 100, 0, 100, 0)), dict(percent=(0, 50, 0, 50, 100, 0), cpu_attention=True),
                dict(percent=(0, 100, 0, 100, 100, 0), num_gpu_batches=2)):
        opts = {"gpu_batch_size": 2, "num_gpu_batches": 1, **pol}
        with LLM(str(tm.path), lora=str(tmp_path / "adapter"), offload_dir=str(tmp_path / "off"), ignore_eos=True,
                 progress=False, **opts) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref, pol


def test_rslora_and_rank_pattern_scale_as_peft_does(tiny_models, tmp_path: Path) -> None:
    """rsLoRA (alpha / sqrt(r)) and a per-module rank and alpha (``rank_pattern``,
    ``alpha_pattern``): the merged weights equal PEFT's, so the tokens do."""
    tm = tiny_models["llama-gqa"]
    merged = _adapted(tm, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], seed=1, use_rslora=True,
                      rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 3})
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["use_rslora"] and cfg["rank_pattern"] == {"down_proj": 2}
    with LLM(str(tm.path), lora=str(tmp_path / "a"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == reference_generate(merged, PROMPTS, 6)
        w = llm.engine.weights.placed[("layer", 1)]
        want = merged.model.model.layers[1].mlp.down_proj.weight.detach()
        assert torch.equal(w["down.w"].data, want)  # bit for bit: the same float32 sum


def test_compressed_weights_around_an_adapter(tiny_models, tmp_path: Path) -> None:
    """Under --compress-weight the adapted matrices are merged, then compressed as any weight:
    the same tokens as the base directory with PEFT's merged weights saved into it."""
    tm = tiny_models["llama-gqa"]
    merged = _adapted(tm, tmp_path / "a", ["q_proj", "up_proj"], seed=2)
    merged.model.save_pretrained(tmp_path / "merged")
    runs = {}
    for name, model, lora in (("adapter", tm.path, str(tmp_path / "a")), ("merged", tmp_path / "merged", None)):
        with LLM(str(model), lora=lora, compress_weight=True, gpu_batch_size=2, ignore_eos=True, progress=False) as llm:
            runs[name] = [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)]
    assert runs["adapter"] == runs["merged"]


def test_a_fused_tensor_is_adapted_whole(tmp_path: Path) -> None:
    """Phi-3 stores q, k and v as one qkv_proj (and gate and up as gate_up_proj): an adapter of
    those modules updates the fused tensor, and the engine cuts the merged rows as it cuts the
    weights."""
    from transformers import AutoModelForCausalLM, Phi3Config

    torch.manual_seed(6)
    m = AutoModelForCausalLM.from_config(Phi3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=255,
        tie_word_embeddings=False)).eval()
    m.save_pretrained(tmp_path / "phi3")
    tm = TinyModel("phi3", tmp_path / "phi3", m, 0)
    merged = _adapted(tm, tmp_path / "a", ["qkv_proj", "gate_up_proj", "o_proj"], seed=3)
    with LLM(str(tm.path), lora=str(tmp_path / "a"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == reference_generate(merged, PROMPTS, 6)


def test_the_command_line_takes_an_adapter(tiny_models, tmp_path: Path, capsys) -> None:
    tm = tiny_models["llama-gqa"]
    merged = _adapted(tm, tmp_path / "a", ["q_proj"], seed=4)
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "input_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    assert main(["--model", str(tm.path), "--lora", str(tmp_path / "a"), "--prompts", str(prompts), "--gen-len", "6",
                 "--ignore-eos", "--output", str(out), "--no-progress", "--print-outputs", "0"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in sorted(rows, key=lambda r: r["id"])] == reference_generate(merged, PROMPTS, 6)
    printed = capsys.readouterr()
    assert "+ LoRA a (4 matrices, rank 4)" in printed.out + printed.err  # the model line says what was merged


@pytest.mark.parametrize("edit,match", [
    ("missing", "not a LoRA adapter directory .no adapter_config.json."),
    ("dora", "DoRA .use_dora. is not supported"),
    ("bias", "trained biases .bias 'lora_only'. are not supported"),
    ("saved", "modules_to_save .whole modules trained beside the adapter. are not supported"),
    ("other-model", r"adapts model.layers.0.self_attn.z_proj \(and 3 more\), which this llama-family model does not read"),
    ("head", "adapts lm_head, which this llama-family model does not read as a whole linear layer"),
    # as PEFT writes an adapter of a tied head: the head's own weights beside it
    ("head-saved", r"adapter tensor base_model.model.lm_head.base_layer.weight is not a LoRA A or B matrix"),
    ("shape", r"q_proj's update is \(8, 64\) but the model's q.w of layer 0 is \(64, 64\)"),
    ("no-b", "has no lora_B beside it"),
])
def test_what_is_not_merged_is_refused_in_one_line(edit: str, match: str, tiny_models, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tm = tiny_models["llama-gqa"]
    a = tmp_path / "a"
    _adapted(tm, a, ["q_proj"] + (["lm_head"] if edit.startswith("head") else []), seed=5)
    cfg_file, st = a / "adapter_config.json", a / "adapter_model.safetensors"
    cfg, sd = json.loads(cfg_file.read_text()), load_file(str(st))
    if edit == "missing":
        cfg_file.unlink()
    elif edit in ("dora", "bias", "saved"):
        cfg.update({"dora": {"use_dora": True}, "bias": {"bias": "lora_only"},
                    "saved": {"modules_to_save": ["lm_head"]}}[edit])
    elif edit == "other-model":
        sd = {k.replace("q_proj", "z_proj"): v for k, v in sd.items()}
    elif edit == "shape":
        sd = {k: (v[:8] if "lora_B" in k else v) for k, v in sd.items()}
    elif edit == "head":
        sd = {k: v for k, v in sd.items() if "base_layer" not in k}
    elif edit == "no-b":
        sd = {k: v for k, v in sd.items() if "lora_B" not in k}
    if cfg_file.exists():
        cfg_file.write_text(json.dumps(cfg))
    save_file(sd, str(st))
    with pytest.raises(ModelLoadError, match=match) as info:
        with LLM(str(tm.path), lora=str(a), progress=False) as llm:
            llm.generate([[3, 4, 5]], gen_len=1)
    assert "\n" not in str(info.value)


@pytest.mark.bundled
def test_an_adapter_of_the_bundled_gguf_model(tmp_path: Path) -> None:
    """The bundled GGUF file as a base: an adapter trained on its Hugging Face form (the same
    values, ``bench.int_checkpoints.export_hf``) merges into the GGUF's weights as they are read,
    the file's Q4 blocks expanded first; greedy tokens equal transformers' on PEFT's merged model."""
    from transformers import AutoModelForCausalLM

    from flexgen_dist.bench.int_checkpoints import export_hf

    hf = tmp_path / "hf"
    hf.mkdir()
    export_hf(hf)
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tm = TinyModel("smollm2", hf, base, base.config.pad_token_id or 0)
    merged = _adapted(tm, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], seed=7)
    prompts = [p[:6] for p in PROMPTS]
    with LLM(None, lora=str(tmp_path / "a"), dtype="float32", ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(prompts, gen_len=4)] == reference_generate(merged, prompts, 4)
