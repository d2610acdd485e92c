"""Native float32 CPU kernels (decode GEMM and attention, RMSNorm, rotary, SwiGLU's
``silu(g) * u``, dequantization of 4/8-bit groups), compiled on first use for the machine that runs them.

``cpu_kernels.cpp`` is built with the system C++ compiler (``$CXX`` or g++) with ``_FLAGS``
into ``kernel_dir()`` (``$FLEXGEN_KERNEL_DIR``, else ``$FLEXGEN_CACHE/kernels``, default
``~/.cache/flexgen_dist/kernels``), once per source, compiler and CPU feature set, so nodes
that share a home directory never load a build for another CPU. The build takes ~2 s. The
GEMM form policy (``gemm.py``) is stored in the same directory.
Without a compiler, on a CPU without AVX2+FMA, or with ``FLEXGEN_CPU_KERNELS=0``, ``library()``
returns None and callers use torch's own kernels; the reason is logged once.

This package is a leaf: it imports nothing else from flexgen_dist.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("flexgen_dist.kernels")

_SRC = Path(__file__).with_name("cpu_kernels.cpp")
# -ffp-contract=off: a product and a sum stay two roundings where the reference rounds twice
# (FMAs are written out where they are meant)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("FLEXGEN_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def kernel_dir() -> Path:
    """Where the compiled kernels and the GEMM form policy live."""
    d = os.environ.get("FLEXGEN_KERNEL_DIR")
    if d:
        return Path(d).expanduser()
    return Path(os.environ.get("FLEXGEN_CACHE", "~/.cache/flexgen_dist")).expanduser() / "kernels"


def cpu_info(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo (e.g. "flags", "model name"), or "" where
    there is none: part of the key of everything built or measured for this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(field)), "")
    except OSError:
        return ""


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # build under a unique name, then rename: ranks on one node may build at the same time
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *_FLAGS, str(_SRC), "-o", tmp], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError((r.stderr.strip().splitlines() or ["compiler failed"])[-1])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    if not enabled():
        return None
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        log.warning("no C++ compiler (g++ or $CXX) found: torch's kernels run instead of the native ones")
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256(_SRC.read_bytes() + " ".join(_FLAGS).encode() + version.encode()
                             + cpu_info("flags").encode()).hexdigest()[:16]
        so = kernel_dir() / f"cpu_kernels-{key}.so"
        if not so.exists():
            _build(cxx, so)
        lib = ctypes.CDLL(str(so))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable (%s): torch's kernels run instead", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fg_linear_f32.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.fg_linear_f32.restype = None
    lib.fg_attention_f32.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, i64, ctypes.c_float,
                                     ptr, ctypes.c_int]
    lib.fg_attention_f32.restype = None
    lib.fg_rms_norm_f32.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
    lib.fg_rms_norm_f32.restype = None
    lib.fg_silu_mul_f32.argtypes = [ptr, ptr, i64, ctypes.c_int]
    lib.fg_silu_mul_f32.restype = None
    lib.fg_rope_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.fg_rope_f32.restype = None
    lib.fg_dequant_f32.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr,
                                   ctypes.c_int]
    lib.fg_dequant_f32.restype = None
    lib.fg_vector_width.restype = ctypes.c_int
    _state["width"] = lib.fg_vector_width()
    _state["key"] = key
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on the first call; None where they cannot be had."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def build_key() -> str | None:
    """The loaded build's key (source, flags, compiler, CPU flags), or None without the kernels."""
    return _state.get("key") if library() is not None else None  # type: ignore[return-value]


def _f32_cpu(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x (..., n) as (rows, n) without a copy (each row contiguous, rows evenly strided), or None."""
    if x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def linear_f32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ w.T + b + residual`` for float32 CPU tensors with few rows, or None where the
    kernel does not apply (no library, another dtype or device, a weight or input whose rows
    are not contiguous).

    x (..., in) with its last dim contiguous, w (out, in) row-major, b (out,) or None,
    residual (..., out) contiguous or None.
    """
    lib = library()
    if (lib is None or not _f32_cpu(x, w) or w.dim() != 2 or w.stride(1) != 1 or x.shape[-1] != w.shape[1]
            or (b is not None and not (_f32_cpu(b) and b.is_contiguous()))
            or (residual is not None and not (_f32_cpu(residual) and residual.is_contiguous()
                                              and residual.shape == (*x.shape[:-1], w.shape[0])))):
        return None
    x2 = _rows(x)
    if x2 is None:
        return None
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    lib.fg_linear_f32(x2.data_ptr(), m, k, x2.stride(0), w.data_ptr(), n, w.stride(0),
                      b.data_ptr() if b is not None else None,
                      residual.data_ptr() if residual is not None else None, y.data_ptr(), n,
                      torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor | None:
    """Decode attention over cache rows: q (R, G, 1, d), k/v (R, L, d) with each row's
    positions contiguous (strided views of a preallocated cache are read in place), mask
    (R, 1, 1, L) bool -> (R, G, 1, d); or None where the kernel does not apply (no library,
    not float32 on the CPU, another layout, head_dim not a multiple of the vector width).
    """
    lib = library()
    if lib is None:
        return None
    r, g, t, d = q.shape
    L = k.shape[1]
    if (t != 1 or not _f32_cpu(q, k, v) or d % int(_state["width"]) or not q.is_contiguous() or mask.dtype != torch.bool
            or mask.shape != (r, 1, 1, L) or mask.stride(-1) != 1 or k.shape != v.shape
            or k.shape[0] != r or any(x.stride(2) != 1 or x.stride(1) != d for x in (k, v))):
        return None
    out = torch.empty((r, g, 1, d), dtype=torch.float32)
    lib.fg_attention_f32(q.data_ptr(), r, g, d, k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), L,
                         mask.data_ptr(), mask.stride(0), scale, out.data_ptr(), torch.get_num_threads())
    return out


def rms_norm_f32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of float32 CPU rows x (..., n) (last dim contiguous) with weight w (n,), in one
    pass; or None where the kernel does not apply."""
    lib = library()
    x2 = _rows(x) if lib is not None and _f32_cpu(x, w) and w.is_contiguous() and w.shape == x.shape[-1:] else None
    if x2 is None:
        return None
    y = torch.empty(x.shape, dtype=torch.float32)
    lib.fg_rms_norm_f32(x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0), w.data_ptr(), eps, y.data_ptr(),
                        torch.get_num_threads())
    return y


def silu_mul_f32(g: torch.Tensor, u: torch.Tensor) -> bool:
    """``g = silu(g) * u`` in place in one pass, for contiguous float32 CPU tensors of one
    shape; False (nothing done) where the kernel does not apply."""
    lib = library()
    if lib is None or not _f32_cpu(g, u) or g.shape != u.shape or not g.is_contiguous() or not u.is_contiguous():
        return False
    lib.fg_silu_mul_f32(g.data_ptr(), u.data_ptr(), g.numel(), torch.get_num_threads())
    return True


def rope_f32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding (rotate-half convention) of x (b, t, heads, d) with cos/sin
    (b, t, 1, d), out of place, in one pass; None where the kernel does not apply."""
    lib = library()
    if (lib is None or x.dim() != 4 or not _f32_cpu(x, cos, sin)
            or not all(a.is_contiguous() for a in (x, cos, sin)) or cos.shape != (*x.shape[:2], 1, x.shape[3]) or sin.shape != cos.shape or x.shape[3] % 2):
        return None
    b, t, h, d = x.shape
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.fg_rope_f32(x.data_ptr(), b * t, h, d, cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                    torch.get_num_threads())
    return out


def dequant_f32(codes: torch.Tensor, mins: torch.Tensor, scales: torch.Tensor, cols: int, group: int,
                bits: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Rows of group-wise quantized codes back to float32 in one pass: codes (..., packed) uint8,
    mins/scales (..., groups) float32, each row contiguous -> (..., cols), contiguous (written
    into ``out`` when given: a reused buffer spares the page faults of a fresh allocation); or
    None where the kernel does not apply (no library, bits other than 4 and 8, another dtype
    or device, rows that are neither one strided run nor two, as a slice of a cache chunk is)."""
    lib = library()
    if (lib is None or bits not in (4, 8) or codes.dtype != torch.uint8 or codes.device.type != "cpu"
            or not _f32_cpu(mins, scales) or mins.shape != scales.shape or mins.stride() != scales.stride()
            or codes.shape[:-1] != mins.shape[:-1] or mins.shape[-1] != -(-cols // group)
            or codes.shape[-1] * 8 // bits < cols or codes.stride(-1) != 1 or mins.stride(-1) != 1):
        return None
    lead = tuple(mins.shape[:-1])
    c2, m2 = _rows(codes), _rows(mins)
    if c2 is not None and m2 is not None:
        n0, n1, cs, ms = 1, c2.shape[0], (0, c2.stride(0)), (0, m2.stride(0))
    elif len(lead) == 2:
        n0, n1, cs, ms = lead[0], lead[1], codes.stride()[:2], mins.stride()[:2]
    else:
        return None
    if out is None:
        out = torch.empty((*lead, cols), dtype=torch.float32)
    elif out.shape != (*lead, cols) or not out.is_contiguous() or not _f32_cpu(out):
        return None
    lib.fg_dequant_f32(codes.data_ptr(), n0, n1, cols, *cs, mins.data_ptr(), scales.data_ptr(), *ms, group, bits,
                       out.data_ptr(), torch.get_num_threads())
    return out

