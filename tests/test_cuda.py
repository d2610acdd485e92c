"""The CUDA paths: every placement on ``--device cuda`` against transformers on the same GPU,
every newer family and the mixtures of experts there, logprobs, penalties and top-k/min-p there, half types, the CPU-attention cache in pinned RAM, disk weights with overlap, compression on
the GPU, and a two-rank pipeline sharing one GPU.

Every test here is marked ``gpu`` and skipped without a CUDA device. The ``gpu_device``
fixture gives the device; ``FLEXGEN_GPU_TESTS_ON_CPU=1`` runs the same tests on the CPU (the
checks that only hold on CUDA, such as pinned memory, then check the CPU's behaviour) so that
their own logic can be exercised on a machine without a GPU."""
from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
import torch

from conftest import MODEL_KINDS, PROMPTS, TinyModel, left_padded, local_ranks, read_jsonl, write_jsonl
from flexgen_dist.distributed.local import generate
from flexgen_dist.engine import kvcache
from flexgen_dist.engine.blocks import left_pad, pad_token, plan_blocks
from flexgen_dist.engine.policy import Policy
from flexgen_dist.engine.sampling import SamplingConfig
from flexgen_dist.engine.stage import StageEngine
from flexgen_dist.memory.disk import DiskStore
from flexgen_dist.memory.tiers import Tier
from flexgen_dist.models.loader import load_model
from test_families_pipeline import FAMILIES, LONG
from test_moe import _model as moe_model

pytestmark = pytest.mark.gpu
GEN = 6
PLACEMENTS = {
    "all-gpu": (100, 0, 100, 0, 100, 0),
    "weights-cpu": (0, 100, 100, 0, 100, 0),
    "cache-cpu": (100, 0, 0, 100, 100, 0),
    "all-cpu": (0, 100, 0, 100, 0, 100),
    "all-disk": (0, 0, 0, 0, 0, 0),
    "mixed": (30, 30, 20, 50, 50, 50),
}


def reference_on(tm: TinyModel, device: torch.device, dtype: torch.dtype, prompts: list[list[int]],
                 gen_len: int) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy tokens and first-step logits on ``device`` in ``dtype``. In float32
    the shared CPU model is moved there and back (lossless); a half type converts a copy, so
    the shared model's float32 weights are never rounded. The EOS id is an ordinary token, as
    the engine's ``ignore_eos`` takes it (``conftest.reference_generate``)."""
    ids, mask = left_padded(tm, prompts, device)
    s = ids.shape[1]
    shared = dtype == torch.float32
    model = (tm.model if shared else copy.deepcopy(tm.model)).to(device=device, dtype=dtype)
    gc = model.generation_config
    eos, gc.eos_token_id = gc.eos_token_id, None
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -1].float().cpu()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len, do_sample=False,
                                 pad_token_id=tm.pad_id)
    finally:
        gc.eos_token_id = eos
        if shared:
            tm.model.to(device="cpu")
    return out[:, s:].tolist(), logits


def engine(tm: TinyModel, pct: tuple, device: torch.device, dtype: torch.dtype, disk: DiskStore, *,
           overlap: bool = True, cpu_attention: bool = True, compress: bool = False,
           gpu_batch_size: int = 2, num_gpu_batches: int = 2,
           state_percent: tuple[float, float] = (100, 0)) -> StageEngine:
    lm = load_model(str(tm.path), load_tokenizer=False, dtype=dtype)
    pol = Policy(gpu_batch_size, num_gpu_batches, *pct, overlap=overlap, cpu_attention=cpu_attention,
                 compress_weight=compress, compress_cache=compress, state_gpu_percent=state_percent[0],
                 state_cpu_percent=state_percent[1])
    return StageEngine(lm.spec, lm.source, (0, lm.spec.num_layers), has_embed=True, has_head=True,
                       policy=pol, device=device, dtype=dtype, disk=disk)


def run(tm: TinyModel, pct: tuple, device: torch.device, dtype: torch.dtype, off: Path,
        prompts: list[list[int]] = PROMPTS, **kw) -> list[list[int]]:
    with DiskStore(off) as disk:
        eng = engine(tm, pct, device, dtype, disk, **kw)
        try:
            outs, _ = generate(eng, prompts, GEN, SamplingConfig(ignore_eos=True))
        finally:
            eng.close()
    return outs


def first_logits(tm: TinyModel, pct: tuple, device: torch.device, dtype: torch.dtype, off: Path) -> torch.Tensor:
    """The engine's prefill logits of every prompt, as one block."""
    with DiskStore(off) as disk:
        eng = engine(tm, pct, device, dtype, disk, gpu_batch_size=len(PROMPTS), num_gpu_batches=1)
        try:
            blk = plan_blocks([len(p) for p in PROMPTS], eng.policy.block_size)[0]
            st = eng.new_block(blk.meta(eng.policy.gpu_batch_size, 1))
            ids = left_pad(PROMPTS, blk.prompt_len, pad_token(eng.spec.pad_token_id, eng.spec.eos_token_ids))
            return eng.run_token(st, 0, [ids])[0].float().cpu()
        finally:
            eng.close()


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_every_placement_float32_matches_transformers_on_the_gpu(kind: str, tiny_models, gpu_device,
                                                                   tmp_path: Path) -> None:
    """float32 on the device: the tokens of every placement, with and without overlap and CPU
    attention, equal transformers' on the same device."""
    tm = tiny_models[kind]
    ref, _ = reference_on(tm, gpu_device, torch.float32, PROMPTS, GEN)
    for (name, pct), overlap, cpu_att in itertools.product(PLACEMENTS.items(), [True, False], [True, False]):
        outs = run(tm, pct, gpu_device, torch.float32, tmp_path / "off", overlap=overlap, cpu_attention=cpu_att)
        assert outs == ref, (name, overlap, cpu_att)


@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa", "qwen3_moe"])
def test_weights_copied_on_their_own_stream_match_transformers(kind: str, tiny_models, gpu_device, tmp_path: Path,
                                                               monkeypatch) -> None:
    """The weights' copies and expansions on a load stream that the compute waits on by event
    (the default on a GPU; a mixture's experts, read after its router, on the compute stream).
    float32 tokens equal transformers' where the weights come from RAM, from disk and from both
    (with and without CPU attention), and 4-bit weights give the tokens they give on the
    compute stream (``FLEXGEN_CUDA_LOAD_STREAM=0``)."""
    from flexgen_dist.engine.streams import LOAD_STREAM_ENV

    tm = moe_model(kind, tmp_path / "m") if kind == "qwen3_moe" else tiny_models[kind]
    ref, _ = reference_on(tm, gpu_device, torch.float32, PROMPTS, GEN)
    monkeypatch.setenv(LOAD_STREAM_ENV, "0")
    default = run(tm, PLACEMENTS["mixed"], gpu_device, torch.float32, tmp_path / "off", compress=True)
    monkeypatch.delenv(LOAD_STREAM_ENV)
    with DiskStore(tmp_path / "off") as disk:
        eng = engine(tm, PLACEMENTS["mixed"], gpu_device, torch.float32, disk)
        assert (eng.weights.load_stream is not None) == (gpu_device.type == "cuda")
        eng.close()
    for name in ("weights-cpu", "all-disk", "mixed"):
        for cpu_att in (True, False):
            outs = run(tm, PLACEMENTS[name], gpu_device, torch.float32, tmp_path / "off", cpu_attention=cpu_att)
            assert outs == ref, (name, cpu_att)
    assert run(tm, PLACEMENTS["mixed"], gpu_device, torch.float32, tmp_path / "off", compress=True) == default


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["opt-pre", "llama-gqa"])
def test_half_types_on_the_gpu_track_transformers(kind: str, dtype: torch.dtype, tiny_models, gpu_device,
                                                   tmp_path: Path) -> None:
    """In a half type the first step's logits stay within the type's rounding of transformers'
    in the same type, for a placement on every tier, and every placement generates every token."""
    if gpu_device.type == "cpu" and dtype == torch.float16:
        pytest.skip("float16 is a GPU type here (the CPU runs bfloat16)")
    tm = tiny_models[kind]
    _, ref_logits = reference_on(tm, gpu_device, dtype, PROMPTS, GEN)
    w = next(tm.model.parameters())
    assert w.dtype == torch.float32 and w.device.type == "cpu"  # the shared model is left as it was
    eps = torch.finfo(dtype).eps
    for name in ("all-gpu", "mixed"):
        lg = first_logits(tm, PLACEMENTS[name], gpu_device, dtype, tmp_path / "off")
        rel = ((lg - ref_logits).abs().max() / ref_logits.abs().max()).item()
        assert rel < 16 * eps, (name, rel)
    for name, pct in PLACEMENTS.items():
        outs = run(tm, pct, gpu_device, dtype, tmp_path / "off")
        assert [len(o) for o in outs] == [GEN] * len(PROMPTS), name
        assert all(0 <= t < tm.model.config.vocab_size for o in outs for t in o), name


def test_cpu_attention_reads_the_cache_in_pinned_ram(tiny_models, gpu_device, tmp_path: Path, monkeypatch) -> None:
    """With the cache on the CPU and CPU attention on, the cache's RAM chunks are pinned on a
    CUDA device (async copies of new k/v), plain pages on a CPU one, and tokens stay exact."""
    tm = tiny_models["llama-gqa"]
    chunks: list = []
    alloc = kvcache.BlockCache._alloc

    def recording_alloc(self, tier, r0, r1, cap, name):
        ch = alloc(self, tier, r0, r1, cap, name)
        chunks.append(ch)
        return ch

    monkeypatch.setattr(kvcache.BlockCache, "_alloc", recording_alloc)
    ref, _ = reference_on(tm, gpu_device, torch.float32, PROMPTS, GEN)
    for compress in (False, True):
        chunks.clear()
        outs = run(tm, (100, 0, 0, 100, 100, 0), gpu_device, torch.float32, tmp_path / "off",
                   cpu_attention=True, compress=compress)
        cpu_chunks = [ch for ch in chunks if ch.tier == Tier.CPU]
        assert cpu_chunks and len(cpu_chunks) == len(chunks)
        for ch in cpu_chunks:
            for t in ([ch.k, ch.v] if not compress else [ch.k.data, ch.k.scales, ch.v.data, ch.v.mins]):
                assert t.device.type == "cpu" and t.is_pinned() == (gpu_device.type == "cuda"), compress
        if not compress:
            assert outs == ref


@pytest.mark.parametrize("name,cpu_att", [("all-gpu", False), ("cache-cpu", False), ("cache-cpu", True),
                                          ("weights-cpu", True)])
def test_merged_decode_on_the_gpu(name: str, cpu_att: bool, tiny_models, gpu_device, tmp_path: Path,
                                  monkeypatch) -> None:
    """Decode runs each layer once over the rows of every GPU batch exactly where
    ``Policy.merges_decode`` says (on CUDA: every activation on the device, and the whole
    cache there too, or in RAM with CPU attention), with the tokens of the batch-by-batch
    order and of transformers."""
    tm = tiny_models["llama-gqa"]
    ref, _ = reference_on(tm, gpu_device, torch.float32, PROMPTS, GEN)
    calls: list[str] = []
    real = StageEngine._compute_merged
    monkeypatch.setattr(StageEngine, "_compute_merged",
                        lambda self, st, i, j, w, n: calls.append(self.slots[j][0]) or real(self, st, i, j, w, n))
    pct = PLACEMENTS[name]
    assert run(tm, pct, gpu_device, torch.float32, tmp_path / "off", num_gpu_batches=3, cpu_attention=cpu_att) == ref
    merges = Policy(2, 3, *pct, cpu_attention=cpu_att).merges_decode(gpu_device.type)
    assert merges == (name != "cache-cpu" or cpu_att or gpu_device.type == "cpu")
    layers = tm.model.config.num_hidden_layers
    blocks = -(-len(PROMPTS) // 6)
    assert calls.count("layer") == (blocks * (GEN - 1) * layers if merges else 0)
    assert calls.count("head") == blocks * (GEN - 1)  # the head merges wherever activations are on the device
    monkeypatch.setattr(StageEngine, "_merged", lambda *a: False)
    assert run(tm, pct, gpu_device, torch.float32, tmp_path / "off2", num_gpu_batches=3, cpu_attention=cpu_att) == ref


def test_disk_weights_stream_with_overlap(tiny_models, gpu_device, tmp_path: Path) -> None:
    """Weights on disk with overlap on: every layer is read from disk into reused buffers
    (pinned on CUDA) while the layer before computes; tokens stay exact."""
    tm = tiny_models["opt-pre"]
    ref, _ = reference_on(tm, gpu_device, torch.float32, PROMPTS, GEN)
    with DiskStore(tmp_path / "off") as disk:
        eng = engine(tm, (0, 0, 100, 0, 100, 0), gpu_device, torch.float32, disk, overlap=True)
        try:
            outs, _ = generate(eng, PROMPTS, GEN, SamplingConfig(ignore_eos=True))
            weight_bytes = disk.allocated_bytes
            read = disk.bytes_read
        finally:
            eng.close()
    assert outs == ref
    assert weight_bytes > 0
    # the weights stream: read again for every token step (2 blocks x GEN sweeps over the
    # layers), not once
    assert read >= GEN * weight_bytes


def test_compression_on_the_gpu_matches_the_cpu(tiny_models, gpu_device, tmp_path: Path, monkeypatch) -> None:
    """4-bit weights and cache: quantized on the device, kept compressed on every tier, and
    dequantized where they are used; the GPU's tokens equal the CPU's for the same policy, and
    the fused 4-bit product's tokens equal those of expand-then-multiply."""
    tm = tiny_models["llama-gqa"]
    pct = (30, 30, 20, 50, 50, 50)
    cpu = run(tm, pct, torch.device("cpu"), torch.float32, tmp_path / "off-cpu", compress=True)
    dev = run(tm, pct, gpu_device, torch.float32, tmp_path / "off-dev", compress=True)
    assert dev == cpu
    dense = run(tm, pct, gpu_device, torch.float32, tmp_path / "off-dense")
    assert dense != dev  # compression really changed the numbers
    monkeypatch.setenv("FLEXGEN_FUSED_QLINEAR", "0")  # expand, then the dense product
    assert run(tm, pct, gpu_device, torch.float32, tmp_path / "off-unfused", compress=True) == dev


def test_two_ranks_share_one_gpu(tiny_models, gpu_device, tmp_path: Path) -> None:
    """A 2-rank pipeline on the one device over gloo (hidden states staged through the host;
    NCCL refuses two ranks on one GPU): tokens equal transformers' on the device."""
    tm = tiny_models["llama-gqa"]
    ref, _ = reference_on(tm, gpu_device, torch.float32, PROMPTS, GEN)
    p = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out, met = tmp_path / "o.jsonl", tmp_path / "m.json"
    r = local_ranks(["-m", "flexgen_dist.run", "--no-progress", "--model", str(tm.path), "--prompts", str(p),
                     "--gen-len", str(GEN), "--ignore-eos", "--device", gpu_device.type, "--dtype", "float32",
                     "--backend", "gloo", "--gpu-batch-size", "1", "--num-gpu-batches", "2", "--num-micro-batches", "2",
                     "--percent", "50", "50", "50", "50", "100", "0", "--offload-dir", str(tmp_path / "off"),
                     "--output", str(out), "--metrics", str(met)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == ref
    m = json.loads(met.read_text())
    assert m["world_size"] == 2 and m["device"].startswith(gpu_device.type)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_weights_expand_on_the_device_to_the_cpu_values(gpu_device, dtype: torch.dtype) -> None:
    """A packed weight on the compute device expands (torch's ops there) to exactly the values
    the CPU's native kernel gives, in every compute dtype, and its fused product equals the
    dense one up to the order of the sums."""
    from flexgen_dist.kernels.qweight import QWeight
    from flexgen_dist.memory.quant import dequantize, quantize
    from flexgen_dist.models import common

    if dtype == torch.float16 and gpu_device.type == "cpu":
        pytest.skip("float16 is a GPU type here (the CPU runs bfloat16)")
    w = (torch.randn(96, 200) * 0.3).to(dtype)
    q = quantize(w, 4, 32, dim=1)
    cpu_values = dequantize(q)
    dev = QWeight(q.data.to(gpu_device), q.mins.to(gpu_device), q.scales.to(gpu_device), (96, 200), 32, 4, dtype)
    assert torch.equal(dev.dense().cpu(), cpu_values)
    x = torch.randn(3, 200).to(dtype).to(gpu_device)
    y, ref = common.linear(x, dev), common.linear(x, cpu_values.to(gpu_device))
    # the fused product (the native kernel on the CPU, the Triton kernel on a GPU): the same
    # values, summed in another order
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name", [*sorted(FAMILIES), "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe-groups", "gpt_oss",
                                  "deepseek_v3", "llama4", "qwen3_next"])
def test_families_and_experts_on_the_gpu_match_transformers(name: str, gpu_device, tmp_path: Path) -> None:
    """Llama 3.1, Mistral, Qwen2/3, Phi-3, Gemma 2/3, the mixtures of experts, Llama 4 and
    Qwen3-Next (the gated delta rule's states on the device, and staged from RAM and disk) in float32 on
    the device: half the weights there and half in RAM, the cache and activations there,
    prompts past the sliding windows; greedy tokens equal transformers' on the same device.
    (Gemma 2's reference runs eager attention: the SDPA that transformers before 5.2x picks by
    default leaves out its softcap, which made this test fail on an H200 with 5.17.)"""
    if name in FAMILIES:
        torch.manual_seed(31)
        m = FAMILIES[name]().eval()
        m.save_pretrained(tmp_path / "m")
        tm = TinyModel(name, tmp_path / "m", m, 0)
    elif name == "gpt_oss":  # attention sinks: the materialised softmax on the device
        from test_gpt_oss import _model as gpt_oss_model
        tm = gpt_oss_model(tmp_path / "m")
    elif name == "llama4":  # chunked attention, the temperature: each prompt's reference alone (test_llama4)
        from test_llama4 import _model as llama4_model
        tm = llama4_model("interleaved", tmp_path / "m")
    elif name == "qwen3_next":  # linear-attention layers: their states on the device (test_qwen3_next)
        from test_qwen3_next import _model as qwen3_next_model
        tm = qwen3_next_model("next", tmp_path / "m")
    else:
        tm = moe_model(name, tmp_path / "m")
    if name == "llama4":
        ref = [reference_on(tm, gpu_device, torch.float32, [p], GEN)[0][0] for p in LONG]
    else:
        ref, _ = reference_on(tm, gpu_device, torch.float32, LONG, GEN)
    assert run(tm, (50, 50, 100, 0, 100, 0), gpu_device, torch.float32, tmp_path / "off", prompts=LONG) == ref
    if name == "qwen3_next":  # the states staged from pinned RAM and from disk, around their layers
        for states in ((0, 100), (34, 33)):
            assert run(tm, (50, 50, 100, 0, 100, 0), gpu_device, torch.float32, tmp_path / "off", prompts=LONG,
                       state_percent=states) == ref, states


def test_logprobs_penalties_and_filters_on_the_gpu_match_the_cpu(tiny_models, gpu_device) -> None:
    from flexgen_dist import LLM
    tm = tiny_models["llama-gqa"]
    cfgs = [SamplingConfig(frequency_penalty=1.0, presence_penalty=0.5), SamplingConfig(logit_bias={7: 3.0}),
            SamplingConfig(temperature=0.8, top_k=5, seed=1), SamplingConfig(temperature=0.8, top_p=0.9, min_p=0.2,
                                                                             seed=1),
            SamplingConfig(), SamplingConfig(temperature=1.2, seed=2)]
    outs = {}
    for dev in ("cpu", gpu_device.type):
        with LLM(str(tm.path), device=dev, dtype="float32", gpu_batch_size=2, num_gpu_batches=3, ignore_eos=True,
                 progress=False) as llm:
            outs[dev] = llm.generate(PROMPTS, gen_len=GEN, sampling=cfgs, logprobs=3)
    for a, b in zip(outs["cpu"], outs[gpu_device.type]):
        assert a.token_ids == b.token_ids
        assert b.logprobs.token_logprobs == pytest.approx(a.logprobs.token_logprobs, abs=1e-4)
        assert [[i for i, _ in t] for t in b.logprobs.top] == [[i for i, _ in t] for t in a.logprobs.top]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_leaves_cudnn_out_and_restores_it(gpu_device: torch.device, dtype: torch.dtype) -> None:
    """A decode step's attention on the GPU is not cuDNN's (its host time was ~1 ms a call on
    an H100, most of a decode step): no cuDNN attention op runs, the values are those of the
    step-by-step softmax in float32, and the process's cuDNN flag is as it was."""
    from torch.profiler import ProfilerActivity, profile

    from flexgen_dist.engine.attention import attend_rows

    g = torch.Generator().manual_seed(0)
    r, grp, d, L, cap = 24, 4, 64, 77, 96
    q = torch.randn(r, grp, 1, d, generator=g).to(gpu_device, dtype)
    cache_k = torch.randn(r, cap, d, generator=g).to(gpu_device, dtype)  # a cache buffer, read to L
    cache_v = torch.randn(r, cap, d, generator=g).to(gpu_device, dtype)
    mask = torch.rand(r, 1, 1, L, generator=g).to(gpu_device) > 0.3
    mask[:, ..., -1] = True  # every row sees its own new position
    k, v = cache_k[:, :L], cache_v[:, :L]
    before = torch.backends.cuda.cudnn_sdp_enabled()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu_device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        out = attend_rows(q, k, v, mask, scale=d ** -0.5)
    names = {e.name for e in prof.events()}
    assert not any("cudnn" in n.lower() and "attention" in n.lower() for n in names), sorted(names)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    s = torch.einsum("rgd,rld->rgl", q[:, :, 0].float(), k.float()) * d ** -0.5
    ref = torch.einsum("rgl,rld->rgd", s.masked_fill(~mask[:, 0], float("-inf")).softmax(-1), v.float())
    assert out.shape == (r, grp, 1, d)
    assert torch.allclose(out[:, :, 0].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("what", ["greedy", "sampled", "nucleus-mixed", "penalties+logprobs"])
def test_what_choosing_holds_is_within_the_peak_model(gpu_device: torch.device, what: str) -> None:
    """The bytes one GPU batch's choice allocates beyond its logits, measured by the CUDA
    allocator, stay within what the peak model counts for it (its float32 copy and
    ``choice_bytes``). On the CPU (FLEXGEN_GPU_TESTS_ON_CPU=1) the choice runs, unmeasured."""
    from flexgen_dist.engine.footprint import CUDA_SORT_BYTES
    from flexgen_dist.engine.sampling import RowSampling, SamplingConfig, choice_bytes, token_logprobs

    b, V = 64, 151_936
    cfgs = {"greedy": [SamplingConfig()] * b,
            "sampled": [SamplingConfig(temperature=0.8, seed=1)] * b,
            "nucleus-mixed": [SamplingConfig(temperature=0.9, top_p=0.9, top_k=50, min_p=0.05, seed=2)] * (b // 2)
            + [SamplingConfig()] * (b // 2),
            "penalties+logprobs": [SamplingConfig(temperature=1.0, frequency_penalty=0.5, logit_bias={7: 2.0})] * b,
            }[what]
    k = 5 if what == "penalties+logprobs" else None
    logits = torch.randn(b, V, generator=torch.Generator().manual_seed(0)).to(gpu_device, torch.float16)
    rs = RowSampling(cfgs, gpu_device, steps=4)
    keys = torch.arange(b, device=gpu_device)
    cuda = gpu_device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    lg = logits.float()  # as the pipeline takes each batch's logits
    ids = rs.sample(lg, keys, 0)
    if k is not None:
        token_logprobs(lg, ids, k)
    assert ids.shape == (b,) and int(ids.min()) >= 0 and int(ids.max()) < V
    if cuda:
        torch.cuda.synchronize()
        used = torch.cuda.max_memory_allocated() - base
        sorts = CUDA_SORT_BYTES if any(not c.greedy and c.top_p < 1.0 for c in cfgs) else 0
        allowed = b * V * (4 + choice_bytes(cfgs, k) + sorts)
        assert used <= allowed + (1 << 20), (what, used, allowed)


def test_lora_adapters_per_request_on_the_gpu_match_peft(tiny_models, gpu_device, tmp_path: Path) -> None:
    """Adapters served per request (``--lora-modules``) on the device, stacks on the GPU, in RAM
    and with merged decode: each prompt's float32 tokens equal transformers' on PEFT's model
    with its adapter."""
    from flexgen_dist import LLM
    from test_lora_modules import CHOICE, LLAMA_ALL, _expected, _two

    tm = tiny_models["llama-gqa"]
    modules, models = _two(tm, tmp_path, LLAMA_ALL)
    want = _expected(models, CHOICE, PROMPTS, GEN)
    for pct, ngb in (((100, 0, 100, 0, 100, 0), 1), ((0, 100, 0, 100, 100, 0), 3)):
        with LLM(str(tm.path), lora_modules=modules, device=gpu_device.type, dtype="float32", percent=pct,
                 gpu_batch_size=2, num_gpu_batches=ngb, ignore_eos=True, progress=False) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN, lora=CHOICE)] == want, pct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embeddings_on_the_gpu_match_transformers(tiny_models, gpu_device, dtype: torch.dtype) -> None:
    """``LLM.embed`` on the device: the last hidden states transformers gives on the same device
    (float32: to 2e-5; bfloat16: to its rounding)."""
    from flexgen_dist import LLM

    tm = tiny_models["llama-gqa"]
    ids, mask = left_padded(tm, PROMPTS, gpu_device)
    ref = copy.deepcopy(tm.model).to(gpu_device, dtype)
    with torch.no_grad():
        want = ref.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1].float().cpu()
    with LLM(str(tm.path), device=gpu_device.type, dtype=str(dtype).replace("torch.", ""), gpu_batch_size=2,
             progress=False) as llm:
        got = torch.tensor([e.embedding for e in llm.embed(PROMPTS, normalize=False)])
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("how", ["mean", "weighted_mean", "cls"])
def test_pooling_on_the_gpu_matches_sentence_transformers(tmp_path: Path, gpu_device, how: str) -> None:
    """A sentence-transformers model's pooling over each input's positions on the device (its
    left-padded rows masked there): transformers' states pooled alike, float32."""
    from flexgen_dist import LLM
    from test_embeddings import _pooled_reference, _sentence_model

    mode = {"mean": "pooling_mode_mean_tokens", "weighted_mean": "pooling_mode_weightedmean_tokens",
            "cls": "pooling_mode_cls_token"}[how]
    d, m = _sentence_model(tmp_path, {mode: True})
    want = _pooled_reference(m, PROMPTS, how)
    with LLM(str(d), device=gpu_device.type, gpu_batch_size=3, progress=False) as llm:
        got = torch.tensor([e.embedding for e in llm.embed(PROMPTS, normalize=False)], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_token_judge_reranks_on_the_gpu_as_transformers(tmp_path: Path, gpu_device) -> None:
    """``classifier_from_token`` on the device: the sigmoid of logit(yes) - logit(no) of
    transformers' causal LM over each joined pair, float32."""
    from flexgen_dist import LLM
    from test_pairs import DOCS, Q, _model, _token_logits, _two_tokens

    d, m, tok = _model(tmp_path, "Qwen3ForCausalLM", tie_word_embeddings=True)
    names, (no, yes) = _two_tokens(tok)
    want = torch.stack([lg[yes] - lg[no] for lg in (_token_logits(m, tok(Q + t)["input_ids"]) for t in DOCS)])
    with LLM(str(d), device=gpu_device.type, classifier_from_token=names, gpu_batch_size=2, progress=False) as llm:
        got = torch.tensor(llm.score_pairs(Q, DOCS), dtype=torch.float64)
    torch.testing.assert_close(got, want.sigmoid(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("placement", [
    dict(percent=(100, 0, 100, 0, 100, 0)),
    dict(percent=(100, 0, 0, 100, 100, 0), cpu_attention=False),  # RAM written without blocking, then moved
    dict(percent=(100, 0, 0, 100, 100, 0), cpu_attention=True),
    dict(percent=(100, 0, 0, 0, 100, 0)),  # disk
], ids=["device", "ram-copied", "ram-cpu-attention", "disk"])
def test_beam_search_on_the_gpu_as_transformers(placement: dict, tiny_models, tmp_path: Path, gpu_device) -> None:
    """``beam_search`` in float32 on the device: transformers' hypotheses (on the CPU) token for
    token, the cache rows moved to their beams on each tier."""
    from flexgen_dist import LLM
    from test_beams import hf_beams, stop_ids

    tm = tiny_models["llama-gqa"]
    ends = stop_ids(tm, 2)
    with LLM(str(tm.path), device=gpu_device.type, dtype="float32", gpu_batch_size=4,
             offload_dir=str(tmp_path / "off"), progress=False, **placement) as llm:
        outs = llm.beam_search(PROMPTS, beam_width=2, max_tokens=8, sampling=SamplingConfig(stop_token_ids=ends))
    got = [[c.token_ids for c in o.sequences] for o in outs]
    assert got == [[t for t, _ in hf_beams(tm, p, 2, 8, ends=(2, *ends))] for p in PROMPTS]


def test_vllm_controls_on_the_gpu(tiny_models, gpu_device) -> None:
    """min_tokens, stop_token_ids, bad words and allowed ids per row on the device: the
    vLLM-rules loop over transformers' float32 logits."""
    from flexgen_dist import LLM
    from test_controls import GEN, reference, settings

    tm = tiny_models["llama-gqa"]
    cfgs = settings(tm)
    with LLM(str(tm.path), device=gpu_device.type, dtype="float32", gpu_batch_size=2, num_gpu_batches=3,
             progress=False) as llm:
        got = [c.token_ids for c in llm.generate(PROMPTS, gen_len=GEN, sampling=cfgs)]
    assert got == [reference(tm, p, c, GEN) for p, c in zip(PROMPTS, cfgs)]


@pytest.mark.parametrize("placement", [
    dict(percent=(100, 0, 100, 0, 100, 0)),
    dict(percent=(50, 50, 0, 100, 0, 100), cpu_attention=True),  # a narrowed batch's activations in RAM
], ids=["device", "offloaded"])
def test_repeated_prompts_on_the_gpu(placement: dict, tiny_models, tmp_path: Path, gpu_device) -> None:
    """Each GPU batch's repeated prompts computed once on the device (the keys and values
    copied to the repeats' cache rows, on the device and in RAM): transformers' tokens, and
    the n best of best_of sampled candidates as the run that computes every row draws them."""
    from conftest import reference_generate
    from flexgen_dist import LLM
    from test_twins import repeated

    tm = tiny_models["llama-gqa"]
    ps = repeated(256)
    hot = SamplingConfig(temperature=1.0, seed=2)
    got = {}
    for share in (True, False):
        with LLM(str(tm.path), device=gpu_device.type, dtype="float32", gpu_batch_size=4, num_gpu_batches=2,
                 share_prefix=share, ignore_eos=True, offload_dir=str(tmp_path / "off"), progress=False,
                 **placement) as llm:
            greedy = [c.token_ids for c in llm.generate(ps, gen_len=5)]
            assert (llm.metrics["repeated_prompt_fraction"] > 0) == share
            sampled = [c.token_ids for c in llm.generate(ps[:3], gen_len=5, sampling=hot, n=2, best_of=4)]
            got[share] = (greedy, sampled)
    assert got[True][0] == [reference_generate(tm, [p], 5)[0] for p in ps]
    assert got[True] == got[False]


@pytest.mark.parametrize("placement", [
    dict(percent=(100, 0, 100, 0, 100, 0)),
    dict(percent=(100, 0, 0, 100, 100, 0), cpu_attention=True),  # the rows' own keys in pinned RAM, the CPU attending
    dict(percent=(100, 0, 0, 100, 100, 0), cpu_attention=False),  # copied to the device each step
    dict(percent=(100, 0, 0, 0, 100, 0), cpu_attention=True, compress_cache=True),  # on disk, 4-bit
], ids=["device", "ram-cpu-attention", "ram-to-device", "disk-compressed"])
def test_a_held_prefix_on_the_gpu(placement: dict, tiny_models, tmp_path: Path, gpu_device, monkeypatch) -> None:
    """A block's shared prefix held once on the device through decode (``engine/held.py``),
    each chunk's own positions attended where they live and merged by log-sum-exp: the
    tokens of the run whose every row keeps its prefix, transformers' where uncompressed."""
    from conftest import reference_generate
    from flexgen_dist import LLM, run_plan, worker
    from flexgen_dist.engine import prompt_groups
    from test_shared_prefix import TWO_BLOCKS, prompts

    tm = tiny_models["llama-gqa"]
    ps = prompts(256, tails=TWO_BLOCKS)
    got = {}
    for hold in (True, False):
        if not hold:
            for mod in (prompt_groups, run_plan, worker):
                monkeypatch.setattr(mod, "holds_prefix", lambda *a: False)
        with LLM(str(tm.path), device=gpu_device.type, dtype="float32", gpu_batch_size=3, num_gpu_batches=2,
                 ignore_eos=True, offload_dir=str(tmp_path / "off"), progress=False, sort_window=0,
                 **placement) as llm:
            got[hold] = [c.token_ids for c in llm.generate(ps, gen_len=GEN)]
            assert llm.metrics["shared_prefix_fraction"] > 0
    assert got[True] == got[False]
    if not placement.get("compress_cache"):
        assert got[True] == [reference_generate(tm, [p], GEN)[0] for p in ps]


@pytest.mark.parametrize("placement", [
    dict(percent=(100, 0, 100, 0, 100, 0)),
    dict(percent=(100, 0, 0, 100, 100, 0), cpu_attention=True),  # prompts' and rows' keys in pinned RAM
    dict(percent=(100, 0, 0, 100, 100, 0), cpu_attention=False),  # copied to the device each step
    dict(percent=(100, 0, 0, 0, 100, 0), cpu_attention=True, compress_cache=True),  # on disk, 4-bit
], ids=["device", "ram-cpu-attention", "ram-to-device", "disk-compressed"])
def test_repeated_prompts_kept_once_on_the_gpu(placement: dict, tiny_models, tmp_path: Path, gpu_device,
                                               monkeypatch) -> None:
    """Three choices of each prompt, each GPU batch's prompts kept once in its cache
    (``engine/prompt_groups.py``), a prompt's rows' queries attending its one row: the tokens of
    the run whose every row keeps its prompt, transformers' where uncompressed."""
    from conftest import reference_generate
    from flexgen_dist import LLM
    from flexgen_dist.engine import prompt_groups
    from test_prompt_groups import _prompts

    tm = tiny_models["llama-gqa"]
    ps = _prompts(256)
    got = {}
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(prompt_groups, "prompt_groups", lambda *a: None)
        with LLM(str(tm.path), device=gpu_device.type, dtype="float32", gpu_batch_size=6, num_gpu_batches=2,
                 ignore_eos=True, offload_dir=str(tmp_path / "off"), progress=False, **placement) as llm:
            got[grouped] = [c.token_ids for c in llm.generate(ps, gen_len=GEN, n=3)]
    assert got[True] == got[False]
    if not placement.get("compress_cache"):
        assert got[True] == [t for t in reference_generate(tm, ps, GEN) for _ in range(3)]
