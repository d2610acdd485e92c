"""Qwen3-Next and Qwen3.5 (``qwen3_next``; ``qwen3_5_text``, ``qwen3_5_moe_text`` and the
image-text ``qwen3_5`` on token ids): three layers of four mix tokens with the gated delta rule
(a state per sequence, no KV cache), the full-attention layers gate their output, every norm
multiplies by (1 + w). Greedy tokens equal transformers' in float32 on every placement, for
prompts that are left-padded in their batch and longer than the prefill's chunk of 64 positions
(so the state is carried from chunk to chunk, and from prefill to decode)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

import pytest
import torch

from conftest import FAMILY_POLICIES, TinyModel, engine_matches, local_ranks, read_jsonl, reference_generate, write_jsonl
from flexgen_dist import LLM
from flexgen_dist.engine.footprint import StageShape, recurrent_bytes, stage_footprint
from flexgen_dist.engine.policy import Policy
from flexgen_dist.models.deltanet import CHUNK, chunked_rule, step_rule
from flexgen_dist.models.loader import load_model
from flexgen_dist.models.source import ModelLoadError

GEN = 6
_g = torch.Generator().manual_seed(1)
# 5 to 150 tokens: padded in their batches of two, two of them past one and two chunks
PROMPTS = [torch.randint(1, 256, (n,), generator=_g).tolist() for n in (5, 70, 150, 3)]

_BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, max_position_embeddings=512, pad_token_id=0)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)


def _build(kind: str, **over):  # noqa: ANN202
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if kind == "next":  # Qwen3-Next: fused projections interleaved by head, one dense layer
        return Qwen3NextForCausalLM(Qwen3NextConfig(**{**_BASE, **_MOE, "intermediate_size": 96, "mlp_only_layers": [1],
                                                       "rope_parameters": rope, **over}))
    if kind == "3.5":  # Qwen3.5 dense, multimodal RoPE sections (plain RoPE on text)
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_BASE, intermediate_size=96, rope_parameters={
            **rope, "mrope_section": [1, 1, 2], "mrope_interleaved": True}))
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**_BASE, **_MOE, rope_parameters=rope))


KINDS = ["next", "3.5", "3.5-moe"]


def _model(kind: str, path: Path, **over) -> TinyModel:
    """A random model of ``kind`` (its config's fields ``over``) saved at ``path``, with weights
    that make each feature show."""
    torch.manual_seed(7)
    m = _build(kind, **over).eval()
    with torch.no_grad():  # zero-initialised norms, gates, experts and pad embedding: give them weights
        for name, p in m.named_parameters():
            if "norm" in name or "experts" in name or "gate" in name:
                p.normal_(0, 0.1)
        m.get_input_embeddings().weight[0].normal_(0, 1.0)  # padding that is not zero already
        for name, p in m.named_parameters():  # slow decays: the state remembers the whole prompt
            if name.endswith("A_log"):
                p.uniform_(-6.0, -3.0)
            elif name.endswith("dt_bias"):
                p.uniform_(-3.0, -1.0)
            elif "linear_attn.in_proj" in name:  # a state that weighs in the layer's output
                p.normal_(0, 0.3)
            elif "self_attn.q_proj" in name:  # gates far from one another (and from 1/2)
                p.normal_(0, 0.3)
    m.save_pretrained(path)
    return TinyModel(kind, path, m, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TinyModel, list[list[int]]]]:
    out = {}
    for kind in KINDS:
        tm = _model(kind, tmp_path_factory.mktemp(kind))
        ref = reference_generate(tm, PROMPTS, GEN)
        # the padded batch's tokens are each prompt's alone: padding leaves the state at zero
        assert ref == [reference_generate(tm, [p], GEN)[0] for p in PROMPTS]
        out[kind] = (tm, ref)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("policy", FAMILY_POLICIES)
def test_greedy_tokens_match_transformers(models: dict, kind: str, policy: dict, tmp_path: Path) -> None:
    tm, ref = models[kind]
    engine_matches(tm, PROMPTS, GEN, ref, tmp_path, **policy)


def test_the_spec_carries_what_the_config_says(models: dict) -> None:
    spec = load_model(str(models["next"][0].path), load_tokenizer=False).spec
    assert spec.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert [spec.linear(j) for j in range(4)] == [True, True, True, False]
    assert (spec.lin_k_heads, spec.lin_v_heads, spec.lin_k_dim, spec.lin_v_dim, spec.lin_conv_kernel) == (
        2, 4, 16, 8, 4)
    assert spec.lin_conv_dim == 2 * 2 * 16 + 4 * 8 and spec.rope_dim == 8
    assert spec.attn_output_gate and spec.norm_unit_offset and spec.qk_norm
    assert spec.moe_layers == (True, False, True, True) and spec.shared_expert_ffn_size == 48
    moe = load_model(str(models["3.5-moe"][0].path), load_tokenizer=False).spec
    assert moe.num_experts == 4 and moe.norm_topk_prob and moe.ffn_size == 32


@pytest.mark.parametrize("feature", ["padding", "decode_state", "unit_norm"])
def test_each_feature_changes_the_tokens(models: dict, feature: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parity above would prove nothing if a feature did not show here: with it left out
    (padded inputs not zeroed; decode restarting the state every step; norms by w, not 1 + w),
    the tokens differ from the reference."""
    from dataclasses import replace

    from flexgen_dist.engine import block_state, stage
    from flexgen_dist.models import hf_config

    tm, ref = models["next"]
    if feature == "unit_norm":
        real = hf_config.qwen_next_fields
        monkeypatch.setattr(hf_config, "qwen_next_fields", lambda cfg: {**real(cfg), "norm_unit_offset": False})
    else:
        real_rec = block_state.recurrent

        def broken(st, layer, i, ks):  # noqa: ANN001, ANN202
            r = real_rec(st, layer, i, ks)
            return replace(r, valid=None) if feature == "padding" else replace(r, fresh=True)
        monkeypatch.setattr(stage, "recurrent", broken)
    with LLM(str(tm.path), gpu_batch_size=2, ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] != ref


def test_the_chunked_prefill_is_the_recurrence() -> None:
    """The prefill's chunked form (a triangular solve per chunk, the state carried across
    chunks, from a given state) and the decode's step-by-step recurrence are one rule."""
    torch.manual_seed(3)
    b, t, hk, hv, dk, dv = 2, 2 * CHUNK + 9, 2, 4, 8, 6
    q, k = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk)
    v, beta = torch.randn(b, t, hv, dv), torch.rand(b, t, hv)
    g = -torch.rand(b, t, hv)
    start = torch.randn(b, hv, dk, dv)
    chunk_state = torch.empty_like(start)
    out = chunked_rule(q, k, v, g, beta, start, chunk_state)
    state = start.clone()
    steps = torch.cat([step_rule(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1], beta[:, i:i + 1], state)
                       for i in range(t)], dim=1)
    assert torch.allclose(out, steps, atol=1e-4) and torch.allclose(chunk_state, state, atol=1e-4)
    assert not torch.allclose(chunked_rule(q, k, v, g, beta, None, torch.empty_like(start)), steps, atol=1e-2)


def test_the_states_are_allocated_as_the_footprint_counts_them(models: dict) -> None:
    """A block holds each linear layer's states on the compute device, exactly the bytes
    ``recurrent_bytes`` predicts, and no KV cache for those layers."""
    from flexgen_dist.engine.blocks import BlockMeta
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.memory.tiers import MemoryTracker

    lm = load_model(str(models["next"][0].path), load_tokenizer=False)
    spec, tracker = lm.spec, MemoryTracker()
    eng = StageEngine(spec, lm.source, (0, 4), has_embed=True, has_head=True, policy=Policy(gpu_batch_size=2,
                      num_gpu_batches=2), device=torch.device("cpu"),
                      dtype=torch.float32, tracker=tracker)
    before = tracker.peak_bytes()["gpu"]
    meta = BlockMeta(prompt_len=10, gen_len=4, prompt_lens=[[10, 8], [10, 10]])
    st = eng.new_block(meta)
    z = StageShape(num_layers=4, has_embed=True, has_head=True, prompt_len=10, gen_len=4, dtype_bytes=4,
                   gpu_batch_size=2, num_gpu_batches=2)
    rows, per_row, copies = stage_footprint(spec, z).cache
    assert recurrent_bytes(spec, z) == 3 * 4 * (spec.lin_conv_dim * 3 * 4 + 4 * 16 * 8 * 4)
    assert tracker.peak_bytes()["gpu"] - before == recurrent_bytes(spec, z) + rows * per_row * copies
    assert {j for j, _ in st.cache.chunks} == {3}  # the attention layer's cache alone
    eng.free_block(st)  # the tracker refuses a free of more than was counted
    eng.close()


STATE_PLACEMENTS = {  # (state gpu %, state cpu %): the 3 linear layers' states by whole layers
    "device": (100, 0), "ram": (0, 100), "disk": (0, 0), "mixed": (34, 33),
}


@pytest.mark.parametrize("name", list(STATE_PLACEMENTS))
def test_states_offloaded_by_the_policy_match_transformers(models: dict, name: str, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The linear layers' states go where ``--state-percent`` says, by whole layers (device, RAM,
    disk), whatever the cache's fractions: the staged ones come to the compute device around their layer and go back, with and
    without overlap, one GPU batch or two (merged decode), RAM staged as on a GPU host or used in
    place as on a CPU device. Tokens equal transformers'; the peaks stay within
    ``predict_peaks``; the disk really holds states where the placement says so."""
    from flexgen_dist.distributed.local import generate
    from flexgen_dist.engine import states
    from flexgen_dist.engine.footprint import predict_peaks
    from flexgen_dist.engine.sampling import SamplingConfig
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.memory.disk import DiskStore
    from flexgen_dist.memory.tiers import MemoryTracker, Tier

    tm, ref = models["next"]
    g, c = STATE_PLACEMENTS[name]
    tiers = states.state_tiers([0, 1, 2], (g / 100, c / 100, 1 - (g + c) / 100))
    assert sorted(tiers.values()) == sorted({"device": [Tier.GPU] * 3, "ram": [Tier.CPU] * 3,
                                             "disk": [Tier.DISK] * 3,
                                             "mixed": [Tier.GPU, Tier.CPU, Tier.DISK]}[name])
    loads: list[tuple[int, bool]] = []
    real_load = states.StateStore.load
    monkeypatch.setattr(states.StateStore, "load",
                        lambda self, j, a, b, read: loads.append((j, read)) or real_load(self, j, a, b, read))
    for overlap, gbs, ram_staged in [(True, 2, False), (False, 2, True), (True, 1, True)]:
        monkeypatch.setattr(states, "staged", lambda tier, cuda, rs=ram_staged: tier == Tier.DISK or
                            (tier == Tier.CPU and (cuda or rs)))
        lm = load_model(str(tm.path), load_tokenizer=False)
        pol = Policy(4 // gbs, gbs, 100, 0, 100, 0, 100, 0, state_gpu_percent=g, state_cpu_percent=c,
                     overlap=overlap)
        tracker = MemoryTracker()
        loads.clear()
        with DiskStore(tmp_path / "off") as disk:
            eng = StageEngine(lm.spec, lm.source, (0, 4), has_embed=True, has_head=True, policy=pol,
                              device=torch.device("cpu"), dtype=torch.float32, disk=disk, tracker=tracker)
            outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
            eng.close()
        assert outs == ref, (name, overlap, gbs)
        moved = {j for j, t in tiers.items() if t == Tier.DISK or (t == Tier.CPU and ram_staged)}
        assert {j for j, _ in loads} == moved  # staged exactly where the placement says
        if moved:  # the prefill's buffers are written, not read; each decode step reads them
            assert (min(moved), False) in loads and (min(moved), True) in loads
        peak, predicted = tracker.peak_bytes(), predict_peaks(lm.spec, pol, (0, 4), has_embed=True, has_head=True,
                                                              prompt_len=150, gen_len=GEN, dtype_bytes=4)
        # on a CPU device the compute tier and RAM are one memory (the tracker counts a disk
        # chunk's staging in RAM, the footprint on the compute device)
        assert peak["disk"] <= predicted["disk"] and \
            peak["gpu"] + peak["cpu"] <= predicted["gpu"] + predicted["cpu"], (peak, predicted)
        assert (peak["disk"] > 0) == (Tier.DISK in tiers.values())


def test_staged_states_under_the_overlapped_schedule_match_transformers(models: dict, tmp_path: Path) -> None:
    """The overlapped schedule runs a block's decode step and the next block's prefill in one
    sweep: each part stages its own rows of a layer (its first batch loads them, its last stores
    them), two blocks' states in flight at once; the tokens are transformers'."""
    from flexgen_dist.distributed.local import generate
    from flexgen_dist.engine.sampling import SamplingConfig
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.memory.disk import DiskStore

    tm, ref = models["next"]
    lm = load_model(str(tm.path), load_tokenizer=False)
    with DiskStore(tmp_path / "off") as disk:
        eng = StageEngine(lm.spec, lm.source, (0, 4), has_embed=True, has_head=True,
                          policy=Policy(1, 1, state_gpu_percent=34, state_cpu_percent=0), device=torch.device("cpu"),
                          dtype=torch.float32, disk=disk)
        sweeps = []
        real = eng.run_sweep
        eng.run_sweep = lambda parts, more=False: sweeps.append(len(parts)) or real(parts, more)  # type: ignore[method-assign]
        outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True), schedule="overlapped", num_groups=2)
        eng.close()
    assert max(sweeps) > 1  # a sweep that ran two blocks' parts
    assert outs == ref


def test_the_state_percent_option_runs_from_the_cli_and_the_api(models: dict, tmp_path: Path, capsys) -> None:
    """``--state-percent 0 0`` (every linear layer's states on disk) from the command line, and
    ``state_percent`` through ``LLM``: transformers' tokens, the placement shown with the policy,
    and no state file left in the offload directory."""
    from flexgen_dist.run import main

    tm, ref = models["next"]
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out, off = tmp_path / "o.jsonl", tmp_path / "off"
    rc = main(["--model", str(tm.path), "--prompts", str(prompts), "--gen-len", str(GEN), "--ignore-eos",
               "--gpu-batch-size", "2", "--state-percent", "0", "0", "--offload-dir", str(off),
               "--output", str(out), "--dtype", "float32"])
    assert rc == 0
    assert [r["tokens"] for r in read_jsonl(out)] == ref
    assert "state_percent=0 0" in capsys.readouterr().err
    assert not list(off.rglob("*state*"))
    with LLM(str(tm.path), gpu_batch_size=2, state_percent=(0, 100), ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] == ref


def test_states_on_disk_open_the_offload_directory_only_for_stages_with_linear_layers(tiny_models,
                                                                                     tmp_path: Path) -> None:
    """``--state-percent 0 0`` asks for disk only where a stage has linear-attention layers: a
    model without them runs with no offload directory made."""
    from flexgen_dist.engine.footprint import needs_disk

    pol = Policy(state_gpu_percent=0, state_cpu_percent=0)
    assert needs_disk([pol]) and not needs_disk([pol], states=False) and not needs_disk([Policy()])
    tm = tiny_models["llama-gqa"]
    off = tmp_path / "off"
    with LLM(str(tm.path), state_percent=(0, 0), offload_dir=str(off), ignore_eos=True, progress=False) as llm:
        assert len(llm.generate([[5, 6, 7]], gen_len=2)[0].token_ids) == 2
    assert not off.exists()


def test_the_footprint_places_and_stages_the_states_as_the_engine_does(models: dict) -> None:
    """The footprint's states: whole layers on each tier by the state fractions, whatever the
    LP's fractions, and the staged layers' buffers on the compute device (at most three a
    block); a CPU device uses the RAM's in place, a GPU host stages them (and passes the disk's
    through host buffers)."""
    from flexgen_dist.engine.states import STAGED_LAYERS

    spec = load_model(str(models["next"][0].path), load_tokenizer=False).spec
    z = StageShape(num_layers=4, has_embed=False, has_head=False, prompt_len=10, gen_len=4, dtype_bytes=4,
                   gpu_batch_size=2, num_gpu_batches=2)
    per = recurrent_bytes(spec, z) // 3
    x = np.array([1, 0, 0, 1, 0, 0, 1, 0, 0.0])
    for fractions, cuda, want in [((0, 1, 0), False, [0, 3, 0]), ((0, 1, 0), True, [STAGED_LAYERS, 3, 0]),
                                  ((0, 0, 1), False, [STAGED_LAYERS, 0, 3]), ((0, 0, 1), True, [STAGED_LAYERS, 2, 3]),
                                  ((1 / 3, 1 / 3, 1 / 3), True, [3, 3, 1])]:
        fp = stage_footprint(spec, replace(z, state_fractions=fractions, cuda=cuda))
        got = fp.peaks(x) - replace(fp, states=np.zeros((2, 3))).peaks(x)
        assert got[0].tolist() == [w * per for w in want], (fractions, cuda)
        assert (fp.linear()[0][:, :, 9] - fp.work[:, :, 9] == fp.states).all()
    fp = stage_footprint(spec, z)  # the default: all on the device, nothing staged
    assert (fp.peaks(x) - replace(fp, states=np.zeros((2, 3))).peaks(x) == [[3 * per, 0, 0]] * 2).all()


def test_the_image_text_checkpoint_runs_its_language_model(models: dict, tmp_path: Path) -> None:
    """A ``qwen3_5`` (Qwen3_5ForConditionalGeneration) directory: its text_config, its weights
    under model.language_model., the vision tower's fields and tensors unused."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tm, ref = models["3.5"]
    text = json.loads((tm.path / "config.json").read_text())
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=32,
                                                             num_heads=2, out_hidden_size=64, patch_size=4,
                                                             spatial_merge_size=1, temporal_patch_size=1))
    vl = Qwen3_5ForConditionalGeneration(cfg).eval()
    vl.model.language_model.load_state_dict(tm.model.model.state_dict())
    vl.lm_head.load_state_dict(tm.model.lm_head.state_dict())
    vl.save_pretrained(tmp_path / "vl")
    with LLM(str(tmp_path / "vl"), gpu_batch_size=2, ignore_eos=True, progress=False) as llm:
        assert llm.model.spec.layer_types[3] == "full_attention"
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] == ref


def test_a_config_without_the_linear_sizes_is_one_line(models: dict, tmp_path: Path) -> None:
    cfg = json.loads((models["next"][0].path / "config.json").read_text())
    del cfg["linear_num_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="linear_num_value_heads"):
        load_model(str(tmp_path), load_tokenizer=False)
    cfg = json.loads((models["next"][0].path / "config.json").read_text())
    cfg["layer_types"][0] = "sliding_attention"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="linear_attention or full_attention"):
        load_model(str(tmp_path), load_tokenizer=False)


@pytest.mark.parametrize("opts", [dict(dtype="bfloat16"), dict(compress_weight=True)])
def test_bfloat16_and_4bit_weights_run(models: dict, opts: dict) -> None:
    """Users run these: every prompt gets its tokens; in bfloat16 the first tokens are
    transformers' own in bfloat16 (the states stay float32 as there)."""
    tm, ref = models["next"]
    with LLM(str(tm.path), gpu_batch_size=2, ignore_eos=True, progress=False, **opts) as llm:
        out = [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)]
    assert [len(o) for o in out] == [GEN] * len(PROMPTS)
    if "dtype" in opts:
        import copy

        bf = TinyModel("bf", tm.path, copy.deepcopy(tm.model).to(torch.bfloat16), 0)  # the fixture's stays float32
        want = [reference_generate(bf, [p], 1)[0] for p in PROMPTS]
        assert [o[:1] for o in out] == want


@pytest.mark.slow
@pytest.mark.multinode
def test_two_ranks_split_linear_and_attention_layers(models: dict, tmp_path: Path) -> None:
    """Two pipeline stages under torchrun (gloo): the first holds linear layers only, the second
    a linear layer and the attention layer; each keeps its own layers' states, half of them by
    ``--state-percent 50 0`` on disk (the first stage's second layer, the second stage's one)."""
    tm, ref = models["next"]
    out = tmp_path / "o.jsonl"
    r = local_ranks(["-m", "flexgen_dist.run", "--no-progress", "--model", str(tm.path), "--prompts",
                     str(write_jsonl(tmp_path / "p.jsonl", PROMPTS)), "--gen-len", str(GEN), "--ignore-eos",
                     "--gpu-batch-size", "2", "--num-gpu-batches", "1", "--stage-layers", "2", "2",
                     "--output", str(out), "--offload-dir", str(tmp_path / "off"), "--state-percent", "50", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == ref


def test_the_registry_entry_is_what_its_config_gives() -> None:
    """qwen3-next-80b-a3b equals the spec of Qwen3-Next-80B-A3B's published config (transformers'
    Qwen3NextConfig defaults, with its context, RoPE base and dense width set here; token ids
    aside), and has the model card's 80B parameters."""
    from dataclasses import replace

    from transformers import Qwen3NextConfig

    from flexgen_dist.models.hf_config import spec_from_hf_config
    from flexgen_dist.models.registry import get_spec

    cfg = Qwen3NextConfig(max_position_embeddings=262144, intermediate_size=5120,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                           "partial_rotary_factor": 0.25})
    got, want = spec_from_hf_config(cfg.to_dict(), "q"), get_spec("qwen3-next-80b-a3b")
    ids = dict(name="", bos_token_id=None, eos_token_ids=(), pad_token_id=None)
    assert replace(got, **ids) == replace(want, **ids)
    assert want.total_numel() / 1e9 == pytest.approx(80, rel=0.01)


def test_a_config_whose_layers_all_attend_needs_no_linear_sizes(models: dict, tmp_path: Path) -> None:
    """Qwen3-Next's layers with every one attending (layer_types all full_attention: transformers
    builds no linear layer): the spec has no linear sizes and no state; the gate and the norms stay."""
    cfg = json.loads((models["next"][0].path / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model(str(tmp_path), dummy_weights=True, load_tokenizer=False).spec
    assert not any(spec.linear(j) for j in range(spec.num_layers)) and spec.recurrent_numel() == (0, 0)
    assert spec.attn_output_gate and spec.norm_unit_offset and spec.lin_v_heads == 0


def test_scoring_equals_transformers_in_prefill_and_decode(models: dict, tmp_path: Path) -> None:
    """Perplexity scoring: sequences of several lengths in one padded batch (the prefill's
    chunks), and teacher-forced decode steps (``eval ppl --decode-tokens``: the recurrence),
    score as transformers' full logits do."""
    import math

    from test_eval import decode_windows, hf_reference

    from flexgen_dist.eval import main

    tm, _ = models["next"]
    seqs = [PROMPTS[2][:100], PROMPTS[1], PROMPTS[0]]
    with LLM(str(tm.path), gpu_batch_size=2, progress=False) as llm:
        scores = llm.score(seqs, [1, 1, 1])
    for s, seq in zip(scores, seqs):
        nll, count, hits = hf_reference(tm.model, seq, [(0, len(seq), 1)])
        assert s.count == count and abs(s.nll - nll) <= 1e-4 * abs(nll) and s.correct == hits
    ids = PROMPTS[2]
    (tmp_path / "ids.jsonl").write_text(json.dumps({"input_ids": ids}) + "\n")
    out = tmp_path / "r.json"
    assert main(["ppl", "--text", str(tmp_path / "ids.jsonl"), "--window", "80", "--stride", "70", "--decode-tokens",
                 "12", "--model", str(tm.path), "--json", str(out), "--no-progress", "--gpu-batch-size", "2"]) == 0
    res = json.loads(out.read_text())
    nll, count, hits = hf_reference(tm.model, ids, decode_windows(len(ids), 80, 70, 12))
    assert res["tokens_scored"] == count and abs(res["ppl"] - math.exp(nll / count)) <= 1e-4 * math.exp(nll / count)


@pytest.mark.bundled
@pytest.mark.parametrize("kind,qtype", [("next", None), ("next", "Q8_0"), ("3.5", None), ("3.5-moe", None)])
def test_gguf_files_match_transformers(kind: str, qtype: str | None, tmp_path: Path) -> None:
    """A ``qwen3next`` GGUF file as llama.cpp's converter writes it (in_proj_qkvz split into
    attn_qkv and attn_gate, in_proj_ba kept as ssm_ba, A as -exp(A_log), the convolution's taps
    squeezed, every norm but ssm_norm stored as 1 + w, q_proj with its gate as attn_q), and
    ``qwen35`` / ``qwen35moe`` files (b and a apart, the v heads tiled): the same spec as the HF
    directory's (but the v heads' order) and transformers' tokens, float32 or Q8_0 kept packed
    under --compress-weight, weights half on disk."""
    from gguf_convert import roundtrip_, write_gguf

    tm = _model(kind, tmp_path / "hf", vocab_size=49152)
    if qtype:
        roundtrip_(tm.model, qtype)
    path = write_gguf(tm.model, tmp_path / "q3n.gguf", qtype)
    spec = load_model(str(path), load_tokenizer=False).spec
    hf = load_model(str(tm.path), load_tokenizer=False).spec
    from dataclasses import replace

    ids = dict(name="", bos_token_id=None, eos_token_ids=(), pad_token_id=None, lin_v_tiled=False)
    assert replace(spec, **ids) == replace(hf, **ids) and spec.lin_v_tiled == (kind != "next")
    ref = reference_generate(TinyModel("q3n", path, tm.model, 0), PROMPTS, GEN)
    with LLM(str(path), percent=(0, 50, 100, 0, 100, 0), gpu_batch_size=2, offload_dir=str(tmp_path / "off"),
             ignore_eos=True, progress=False) as llm:
        assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN)] == ref
    if qtype:  # kept packed (Q8_0 blocks in the fused product): the same log-likelihoods to 0.1 %
        # (greedy tokens of this tiny model sit within 0.003 of a tie, where summation order decides)
        from test_eval import hf_reference

        seqs = [p + r for p, r in zip(PROMPTS, ref)]
        with LLM(str(path), gpu_batch_size=2, compress_weight=True, progress=False) as llm:
            scores = llm.score(seqs, [1] * len(seqs))
        for sc, seq in zip(scores, seqs):
            nll, count, _ = hf_reference(tm.model, seq, [(0, len(seq), 1)])
            assert sc.count == count and abs(sc.nll - nll) <= 1e-3 * abs(nll)
