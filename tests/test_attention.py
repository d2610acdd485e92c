"""Attention kernels against a naive reference: dense rows, prefill SDPA, top-k sparse."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_dist.engine.attention import (_bmm_attend, _sdpa_decode, attend_rows, mask_to_rows, merge_partial,
                                           prefill_attention, q_to_rows, rows_to_out, to_rows)


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (b, t, nh, d), k/v (b, L, kvh, d), mask (b, t, L) -> (b, t, nh*d)."""
    b, t, nh, d = q.shape
    rep = nh // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bthd,blhd->bhtl", q, k) / math.sqrt(d)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhtl,blhd->bthd", s.softmax(-1), v).reshape(b, t, nh * d)


def make(b=3, t=5, L=5, nh=6, kvh=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, nh, d, generator=g)
    k = torch.randn(b, L, kvh, d, generator=g)
    v = torch.randn(b, L, kvh, d, generator=g)
    mask = torch.rand(b, t, L, generator=g) > 0.3
    mask[..., -1] = True  # every query sees at least one key
    return q, k, v, mask


def test_dense_rows_match_reference_and_strided_cache_views() -> None:
    q, k, v, mask = make()
    kvh = k.shape[2]
    ref = naive(q, k, v, mask)
    out = rows_to_out(attend_rows(q_to_rows(q, kvh), to_rows(k), to_rows(v), mask_to_rows(mask, kvh)), q.shape[0])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the cache is a strided view into a longer preallocated buffer
    big_k = torch.zeros(k.shape[0] * kvh, 9, k.shape[3])
    big_v = torch.zeros_like(big_k)
    big_k[:, :5], big_v[:, :5] = to_rows(k), to_rows(v)
    out2 = rows_to_out(attend_rows(q_to_rows(q, kvh), big_k[:, :5], big_v[:, :5], mask_to_rows(mask, kvh)), 3)
    torch.testing.assert_close(out2, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos_major", [False, True])
def test_half_type_decode_matches_float32_reference(dtype: torch.dtype, pos_major: bool) -> None:
    """Decode (one query position) in a half type on the CPU takes the fused path; it must
    agree with the float32 reference over strided views of a longer preallocated cache, laid
    out row-major (RAM chunks) or position-major (staged disk chunks), with GQA."""
    q, k, v, mask = make(b=4, t=1, L=11, nh=8, kvh=2, d=16, seed=3)
    kvh = k.shape[2]
    ref = naive(q, k, v, mask)
    rows = k.shape[0] * kvh
    if pos_major:
        big_k, big_v = (torch.zeros(20, rows, 16, dtype=dtype) for _ in range(2))
        big_k[:11], big_v[:11] = to_rows(k).transpose(0, 1), to_rows(v).transpose(0, 1)
        kc, vc = big_k[:11].transpose(0, 1), big_v[:11].transpose(0, 1)
    else:
        big_k, big_v = (torch.zeros(rows, 20, 16, dtype=dtype) for _ in range(2))
        big_k[:, :11], big_v[:, :11] = to_rows(k), to_rows(v)
        kc, vc = big_k[:, :11], big_v[:, :11]
    out = attend_rows(q_to_rows(q.to(dtype), kvh), kc, vc, mask_to_rows(mask, kvh))
    assert out.dtype == dtype and out.shape == (rows, 4, 1, 16)
    torch.testing.assert_close(rows_to_out(out, 4).float(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("pos_major", [False, True])
def test_fused_decode_equals_the_bmm_path_in_float32(pos_major: bool) -> None:
    """The GPU's decode attention (SDPA, the G query heads of a row as G queries over its kv
    head) gives the bmm path's values in float32, over strided cache views, with GQA."""
    q, k, v, mask = make(b=4, t=1, L=11, nh=8, kvh=2, d=16, seed=5)
    kvh, rows = k.shape[2], k.shape[0] * k.shape[2]
    if pos_major:
        big_k, big_v = (torch.zeros(20, rows, 16) for _ in range(2))
        big_k[:11], big_v[:11] = to_rows(k).transpose(0, 1), to_rows(v).transpose(0, 1)
        kc, vc = big_k[:11].transpose(0, 1), big_v[:11].transpose(0, 1)
    else:
        big_k, big_v = (torch.zeros(rows, 20, 16) for _ in range(2))
        big_k[:, :11], big_v[:, :11] = to_rows(k), to_rows(v)
        kc, vc = big_k[:, :11], big_v[:, :11]
    qr, m = q_to_rows(q, kvh), mask_to_rows(mask, kvh)
    fused = _sdpa_decode(qr, kc, vc, m, 0.25)
    torch.testing.assert_close(fused, _bmm_attend(qr, kc, vc, m, 0.25, 0.0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rows_to_out(fused, 4), naive(q * 0.25 * 4, k, v, mask), rtol=1e-5, atol=1e-5)


def test_prefill_sdpa_matches_reference() -> None:
    q, k, v, _ = make(t=7, L=7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    mask = causal[None].expand(3, 7, 7).clone()
    torch.testing.assert_close(prefill_attention(q, k, v, mask[:, None]), naive(q, k, v, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_prefill_without_a_mask_is_causal(softcap: float) -> None:
    """No mask (an unpadded GPU batch without a window) is plain causal attention: SDPA's
    causal kernel, or the capped scores' own causal mask, give what the explicit mask gives."""
    q, k, v, _ = make(t=7, L=7)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None].expand(3, 7, 7)
    with_mask = prefill_attention(q, k, v, mask[:, None], softcap=softcap)
    torch.testing.assert_close(prefill_attention(q, k, v, None, softcap=softcap), with_mask, rtol=1e-6, atol=1e-6)
    other = prefill_attention(q, k, v, torch.ones_like(mask)[:, None], softcap=softcap)  # not causal
    assert not torch.allclose(other, with_mask)


def test_row_chunks_merge_to_the_whole() -> None:
    q, k, v, mask = make()
    kvh = 2
    qr, kr, vr, mr = q_to_rows(q, kvh), to_rows(k), to_rows(v), mask_to_rows(mask, kvh)
    whole = attend_rows(qr, kr, vr, mr)
    parts = [(a, b, attend_rows(qr[a:b], kr[a:b], vr[a:b], mr[a:b])) for a, b in ((0, 2), (2, 5), (5, 6))]
    torch.testing.assert_close(merge_partial(parts, 6, torch.device("cpu")), whole)


def test_top_k_sparse_attention() -> None:
    q, k, v, mask = make(t=1, L=10)
    mask[:] = True
    kvh = 2
    args = (q_to_rows(q, kvh), to_rows(k), to_rows(v), mask_to_rows(mask, kvh))
    dense = attend_rows(*args)
    torch.testing.assert_close(attend_rows(*args, sparsity=1.0), dense)
    torch.testing.assert_close(attend_rows(*args, sparsity=0.999), dense, rtol=1e-5, atol=1e-5)  # k = L
    one = attend_rows(*args, sparsity=0.1)  # k = 1: the value row of the best-scoring key
    qr, kr, vr = args[0], args[1], args[2]
    best = torch.einsum("rgtd,rld->rgtl", qr, kr).argmax(-1)
    picked = vr[torch.arange(vr.shape[0])[:, None, None], best]
    torch.testing.assert_close(one, picked)
    half = attend_rows(*args, sparsity=0.5)
    assert not torch.allclose(half, dense) and torch.isfinite(half).all()


@pytest.mark.parametrize("r0,r1", [(0, 12), (0, 5), (5, 12), (4, 8), (1, 2), (3, 11), (7, 7)])
@pytest.mark.parametrize("pos_major", [False, True])
def test_copy_rows_gathers_cache_rows_from_the_projection_layout(r0: int, r1: int, pos_major: bool) -> None:
    """Prefill writes k/v (b, t, kvh, d) straight into a chunk's rows [r0, r1), which may
    split a sequence's kv heads, in a row-major cache view or a position-major buffer."""
    from flexgen_dist.engine.cache_layout import copy_rows

    src = torch.randn(3, 5, 4, 2)  # 3 sequences x 4 kv heads = 12 rows
    n = r1 - r0
    if pos_major:
        buf = torch.full((5, n, 2), float("nan"))
        dst = buf.transpose(0, 1)
    else:
        buf = torch.full((n, 9, 2), float("nan"))
        dst = buf[:, :5]
    copy_rows(dst, src, r0, r1)
    torch.testing.assert_close(dst, to_rows(src)[r0:r1], rtol=0, atol=0)
    if not pos_major:
        assert buf[:, 5:].isnan().all()  # positions past the prompt untouched
