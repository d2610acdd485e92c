"""Transparent huge pages for large host tensors (Linux), on by default.

A CPU compute device, CPU attention and the offloaded tiers all stream through large host
tensors (weights, activations, read buffers). With 4 KiB pages every 4 KiB read can cost a
TLB miss, and under a hypervisor each miss is a two-level page walk. On the 2-core VM of
docs/benchmarks.md, two one-core jobs running side by side each lost 7.5 % of their prefill
compute to the other with 4 KiB pages and 0.5-2.7 % with huge pages; alone, a job ran equally
fast either way (docs/architecture.md, speed notes).

PyTorch's CPU allocator asks the kernel for huge pages (``madvise(MADV_HUGEPAGE)``) on every
allocation of 2 MiB or more when ``THP_MEM_ALLOC_ENABLE=1`` is in the environment at its
first such allocation. :func:`request` puts it there; the package calls it on import, before
it imports torch. ``FLEXGEN_HUGE_PAGES=0`` opts out, and a value the user gave
``THP_MEM_ALLOC_ENABLE`` is left as it is. Where the kernel's THP mode is ``never`` nothing
changes. :func:`status` says what a process actually got (it is in every stage's metrics).

*Freed host memory kept for reuse* (``keep_freed``, with ``request``): glibc returns a large
freed block (above its mmap threshold, 128 KiB to 32 MiB as it adapts) to the kernel, so the
next large tensor is fresh memory, faulted in page by page; a huge-page-advised region may
then be compacted on the spot (the kernel's THP ``defrag`` mode ``madvise``). On the 2-core
Xeon VM of docs/benchmarks.md widening a 2048 x 2048 bfloat16 weight to float32 took 20-25
ms a call where it takes 0.5 ms into reused memory, and the bundled model's bfloat16 prefill
(whose products widen their operands on that CPU) ran 37 % faster with freed memory kept.
``mallopt`` raises the mmap threshold and the trim threshold to 2 GiB, so freed blocks stay
in the process's heap and are reused; the process's resident size stays near its peak (the
working set the memory model counts). ``FLEXGEN_KEEP_FREED=0`` opts out, and so does a
``MALLOC_*`` or ``GLIBC_TUNABLES`` malloc setting the user gave; elsewhere than glibc nothing
changes.

This module imports no torch at module level, so it lives outside ``memory`` (whose package
imports torch): its request must come before torch is imported.
"""
from __future__ import annotations

import functools
import os

OPT_OUT = "FLEXGEN_HUGE_PAGES"  # "0": leave torch's allocator as it is
TORCH_ENV = "THP_MEM_ALLOC_ENABLE"
_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"


KEEP_OPT_OUT = "FLEXGEN_KEEP_FREED"  # "0": glibc's malloc as it is
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_KEEP_BYTES = 2**31 - 1  # the largest value mallopt takes (an int)
_kept: list[str] = []  # what keep_freed did: "on", "off" (opted out, the user's setting) or "unavailable"


def _off(var: str) -> bool:
    return os.environ.get(var, "1").strip().lower() in ("0", "false", "no", "off")


def request() -> None:
    """Ask torch's CPU allocator for huge pages, unless opted out or set by the user; and keep
    freed host memory for reuse (``keep_freed``)."""
    keep_freed()
    if _off(OPT_OUT):
        return
    os.environ.setdefault(TORCH_ENV, "1")


def keep_freed() -> str:
    """Keep large freed blocks in the heap for the next tensors (see the module's docstring):
    "on", "off" (opted out, or the user set glibc's malloc) or "unavailable" (not glibc)."""
    if _kept:
        return _kept[0]
    user = any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if _off(KEEP_OPT_OUT) or user:
        _kept.append("off")
        return "off"
    got = "unavailable"
    try:
        import ctypes  # noqa: PLC0415 - only where it is asked for

        libc = ctypes.CDLL(None)
        if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version"):
            ok = libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1
            got = "on" if ok else "unavailable"
    except OSError:
        pass
    _kept.append(got)
    return got


def kernel_mode(path: str = _SYSFS) -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), or None where there is none."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def _eligible(addr: int, smaps: str = "/proc/self/smaps") -> bool | None:
    """Whether the mapping holding ``addr`` may get huge pages (its ``THPeligible`` flag)."""
    try:
        with open(smaps) as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "THPeligible:":
                    return line.split()[1] == "1"
    except (OSError, ValueError, IndexError):
        return None
    return None


@functools.cache  # fixed for the process: torch decides once, and so does the kernel's mode
def status() -> str:
    """What this process gets for large CPU tensors: "on" (huge pages), "off" (4 KiB pages:
    opted out, or torch's allocator had decided before the request), or "unavailable" (no
    THP in this kernel, or its mode is "never")."""
    mode = kernel_mode()
    if mode is None or mode == "never":
        return "unavailable"
    if mode == "always":
        return "on"
    import torch  # noqa: PLC0415 - the module itself must not import torch

    probe = torch.empty(4 << 20, dtype=torch.uint8)
    got = _eligible(probe.data_ptr())
    return "on" if got else "off"
