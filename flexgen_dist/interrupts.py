"""Stop signals (Ctrl-C, a scheduler's SIGTERM/SIGUSR1) against the I/O threads.

Python raises ``KeyboardInterrupt`` (and the entry points' ``Stopped``) in the main thread at
whatever bytecode it is running. Raised inside ``ThreadPoolExecutor.submit``, between one of
the executor's locks being taken and the ``with`` block that would release it, it leaves that
lock held: the next I/O worker to finish blocks on it forever, and a cleanup that waits for the
workers waits forever too (seen once in the suite's Ctrl-C test: the main thread in
``shutdown``, a worker in the idle semaphore's ``release``). So the engine submits its I/O with
the stop signals held back for the length of the call (delivered right after it, outside the
executor), and the offload cleanup waits for the workers a bounded time (``join_bounded``).
"""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's "stop now" (Slurm: --signal=USR1@60)
_HELD = {signal.SIGINT, *STOP_SIGNALS}


def submit(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future:
    """``pool.submit(fn, *args)`` with the stop signals held back on the main thread until it
    returns (two system calls; elsewhere, and where signal masks do not exist, a plain submit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return pool.submit(fn, *args)
    old = None
    try:
        # a signal already received raises here, after the mask is set: the finally undoes it
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
        return pool.submit(fn, *args)
    finally:
        if old is None:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
        else:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def join_bounded(pool: ThreadPoolExecutor, seconds: float) -> list[threading.Thread]:
    """Shut ``pool`` down (queued work cancelled) and wait up to ``seconds`` in all for its
    workers; the ones still alive then (stuck: see the module's note)."""
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + seconds
    workers = list(getattr(pool, "_threads", ()))
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in workers if t.is_alive()]


def stuck_threads(seconds: float) -> list[threading.Thread]:
    """The non-daemon threads other than this one still alive after up to ``seconds`` of
    waiting for them (interpreter exit would wait for them forever)."""
    deadline = time.monotonic() + seconds
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in others if t.is_alive()]
