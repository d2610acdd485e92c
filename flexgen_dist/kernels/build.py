"""Building and loading the native CPU kernels (the package's docstring says what they are):
the sources compiled once per source, compiler and CPU feature set into ``kernel_dir()``,
loaded with their entry points' types (``library()``), or None where they cannot be had.
``build_from`` builds another revision's sources beside them (``bench compare-attention``).
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

log = logging.getLogger("flexgen_dist.kernels")

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "cpu_kernels.cpp", _HERE / "cpu_attention.cpp", _HERE / "cpu_qlinear.cpp",
            _HERE / "cpu_quant.cpp"]
_HEADERS = [_HERE / "cpu_simd.h"]
# -ffp-contract=off: a product and a sum stay two roundings where the reference rounds twice
# (FMAs are written out where they are meant)
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("FLEXGEN_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def cache_root() -> Path:
    """Where flexgen_dist keeps what it measures or builds once per machine: ``$FLEXGEN_CACHE``,
    else ``$XDG_CACHE_HOME/flexgen_dist``, else ``~/.cache/flexgen_dist``."""
    d = os.environ.get("FLEXGEN_CACHE")
    if d:
        return Path(d).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path("~/.cache").expanduser()) / "flexgen_dist"


def kernel_dir() -> Path:
    """Where the compiled kernels and the GEMM form policy live."""
    d = os.environ.get("FLEXGEN_KERNEL_DIR")
    if d:
        return Path(d).expanduser()
    return cache_root() / "kernels"


def cpu_info(field: str) -> str:
    """The first ``field`` line of /proc/cpuinfo (e.g. "flags", "model name"), or "" where
    there is none: part of the key of everything built or measured for this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(field)), "")
    except OSError:
        return ""


def _build(cxx: str, out: Path, sources: list[Path] | None = None) -> None:
    """Compile every source (``_SOURCES``, or the same files from elsewhere) at once (one compiler
    per source, in parallel), then link."""
    sources = _SOURCES if sources is None else sources
    out.parent.mkdir(parents=True, exist_ok=True)
    # build under unique names, then rename: ranks on one node may build at the same time
    work = Path(tempfile.mkdtemp(prefix="build-", dir=out.parent))
    try:
        compile_flags = [f for f in _FLAGS if f != "-shared"]
        objs = [work / f"{src.stem}.o" for src in sources]
        procs = [subprocess.Popen([cxx, *compile_flags, "-c", str(src), "-o", str(obj)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for src, obj in zip(sources, objs)]
        errors = []
        for p in procs:
            _, err = p.communicate(timeout=300)
            if p.returncode != 0:
                errors.append((err.strip().splitlines() or ["compiler failed"])[-1])
        if errors:
            raise RuntimeError(errors[0])
        lib = work / "lib.so"
        r = subprocess.run([cxx, *_FLAGS, *map(str, objs), "-o", str(lib)], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            raise RuntimeError((r.stderr.strip().splitlines() or ["linker failed"])[-1])
        os.replace(lib, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load() -> ctypes.CDLL | None:
    if not enabled():
        return None
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        log.warning("no C++ compiler (g++ or $CXX) found: torch's kernels run instead of the native ones")
        return None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = hashlib.sha256(b"".join(f.read_bytes() for f in _SOURCES + _HEADERS) + " ".join(_FLAGS).encode() + version.encode()
                             + cpu_info("flags").encode()).hexdigest()[:16]
        so = kernel_dir() / f"cpu_kernels-{key}.so"
        if not so.exists():
            _build(cxx, so)
        lib = ctypes.CDLL(str(so))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable (%s): torch's kernels run instead", e)
        return None
    _bind(lib)
    _state["width"] = lib.fg_vector_width()
    _state["dpbf16"] = bool(lib.fg_has_dpbf16())
    _state["key"] = key
    return lib


def _bind(lib: ctypes.CDLL) -> None:
    """The entry points' argument and result types."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fg_linear_f32.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.fg_linear_f32.restype = None
    lib.fg_attention.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, ptr,
                                 ctypes.c_float, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.fg_attention.restype = None
    if hasattr(lib, "fg_attention_packed"):  # a build of an earlier revision may lack these (build_from)
        lib.fg_attention_packed.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ctypes.c_int, i64, ptr, i64, ptr,
                                            ctypes.c_float, ptr, ptr, ctypes.c_int, ctypes.c_int]
        lib.fg_attention_packed.restype = ctypes.c_int
    if hasattr(lib, "fg_quant"):
        lib.fg_quant.argtypes = [ptr, i64, i64, i64, ctypes.c_int, i64, ctypes.c_int, ptr, i64, ptr, ptr, i64,
                                 ctypes.c_int]
        lib.fg_quant.restype = ctypes.c_int
    lib.fg_rms_norm.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int]
    lib.fg_rms_norm.restype = None
    lib.fg_silu_mul.argtypes = [ptr, ptr, i64, ctypes.c_int, ctypes.c_int]
    lib.fg_silu_mul.restype = None
    lib.fg_rope.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.fg_rope.restype = None
    lib.fg_dequant.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, ctypes.c_int, i64, ctypes.c_int,
                               ptr, ctypes.c_int, ctypes.c_int, ptr]
    lib.fg_dequant.restype = None
    lib.fg_dequant_fp8.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.fg_dequant_fp8.restype = None
    lib.fg_qlinear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int, i64, i64, ctypes.c_int,
                               ptr, ptr, ptr, i64, ctypes.c_int, ptr, ctypes.c_int, ctypes.c_int, ptr]
    lib.fg_qlinear.restype = None
    lib.fg_has_dpbf16.restype = ctypes.c_int
    lib.fg_linear_bf16.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ctypes.c_int]
    lib.fg_linear_bf16.restype = ctypes.c_int
    lib.fg_vector_width.restype = ctypes.c_int


def build_from(src_dir: Path, out: Path) -> ctypes.CDLL:
    """The kernels built from the same files (``_SOURCES``' and ``_HEADERS``' names; a source an
    earlier revision did not have is left out) in another directory, with this build's compiler
    and flags, into ``out``: another revision's kernels beside this one's in one process (``bench
    compare-attention``). Raises RuntimeError where the build fails."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) found")
    _build(cxx, out, [src_dir / f.name for f in _SOURCES if (src_dir / f.name).exists()])
    lib = ctypes.CDLL(str(out))
    _bind(lib)
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
