"""The GPU's fused 4/8-bit product (``kernels/qlinear_gpu.py``, a Triton kernel) against the
reference: expand the codes (``expand_reference``), then ``F.linear`` (+ residual).

On a machine without a GPU the same kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``,
CPU tensors) in a process of its own, so the kernel's indexing, unpacking, masking and epilogue
are checked everywhere; on a GPU it runs compiled (marked ``gpu``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")

# (rows, out, in, group, bits): odd rows and features, a last group cut short, one row, the
# largest fused row count, the GGUF group of 32 and a group larger than BLOCK_K's 128
SHAPES = [(1, 40, 96, 32, 4), (3, 100, 200, 64, 4), (17, 64, 130, 32, 8), (64, 33, 256, 128, 4),
          (5, 48, 512, 256, 4), (8, 80, 64, 16, 8)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _case(m: int, n: int, k: int, group: int, bits: int, dtype: torch.dtype, device: torch.device, bias: bool,
          residual: bool, seed: int, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    from flexgen_dist.kernels import qlinear_gpu
    from flexgen_dist.kernels.qweight import expand_reference
    from flexgen_dist.memory.quant import quantize

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.2).to(dtype)
    q = quantize(w, bits, group, dim=1)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    r = torch.randn(m, n, generator=g).to(dtype).to(device) if residual else None
    codes, mins, scales = (t.to(device) for t in (q.data, q.mins, q.scales))
    y = qlinear_gpu.qlinear(x, codes, mins, scales, n, group, bits, b, r, tiles=tiles)
    assert y is not None, f"the fused kernel refused a layout it should take {qlinear_gpu._failed[:1]}"
    dense = expand_reference(codes, mins, scales, k, group, bits, dtype)
    ref = torch.nn.functional.linear(x.float(), dense.float(), None if b is None else b.float())
    if r is not None:
        ref = (ref.to(dtype).float() + r.float())
    return y, ref


# other tilings, split-K among them (the partial sums finished in torch), on every shape
TILES = ["32:128:2", "16:64:3:4:2", "64:256:4:8:4"]


# (lead shape, cols, group, bits): a weight, a KV cache chunk (rows, positions, head_dim), a
# last group cut short, 8-bit codes, one row
DEQUANT = [((40,), 200, 64, 4), ((3, 5), 128, 64, 4), ((7,), 100, 32, 8), ((2, 3, 4), 64, 64, 4), ((1,), 33, 16, 4)]


def check_dequant(device: torch.device) -> int:
    """The one-pass expansion equals the reference bit for bit, in every dtype, with and
    without ``out``; returns the number of expansions checked."""
    from flexgen_dist.kernels import qlinear_gpu
    from flexgen_dist.kernels.qweight import expand_reference
    from flexgen_dist.memory.quant import quantize

    n_checked = 0
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [torch.float16])
    for i, (lead, cols, group, bits) in enumerate(DEQUANT):
        for dtype in dtypes:
            g = torch.Generator().manual_seed(i)
            q = quantize((torch.randn(*lead, cols, generator=g) * 3).to(dtype), bits, group, dim=-1)
            codes, mins, scales = (t.to(device) for t in (q.data, q.mins, q.scales))
            ref = expand_reference(codes, mins, scales, cols, group, bits, dtype)
            y = qlinear_gpu.dequant(codes, mins, scales, cols, group, bits, dtype)
            assert y is not None, f"the expansion refused a layout it should take {qlinear_gpu._failed[:1]}"
            assert y.shape == ref.shape and y.dtype == dtype
            assert torch.equal(y, ref), f"{(lead, cols, group, bits, dtype)}: differs from the reference"
            out = torch.full_like(ref, float("nan"))
            assert qlinear_gpu.dequant(codes, mins, scales, cols, group, bits, dtype, out) is out
            assert torch.equal(out, ref)
            n_checked += 1
    return n_checked


# (rows, out, in, group, table format): the 4-bit table formats' products and expansions
TABLE_CASES = [(1, 40, 96, 32, "nf4"), (5, 48, 200, 64, "iq4nl"), (3, 33, 64, 32, "mxfp4")]


def check_tables(device: torch.device) -> int:
    """A 4-bit table format (each code its table entry times a float32 scale, no mins): the
    one-pass expansion equals the torch reference bit for bit and the product is within the
    dtype's tolerance of expand-then-multiply, in float32 and bfloat16; returns the number checked."""
    from flexgen_dist.kernels import qlinear_gpu
    from flexgen_dist.kernels.qweight import expand_table_reference
    from flexgen_dist.memory.quant import _pack, lut4_table

    n_checked = 0
    for i, (m, n, k, group, fmt) in enumerate(TABLE_CASES):
        g = torch.Generator().manual_seed(40 + i)
        groups = -(-k // group)
        codes = _pack(torch.randint(0, 16, (n, groups * group), generator=g, dtype=torch.uint8), 4).to(device)
        scales = (torch.rand(n, groups, generator=g) * 0.1).to(device)
        table = lut4_table(fmt, device)
        for dtype in (torch.float32, torch.bfloat16):
            ref_w = expand_table_reference(codes, scales, table, k, group, dtype)
            w = qlinear_gpu.dequant(codes, scales, scales, k, group, 4, dtype, table=table)
            assert w is not None and torch.equal(w, ref_w), f"{(n, k, group, fmt, dtype)}: expansion differs"
            x = torch.randn(m, k, generator=g).to(dtype).to(device)
            y = qlinear_gpu.qlinear(x, codes, scales, scales, n, group, 4, table=table)
            assert y is not None, f"the fused kernel refused a table format {qlinear_gpu._failed[:1]}"
            ref = torch.nn.functional.linear(x.float(), ref_w.float())
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < TOL[dtype], f"{(m, n, k, group, fmt, dtype)}: relative error {err:.2e}"
            n_checked += 1
    return n_checked


def check_all(device: torch.device) -> int:
    """Every shape, dtype and epilogue with the default tiling, and every shape with the
    ``TILES`` in one dtype; returns the number of products checked."""
    from flexgen_dist.kernels.qlinear_gpu import Tiles

    n_checked = 0
    for i, (m, n, k, group, bits) in enumerate(SHAPES):
        for j, text in enumerate(TILES):
            bias, residual = j % 2 == 0, j == 1
            y, ref = _case(m, n, k, group, bits, torch.float32, device, bias, residual, seed=7 + i,
                           tiles=Tiles.parse(text))
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < TOL[torch.float32], f"{(m, n, k, group, bits, text)}: relative error {err:.2e}"
            n_checked += 1
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
    for i, (m, n, k, group, bits) in enumerate(SHAPES):
        for dtype in dtypes:
            for bias, residual in ((False, False), (True, False), (True, True)):
                y, ref = _case(m, n, k, group, bits, dtype, device, bias, residual, seed=100 * i + n_checked)
                assert y.shape == (m, n) and y.dtype == dtype and y.device.type == device.type
                assert torch.isfinite(y).all()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                assert err < TOL[dtype], f"{(m, n, k, group, bits, dtype, bias, residual)}: relative error {err:.2e}"
                n_checked += 1
    return n_checked


def test_the_kernel_in_the_interpreter_matches_the_reference() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"checked {len(SHAPES) * (2 * 3 + len(TILES))} products" in r.stdout
    assert f"checked {len(DEQUANT) * 3} expansions" in r.stdout
    assert f"checked {len(TABLE_CASES) * 2} table formats" in r.stdout


def test_what_the_kernel_does_not_take_is_left_to_the_expansion() -> None:
    from flexgen_dist.kernels import qlinear_gpu
    from flexgen_dist.memory.quant import quantize

    q = quantize(torch.randn(32, 96), 4, 32, dim=1)
    x = torch.randn(2, 96)
    assert qlinear_gpu.qlinear(x, q.data, q.mins, q.scales, 32, 32, 4) is None  # CPU tensors, compiled mode
    big = torch.randn(qlinear_gpu.MAX_ROWS + 1, 96)
    assert qlinear_gpu.qlinear(big, q.data, q.mins, q.scales, 32, 32, 4) is None
    q2 = quantize(torch.randn(32, 96), 2, 32, dim=1)
    assert qlinear_gpu.qlinear(x, q2.data, q2.mins, q2.scales, 32, 32, 2) is None
    with pytest.raises(ValueError, match="BN:BK:SPLIT"):
        qlinear_gpu.Tiles.parse("48:128:1")


def test_a_kernel_that_cannot_run_here_is_left_once_with_a_warning(monkeypatch, caplog) -> None:
    """A GPU or Triton build a kernel does not compile for: one warning, then torch's path."""
    from flexgen_dist.kernels import qlinear_gpu

    class Broken:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def run(*args, **kw) -> None:  # noqa: ANN002, ANN003
                raise RuntimeError("no such instruction on this GPU\n(details)")
            return run

    monkeypatch.setattr(qlinear_gpu, "_failed", [])
    with caplog.at_level("WARNING", logger="flexgen_dist"):
        assert qlinear_gpu._launch(Broken(), (1,), 0) is False
        assert qlinear_gpu._launch(Broken(), (1,), 0) is False
    warned = [r.getMessage() for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(warned) == 1 and "no such instruction on this GPU" in warned[0] and "details" not in warned[0]
    assert not qlinear_gpu.available()


def test_a_tiling_too_large_for_the_gpu_is_fitted_not_abandoned(monkeypatch, caplog) -> None:
    """A tiling that needs more shared memory than the GPU has (seen on an H100: float32 rows at
    64:256:4:8:4 asked 283 KiB of 227) takes fewer stages, then a shorter input step, keeps the
    fitted tiling for that launch shape, and leaves the kernel on for every other product; where
    nothing fits, that product alone expands (None), with one warning."""
    from types import SimpleNamespace

    from flexgen_dist.kernels import qlinear_gpu
    from flexgen_dist.memory.quant import quantize

    class OutOfResources(Exception):  # the name Triton's error has
        pass

    launched: list[tuple[int, int]] = []
    fits = {"stages": 1, "block_k": 64}

    class Kernel:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def run(*args, BLOCK_K, num_stages, **kw) -> None:  # noqa: ANN001, ANN002, ANN003
                launched.append((BLOCK_K, num_stages))
                if num_stages > fits["stages"] or BLOCK_K > fits["block_k"]:
                    raise OutOfResources("out of resource: shared memory, Required: 289792, Hardware limit: 232448")
            return run

    monkeypatch.setattr(qlinear_gpu, "_kernel", lambda: SimpleNamespace(qlinear=Kernel(), dequant=Kernel()))
    monkeypatch.setattr(qlinear_gpu, "_takes", lambda *a: True)
    monkeypatch.setattr(qlinear_gpu, "_failed", [])
    monkeypatch.setattr(qlinear_gpu, "_fitted", {})
    monkeypatch.setattr(qlinear_gpu, "_unfit_logged", set())
    q = quantize(torch.randn(64, 256), 4, 64, dim=1)
    x = torch.randn(8, 256)
    asked = qlinear_gpu.Tiles.parse("64:256:1:8:4")
    y = qlinear_gpu.qlinear(x, q.data, q.mins, q.scales, 64, 64, 4, tiles=asked)
    assert y is not None and y.shape == (8, 64)
    assert launched == [(256, 4), (256, 3), (256, 2), (256, 1), (128, 3), (128, 2), (128, 1), (64, 3), (64, 2),
                        (64, 1)]
    launched.clear()
    assert qlinear_gpu.qlinear(x, q.data, q.mins, q.scales, 64, 64, 4, tiles=asked) is not None
    assert launched == [(64, 1)]  # the fitted tiling, straight away
    assert qlinear_gpu.available() and not qlinear_gpu._failed
    fits["block_k"] = 32  # below one group: nothing fits
    launched.clear()
    with caplog.at_level("WARNING", logger="flexgen_dist"):
        other = qlinear_gpu.Tiles.parse("64:128:1:4:2")
        assert qlinear_gpu.qlinear(x, q.data, q.mins, q.scales, 64, 64, 4, tiles=other) is None
        assert qlinear_gpu.qlinear(x, q.data, q.mins, q.scales, 64, 64, 4, tiles=other) is None
    assert launched == [(128, 2), (128, 1), (64, 3), (64, 2), (64, 1)]  # the second call tries nothing
    warned = [r.getMessage() for r in caplog.records if "no tiling" in r.getMessage()]
    assert len(warned) == 1 and "8 rows" in warned[0]
    assert qlinear_gpu.available()  # the kernel stays on for the products that fit


def _compile(kernel, args: dict[str, str], const: dict, arch: int, **options):  # noqa: ANN001, ANN202
    """Triton's ahead-of-time compile for an NVIDIA GPU of compute capability ``arch`` (no GPU
    needed: Triton brings its own ptxas)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**args, **{n: "constexpr" for n in const}}
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const), target=GPUTarget("cuda", arch, 32),
                          options=options)


@pytest.mark.parametrize("arch", [90, 80])
def test_the_kernels_compile_for_hopper_and_ampere(arch: int) -> None:
    """Both kernels build to GPU code for an H100/H200 (sm_90) and an A100 (sm_80) in every
    dtype, split-K included; the expansion's products are rounded on their own (mul.rn), never
    fused with the add, so it equals the reference bit for bit."""
    from flexgen_dist.kernels import qlinear_gpu

    if "TRITON_INTERPRET" in os.environ:
        pytest.skip("the interpreter compiles nothing")
    k = qlinear_gpu._kernel()
    for dt in ("fp16", "bf16", "fp32"):
        args = dict(zip(["x_ptr", "codes_ptr", "mins_ptr", "scales_ptr", "table_ptr", "b_ptr", "r_ptr", "y_ptr",
                         "part_ptr"], [f"*{dt}", "*u8", f"*{dt}", f"*{dt}", "*fp32", f"*{dt}", f"*{dt}", f"*{dt}", "*fp32"]))
        args.update({n: "i32" for n in ("M", "N", "K", "PACKED", "GROUPS", "K_PER", "stride_xm", "stride_cn",
                                        "stride_gn", "stride_rm", "stride_ym")})
        for split, bits in ((1, 4), (4, 8)):
            const = dict(GROUP=64, BITS=bits, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, HAS_BIAS=True,
                         HAS_RES=True, IEEE=dt == "fp32", WIDEN=False, TABLE=False)
            ptx = _compile(k.qlinear, args, const, arch, num_warps=4, num_stages=3).asm["ptx"]
            assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx)
            if dt != "fp32":  # the tiles' product on the tensor cores; float32's IEEE dot is FMAs
                assert "mma" in ptx and not re.search(r"fma\.rn(\.ftz)?\.f32", ptx)
        dq_args = dict(zip(["codes_ptr", "mins_ptr", "scales_ptr", "table_ptr", "y_ptr"],
                           ["*u8", f"*{dt}", f"*{dt}", "*fp32", f"*{dt}"]))
        dq_args.update({n: "i32" for n in ("R", "C", "PACKED", "GROUPS", "stride_cr", "stride_gr", "stride_yr")})
        ptx = _compile(k.dequant, dq_args, dict(GROUP=64, BITS=4, BLOCK_R=32, BLOCK_C=128, INTERPRET=False,
                                                TABLE=False), arch, num_warps=4).asm["ptx"]
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx) and not re.search(r"fma\.rn(\.ftz)?\.f32", ptx)
        # a 4-bit table format (float32 scales, no mins): both kernels build, the product rounded on its own
        t_args = {**args, "mins_ptr": "*fp32", "scales_ptr": "*fp32"}
        const = dict(GROUP=32, BITS=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, HAS_BIAS=False,
                     HAS_RES=False, IEEE=dt == "fp32", WIDEN=False, TABLE=True)
        assert re.search(r"mul\.rn(\.ftz)?\.f32", _compile(k.qlinear, t_args, const, arch, num_warps=4,
                                                            num_stages=3).asm["ptx"])
        ptx = _compile(k.dequant, {**dq_args, "mins_ptr": "*fp32", "scales_ptr": "*fp32"},
                       dict(GROUP=32, BITS=4, BLOCK_R=32, BLOCK_C=128, INTERPRET=False, TABLE=True), arch,
                       num_warps=4).asm["ptx"]
        assert re.search(r"mul\.rn(\.ftz)?\.f32", ptx)


@pytest.mark.gpu
def test_the_compiled_kernels_on_the_gpu_match_the_reference() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert check_all(torch.device("cuda")) == len(SHAPES) * (3 * 3 + len(TILES))
    assert check_dequant(torch.device("cuda")) == len(DEQUANT) * 3
    assert check_tables(torch.device("cuda")) == len(TABLE_CASES) * 2


def _interpreter_index_on_new_numpy() -> None:
    """Triton's interpreter (3.6) turns a loop bound into an int with ``int(array)`` on a
    one-element array, which numpy 2.4 refuses; take the element instead."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if __name__ == "__main__":
    _interpreter_index_on_new_numpy()
    print(f"checked {check_all(torch.device('cpu'))} products")
    print(f"checked {check_dequant(torch.device('cpu'))} expansions")
    print(f"checked {check_tables(torch.device('cpu'))} table formats")
