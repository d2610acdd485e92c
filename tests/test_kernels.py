"""The model's small kernels against their textbook definitions: rotary, RMSNorm, and the native
CPU kernels (the GEMM form policy: test_gemm_policy.py)."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from flexgen_dist import kernels
from flexgen_dist.kernels import attend
from flexgen_dist.models import common


def test_apply_rope_matches_rotate_half_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 16, generator=g)
    pos = torch.arange(5).expand(3, 5) + torch.tensor([[0], [2], [7]])
    cos, sin = common.rope_cos_sin(pos, 16, 10000.0, torch.float32)
    rotated = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    ref = x * cos + rotated * sin
    out = common.apply_rope(x, cos, sin)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert out.data_ptr() != x.data_ptr()  # the input is not modified in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 7, 32, generator=g) * 3).to(dtype)
    w = torch.randn(32, generator=g).to(dtype)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = common.rms_norm(x, w, 1e-5)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def _native_library():
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    lib = kernels.library()
    assert lib is not None, "g++ is present, so the native kernels must build"
    return lib


@pytest.mark.parametrize("rows", [1, 5, 8, 13, 32, 64])
@pytest.mark.parametrize("shape", [(48, 64), (7, 33), (50, 16), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear(rows: int, shape: tuple[int, int], bias: bool) -> None:
    """Every row and column tail (rows not a multiple of the register block, in-features not a
    multiple of the vector width, out-features not a multiple of the weight block)."""
    _native_library()
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, 1, k, generator=g)
    out = kernels.linear_f32(x, w, b)
    assert out is not None and out.shape == (rows, 1, n)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_native_linear_reads_strided_rows_and_declines_what_it_cannot_take() -> None:
    _native_library()
    g = torch.Generator().manual_seed(7)
    big = torch.randn(6, 40, generator=g)
    x = big[:, 4:36]  # rows 40 apart, each contiguous
    w = torch.randn(24, 40, generator=g)[:, 3:35]  # weight rows 40 apart
    out = kernels.linear_f32(x, w)
    assert out is not None
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert kernels.linear_f32(x.t(), torch.randn(3, 6)) is None  # input rows not contiguous
    assert kernels.linear_f32(x, w.t().contiguous().t()) is None  # weight not row-major
    assert kernels.linear_f32(x.bfloat16(), w.bfloat16()) is None  # float32 only


@pytest.mark.parametrize("rows", [1, 5, 8, 13, 64])
@pytest.mark.parametrize("shape", [(48, 64), (7, 33), (50, 16), (576, 1536), (37, 100)])
def test_native_bf16_linear_rounds_once_as_the_float32_product(rows: int, shape: tuple[int, int]) -> None:
    """bfloat16 products summed in float32 and rounded once, then the bias and the residual with
    one rounding each: the float32 product of the same operands, to the summation order (a
    last-bit difference on an element where a sum lands on a rounding boundary)."""
    _native_library()
    if not kernels.native_bf16_product():
        pytest.skip("this CPU has no AVX512_BF16: linear_bf16 declines (test_native_bf16_linear_declines...)")
    n, k = shape
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    r = torch.randn(rows, 1, n, generator=g).bfloat16()
    x = torch.randn(rows, 1, k, generator=g).bfloat16()
    for bias, res in [(None, None), (b, None), (b, r), (None, r)]:
        out = kernels.linear_bf16(x, w, bias, res)
        assert out is not None and out.shape == (rows, 1, n) and out.dtype == torch.bfloat16
        prod = F.linear(x.float(), w.float())
        ref, scale = prod.bfloat16(), prod.abs()
        if bias is not None:
            ref, scale = ref.add_(bias), scale + bias.float().abs()
        if res is not None:
            ref, scale = ref.add_(res), scale + res.float().abs()
        ulp = scale.clamp_min(1.0) * 2.0 ** -7  # a bfloat16 step of the largest term
        assert bool(((out.float() - ref.float()).abs() <= 2 * ulp).all())
        assert (out != ref).float().mean().item() < 0.01
    # the same at any thread count: each output is one thread's, in a fixed order
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.linear_bf16(x, w, b, r)
        torch.set_num_threads(2)
        assert torch.equal(one, kernels.linear_bf16(x, w, b, r))
    finally:
        torch.set_num_threads(before)


def test_native_bf16_linear_declines_what_it_cannot_take() -> None:
    """Where it cannot run (no AVX512_BF16, another dtype, columns not contiguous) it returns
    None, and the GEMM policy then never offers it as a form for bfloat16."""
    from flexgen_dist.kernels.gemm import FORMS, GemmPolicy
    _native_library()
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 40, generator=g).bfloat16(), torch.randn(24, 40, generator=g).bfloat16()
    assert (kernels.linear_bf16(x, w) is not None) == kernels.native_bf16_product()
    assert ("native" in GemmPolicy._forms(torch.bfloat16)) == kernels.native_bf16_product()
    assert GemmPolicy._forms(torch.float16) == FORMS[:2]
    assert kernels.linear_bf16(x.float(), w.float()) is None
    assert kernels.linear_bf16(x, w.t().contiguous().t()) is None  # weight not row-major
    assert kernels.linear_bf16(x.t(), torch.randn(3, 4).bfloat16()) is None  # input rows not contiguous
    if kernels.native_bf16_product():
        big = torch.randn(6, 48, generator=g).bfloat16()
        xs, ws = big[:, 4:44], torch.randn(24, 48, generator=g).bfloat16()[:, 3:43]  # rows evenly strided
        out = kernels.linear_bf16(xs, ws)
        assert out is not None
        torch.testing.assert_close(out.float(), F.linear(xs.float(), ws.float()), rtol=2 ** -7, atol=2 ** -6)


def test_kernels_can_be_switched_off(monkeypatch) -> None:
    monkeypatch.setattr(kernels.build, "_state", {})
    monkeypatch.setenv("FLEXGEN_CPU_KERNELS", "0")
    assert kernels.library() is None


ATT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["row-major", "position-major"])
@pytest.mark.parametrize("g,d,L", [(1, 64, 1), (3, 64, 37), (4, 128, 200), (2, 32, 9), (5, 80, 23), (7, 128, 16),
                                   (8, 96, 45), (2, 256, 3), (6, 48, 100)])
def test_native_attention_matches_softmax_reference(dtype: torch.dtype, layout: str, g: int, d: int,
                                                    L: int) -> None:
    """Rows read in place from a preallocated (rows, max_len, d) cache, or from a staged disk
    chunk (max_len, rows, d), some positions masked; float32 arithmetic in every dtype, so the
    result is the float32 reference rounded once (plus the inputs' own rounding)."""
    _native_library()
    gen = torch.Generator().manual_seed(g * 100 + L)
    r, max_len = 6, L + 5
    if layout == "row-major":
        cache_k, cache_v = torch.randn(2, r, max_len, d, generator=gen).to(dtype)
    else:
        cache_k, cache_v = torch.randn(2, max_len, r, d, generator=gen).to(dtype).transpose(1, 2)
    k, v = cache_k[:, :L], cache_v[:, :L]
    q = torch.randn(r, g, 1, d, generator=gen).to(dtype)
    mask = torch.rand(r, 1, 1, L, generator=gen) > 0.3
    mask[..., -1] = True  # every row sees at least one position
    out = attend.attention(q, k, v, mask, 1.0 / d ** 0.5)
    assert out is not None and out.shape == (r, g, 1, d) and out.dtype == dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.einsum("rgtd,rld->rgtl", qf, kf) / d ** 0.5
    ref = torch.einsum("rgtl,rld->rgtd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vf)
    torch.testing.assert_close(out.float(), ref, rtol=ATT_TOL[dtype], atol=ATT_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_with_sinks_matches_softmax_reference(dtype: torch.dtype) -> None:
    """gpt-oss's sinks: a logit per (row, query head) joins the softmax's denominator, its share
    dropped; large sinks (taking most of the mass) and small ones both."""
    _native_library()
    gen = torch.Generator().manual_seed(7)
    r, g, d, L = 6, 4, 64, 37
    q, k, v = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((r, g, 1, d), (r, L, d), (r, L, d)))
    mask = torch.rand(r, 1, 1, L, generator=gen) > 0.3
    mask[..., -1] = True
    sinks = torch.randn(r, g, generator=gen) * 4
    out = attend.attention(q, k, v, mask, 1.0 / d ** 0.5, sinks)
    assert out is not None
    scores = torch.einsum("rgtd,rld->rgtl", q.float(), k.float()).div(d ** 0.5).masked_fill(~mask, float("-inf"))
    probs = torch.cat([scores, sinks[:, :, None, None]], -1).softmax(-1)[..., :-1]
    ref = torch.einsum("rgtl,rld->rgtd", probs, v.float())
    torch.testing.assert_close(out.float(), ref, rtol=ATT_TOL[dtype], atol=ATT_TOL[dtype])
    plain = attend.attention(q, k, v, mask, 1.0 / d ** 0.5)
    assert plain is not None and not torch.allclose(plain.float(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g,d,L", [(2, 64, 40), (3, 128, 17), (5, 48, 7), (8, 80, 33)])
def test_native_attention_heads_together_equal_each_head_alone(dtype: torch.dtype, g: int, d: int, L: int) -> None:
    """The kernel scores pairs of heads against tiles of positions and sums values in tiles of
    heads x vectors, and adds each score's and each output's terms in one fixed order whatever
    the tile: so every head's output (and log-sum-exp) is bit for bit what the head gives alone."""
    _native_library()
    gen = torch.Generator().manual_seed(g * 10 + d)
    r = 5
    q = torch.randn(r, g, 1, d, generator=gen).to(dtype)
    k, v = torch.randn(2, r, L + 3, d, generator=gen).to(dtype)[:, :, :L]
    mask = torch.rand(r, 1, 1, L, generator=gen) > 0.25
    mask[..., 0] = True
    together = attend.attention(q, k, v, mask, 0.125)
    alone = [attend.attention(q[:, h:h + 1].contiguous(), k, v, mask, 0.125) for h in range(g)]
    assert together is not None and all(a is not None for a in alone)
    assert torch.equal(together, torch.cat(alone, 1))
    got = attend.attention_lse(q, k, v, mask, 0.125)
    each = [attend.attention_lse(q[:, h:h + 1].contiguous(), k, v, mask, 0.125) for h in range(g)]
    assert got is not None and all(e is not None for e in each)
    assert torch.equal(got[0], torch.cat([e[0] for e in each], 1))
    assert torch.equal(got[1], torch.cat([e[1] for e in each], 1))


def test_native_attention_declines_other_layouts() -> None:
    _native_library()
    q, k, v = torch.randn(4, 2, 1, 64), torch.randn(4, 10, 64), torch.randn(4, 10, 64)
    mask = torch.ones(4, 1, 1, 10, dtype=torch.bool)
    assert attend.attention(q, k, v, mask, 0.125) is not None
    assert attend.attention(q, k[..., ::2].repeat(1, 1, 2), v, mask, 0.125) is not None
    assert attend.attention(q, torch.randn(4, 64, 10).transpose(1, 2), v, mask, 0.125) is None  # d strided
    assert attend.attention(q.bfloat16(), k, v, mask, 0.125) is None  # dtypes mixed
    assert attend.attention(q.double(), k.double(), v.double(), mask, 0.125) is None  # float64
    assert attend.attention(torch.randn(4, 2, 3, 64), k, v, mask, 0.125) is None  # prefill-shaped q
    assert attend.attention(torch.randn(4, 2, 1, 20), k[..., :20], v[..., :20], mask, 0.125) is None


def _packed_cache(r: int, L: int, d: int, dtype: torch.dtype, bits: int, group: int, layout: str,
                  gen: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A compressed cache's first L positions as the engine holds them (memory/quant.py's layout
    in a buffer of L + 4 slots, row-major, or position-major as a staged disk chunk): the parts
    (codes, mins, scales) as (rows, L, ...) views, and the expansion of those positions."""
    from flexgen_dist.memory.quant import dequantize, quantize

    x = torch.randn(r, L + 4, d, generator=gen).to(dtype)
    if layout == "row-major":
        q = quantize(x, bits, group, -1)
        parts = tuple(p[:, :L] for p in (q.data, q.mins, q.scales))
    else:
        q = quantize(x.transpose(0, 1).contiguous(), bits, group, -1)
        parts = tuple(p[:L].transpose(0, 1) for p in (q.data, q.mins, q.scales))
    full = dequantize(q)
    return parts, full[:, :L] if layout == "row-major" else full.transpose(0, 1)[:, :L]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout", ["row-major", "position-major"])
@pytest.mark.parametrize("g,d,L,group", [(1, 64, 1, 64), (3, 64, 37, 64), (4, 128, 50, 64), (5, 80, 23, 16),
                                         (7, 128, 16, 128), (2, 48, 19, 16), (2, 16, 9, 64), (3, 128, 21, 32),
                                         (3, 96, 13, 48), (3, 48, 11, 64)])
def test_native_packed_attention_equals_attention_over_the_expanded_cache(dtype: torch.dtype, bits: int,
                                                                         layout: str, g: int, d: int, L: int,
                                                                         group: int) -> None:
    """Attention read straight from a compressed cache's codes expands each value as the
    expansion does (code * scale + min in float32, rounded to the dtype) and then runs the dense
    kernel's arithmetic: the output, its log-sum-exps and the sinks' softmax are bit for bit those
    over the expanded cache, in every dtype, for 4- and 8-bit codes (4-bit ones through a table of
    the group's 16 values on AVX-512), groups of one or several vectors (and wider than the head,
    padded; value tiles narrowed to fit a group), both cache layouts."""
    _native_library()
    gen = torch.Generator().manual_seed(g * 1000 + d + L + bits)
    r = 6
    (kp, kd), (vp, vd) = (_packed_cache(r, L, d, dtype, bits, group, layout, gen) for _ in range(2))
    q = torch.randn(r, g, 1, d, generator=gen).to(dtype)
    mask = torch.rand(r, 1, 1, L, generator=gen) > 0.3
    mask[..., 0] = True
    sinks = torch.randn(r, g, generator=gen)
    for s in (None, sinks):
        got = attend.attention_packed(q, kp, vp, bits, group, mask, 0.125, s)
        want = attend.attention(q, kd, vd, mask, 0.125, s)
        assert got is not None and got[1] is None and want is not None
        assert got[0].dtype == dtype and torch.equal(got[0], want)
    got = attend.attention_packed(q, kp, vp, bits, group, mask, 0.125, with_lse=True)
    want = attend.attention_lse(q, kd, vd, mask, 0.125)
    assert got is not None and want is not None and got[1] is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_native_packed_attention_declines_what_it_cannot_read() -> None:
    """None (the caller expands the cache) for codes it does not take: other bits, groups that
    split a vector, group data in another dtype than q's, a prefill-shaped q."""
    _native_library()
    gen = torch.Generator().manual_seed(3)
    kp, _ = _packed_cache(4, 10, 64, torch.float32, 4, 64, "row-major", gen)
    q = torch.randn(4, 2, 1, 64, generator=gen)
    mask = torch.ones(4, 1, 1, 10, dtype=torch.bool)
    assert attend.attention_packed(q, kp, kp, 4, 64, mask, 0.125) is not None
    assert attend.attention_packed(q, kp, kp, 2, 64, mask, 0.125) is None  # 2-bit codes
    k4, _ = _packed_cache(4, 10, 64, torch.float32, 4, 4, "row-major", gen)
    assert attend.attention_packed(q, k4, k4, 4, 4, mask, 0.125) is None  # groups of 4 split a vector
    assert attend.attention_packed(q.bfloat16(), kp, kp, 4, 64, mask, 0.125) is None  # float32 groups
    assert attend.attention_packed(torch.randn(4, 2, 3, 64), kp, kp, 4, 64, mask, 0.125) is None


@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 1, 576), (2, 7, 33), (4096, 24)])
def test_native_rms_norm_matches_reference(shape: tuple[int, ...]) -> None:
    _native_library()
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    out = kernels.rms_norm(x, w, 1e-5)
    assert out is not None and out.shape == x.shape
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    strided = torch.randn(6, 80, generator=g)[:, 8:72]  # rows 80 apart
    torch.testing.assert_close(kernels.rms_norm(strided, torch.ones(64), 1e-6),
                               strided * torch.rsqrt(strided.pow(2).mean(-1, keepdim=True) + 1e-6),
                               rtol=1e-5, atol=1e-5)
    assert kernels.rms_norm(x, w.bfloat16(), 1e-5) is None  # a weight of another dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 64), (1, 1, 576), (2, 7, 33), (64, 1, 576), (5, 4096)])
def test_native_half_rms_norm_matches_the_reference_rounding(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Normalised in float32, rounded, then times the weight in the dtype (common.rms_norm's
    torch path): equal but for a last-bit difference where the float32 normaliser's own last
    bit moves a value across a rounding boundary (rsqrt against 1 / sqrt)."""
    _native_library()
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    out = kernels.rms_norm(x, w, 1e-5)
    assert out is not None and out.shape == x.shape and out.dtype == dtype
    ref = w * F.rms_norm(x.float(), (shape[-1],), None, 1e-5).to(dtype)
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert bool(((out.float() - ref.float()).abs() <= ref.float().abs() * step * 1.01).all())
    assert (out != ref).float().mean().item() < 0.01
    strided = (torch.randn(6, 80, generator=g)[:, 8:72]).to(dtype)  # rows 80 apart
    one = torch.ones(64, dtype=dtype)
    torch.testing.assert_close(kernels.rms_norm(strided, one, 1e-6),
                               one * F.rms_norm(strided.float(), (64,), None, 1e-6).to(dtype), rtol=step, atol=step)
    assert kernels.rms_norm(x.double(), w.double(), 1e-5) is None  # a dtype the kernels do not take
    assert kernels.rms_norm(x, w.float(), 1e-5) is None  # weight of another dtype


def test_native_linear_adds_the_residual_as_linear_then_add() -> None:
    _native_library()
    g = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(5, 1, 40, generator=g), torch.randn(30, 40, generator=g), torch.randn(30, generator=g)
    res = torch.randn(5, 1, 30, generator=g)
    out = kernels.linear_f32(x, w, b, res)
    assert out is not None
    torch.testing.assert_close(out, F.linear(x, w, b) + res, rtol=1e-5, atol=1e-4)
    assert kernels.linear_f32(x, w, b, res.transpose(0, 1)) is None  # a residual of another shape


@pytest.mark.parametrize("n", [7, 64, 100_003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_silu_mul_matches_torch(n: int, dtype: torch.dtype) -> None:
    """float32 to float32's rounding; a half dtype as torch rounds ``silu(g) * u`` there (silu
    rounded, then the product), but for a last-bit difference where the two exp functions'
    last float32 bit moves silu across a rounding boundary."""
    _native_library()
    g = torch.Generator().manual_seed(n)
    gate, up = (torch.randn(n, generator=g) * 6).to(dtype), torch.randn(n, generator=g).to(dtype)
    ref = F.silu(gate) * up
    assert kernels.silu_mul(gate, up)
    if dtype == torch.float32:
        torch.testing.assert_close(gate, ref, rtol=1e-6, atol=1e-6)
    else:
        step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
        assert bool(((gate.float() - ref.float()).abs() <= ref.float().abs() * step * 1.01 + 1e-6).all())
        assert (gate != ref).float().mean().item() < 0.01
    assert not kernels.silu_mul(gate, up.float() if dtype != torch.float32 else up.bfloat16())  # mixed dtypes
    assert not kernels.silu_mul(gate[::2], up[::2])  # not contiguous


@pytest.mark.parametrize("d", [64, 8, 40])
def test_native_rope_equals_rotate_half_formula(d: int) -> None:
    _native_library()
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, 5, 4, d, generator=g)
    pos = torch.arange(5).expand(3, 5) + torch.tensor([[0], [2], [7]])
    cos, sin = common.rope_cos_sin(pos, d, 10000.0, torch.float32)
    ref = x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1) * sin
    out = kernels.rope(x, cos, sin)
    assert out is not None
    assert torch.equal(out, ref)  # the same two roundings per element as the formula
    assert kernels.rope(x.transpose(1, 2), cos, sin) is None


@pytest.mark.parametrize("d", [64, 8, 40, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_half_rope_rounds_as_the_torch_path(d: int, dtype: torch.dtype) -> None:
    """A half dtype as apply_rope's torch path rounds it (x * cos rounded, then each half's
    addcmul_ rounded once), but for a last-bit difference where float32 orders differ."""
    _native_library()
    g = torch.Generator().manual_seed(d)
    x = torch.randn(3, 5, 4, d, generator=g).to(dtype)
    pos = torch.arange(5).expand(3, 5) + torch.tensor([[0], [2], [7]])
    cos, sin = common.rope_cos_sin(pos, d, 10000.0, dtype)
    half = d // 2
    ref = x * cos
    ref[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    ref[..., half:].addcmul_(x[..., :half], sin[..., :half])
    out = kernels.rope(x, cos, sin)
    assert out is not None and out.dtype == dtype
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert bool(((out.float() - ref.float()).abs() <= (x.float().abs() * 2) * step * 1.01 + 1e-6).all())
    assert (out != ref).float().mean().item() < 0.01
    assert kernels.rope(x, cos.float(), sin.float()) is None  # tables of another dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape,group", [((64, 256), 64), ((7, 100), 32), ((33, 50), 24), ((3, 5, 64), 16),
                                         ((4, 9, 128), 64),
                                         ((9, 40), 64)])
def test_native_dequant_equals_the_torch_path(monkeypatch, dtype: torch.dtype, bits: int, shape: tuple[int, ...],
                                              group: int) -> None:
    """Bit for bit, in every compute dtype (code * scale + min in float32, then rounded to the
    dtype): every group size (vectorised runs of 16 and scalar tails), a last group cut
    short, leading dims, and strided rows (a cache chunk's slice of positions)."""
    from flexgen_dist.memory.quant import dequantize, quantize

    _native_library()
    g = torch.Generator().manual_seed(bits * 100 + group)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    q = quantize(x, bits, group, dim=-1)
    fast = kernels.dequant(q.data, q.mins, q.scales, shape[-1], group, bits, dtype)
    assert fast is not None and fast.dtype == dtype
    with monkeypatch.context() as m:
        m.setattr(kernels.build, "_state", {"lib": None})  # the torch path
        ref = dequantize(q)
    assert torch.equal(fast, ref) and torch.equal(dequantize(q), ref)
    part = slice(1, shape[0] - 1)  # rows of a bigger tensor: evenly strided, each contiguous
    sub = kernels.dequant(q.data[part], q.mins[part], q.scales[part], shape[-1], group, bits, dtype)
    assert sub is not None and torch.equal(sub, ref[part])
    if len(shape) == 3:  # positions [1, 4) of each row of a cache chunk: two strides per part
        pos = (slice(None), slice(1, 4))
        sub = kernels.dequant(q.data[pos], q.mins[pos], q.scales[pos], shape[-1], group, bits, dtype)
        assert sub is not None and sub.is_contiguous() and torch.equal(sub, ref[pos])
    assert kernels.dequant(q.data, q.mins, q.scales, shape[-1], group, 2, dtype) is None  # 2-bit: torch's
    assert kernels.dequant(q.data, q.mins, q.scales.float().to(torch.float64), shape[-1], group, bits,
                           dtype) is None  # mins and scales of two dtypes
