"""Byte sizes as people write them: ``parse_size("16GiB")`` and ``format_bytes(n)``.

A leaf: every memory module (and the budgets, the planner's hardware files, the CLIs) reads or
prints sizes, so this imports nothing of flexgen_dist.
"""
from __future__ import annotations

import math
import re

# Bare K/M/G/T and KiB... are binary (what memory sizes mean); KB/MB/GB/TB are SI.
_UNITS = {"": 1, "b": 1,
          "k": 2**10, "kib": 2**10, "kb": 10**3,
          "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9,
          "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(s: str | int | float) -> int:
    """Bytes from ``"16GiB"``, ``"512MB"``, ``"1.5G"``, ``"100"`` or a number of bytes.

    K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024; KB/MB/GB/TB powers of 1000
    (case-insensitive). Fractions round to the nearest byte.
    """
    if isinstance(s, bool):
        raise ValueError(f"invalid size {s!r}: give bytes or a string like '16GiB'")
    if isinstance(s, (int, float)):
        if not math.isfinite(s) or s < 0:
            raise ValueError(f"invalid size {s!r}: must be a finite number of bytes >= 0")
        return int(round(s))
    m = _SIZE_RE.match(str(s))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"invalid size {s!r}: use a number with an optional unit "
                         f"such as '100', '512MB', '1.5G' or '16GiB'")
    value = float(m.group(1))
    if not math.isfinite(value):
        raise ValueError(f"invalid size {s!r}: not a finite number")
    return int(round(value * _UNITS[unit]))


def format_bytes(n: int) -> str:
    """``1610612736 -> '1.50 GiB'``; below 1 KiB plain bytes (``'512 B'``)."""
    sign = "-" if n < 0 else ""
    n = abs(int(n))
    if n < 1024:
        return f"{sign}{n} B"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    raise AssertionError("unreachable")
