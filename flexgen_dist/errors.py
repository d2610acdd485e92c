"""The exceptions an entry point reports as one ``error:`` line (exit 1) instead of a traceback:
a user can fix each by changing an input, a flag or the machine's state."""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

from .config import ConfigError
from .interrupts import STOP_SIGNALS, stuck_threads
from .distributed.comm import PeerFailure
from .memory.disk import DiskStoreError
from .memory.tiers import MemoryBudgetError
from .models.source import ModelLoadError

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ModelLoadError, DiskStoreError, MemoryBudgetError,
                                                ValueError, FileNotFoundError, PermissionError,
                                                PeerFailure)  # a dead peer: one line naming it


class Stopped(BaseException):
    """A stop signal arrived: unwind like Ctrl-C (close outputs, remove offload files)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def _exit_unless_stuck(code: int) -> int:
    """``code``, to return; but where a thread the stop left stuck (``interrupts``) would hold
    the interpreter's exit forever, exit now, outputs already closed and flushed."""
    stuck = stuck_threads(10.0)
    if stuck:
        print(f"error: {len(stuck)} I/O thread(s) stuck after the stop; exiting without them", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def exit_code_of(body: Callable[[], int]) -> int:
    """Run an entry point's body: a user error is one ``error:`` line and exit 1; Ctrl-C
    exits 130, SIGTERM 143 and SIGUSR1 138, each after one line, with the outputs written so
    far kept (complete lines, fsynced) and the offload files removed."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        old = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    try:
        return body()
    except KeyboardInterrupt:
        print("error: interrupted; outputs written so far are kept (rerun with --resume to finish)", file=sys.stderr)
        return _exit_unless_stuck(130)
    except Stopped as e:
        name = signal.Signals(e.signum).name
        print(f"error: stopped by {name}; outputs written so far are kept (rerun with --resume to finish)",
              file=sys.stderr)
        return _exit_unless_stuck(128 + e.signum)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
