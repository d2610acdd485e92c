"""Offload dirs of dead runs: who owns a dir, and removing those whose owner is gone.

A process killed outright (SIGKILL, a lost node) cannot remove its offload dir. Each dir
carries an ``.owner`` file (host, pid and the process's start time, so a reused pid is not
mistaken for the owner); every run removes, under its offload root, the dirs whose owner on
this host is dead (never a live one's, never another host's) and logs how much it freed.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from pathlib import Path

from flexgen_dist.memory.tiers import format_bytes

log = logging.getLogger("flexgen_dist")


OWNER_FILE = ".owner"


def _proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (/proc), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` still exists and is the one that started at ``start``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    now = _proc_start(pid)
    return start is None or now is None or now == start  # a reused pid is another process


def _dir_bytes(path: Path) -> int:
    n = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                n += os.stat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return n


def remove_stale_dirs(root: Path) -> tuple[int, int]:
    """Remove the offload dirs under ``root`` whose owner process on this host is dead.
    Returns (dirs removed, bytes freed)."""
    host, count, freed = socket.gethostname(), 0, 0
    for d in root.glob("flexgen-rank*"):
        try:
            owner = json.loads((d / OWNER_FILE).read_text())
            if owner["host"] != host or _alive(int(owner["pid"]), owner.get("start")):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no readable owner: not ours to judge
        size = _dir_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            count, freed = count + 1, freed + size
    return count, freed


def write_owner(d: Path) -> None:
    """Mark ``d`` as this process's (host, pid, start time)."""
    (d / OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                            "start": _proc_start(os.getpid())}))


def reclaim_stale_dirs(root: Path) -> None:
    """``remove_stale_dirs`` under an existing ``root``, saying what it freed."""
    if not root.is_dir():
        return
    stale, freed = remove_stale_dirs(root)
    if stale:
        log.warning("offload dir %s: removed %d dir(s) left by runs that died (%s freed)",
                    root, stale, format_bytes(freed))
