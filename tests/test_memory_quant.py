"""Group-wise min-max quantization: error bound, layout, padding, packing, constant groups."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_dist.memory.quant import (QTensor, dequantize, empty_qtensor, qtensor_layout,
                                       quantize)
from flexgen_dist.memory.tiers import copy_between


def _assert_error_bound(x: torch.Tensor, q: QTensor, group_size: int, dim: int) -> None:
    """Per group: max |x - deq(q(x))| <= (max - min) / (2^bits - 1) / 2 + dtype rounding."""
    y = dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    xf, yf = x.float().movedim(dim, -1), y.float().movedim(dim, -1)
    eps = torch.finfo(x.dtype).eps
    n = xf.shape[-1]
    for j in range(0, n, group_size):  # the last group may be short: padded by quantize
        g, h = xf[..., j:j + group_size], yf[..., j:j + group_size]
        err = (h - g).abs().amax(-1)
        half_step = (g.amax(-1) - g.amin(-1)) / (2 ** q.bits - 1) / 2
        # Rounding of the stored min/scale and of the output dtype: a few ulps of the values.
        slack = 2 * eps * g.abs().amax(-1) + 1e-7
        assert torch.all(err <= half_step + slack), (
            f"group {j // group_size}: error {(err - half_step).max().item():.3g} over bound")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_bound_per_group(dtype: torch.dtype, bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(3, 5, 128, generator=g) * 3 + 1.5).to(dtype)
    q = quantize(x, bits=bits, group_size=64)
    _assert_error_bound(x, q, 64, -1)


def test_eight_bit_is_tighter_than_four_bit() -> None:
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    e4 = (dequantize(quantize(x, bits=4)) - x).abs().max().item()
    e8 = (dequantize(quantize(x, bits=8)) - x).abs().max().item()
    assert e8 < e4 / 8  # 255 vs 15 levels


@pytest.mark.parametrize("shape,group_size,dim", [
    ((4, 130), 64, -1),   # 130 = 2 groups + 2 leftover elements
    ((2, 3, 5), 64, -1),  # fewer elements than one group
    ((7, 9), 4, 0),       # grouped along dim 0: 7 rows -> 2 groups of 4
    ((3, 33, 6), 8, 1),   # middle dim
    ((5, 11), 5, -1),     # odd group size: 4-bit codes do not pair up within a group
])
def test_odd_sizes_with_padding(shape: tuple[int, ...], group_size: int, dim: int) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 2
    for bits in (4, 8):
        q = quantize(x, bits=bits, group_size=group_size, dim=dim)
        data_shape, meta_shape = qtensor_layout(shape, bits, group_size, dim)
        assert q.data.shape == data_shape and q.mins.shape == meta_shape
        assert q.data.dtype == torch.uint8 and q.mins.dtype == x.dtype
        _assert_error_bound(x, q, group_size, dim)


def test_layout_keeps_leading_dims_for_dim_last() -> None:
    x = torch.randn(6, 10, 96)  # (rows, seq, head_dim) as in a KV cache
    q = quantize(x, bits=4, group_size=64, dim=-1)
    num_groups = math.ceil(96 / 64)
    assert q.data.shape == (6, 10, num_groups * 64 // 2)
    assert q.mins.shape == q.scales.shape == (6, 10, num_groups)
    assert q.shape == x.shape and q.dim == 2


def test_constant_tensors_do_not_produce_nan() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for value in (0.0, 3.25, -7.5):
            x = torch.full((4, 100), value, dtype=dtype)
            q = quantize(x, bits=4, group_size=64)
            assert not torch.isnan(q.scales.float()).any()
            y = dequantize(q)
            assert not torch.isnan(y.float()).any()
            assert torch.equal(y, x)
    # One constant group next to a varying one.
    x = torch.cat([torch.ones(2, 64), torch.randn(2, 64)], dim=1)
    y = dequantize(quantize(x, bits=4, group_size=64))
    assert torch.equal(y[:, :64], x[:, :64])


def test_extremes_are_reconstructed_closely() -> None:
    # min maps to code 0 and max to the top code: both ends come back (nearly) exactly.
    x = torch.linspace(-1.0, 1.0, 64).reshape(1, 64)
    y = dequantize(quantize(x, bits=4, group_size=64))
    assert abs(y[0, 0].item() + 1.0) < 1e-6
    assert abs(y[0, -1].item() - 1.0) < 1e-6


def test_four_bit_nbytes_is_a_quarter_of_fp16_plus_metadata() -> None:
    x = torch.randn(1024, 1024).half()
    q = quantize(x, bits=4, group_size=64)
    meta = 2 * (1024 * 1024 // 64) * 2  # mins + scales, fp16 each
    assert q.nbytes == 1024 * 1024 // 2 + meta
    dense = x.numel() * x.element_size()
    assert 0.25 < q.nbytes / dense < 0.3
    q8 = quantize(x, bits=8, group_size=64)
    assert q8.nbytes == 1024 * 1024 + meta


def test_packing_is_two_codes_per_byte_low_nibble_first() -> None:
    # Codes 0..15 in one group of 16: min 0, scale 1.
    x = torch.arange(16, dtype=torch.float32).reshape(1, 16)
    q = quantize(x, bits=4, group_size=16)
    assert q.data.tolist() == [[(2 * i) | ((2 * i + 1) << 4) for i in range(8)]]
    assert torch.equal(dequantize(q), x)


def test_empty_qtensor_filled_by_row_slices_matches_whole_quantization() -> None:
    x = torch.randn(8, 12, 40, generator=torch.Generator().manual_seed(3)).half()
    cache = empty_qtensor(x.shape, x.dtype, bits=4, group_size=16, dim=-1)
    assert torch.equal(dequantize(cache), torch.zeros_like(x))  # zeros, never NaN
    for r0, r1 in ((0, 3), (3, 8)):
        copy_between(cache, quantize(x[r0:r1], bits=4, group_size=16), dst_rows=(r0, r1))
    whole = quantize(x, bits=4, group_size=16)
    for got, want in zip(cache.parts(), whole.parts()):
        assert torch.equal(got, want)


def test_to_and_pin_keep_contents() -> None:
    x = torch.randn(4, 64)
    q = quantize(x)
    for moved in (q.to("cpu"), q.pin()):
        assert torch.equal(dequantize(moved), dequantize(q))
    assert dequantize(q, device="cpu").device.type == "cpu"


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="bits=3"):
        quantize(torch.randn(4, 8), bits=3)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.arange(8).reshape(2, 4))
    with pytest.raises(ValueError, match="dim=2"):
        quantize(torch.randn(4, 8), dim=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape,group_size", [((7, 64), 64), ((3, 5, 80), 64), ((4, 1, 16), 64), ((6, 33), 16),
                                              ((2, 3, 128), 32), ((5, 7), 3), ((9, 100), 48)])
def test_native_quantization_equals_the_reference(dtype: torch.dtype, bits: int, shape: tuple[int, ...],
                                                 group_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU ``quantize`` along the last dim runs the native one-pass kernel where it can;
    its codes (padding included), minimums and scales are bit for bit torch's reference path's,
    with repeated values, a constant row (scale 0) and a strided input among them."""
    import shutil

    from flexgen_dist import kernels

    if shutil.which("g++") is None or kernels.library() is None:
        pytest.skip("no native kernels here: quantize runs torch's path only")
    gen = torch.Generator().manual_seed(bits * 100 + shape[-1])
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    x[..., :2] = 0.5
    x[0] = 1.25
    strided = torch.randn(shape[-1], 3, generator=gen).to(dtype).t()[:, None].expand(3, 2, shape[-1])
    for t in (x, x.transpose(0, -2) if x.dim() > 2 else x, strided[..., :shape[-1]]):
        assert kernels.quant(t, bits, group_size) is not None
        native = quantize(t, bits, group_size)
        with monkeypatch.context() as m:
            m.setattr(kernels, "quant", lambda *a, **kw: None)
            ref = quantize(t, bits, group_size)
        for a, b in ((native.data, ref.data), (native.mins, ref.mins), (native.scales, ref.scales)):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
