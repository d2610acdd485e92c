"""Stop signals against the I/O threads (flexgen_dist/interrupts.py): submits hold the stop
signals back, a stuck worker does not hold the offload cleanup, and a thread a stop left stuck
does not hold the process's exit."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from flexgen_dist.interrupts import STOP_SIGNALS, join_bounded, submit


class _MaskReadingPool(ThreadPoolExecutor):
    """A pool whose submit notes the signal mask it ran under."""

    seen: set = set()

    def submit(self, fn, *args, **kwargs):  # type: ignore[override]
        _MaskReadingPool.seen = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return super().submit(fn, *args, **kwargs)


def test_submit_holds_the_stop_signals_back_and_restores_the_mask() -> None:
    before = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    with _MaskReadingPool(max_workers=1) as pool:
        assert submit(pool, lambda x: x + 1, 41).result() == 42
    assert {signal.SIGINT, *STOP_SIGNALS} <= _MaskReadingPool.seen
    assert set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) == before


def test_a_signal_sent_during_submit_arrives_after_it() -> None:
    got: list[str] = []

    def handler(signum, frame):
        got.append("signal")

    class Pool(ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):  # type: ignore[override]
            signal.raise_signal(signal.SIGUSR1)  # held back: the handler must not run in here
            got.append("submitted")
            return super().submit(fn, *args, **kwargs)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        with Pool(max_workers=1) as pool:
            submit(pool, time.sleep, 0).result()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got == ["submitted", "signal"]


def test_a_signal_received_as_submit_blocks_leaves_no_mask_behind(monkeypatch) -> None:
    """CPython runs the handlers of signals received before the mask changes inside the
    ``pthread_sigmask`` call itself, after setting the mask: a Ctrl-C caught there raises out of
    submit's first line. The stop signals are unblocked again (else no later stop would ever
    reach the main thread)."""
    import flexgen_dist.interrupts as interrupts

    real = signal.pthread_sigmask

    def blocks_then_raises(how, mask):  # what CPython does with a signal already received
        old = real(how, mask)
        if how == signal.SIG_BLOCK:
            raise KeyboardInterrupt
        return old

    before = set(real(signal.SIG_BLOCK, []))
    monkeypatch.setattr(interrupts.signal, "pthread_sigmask", blocks_then_raises)
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            submit(pool, time.sleep, 0)
            raised = False
        except KeyboardInterrupt:
            raised = True
    monkeypatch.undo()
    assert raised and set(real(signal.SIG_BLOCK, [])) == before


def test_join_bounded_returns_the_stuck_workers_in_time() -> None:
    release = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1)
    pool.submit(release.wait)
    t0 = time.monotonic()
    stuck = join_bounded(pool, 0.3)
    assert len(stuck) == 1 and time.monotonic() - t0 < 5
    release.set()
    assert join_bounded(pool, 5.0) == []


def test_a_thread_left_stuck_by_a_stop_does_not_hold_the_exit() -> None:
    """Ctrl-C exits 130 with its line even where a non-daemon thread would never finish."""
    script = textwrap.dedent("""
        import threading
        from flexgen_dist.errors import exit_code_of
        lock = threading.Lock(); lock.acquire()
        def body():
            threading.Thread(target=lock.acquire).start()  # never returns
            raise KeyboardInterrupt
        raise SystemExit(exit_code_of(body))
    """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert "interrupted; outputs written so far are kept" in r.stderr
    assert "1 I/O thread(s) stuck after the stop" in r.stderr
    assert time.monotonic() - t0 < 60
