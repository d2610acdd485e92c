"""GGUF weights kept in the file's own blocks under --compress-weight: Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 and the K-quants (Q2_K ... Q6_K), each expanding to ``gguf.dequantize``'s values bit for
bit; a Q4_K_M file (Q4_K, with Q6_K value, down and head matrices) gives transformers' greedy
tokens on its values with its blocks kept."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PROMPTS, TinyModel, reference_generate
from flexgen_dist.memory.quant import QTensor, dequantize
from flexgen_dist.models.gguf_blocks import GGUF_NATIVE, encode_blocks, gguf_packed
from flexgen_dist.models.loader import bundled_model_path

# (elements, bytes) of a block and where its float16 factors sit (llama.cpp's block structs)
BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)),
          "Q8_0": (32, 34, (0,)), "Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)),
          "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)),
          "IQ4_NL": (32, 18, (0,)), "IQ4_XS": (256, 136, (0,)), "MXFP4": (32, 17, ())}  # (any E8M0 byte is finite)


def random_blocks(kind: str, rows: int, per_row: int, seed: int = 0) -> np.ndarray:
    """Rows of random ``kind`` blocks: every code, scale and mask bit random, the float16
    factors finite (any bytes are a valid block but for a NaN or infinite factor)."""
    rng = np.random.default_rng(seed)
    _, size, halves = BLOCKS[kind]
    blk = rng.integers(0, 256, (rows * per_row, size), dtype=np.uint8)
    for at in halves:
        blk[:, at:at + 2] = (rng.standard_normal(rows * per_row) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blk.reshape(rows, per_row * size)


@pytest.mark.parametrize("kind", list(GGUF_NATIVE))
def test_packed_blocks_dequantize_bit_exact(kind: str) -> None:
    """Every kept type, on random blocks: the engine's expansion of the kept codes equals
    ``gguf.dequantize`` exactly (float32), in the code width and groups of the type's row
    of the table, at its size."""
    import gguf
    import gguf.quants as gq

    per, size, _ = BLOCKS[kind]
    rows, cols = 6, 2 * per
    raw = random_blocks(kind, rows, 2)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    ref = torch.from_numpy(gq.dequantize(raw, qtype).copy())
    pw = gguf_packed(raw, kind, (rows, cols), torch.float32)
    bits, group, *table = GGUF_NATIVE[kind]
    fmt = table[0] if table else "int"
    assert (pw.bits, pw.group_size, pw.fmt) == (bits, group, fmt)
    qt = QTensor(pw.codes, pw.mins, pw.scales, torch.Size(pw.shape), torch.float32, 1, group, bits, fmt)
    assert torch.equal(dequantize(qt), ref)
    metas = 1 if table else 2  # a table format's scales alone; else scales and mins, float32 here
    assert pw.nbytes == rows * cols * bits // 8 + metas * 4 * rows * cols // group


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_encoded_k_blocks_read_back_close_and_reencode_to_themselves(kind: str) -> None:
    """``encode_blocks`` (round to nearest) writes blocks ``gguf.dequantize`` reads within a
    step of the values, and encoding the values read gives them back unchanged (what a test
    file written from a model's quantized values needs)."""
    import gguf
    import gguf.quants as gq

    x = np.random.default_rng(1).standard_normal((5, 512)).astype(np.float32) * 0.05
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    y = gq.dequantize(encode_blocks(x, kind), qtype)
    assert np.abs(y - x).max() < {"Q4_K": 0.07, "Q5_K": 0.035, "Q6_K": 0.02, "IQ4_NL": 0.1, "IQ4_XS": 0.1}[kind] \
        * np.abs(x).max()
    assert np.array_equal(gq.dequantize(encode_blocks(y, kind), qtype), y)


def llama_file(qtype: str, seed: int, path: Path) -> tuple:
    """(a random Llama with rows of 256, hidden 256 and FFN 512, holding the values of its
    ``qtype`` file; that file at ``path``)."""
    import transformers as tf

    from gguf_convert import roundtrip_, write_gguf

    torch.manual_seed(seed)
    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                                           pad_token_id=2, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # sharp attention, so that a wrong row order of q or k would show
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight *= 12
    roundtrip_(m, qtype)
    return m, write_gguf(m, path, qtype)


@pytest.mark.bundled
def test_a_q4_k_m_file_keeps_its_blocks_and_matches_transformers(tmp_path: Path) -> None:
    """A Llama written as a Q4_K_M file (rows of 256: hidden 256, FFN 512): greedy tokens equal
    transformers' on the file's values in float32, expanded and with the blocks kept
    (--compress-weight: Q4_K matrices as 4-bit codes in groups of 32, Q6_K ones as 8-bit in
    groups of 16, each expanding to the file's values exactly); the budget check sizes them
    as stored."""
    from conftest import kept_codes_sized_as_stored

    m, path = llama_file("Q4_K_M", 3, tmp_path / "m.gguf")
    ref = reference_generate(TinyModel("llama", path, m, 0), PROMPTS, 6)
    for compress in (False, True):
        from flexgen_dist import LLM

        with LLM(str(path), compress_weight=compress, gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True,
                 progress=False) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref, compress
            if compress:
                placed = llm.engine.weights.placed[("layer", 0)]
                for key, hf, want in (("q.w", "q_proj", (4, 32)), ("v.w", "v_proj", (8, 16)),
                                      ("down.w", "mlp.down_proj", (8, 16)), ("up.w", "mlp.up_proj", (4, 32))):
                    q = placed[key].data
                    assert isinstance(q, QTensor) and (q.bits, q.group_size) == want, key
                    stem = "self_attn." + hf if hf.endswith(("q_proj", "v_proj")) else hf
                    if key != "q.w":  # q's rows are permuted in the file (llama.cpp's order), undone on load
                        value = m.get_parameter(f"model.layers.0.{stem}.weight").detach()
                        assert torch.equal(dequantize(q), value), key
    predicted, stored = kept_codes_sized_as_stored(path)
    assert predicted == stored > 0


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


@pytest.mark.bundled
def test_the_bundled_model_as_q4_k_m_keeps_each_type_in_its_width(tmp_path: Path) -> None:
    """``bench.gguf_kquants`` writes the bundled model by llama.cpp's Q4_K_M recipe (Q6_K for the
    value and down matrices of its "more bits" layers, fallbacks where a row is not whole
    super-blocks); kept, each layer's matrices are in their type's width and groups and give
    the greedy tokens of the file expanded."""
    from flexgen_dist import LLM
    from flexgen_dist.bench.gguf_kquants import more_bits, q4_k_m_type, write_q4_k_m

    assert [i for i in range(30) if more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert q4_k_m_type("blk.3.ffn_down.weight", 1536, 30) == "Q4_K"
    assert q4_k_m_type("blk.5.ffn_down.weight", 1536, 30) == "Q6_K"
    assert q4_k_m_type("blk.5.attn_v.weight", 576, 30) == "Q8_0"  # Q6_K's fallback
    assert q4_k_m_type("blk.3.attn_q.weight", 576, 30) == "Q5_0"  # Q4_K's
    path = tmp_path / "q4km.gguf"
    assert write_q4_k_m(bundled_model_path(), path) == {"Q8_0": 15, "Q6_K": 14, "Q5_0": 166, "Q4_K": 16}
    out = {}
    for compress in (False, True):
        with LLM(str(path), compress_weight=compress, ignore_eos=True, progress=False) as llm:
            out[compress] = [c.token_ids for c in llm.generate(["The capital of France is", "def add(a, b):"],
                                                               gen_len=8)]
            if compress:
                placed = llm.engine.weights.placed
                for layer, key, want in ((3, "down.w", (4, 32)), (5, "down.w", (8, 16)), (5, "v.w", (8, 32)),
                                         (3, "q.w", (8, 32))):
                    q = placed[("layer", layer)][key].data
                    assert isinstance(q, QTensor) and (q.bits, q.group_size) == want, (layer, key)
    assert out[True] == out[False]


@pytest.mark.bundled
@pytest.mark.parametrize("qtype", ["IQ4_XS", "IQ4_NL"])
def test_an_iq4_file_keeps_its_codes_in_the_table_format(qtype: str, tmp_path: Path) -> None:
    """A Llama written as an IQ4_XS / IQ4_NL file (every matrix, the embedding and head
    included): greedy tokens equal transformers' on the file's values in float32 with the
    codes kept (--compress-weight: the ``iq4nl`` table format, 4-bit codes and a float32
    scale per 32 values, each matrix expanding to the file's values exactly) and expanded; the
    budget check sizes them as stored."""
    from conftest import kept_codes_sized_as_stored
    from flexgen_dist import LLM

    m, path = llama_file(qtype, 4, tmp_path / "m.gguf")
    ref = reference_generate(TinyModel("llama", path, m, 0), PROMPTS, 6)
    for compress in (True, False):
        with LLM(str(path), compress_weight=compress, gpu_batch_size=2, num_gpu_batches=2, ignore_eos=True,
                 progress=False) as llm:
            assert [c.token_ids for c in llm.generate(PROMPTS, gen_len=6)] == ref, compress
            if compress:
                placed = llm.engine.weights.placed
                for slot, key, value in ((("layer", 1), "down.w", m.model.layers[1].mlp.down_proj.weight),
                                         (("layer", 0), "v.w", m.model.layers[0].self_attn.v_proj.weight),
                                         (("head", None), "lm_head.w", m.lm_head.weight)):
                    q = placed[slot][key].data
                    assert isinstance(q, QTensor) and (q.fmt, q.bits, q.group_size) == ("iq4nl", 4, 32), key
                    assert torch.equal(dequantize(q), value.detach()), key
    predicted, stored = kept_codes_sized_as_stored(path)
    assert predicted == stored > 0
