"""The model's small kernels against their textbook definitions: rotary, RMSNorm, linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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


@pytest.fixture
def fresh_gemm_tuner(monkeypatch):
    monkeypatch.setattr(common, "_GEMM_TUNE", True)
    monkeypatch.setattr(common, "_GEMM_CHOICE", {})
    monkeypatch.setattr(common, "_GEMM_TRIALS", {})


@pytest.mark.parametrize("rows", [1, 6, 32, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_through_tuning(fresh_gemm_tuner, rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 24, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(rows, 1, 24, generator=g)
    ref = F.linear(x, w, b)
    for _ in range(2 * common._GEMM_TRIAL_CALLS + 2):  # trials of both forms, then the choice
        out = common.linear(x, w, b)
        assert out.shape == ref.shape and out.is_contiguous()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    key = (rows, 48, 24, torch.float32)
    if rows <= common._GEMM_TUNE_MAX_ROWS:
        assert key in common._GEMM_CHOICE and key not in common._GEMM_TRIALS
    else:
        assert not common._GEMM_CHOICE and not common._GEMM_TRIALS  # big GEMMs are not tuned


def test_linear_accepts_strided_input(fresh_gemm_tuner) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 8, generator=g)
    x = torch.randn(8, 4, generator=g).t()  # (4, 8), not contiguous
    for _ in range(2 * common._GEMM_TRIAL_CALLS + 1):
        torch.testing.assert_close(common.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_linear_tuning_can_be_switched_off(fresh_gemm_tuner, monkeypatch) -> None:
    monkeypatch.setattr(common, "_GEMM_TUNE", False)
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    for _ in range(10):
        torch.testing.assert_close(common.linear(x, w), F.linear(x, w))
    assert not common._GEMM_CHOICE and not common._GEMM_TRIALS
