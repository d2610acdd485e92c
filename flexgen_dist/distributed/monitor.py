"""The failure monitor: one rank's failure ends the whole job quickly, with a message naming
the rank that failed, instead of leaving the others blocked in a receive (``FailureMonitor``;
see its docstring). Its store is a TCPStore of its own on rank 0 (``create_failure_store``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType

import torch.distributed as dist

from flexgen_dist.distributed.topology import LOGGER_NAME, DistContext

log = logging.getLogger(LOGGER_NAME + ".comm")

def create_failure_store(
    ctx: DistContext, port: int | None = None, timeout_s: float | None = None
) -> dist.TCPStore | None:
    """A TCPStore on rank 0 at master_addr:(master_port + 1) for the failure monitor.

    Separate from the process group's own store because under torchrun that one belongs to the
    launcher's agent. Returns None for world size 1 (nothing to monitor).
    """
    if ctx.world_size == 1:
        return None
    port = ctx.topology.master_port + 1 if port is None else port
    timeout = ctx.timeout_s if timeout_s is None else timeout_s
    try:
        return dist.TCPStore(
            ctx.topology.master_addr, port, is_master=ctx.rank == 0,
            timeout=timedelta(seconds=timeout), wait_for_workers=False,
        )
    except Exception as err:  # noqa: BLE001 - c10d raises DistNetworkError/RuntimeError
        where = "open" if ctx.rank == 0 else "reach"
        raise RuntimeError(
            f"rank {ctx.rank}: cannot {where} the failure monitor's store at "
            f"{ctx.topology.master_addr}:{port} (MASTER_PORT + 1): {err}. Pick another "
            "MASTER_PORT whose next port is free too, and open both in the firewall"
        ) from err


class FailureMonitor:
    """Make every rank exit non-zero, naming the culprit, when one rank fails or dies.

    Keys in the store (prefix "fgd/"): "hb/{r}" a heartbeat counter that rank r's thread bumps
    every `poll_s`; "state/{r}" = "failed:<msg>" (set by `report`), "aborted:<msg>" (rank r
    exited because of another rank) or "done" (clean `stop`). A daemon thread on each rank
    polls every `poll_s` and calls `on_abort`/cleanups then `os._exit(exit_code)` when
      - a peer's state is failed/aborted: "rank X failed: <msg>";
      - a peer's heartbeat has not moved for `timeout_s` (killed -9, hung, lost its node);
      - the store on rank 0 is unreachable before rank 0 said "done": rank 0 died.
    Heartbeats are counters, not timestamps, so clocks of different nodes need not agree.
    Rank 0 hosts the store, so its `stop` waits (at most `timeout_s`) until every peer is done
    or gone, and peers that have seen rank 0 "done" ignore the store vanishing.
    """

    def __init__(
        self,
        ctx: DistContext,
        store: dist.Store | None = None,
        on_abort: Callable[[], None] | None = None,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        exit_code: int = 1,
    ):
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.ctx = ctx
        self.timeout_s = ctx.timeout_s if timeout_s is None else float(timeout_s)
        self.store = store if store is not None else create_failure_store(ctx, timeout_s=self.timeout_s)
        self.poll_s = poll_s
        self.exit_code = exit_code
        self._cleanups: list[Callable[[], None]] = [on_abort] if on_abort is not None else []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers = [p for p in range(ctx.world_size) if p != ctx.rank]
        self._finished: dict[int, str] = {}  # peer -> "done" | "failed:..." | "aborted:..."
        self._reported = False

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run `fn` (best effort) before exiting on a peer's failure, e.g. remove offload files."""
        self._cleanups.append(fn)

    def start(self) -> FailureMonitor:
        if self.store is None or self._thread is not None:
            return self
        self.store.add(_key("hb", self.ctx.rank), 1)
        self._thread = threading.Thread(target=self._run, name="flexgen-failure-monitor", daemon=True)
        self._thread.start()
        return self

    def report(self, exc: BaseException, quiet: bool = False) -> None:
        """Tell the other ranks that this one failed with `exc` (once; best effort, never raises).
        Says so on stderr and in the rank log; ``quiet``: in the rank log only (the caller
        prints the error itself, with ``earlier_failure`` where there is one)."""
        if self._reported:
            return
        self._reported = True
        me = self.ctx.rank
        msg = f"{type(exc).__name__}: {exc}"[:1000]
        lines = [f"flexgen_dist rank {me} failed: {msg}"]
        if self.store is not None:
            try:
                # A broken connection is often the echo of an earlier failure: name the first.
                for p in self._peers:
                    if store_has(self.store, _key("state", p)):
                        state = self.store.get(_key("state", p)).decode(errors="replace")
                        if state.startswith("failed:"):
                            lines.append(f"flexgen_dist rank {me}: rank {p} had failed before: "
                                         f"{state[len('failed:'):][:300]}")
                self.store.set(_key("state", me), "failed:" + msg)
            except Exception as err:  # noqa: BLE001 - the store host may be gone already
                lines.append(f"flexgen_dist rank {me}: rank 0 (host of the failure store) is "
                             f"unreachable ({err}): it probably died first; see its log")
        for line in lines:
            (_to_log_files if quiet else _say)(line)

    def earlier_failure(self) -> tuple[int, str] | None:
        """(rank, message) of a failure another rank reported, or None: a broken connection
        here is often only the echo of it."""
        if self.store is None:
            return None
        try:
            for p in self._peers:
                if store_has(self.store, _key("state", p)):
                    state = self.store.get(_key("state", p)).decode(errors="replace")
                    if state.startswith("failed:"):
                        return p, f"rank {p} failed: {state[len('failed:'):][:500]}"
        except Exception:  # noqa: BLE001 - the store host is gone
            if self.ctx.rank != 0 and self._finished.get(0) != "done":
                return 0, "rank 0 failed: its failure store is unreachable: it probably died; see its log"
        return None

    def stop(self) -> None:
        """Stop the thread and say "done" (unless reported); rank 0 waits for its peers."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        store = self.store
        assert store is not None
        try:
            if not self._reported:
                store.set(_key("state", self.ctx.rank), "done")
            if self.ctx.rank == 0:
                # Keep the store alive until every peer is finished (or timeout_s passed); after
                # our own failure only long enough for the peers' monitors to read it.
                linger = min(self.timeout_s, 2 * self.poll_s + 1) if self._reported else self.timeout_s
                deadline = time.monotonic() + linger
                waiting = [p for p in self._peers if p not in self._finished]
                while waiting and time.monotonic() < deadline:
                    waiting = [p for p in waiting if not store.check([_key("state", p)])]
                    if waiting:
                        time.sleep(0.05)
        except Exception as err:  # noqa: BLE001
            log.warning("failure monitor stop: %s", err)

    def __enter__(self) -> FailureMonitor:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.report(exc)
        self.stop()

    def _run(self) -> None:
        store = self.store
        assert store is not None
        counts = {p: -1 for p in self._peers}
        last_change = {p: time.monotonic() for p in self._peers}
        while not self._stop.wait(self.poll_s):
            if self._reported:
                return  # this rank is failing already: let it clean up and exit on its own
            try:
                store.add(_key("hb", self.ctx.rank), 1)
                now = time.monotonic()
                for p in self._peers:
                    if p not in self._finished and store.check([_key("state", p)]):
                        self._finished[p] = store.get(_key("state", p)).decode(errors="replace")
                # Name a rank that failed before one that only aborted because of it.
                for kind in ("failed", "aborted"):
                    for p, state in sorted(self._finished.items()):
                        if state.startswith(kind + ":"):
                            self._abort(f"rank {p} {kind}: {state[len(kind) + 1:]}")
                for p in self._peers:
                    if p in self._finished:
                        continue
                    count = int(store.add(_key("hb", p), 0))
                    if count != counts[p]:
                        counts[p], last_change[p] = count, now
                    elif now - last_change[p] > self.timeout_s:
                        self._abort(
                            f"rank {p} failed: no heartbeat for {self.timeout_s:g} s "
                            "(killed, hung or its node is gone); see its log"
                        )
            except Exception as err:  # noqa: BLE001 - the store is gone
                if self._stop.is_set() or self._finished.get(0) == "done":
                    return
                addr = f"{self.ctx.topology.master_addr}:{self.ctx.topology.master_port + 1}"
                self._abort(
                    f"rank 0 failed: its failure store at {addr} is unreachable ({err}); "
                    "it probably died; see its log"
                )

    def _abort(self, reason: str) -> None:
        me = self.ctx.rank
        _say(f"error: rank {me} stops: {reason}")
        try:
            assert self.store is not None
            self.store.set(_key("state", me), "aborted:" + reason[:1000])
            if me == 0:
                # We host the store: keep it up until the peers have read why we stop.
                deadline = time.monotonic() + 2 * self.poll_s + 1
                waiting = [p for p in self._peers if p not in self._finished]
                while waiting and time.monotonic() < deadline:
                    waiting = [p for p in waiting if not store_has(self.store, _key("state", p))]
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - best effort
            pass
        for fn in self._cleanups:
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - best effort, we are exiting anyway
                print(f"flexgen_dist rank {me}: cleanup failed: {err}", file=sys.stderr)
        logging.shutdown()
        os._exit(self.exit_code)


def _handlers() -> list[logging.Handler]:
    out, lg = [], log
    while lg is not None:
        out += lg.handlers
        lg = lg.parent if lg.propagate else None  # type: ignore[assignment]
    return out


def _to_log_files(line: str) -> None:
    """To the rank's log files (``--log-dir``), not to stderr."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    for h in _handlers():
        if isinstance(h, logging.FileHandler):
            h.handle(record)


def _say(line: str) -> None:
    """Once to stderr (what launchers collect), and to the rank's log files."""
    print(line, file=sys.stderr, flush=True)
    _to_log_files(line)


def store_has(store: dist.Store, key: str) -> bool:
    return bool(store.check([key]))


def _key(kind: str, rank: int) -> str:
    return f"fgd/{kind}/{rank}"
