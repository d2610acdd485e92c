"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept in the file's own blocks under --compress-weight."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_dist.memory.quant import QTensor, dequantize
from flexgen_dist.models.loader import bundled_model_path
from flexgen_dist.models.packed import gguf_packed


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_blocks_dequantize_bit_exact(kind: str) -> None:
    import gguf
    import gguf.quants as gq

    x = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gq.quantize(x, qtype)
    ref = torch.from_numpy(gq.dequantize(raw, qtype).copy())
    pw = gguf_packed(raw, kind, (6, 96), torch.float32)
    assert pw.bits == (8 if kind == "Q8_0" else 4) and pw.group_size == 32
    qt = QTensor(pw.codes, pw.mins, pw.scales, torch.Size(pw.shape), torch.float32, 1, 32, pw.bits)
    assert torch.equal(dequantize(qt), ref)
    assert pw.nbytes < x.nbytes / (3 if kind == "Q8_0" else 5)  # ~4x / ~7x smaller than float32


@pytest.mark.bundled
def test_native_compressed_weights_answer_paris_and_keep_perplexity() -> None:
    from flexgen_dist import LLM
    from flexgen_dist.eval import evaluate

    args = {"window": 128, "max_windows": 2}
    res = {}
    for compress in (False, True):
        with LLM(compress_weight=compress, progress=False) as llm:
            out = llm.generate(["The capital of France is"], gen_len=3)
            res[compress] = evaluate(llm, **args)
            placed = llm.engine.weights.placed
        assert out[0].text.startswith(" Paris"), (compress, out[0].text)
        if compress:  # the file's own 32-element blocks along the input dim, 4-bit
            q = placed[("layer", 0)]["q.w"].data
            assert isinstance(q, QTensor) and (q.dim, q.group_size, q.bits) == (1, 32, 4)
    rel = abs(res[True]["ppl"] - res[False]["ppl"]) / res[False]["ppl"]
    assert rel < 1e-3, (res[True]["ppl"], res[False]["ppl"])
    assert res[True]["peak_bytes"][0]["gpu"] + res[True]["peak_bytes"][0]["cpu"] < \
        res[False]["peak_bytes"][0]["gpu"] + res[False]["peak_bytes"][0]["cpu"]


@pytest.mark.bundled
@pytest.mark.parametrize("native", [True, False])
def test_budget_predicts_the_packed_bytes_exactly(native: bool) -> None:
    """The budget check sizes each weight as it will be stored: the file's own 32-element
    blocks (Q4_1 layers, a Q8_0 embedding) on the native path, the policy's groups otherwise."""
    from flexgen_dist.engine.footprint import predict_peaks
    from flexgen_dist.engine.policy import Policy
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.models.loader import load_model

    lm = load_model(str(bundled_model_path()), load_tokenizer=False)
    lm.source.keep_packed = native
    spec = lm.spec
    pol = Policy(1, 1, 0, 100, 100, 0, 100, 0, compress_weight=True)  # weights alone in RAM
    peak = predict_peaks(spec, pol, (0, 4), has_embed=True, has_head=False, prompt_len=4, gen_len=1,
                         dtype_bytes=4, packed=lm.source.packed_formats)
    eng = StageEngine(spec, lm.source, (0, 4), has_embed=True, has_head=False, policy=pol,
                      device=torch.device("cpu"), dtype=torch.float32)
    stored = eng.weights.bytes_per_tier()
    eng.close()
    emb = eng.weights.placed[("embed", None)]["tok.w"].data
    assert (emb.bits, emb.group_size) == ((8, 32) if native else (4, 64))
    assert peak["cpu"] == stored["cpu"] > 0
