"""gpt-oss (``gpt_oss``): attention sinks (a learned logit per head joining each softmax's
denominator), sliding and global layers alternating, YaRN, q/k/v/o biases; every layer a
mixture of experts routed by a softmax over the top logits of a biased router, experts with
biases and a clamped gate, stored transposed with gate and up interleaved. Greedy tokens equal
transformers' in float32 from a Hugging Face directory, resident and offloaded, with prompts
past the window, at 1 rank and 2."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, TinyModel, read_jsonl, reference_generate, write_jsonl
from flexgen_dist import LLM
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.registry import get_spec

GEN = 6
LONG = [p * 3 for p in PROMPTS]  # 6 to 27 tokens: past the window of 5
OFFLOAD = (0, 40, 0, 100, 100, 0)


def _config(**kw):
    from transformers import GptOssConfig

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, num_local_experts=8,
                num_experts_per_tok=2, sliding_window=5, pad_token_id=0, bos_token_id=1, eos_token_id=255,
                swiglu_limit=0.5,  # low enough that the clamps bite in a tiny model's activations
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0})
    return GptOssConfig(**{**base, **kw})


def _clamps_as_configured(m):
    """The reference's experts with the config's ``swiglu_alpha`` and ``swiglu_limit``:
    transformers before 5.2x fixes them at 1.702 and 7.0 whatever the config says (every
    published gpt-oss config says those), so a test config's limit of 0.5 would otherwise make
    the reference another model than the one its config describes."""
    for mod in m.modules():
        if hasattr(mod, "limit") and hasattr(mod, "alpha"):
            mod.alpha, mod.limit = (getattr(m.config, "swiglu_alpha", 1.702), getattr(m.config, "swiglu_limit", 7.0))
    return m


def _model(path: Path, **kw) -> TinyModel:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(17)
    m = _clamps_as_configured(AutoModelForCausalLM.from_config(_config(**kw)).eval())
    with torch.no_grad():  # sinks and biases that matter (some start at zero)
        for name, p in m.named_parameters():
            if name.endswith(("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias")):
                p.copy_(torch.randn(p.shape) * (2.0 if name.endswith("sinks") else 0.5))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(6)
    m.save_pretrained(path)
    return TinyModel("gpt_oss", path, m, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _model(tmp_path_factory.mktemp("gpt_oss"))


@pytest.mark.parametrize("placement", ["resident", "offloaded"])
def test_greedy_tokens_match_transformers(tiny: TinyModel, placement: str, tmp_path: Path) -> None:
    ref = reference_generate(tiny, LONG, GEN)
    pct = (100, 0, 100, 0, 100, 0) if placement == "resident" else OFFLOAD
    with LLM(str(tiny.path), percent=pct, gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"),
             ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=GEN)] == ref
        spec = llm.model.spec
    assert spec.total_numel() == sum(p.numel() for p in tiny.model.parameters())


def test_the_spec_carries_what_the_config_says(tiny: TinyModel) -> None:
    s = load_model(str(tiny.path), load_tokenizer=False).spec
    assert (s.router_scoring, s.router_bias, s.expert_bias, s.attn_sinks, s.attention_bias) == (
        "topk_softmax", True, True, True, True)
    assert (s.swiglu_alpha, s.swiglu_limit, s.num_experts, s.experts_per_tok) == (1.702, 0.5, 8, 2)
    assert s.layer_types == ("sliding_attention", "full_attention") * 2 and s.sliding_window == 5
    assert s.rope_scaling is not None and s.rope_scaling.rope_type == "yarn" and not s.rope_scaling.truncate


def test_sinks_are_in_every_attention_path(tiny: TinyModel, tmp_path: Path) -> None:
    """Prefill (materialised per sequence), decode on the cache's tier, merged decode over the
    whole layer, and the cache on disk: each with the sinks (no sinks: other tokens)."""
    ref = reference_generate(tiny, PROMPTS, GEN)
    for pct, gbs in (((100, 0, 0, 0, 100, 0), 1), ((100, 0, 0, 100, 100, 0), 3), ((0, 100, 50, 50, 100, 0), 2)):
        with LLM(str(tiny.path), percent=pct, gpu_batch_size=gbs, num_gpu_batches=len(PROMPTS) // gbs,
                 offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS[:gbs * (len(PROMPTS) // gbs)], gen_len=GEN)] == \
                ref[:gbs * (len(PROMPTS) // gbs)], pct


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, scales, the values they hold) of a (..., rows, cols) matrix in MXFP4: groups of
    32 along cols, each a power-of-two scale (its largest value fits 6) and e2m1 codes, two a
    byte, the low nibble first."""
    g = w.reshape(*w.shape[:-1], -1, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6.0)).to(torch.int32)
    x = g / torch.pow(2.0, e.float())[..., None]
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (x < 0)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    values = (E2M1[code % 8] * torch.where(code >= 8, -1.0, 1.0) * torch.pow(2.0, e.float())[..., None])
    return blocks, (e + 127).to(torch.uint8), values.reshape(w.shape)


def test_openai_mxfp4_checkpoints_match_transformers(tmp_path: Path) -> None:
    """gpt-oss as OpenAI ships it: the experts' matrices MXFP4 (``*_blocks`` and ``*_scales``,
    out x in), the rest as is; expanded on read to the values transformers expands, or kept
    in the mxfp4 table format under --compress-weight (the same values, sized as stored)."""
    import json

    from safetensors.torch import save_file

    tm = _model(tmp_path / "m")
    sd = {k: v.detach().clone().contiguous() for k, v in tm.model.state_dict().items()}
    for name in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, values = _mxfp4(sd.pop(name).transpose(1, 2))  # stored out x in
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        with torch.no_grad():
            tm.model.get_parameter(name).copy_(values.transpose(1, 2))
    for f in tm.path.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(tm.path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tm.path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tm.path / "config.json").write_text(json.dumps(cfg))
    ref = reference_generate(tm, LONG, GEN)
    with LLM(str(tm.path), percent=OFFLOAD, gpu_batch_size=2, num_gpu_batches=2, offload_dir=str(tmp_path / "off"),
             ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=GEN)] == ref
    # --compress-weight: each expert's codes kept in the mxfp4 table format, its values exactly
    from conftest import kept_codes_sized_as_stored
    from flexgen_dist.memory.quant import QTensor, dequantize

    with LLM(str(tm.path), compress_weight=True, ignore_eos=True, progress=False) as llm:
        assert all(len(c.token_ids) == GEN for c in llm.generate(LONG, gen_len=GEN))
        placed = llm.engine.weights.placed[("layer", 1)]
    gate_up = tm.model.get_parameter("model.layers.1.mlp.experts.gate_up_proj")[1].detach()  # in x out
    down = tm.model.get_parameter("model.layers.1.mlp.experts.down_proj")[1].detach()
    for key, want in (("experts.1.gate.w", gate_up[:, 0::2].t()), ("experts.1.up.w", gate_up[:, 1::2].t()),
                      ("experts.1.down.w", down.t())):
        q = placed[key].data
        assert isinstance(q, QTensor) and (q.fmt, q.bits, q.group_size) == ("mxfp4", 4, 32), key
        assert torch.equal(dequantize(q), want), key
    predicted, stored = kept_codes_sized_as_stored(tm.path)
    assert predicted == stored > 0


@pytest.mark.parametrize("name,total,active", [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)])
def test_registry_shapes_have_the_published_sizes(name: str, total: float, active: float) -> None:
    """OpenAI's model card: 20.91B parameters (3.61B active), 116.83B (5.13B active), the
    active count with the unembedding and without the embedding."""
    s = get_spec(name)
    assert s.total_numel() / 1e9 == pytest.approx(total, abs=0.01)
    act = s.head_numel() + sum(s.active_layer_numel(j) for j in range(s.num_layers))
    assert act / 1e9 == pytest.approx(active, abs=0.02)


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_match_transformers(tiny: TinyModel, tmp_path: Path) -> None:
    from test_pipeline import torchrun

    out = tmp_path / "o.jsonl"
    r = torchrun(2, ["--model", str(tiny.path), "--prompts", str(write_jsonl(tmp_path / "p.jsonl", LONG)),
                     "--gen-len", str(GEN), "--ignore-eos", "--gpu-batch-size", "2", "--num-gpu-batches", "2",
                     "--percent", *map(str, OFFLOAD), "--offload-dir", str(tmp_path / "off"), "--output", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == reference_generate(tiny, LONG, GEN)


def test_mxfp4_expansion_is_transformers_own() -> None:
    """The expansion against transformers' (``convert_moe_packed_tensors``, which also
    transposes to in x out), on random codes and scales of every e2m1 value."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from flexgen_dist.models.float_quant import dequantize_mxfp4

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, "w")
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))


@pytest.mark.bundled
@pytest.mark.parametrize("mxfp4", [False, True])
def test_gguf_files_match_transformers(mxfp4: bool, tmp_path: Path) -> None:
    """gpt-oss as llama.cpp writes it (``gpt-oss``: sinks as attn_sinks, the router as
    ffn_gate_inp with its bias, gate and up apart, the experts' biases, YaRN's keys, the
    window, llama.cpp's fixed alternation; the experts MXFP4 as released, or float32)."""
    from gguf_convert import mxfp4_roundtrip_, write_gguf

    cfg = _config(vocab_size=49152, swiglu_limit=7.0)  # the bundled tokenizer; llama.cpp fixes the limit at 7
    from transformers import AutoModelForCausalLM

    torch.manual_seed(23)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias")):
                p.copy_(torch.randn(p.shape) * (2.0 if name.endswith("sinks") else 0.5))
    if mxfp4:
        mxfp4_roundtrip_(m)
    path = write_gguf(m, tmp_path / "gpt-oss.gguf", mxfp4_experts=mxfp4)
    m.save_pretrained(tmp_path / "hf")
    ours = load_model(str(path), load_tokenizer=False).spec
    ref = load_model(str(tmp_path / "hf"), load_tokenizer=False).spec
    assert dataclasses.replace(ours, name=ref.name, eos_token_ids=ref.eos_token_ids, bos_token_id=ref.bos_token_id,
                               pad_token_id=ref.pad_token_id) == ref
    want = reference_generate(TinyModel("gpt_oss", path, m, 2), LONG, GEN)
    with LLM(str(path), percent=OFFLOAD, offload_dir=str(tmp_path / "off"), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(LONG, gen_len=GEN)] == want
    if mxfp4:  # --compress-weight keeps the file's MXFP4 blocks in the mxfp4 table format, their values exactly
        from flexgen_dist.memory.quant import QTensor, dequantize

        with LLM(str(path), compress_weight=True, ignore_eos=True, progress=False) as llm:
            llm.generate(LONG[:1], gen_len=1)
            q = llm.engine.weights.placed[("layer", 0)]["experts.2.down.w"].data
        assert isinstance(q, QTensor) and (q.fmt, q.bits, q.group_size) == ("mxfp4", 4, 32)
        assert torch.equal(dequantize(q), m.get_parameter("model.layers.0.mlp.experts.down_proj")[2].detach().t())
