"""The fused product of packed 4/8-bit weights (kernels.qlinear) and the packed weight the model
math receives (kernels.qweight.QWeight), against expand-then-multiply."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from flexgen_dist import kernels
from flexgen_dist.kernels import qweight
from flexgen_dist.kernels.qweight import QWeight, expand_reference
from flexgen_dist.memory.quant import dequantize, quantize
from flexgen_dist.models import common

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# relative tolerance of a product against the float32 product of the same rounded operands:
# one rounding of the output to the dtype (plus a bias and a residual add, one each)
TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


@pytest.fixture(autouse=True)
def _native() -> None:
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    assert kernels.library() is not None, "g++ is present, so the native kernels must build"


def _packed(n: int, k: int, dtype: torch.dtype, bits: int, group: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.5).to(dtype)
    q = quantize(w, bits, group, dim=1)
    return q, dequantize(q)


def _reference(x, wd, b, r):
    y = F.linear(x.float(), wd.float()).to(x.dtype)
    if b is not None:
        y = y.add_(b)
    return y if r is None else y.add_(r)


# odd shapes: K not a multiple of 32 (a chunk cut short) or of the group; N not a multiple of
# the panel (32) or of the register blocks; groups of 16 (GGUF's Q2_K/Q3_K/Q6_K: a 32-column chunk
# over two groups), 24, 32, 64 and 10; 4 and 8 bits
SHAPES = [(1, 7, 64, 64, 4), (3, 33, 100, 32, 4), (7, 65, 130, 64, 4), (64, 96, 2048, 64, 4),
          (13, 40, 96, 32, 8), (5, 17, 48, 16, 4), (4, 33, 272, 16, 8), (2, 9, 70, 10, 4), (6, 37, 72, 24, 8),
          (19, 70, 200, 64, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group,bits", SHAPES)
def test_fused_product_equals_expand_then_multiply(dtype: torch.dtype, m: int, n: int, k: int, group: int,
                                                   bits: int) -> None:
    q, wd = _packed(n, k, dtype, bits, group, seed=m * 7 + n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    for bias, res in [(None, None), (b, None), (b, r), (None, r)]:
        ref = _reference(x, wd, bias, res)
        paths = [True, False] if dtype == torch.bfloat16 else [True]  # native bf16 product and widened
        for native in paths:
            y = kernels.qlinear(x, q.data, q.mins, q.scales, n, group, bits, bias, res, native_bf16=native)
            assert y is not None and y.dtype == dtype and y.shape == (m, n)
            err = (y.float() - ref.float()).abs().max().item()
            assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), (native, bias is None, err)
    if dtype == torch.float32:  # bit for bit what expanding then the native few-row GEMM give
        assert torch.equal(kernels.qlinear(x, q.data, q.mins, q.scales, n, group, bits, b, r),
                           kernels.linear_f32(x, wd, b, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_product_is_the_same_at_any_thread_count(dtype: torch.dtype) -> None:
    """Each output is summed by one thread in a fixed order: 1 and 2 threads agree to the bit."""
    q, _ = _packed(200, 520, dtype, 4, 64, seed=3)
    x = torch.randn(24, 520).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.qlinear(x, q.data, q.mins, q.scales, 200, 64, 4)
        torch.set_num_threads(2)
        two = kernels.qlinear(x, q.data, q.mins, q.scales, 200, 64, 4)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_fused_product_reads_strided_rows_and_declines_what_it_cannot_take() -> None:
    q, wd = _packed(40, 128, torch.bfloat16, 4, 64, seed=1)
    big = torch.randn(6, 256).bfloat16()
    x = big[:, :128]  # rows 256 apart, each contiguous
    y = kernels.qlinear(x, q.data, q.mins, q.scales, 40, 64, 4)
    assert y is not None and torch.equal(y, kernels.qlinear(x.contiguous(), q.data, q.mins, q.scales, 40, 64, 4))
    assert kernels.qlinear(big[:, ::2], q.data, q.mins, q.scales, 40, 64, 4) is None  # columns not contiguous
    assert kernels.qlinear(x.double(), q.data, q.mins, q.scales, 40, 64, 4) is None  # float64
    assert kernels.qlinear(x, q.data, q.mins, q.scales, 40, 64, 2) is None  # 2-bit codes
    assert kernels.qlinear(x, q.data, q.mins, q.scales, 41, 64, 4) is None  # rows that are not there
    assert kernels.qlinear(x, q.data, q.mins, q.scales, 40, 64, 4, b=torch.zeros(40)) is None  # bias dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_weight_expands_gathers_and_multiplies_as_the_dense_one(dtype: torch.dtype) -> None:
    q, wd = _packed(50, 96, dtype, 4, 32, seed=5)
    buf = torch.empty(50, 96, dtype=dtype)
    w = QWeight(q.data, q.mins, q.scales, (50, 96), 32, 4, dtype, buf)
    assert w.dense() is buf and torch.equal(buf, wd)
    assert torch.equal(expand_reference(q.data, q.mins, q.scales, 96, 32, 4, dtype), wd)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(common.embedding(ids, w), F.embedding(ids, wd))
    few = torch.randn(2, 3, 96).to(dtype)  # 6 rows: the fused product
    many = torch.randn(2, qweight.FUSED_MAX_ROWS, 96).to(dtype)  # 128 rows: expanded, then the BLAS
    for x in (few, many):
        y = common.linear(x, w)
        ref = common.linear(x, wd)
        assert y.shape == ref.shape
        assert (y.float() - ref.float()).abs().max().item() <= TOL[dtype] * max(1.0, ref.float().abs().max().item())
    assert torch.equal(common.linear(many, w), common.linear(many, wd))  # the same dense product


def test_expansion_without_the_native_kernels_is_the_reference(monkeypatch) -> None:
    q, wd = _packed(20, 64, torch.bfloat16, 4, 64, seed=9)
    w = QWeight(q.data, q.mins, q.scales, (20, 64), 64, 4, torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    monkeypatch.setattr(kernels.build, "_state", {"lib": None})
    assert torch.equal(w.dense(), wd)
    assert torch.equal(common.linear(x, w), common.linear(x, wd))


# the 4-bit table formats (bitsandbytes' NF4/FP4, llama.cpp's IQ4 values): odd shapes as above
TABLE_SHAPES = [(1, 33, 272, 32), (5, 17, 64, 64), (13, 40, 96, 16), (3, 8, 100, 32)]


@pytest.mark.parametrize("fmt", ["nf4", "fp4", "iq4nl"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group", TABLE_SHAPES)
def test_a_table_format_multiplies_and_expands_as_its_reference(fmt: str, dtype: torch.dtype, m: int, n: int, k: int,
                                                                group: int) -> None:
    """A 4-bit table format's codes (each code its table entry times the group's float32
    scale, no mins): the one-pass expansion equals the torch reference bit for bit, the fused
    product equals expanding then multiplying (bit for bit in float32, within one rounding of
    the output in the half dtypes, on both bfloat16 paths), and ``QWeight`` routes both."""
    from flexgen_dist.kernels.qweight import expand_table_reference
    from flexgen_dist.memory.quant import QTensor, _pack, lut4_table

    g = torch.Generator().manual_seed(m * 31 + k)
    groups = -(-k // group)
    codes = _pack(torch.randint(0, 16, (n, groups * group), generator=g, dtype=torch.uint8), 4)
    scales = torch.randn(n, groups, generator=g)
    table = lut4_table(fmt)
    wd = expand_table_reference(codes, scales, table, k, group, dtype)
    assert torch.equal(kernels.dequant_lut4(codes, scales, table, k, group, dtype), wd)
    q = QTensor(codes, torch.empty(n, 0), scales, torch.Size((n, k)), dtype, 1, group, 4, fmt)
    assert torch.equal(dequantize(q), wd)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    ref = _reference(x, wd, b, None)
    for native in ([True, False] if dtype == torch.bfloat16 else [True]):
        y = kernels.qlinear(x, codes, scales, scales, n, group, 4, b, native_bf16=native, table=table)
        assert y is not None and y.dtype == dtype
        err = (y.float() - ref.float()).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), (native, err)
    if dtype == torch.float32:
        assert torch.equal(kernels.qlinear(x, codes, scales, scales, n, group, 4, b, table=table),
                           kernels.linear_f32(x, wd, b))
    w = QWeight(codes, torch.empty(n, 0), scales, (n, k), group, 4, dtype, table=table)
    assert torch.equal(w.dense(), wd) and torch.equal(w.rows(torch.tensor([[2, 0]])), wd[[2, 0]].view(1, 2, k))
    fused = w.linear(x, b)
    assert fused is not None and torch.equal(fused, kernels.qlinear(x, codes, scales, scales, n, group, 4, b,
                                                                    table=table))


@pytest.mark.gpu
def test_a_table_format_on_the_gpu_expands_to_the_cpu_values(gpu_device) -> None:
    """A 4-bit table format's codes copied to the compute device expand (the Triton one-pass
    kernel) to exactly the CPU's values in every compute dtype, and its weight's fused product
    is within the dtype's rounding of expanding then multiplying."""
    from flexgen_dist.memory.quant import QTensor, _pack, lut4_table

    g = torch.Generator().manual_seed(2)
    codes = _pack(torch.randint(0, 16, (48, 128), generator=g, dtype=torch.uint8), 4)
    scales = torch.randn(48, 4, generator=g)
    for fmt in ("nf4", "iq4nl"):
        for dtype in DTYPES:
            q = QTensor(codes, torch.empty(48, 0), scales, torch.Size((48, 128)), dtype, 1, 32, 4, fmt)
            cpu = dequantize(q)
            dev = dequantize(q, gpu_device)
            assert dev.device.type == gpu_device.type and torch.equal(dev.cpu(), cpu)
            w = QWeight(codes.to(gpu_device), torch.empty(48, 0, device=gpu_device), scales.to(gpu_device), (48, 128),
                        32, 4, dtype, table=lut4_table(fmt, gpu_device))
            x = torch.randn(2, 128, device=gpu_device).to(dtype)
            fused = w.linear(x)  # the Triton product on a GPU (the CPU's on the stand-in)
            ref = F.linear(x.float(), cpu.to(gpu_device).float())
            assert fused is not None and ((fused.float() - ref).norm() / ref.norm()).item() < TOL[dtype] * 4
            assert torch.equal(w.dense().cpu(), cpu)
