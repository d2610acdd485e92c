"""The suite's own lock: under pytest-xdist a test marked `exclusive` runs while no other
test does (conftest._machine_share), and a waiting exclusive test is not starved."""
from __future__ import annotations

import tempfile
import threading
import time
import uuid
from pathlib import Path

from conftest import _machine_share


def test_an_exclusive_test_waits_for_running_tests_and_holds_back_new_ones(monkeypatch) -> None:
    uid = f"lock-test-{uuid.uuid4().hex}"
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uid)
    events: list[str] = []
    running, release = threading.Event(), threading.Event()

    def other_test(name: str, hold: threading.Event | None) -> None:
        with _machine_share(False):
            events.append(f"{name} start")
            if hold is not None:
                running.set()
                hold.wait(10)
            events.append(f"{name} end")

    first = threading.Thread(target=other_test, args=("first", release))
    first.start()
    assert running.wait(10)
    exclusive_done = threading.Event()

    def exclusive_test() -> None:
        with _machine_share(True):
            events.append("exclusive start")
            time.sleep(0.2)
            events.append("exclusive end")
        exclusive_done.set()

    ex = threading.Thread(target=exclusive_test)
    ex.start()
    time.sleep(0.3)  # the exclusive test now waits for the first to end
    assert "exclusive start" not in events
    second = threading.Thread(target=other_test, args=("second", None))
    second.start()  # a test started meanwhile waits at the turnstile
    time.sleep(0.3)
    assert "second start" not in events
    release.set()
    for t in (first, ex, second):
        t.join(10)
    assert exclusive_done.is_set()
    assert events == ["first start", "first end", "exclusive start", "exclusive end", "second start", "second end"]
    for f in Path(tempfile.gettempdir()).glob(f"flexgen-tests-{uid}.*"):
        f.unlink()


def test_without_xdist_nothing_is_locked(monkeypatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    with _machine_share(True), _machine_share(True):  # would deadlock if it locked
        pass
