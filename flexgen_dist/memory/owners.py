"""Offload dirs: removing a run's own when it ends, and those of dead runs.

A run's dir is removed when its store is closed or garbage-collected, at interpreter exit,
and on SIGTERM (a handler is installed only over the default action; it removes the files
and re-raises the signal so the exit status still says SIGTERM): ``remove_at_exit``.

A process killed outright (SIGKILL, a lost node) cannot remove its offload dir. Each dir
carries an ``.owner`` file (host, pid and the process's start time, so a reused pid is not
mistaken for the owner); every run removes, under its offload root, the dirs whose owner on
this host is dead (never a live one's, never another host's) and logs how much it freed.
Both removals take the ``.owner`` file last (``remove_dir``): a removal cut short by a SIGKILL
leaves a dir that still names its dead owner, so the next run finishes it. (With ``rmtree``
the owner file could go first and the weight files stay, in a dir no run would judge.) A dir
is created under a hidden name and renamed once its owner file is in it (``make_dir``), so a
visible dir always has one.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flexgen_dist.interrupts import join_bounded
from flexgen_dist.memory.units import format_bytes

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


def remove_dir(path: str | os.PathLike) -> None:
    """Remove an offload dir, its ``.owner`` file last (then the dir); a missing one is fine."""
    d = Path(path)
    try:
        entries = [e for e in os.scandir(d) if e.name != OWNER_FILE]
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        except OSError:
            pass
    with contextlib.suppress(OSError):
        os.unlink(d / OWNER_FILE)
    with contextlib.suppress(OSError):
        os.rmdir(d)


def make_dir(root: Path, name: str) -> Path:
    """``root/name``, created with this process's ``.owner`` file already in it."""
    hidden = root / f".{name}"
    hidden.mkdir()
    write_owner(hidden)
    hidden.rename(root / name)
    return root / name


def remove_stale_dirs(root: Path) -> tuple[int, int]:
    """Remove the offload dirs under ``root`` whose owner process on this host is dead (and
    the hidden ones of runs that died while creating theirs). Returns (dirs removed, bytes freed)."""
    host, count, freed = socket.gethostname(), 0, 0
    for d in [*root.glob("flexgen-rank*"), *root.glob(".flexgen-rank*")]:
        try:
            owner = json.loads((d / OWNER_FILE).read_text())
            if owner["host"] != host or _alive(int(owner["pid"]), owner.get("start")):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no readable owner: not ours to judge
        size = _dir_bytes(d)
        remove_dir(d)
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


# Process-wide by nature: a signal handler has no other way to find the live stores.
_LIVE_DIRS: set[tuple[str, int]] = set()
_LIVE_LOCK = threading.Lock()


def _sigterm_handler(signum: int, frame: Any) -> None:
    pid = os.getpid()
    for path, owner in _LIVE_DIRS.copy():
        if owner == pid:
            remove_dir(path)
    signal.signal(signum, signal.SIG_DFL)  # we only ever replace the default action
    os.kill(pid, signum)


def _install_sigterm_handler() -> None:
    """Take over SIGTERM only from its default action (and only from the main thread).

    A handler set by someone else is left alone: it either exits (SystemExit runs the
    caller's ``finally`` and atexit, which remove the files) or deliberately keeps running.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_handler)


class FileGate:
    """Creating a file in an offload dir and removing the dir, one at a time: once the dir is
    being removed no file is created in it. (A file created while the removal runs, by a thread
    still placing weights when a dead peer's monitor or a stop closes the store, kept the dir
    alive after its ``.owner`` was gone: an orphan no later run would reclaim.)"""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False


def _cleanup(path: str, pid: int, executor: ThreadPoolExecutor, gate: FileGate | None = None) -> None:
    if os.getpid() != pid:  # a forked child must not delete its parent's files
        return
    stuck = join_bounded(executor, 30.0)  # pending I/O first; a stuck worker must not hold the exit
    if stuck:
        log.warning("offload dir %s: %d I/O thread(s) stuck after a stop; removing the files without them",
                    path, len(stuck))
    if gate is None:
        remove_dir(path)
    else:
        with gate.lock:  # no file is created from here on
            gate.closed = True
            remove_dir(path)
    with _LIVE_LOCK:
        _LIVE_DIRS.discard((path, pid))


def remove_at_exit(owner: object, path: str, executor: ThreadPoolExecutor,
                   gate: FileGate | None = None) -> weakref.finalize:
    """Remove ``path`` (after ``executor``'s pending I/O) when ``owner`` is collected, at
    exit, or on SIGTERM; call the returned finalizer to remove it now. With ``gate``, files
    created under it are never left behind by the removal."""
    fin = weakref.finalize(owner, _cleanup, path, os.getpid(), executor, gate)
    with _LIVE_LOCK:
        _LIVE_DIRS.add((path, os.getpid()))
    _install_sigterm_handler()
    return fin
