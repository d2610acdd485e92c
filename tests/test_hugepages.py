"""Huge pages for large host tensors: requested on import, opt-out, and reported as got."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_dist import hugepages


def _python(code: str, **env: str | None) -> str:
    full = {k: v for k, v in os.environ.items()
            if k not in ("THP_MEM_ALLOC_ENABLE", "FLEXGEN_HUGE_PAGES", "FLEXGEN_KEEP_FREED") and not k.startswith("MALLOC_")}
    full.update({k: v for k, v in env.items() if v is not None})
    res = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


IMPORT = "import os, flexgen_dist; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
STATUS = "import flexgen_dist; from flexgen_dist import hugepages; print(hugepages.status())"


def test_import_requests_huge_pages_unless_opted_out_or_set() -> None:
    assert _python(IMPORT) == "1"
    assert _python(IMPORT, FLEXGEN_HUGE_PAGES="0") == "None"
    assert _python(IMPORT, FLEXGEN_HUGE_PAGES="off") == "None"
    assert _python(IMPORT, THP_MEM_ALLOC_ENABLE="0") == "0"  # the user's own value stays


def test_kernel_mode_reads_the_bracketed_word(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never")):
        f.write_text(text)
        assert hugepages.kernel_mode(str(f)) == mode
    assert hugepages.kernel_mode(str(tmp_path / "missing")) is None


def test_eligible_reads_the_flag_of_the_mapping_holding_the_address(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python\n"
        "Size:                328 kB\nTHPeligible:    0\nVmFlags: rd ex mr mw me dw\n"
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\n"
        "Size:               4096 kB\nAnonHugePages:   4096 kB\nTHPeligible:    1\nVmFlags: rd wr hg\n")
    assert hugepages._eligible(0x7F0000100000, str(smaps)) is True
    assert hugepages._eligible(0x00401000, str(smaps)) is False
    assert hugepages._eligible(0x10, str(smaps)) is None  # in no mapping
    assert hugepages._eligible(0x10, str(tmp_path / "missing")) is None


def test_status_says_what_the_process_got() -> None:
    mode = hugepages.kernel_mode()
    default, opted_out = _python(STATUS), _python(STATUS, FLEXGEN_HUGE_PAGES="0")
    late = _python("import torch; x = torch.empty(8 << 20); import flexgen_dist; "
                   "from flexgen_dist import hugepages; print(hugepages.status())")
    if mode in (None, "never"):
        assert default == opted_out == late == "unavailable"
    elif mode == "always":  # the kernel gives them to every mapping
        assert default == opted_out == late == "on"
    else:  # madvise: only what torch's allocator asks for
        assert (default, opted_out) == ("on", "off")
        # torch decides once, at its first large allocation: a request after it comes too late
        assert late == "off"


def test_every_stage_reports_its_huge_pages(tiny_models, tmp_path: Path) -> None:
    import json

    from flexgen_dist.run import main

    tm = tiny_models["opt-post-proj"]
    met = tmp_path / "m.json"
    rc = main(["--model", str(tm.path), "--num-prompts", "2", "--prompt-len", "8", "--gen-len", "2",
               "--output", str(tmp_path / "o.jsonl"), "--no-progress", "--metrics", str(met)])
    assert rc == 0
    got = json.loads(met.read_text())
    assert got["huge_pages"] == [hugepages.status()] and got["huge_pages"][0] in ("on", "off", "unavailable")
    assert got["keep_freed"] == [hugepages.keep_freed()] and got["keep_freed"][0] in ("on", "off", "unavailable")


KEEP = "import flexgen_dist; from flexgen_dist import hugepages; print(hugepages.keep_freed())"
# a 64 MiB tensor written and freed five times: the page faults of each
REFAULT = """import resource, flexgen_dist, torch
from flexgen_dist import hugepages
out = []
for _ in range(5):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = torch.ones(16 << 20); del y
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(hugepages.keep_freed(), *out)"""


def test_freed_host_memory_is_kept_for_the_next_tensor_unless_opted_out() -> None:
    """On glibc, import keeps large freed blocks in the heap: a tensor written after one of its
    size was freed reuses its pages (almost no page faults), where glibc's default hands the
    block back to the kernel and the next is faulted in anew. ``FLEXGEN_KEEP_FREED=0`` or a
    ``MALLOC_*`` setting of the user's leaves glibc as it is."""
    import ctypes

    glibc = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    assert _python(KEEP) == ("on" if glibc else "unavailable")
    assert _python(KEEP, FLEXGEN_KEEP_FREED="0") == "off"
    assert _python(KEEP, MALLOC_ARENA_MAX="2") == "off"  # the user's own malloc settings stay
    if glibc:  # after the first (fresh memory either way), the kept process reuses it
        kept, *faults_kept = _python(REFAULT).split()
        off, *faults_off = _python(REFAULT, FLEXGEN_KEEP_FREED="0").split()
        assert (kept, off) == ("on", "off")
        later_kept, later_off = [int(f) for f in faults_kept[1:]], [int(f) for f in faults_off[1:]]
        assert max(later_kept) * 8 < min(later_off), (faults_kept, faults_off)


@pytest.mark.parametrize("value", ["1", "yes"])
def test_other_values_keep_the_request(value: str) -> None:
    assert _python(IMPORT, FLEXGEN_HUGE_PAGES=value) == "1"
