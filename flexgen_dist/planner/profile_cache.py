"""This host's hardware profile, kept: where it lives, what it is valid for, and measuring it
once when there is none.

``load_or_profile`` reads a spec file, or this host's cached profile, measuring it
(``profiler.profile_hardware``) when there is none or it cannot be used (``read_cached``
says why), with a version and the machine's identity beside it.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from flexgen_dist.kernels import cache_root
from flexgen_dist.kernels.gemm import identity as gemm_identity
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner import profiler


PROFILE_VERSION = 7  # what a cached profile holds and how it is measured; older ones are measured again


def default_cache_path(device: str, threads: int | None = None) -> Path:
    """Where this host's profile for ``device`` and a compute thread count (default: this
    process's) is cached: ``$FLEXGEN_HARDWARE_CACHE``, else ``hardware/`` under the cache
    root (``$FLEXGEN_CACHE``, ``$XDG_CACHE_HOME/flexgen_dist`` or ``~/.cache/flexgen_dist``).
    Rates scale with the threads, so a one-core node and a two-core one keep two profiles."""
    d = os.environ.get("FLEXGEN_HARDWARE_CACHE")
    base = Path(d).expanduser() if d else cache_root() / "hardware"
    t = torch.get_num_threads() if threads is None else threads
    return base / f"{socket.gethostname()}-{device}-t{t}.yaml"


def profile_identity(device: str, threads: int | None = None) -> dict[str, Any]:
    """What a cached profile is valid for: the CPU, the torch build, the native kernels, the
    GPU, the compute threads (default: this process's). The kernels are part of it because
    the profile times the engine's own products and attention: new kernels (a package
    upgrade) move the rates the planner predicts with, so they are measured again."""
    ident: dict[str, Any] = {k: None if v is None else str(v) for k, v in gemm_identity().items()}
    ident["gpu"] = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None
    ident["threads"] = torch.get_num_threads() if threads is None else threads
    return ident


def read_cached(path: Path, device: str) -> tuple[HardwareSpec | None, str]:
    """The cached profile at ``path`` if it is whole, of this version and of this machine;
    else None and why it cannot be used (one line)."""
    if not path.exists():
        return None, "no profile of this host is cached yet"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        return None, f"the cached profile {path} is unreadable ({str(e).splitlines()[0]})"
    if not isinstance(data, dict):
        return None, f"the cached profile {path} is corrupt (not a mapping)"
    version = data.get("profile_version")
    if version != PROFILE_VERSION:
        return None, (f"the cached profile {path} is stale (profile version {version}; this version of "
                      f"flexgen_dist measures version {PROFILE_VERSION})")
    ident, now = data.get("identity"), profile_identity(device)
    if ident != now:
        diff = sorted(k for k in now if not isinstance(ident, dict) or ident.get(k) != now[k])
        return None, f"the cached profile {path} is of another {', '.join(diff)} than this run's"
    try:
        return HardwareSpec.from_dict(data, where=str(path)), ""
    except ValueError as e:
        return None, f"the cached profile {path} is corrupt ({e})"


def write_cached(path: Path, hw: HardwareSpec, device: str, threads: int | None = None) -> None:
    """Write ``hw`` to ``path`` with its version and identity (for ``threads`` compute threads,
    default this process's), atomically (a concurrent reader sees the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"profile_version": PROFILE_VERSION, "identity": profile_identity(device, threads),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **hw.to_dict()}
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("# flexgen_dist hardware profile, measured on this host (SI units; fields in "
                    "configs/hardware/README.md)\n" + yaml.safe_dump(body, sort_keys=False))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cached_profile(device: str) -> HardwareSpec | None:
    """This host's cached profile where a usable one exists; never measures (plain runs)."""
    return read_cached(default_cache_path(device), device)[0]


def load_or_profile(path: str | Path | None, device: str = "cpu",
                    offload_dir: str = "/tmp") -> HardwareSpec:
    """The spec in ``path`` (a user's file: its errors are errors), or this host's cached
    profile, measured and cached when there is none, or when the cached one is unreadable,
    corrupt, stale or of another machine (one line on stderr says which, and where it goes).
    Measuring takes up to a minute; ``python -m flexgen_dist.planner profile`` does it ahead."""
    if path is not None:
        return HardwareSpec.from_yaml(path)
    p = default_cache_path(device)
    hw, why = read_cached(p, device)
    if hw is not None:
        return hw
    print(f"hardware profile: {why}: measuring this machine now (under a minute), kept in {p}",
          file=sys.stderr, flush=True)
    hw = profiler.profile_hardware(device=device, offload_dir=offload_dir)
    try:
        write_cached(p, hw, device)
    except OSError as e:
        print(f"hardware profile: cannot be kept in {p} ({e.strerror or e}): the next run measures again",
              file=sys.stderr)
    return hw
