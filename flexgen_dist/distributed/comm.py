"""Point-to-point transfers between stages, with bounded waits, and a failure monitor.

`StageComm` moves hidden states and token ids between neighbouring stages; every wait is
bounded by the context's timeout and a dead peer becomes a `PeerFailure` naming its rank.
Sending to one's own rank loops back in process, so a one-stage pipeline (world size 1, no
process group) runs the same send/recv code as an m-stage one.

`FailureMonitor` makes one rank's failure end the whole job quickly, with a message naming
the rank that failed, instead of leaving the others blocked in a receive. See its docstring.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from flexgen_dist.distributed.topology import LOGGER_NAME, DistContext

log = logging.getLogger(LOGGER_NAME + ".comm")


class PeerFailure(RuntimeError):
    """A neighbouring rank did not answer in time or its connection broke."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


@dataclass
class CommHandle:
    """An outstanding isend/irecv; pass it to `StageComm.wait`."""

    op: str  # "send" | "recv"
    peer: int
    work: Any = None  # torch.distributed Work; None for loopback and world size 1
    buffer: torch.Tensor | None = None  # recv: the caller's buffer, filled by wait()
    wire: torch.Tensor | None = None  # the tensor the backend reads or writes
    done: bool = False


class StageComm:
    """Send and receive tensors and small objects between ranks of a `DistContext`."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        # Tensors sent to our own rank, oldest first (a one-stage pipeline sends to itself).
        self._loopback: collections.deque[torch.Tensor] = collections.deque()

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.ctx.world_size:
            raise ValueError(f"peer rank {peer} is outside [0, {self.ctx.world_size})")

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.ctx.backend == "nccl":
            if tensor.device != self.ctx.device:
                raise ValueError(f"nccl sends tensors on {self.ctx.device}, got {tensor.device}")
            return tensor.contiguous()
        # gloo moves CPU memory only: stage device tensors through the host.
        return tensor.detach().to("cpu").contiguous()

    def isend(self, tensor: torch.Tensor, dst: int) -> CommHandle:
        """Start sending `tensor` to `dst`; keep it unmodified until `wait` returns."""
        self._check_peer(dst)
        if dst == self.ctx.rank:
            self._loopback.append(tensor.detach().clone())
            return CommHandle("send", dst, done=True)
        wire = self._to_wire(tensor)
        try:
            work = dist.isend(wire, dst)
        except Exception as err:  # noqa: BLE001 - gloo raises plain RuntimeErrors
            raise _peer_failure("send", dst, err, self.ctx.timeout_s) from err
        return CommHandle("send", dst, work=work, wire=wire)

    def irecv(self, buf: torch.Tensor, src: int) -> CommHandle:
        """Start receiving into `buf` from `src`; `buf` holds the data once `wait` returns."""
        self._check_peer(src)
        if src == self.ctx.rank:
            return CommHandle("recv", src, buffer=buf)
        if self.ctx.backend == "nccl":
            if buf.device != self.ctx.device:
                raise ValueError(f"nccl receives into tensors on {self.ctx.device}, got {buf.device}")
            wire_device = buf.device
        else:
            wire_device = torch.device("cpu")  # gloo: stage device buffers through the host
        if buf.device == wire_device and buf.is_contiguous():
            wire = buf
        else:
            wire = torch.empty(buf.shape, dtype=buf.dtype, device=wire_device)
        try:
            work = dist.irecv(wire, src)
        except Exception as err:  # noqa: BLE001
            raise _peer_failure("recv", src, err, self.ctx.timeout_s) from err
        return CommHandle("recv", src, work=work, buffer=buf, wire=wire)

    def wait(self, handle: CommHandle, timeout_s: float | None = None) -> torch.Tensor | None:
        """Finish `handle` within `timeout_s` (default: the context's); return the recv buffer.

        Raises PeerFailure naming the peer when it does not answer in time or its connection
        breaks. With gloo a timed-out transfer also breaks the connection, so this is fatal.
        """
        if handle.done:
            return handle.buffer
        if handle.work is None:  # loopback receive
            if not self._loopback:
                raise RuntimeError(f"rank {handle.peer} waits for a tensor it never sent itself")
            data = self._loopback.popleft()
            _check_same(data, handle.buffer)
            handle.buffer.copy_(data)  # type: ignore[union-attr]
            handle.done = True
            return handle.buffer
        t = self.ctx.timeout_s if timeout_s is None else timeout_s
        try:
            finished = handle.work.wait(timedelta(seconds=t))
        except Exception as err:  # noqa: BLE001 - backend errors carry no useful type
            raise _peer_failure(handle.op, handle.peer, err, t) from err
        if finished is False:
            raise _peer_failure(handle.op, handle.peer, None, t)
        if handle.op == "recv" and handle.wire is not handle.buffer:
            handle.buffer.copy_(handle.wire)  # type: ignore[union-attr]
        handle.done = True
        handle.wire = None
        return handle.buffer

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.wait(self.isend(tensor, dst))

    def recv(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        src: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Receive a tensor of `shape`/`dtype` from `src` into `out` or a fresh buffer."""
        buf = torch.empty(tuple(shape), dtype=dtype, device=self.ctx.device) if out is None else out
        if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            raise ValueError(f"out is {tuple(buf.shape)} {buf.dtype}, expected {tuple(shape)} {dtype}")
        result = self.wait(self.irecv(buf, src))
        assert result is not None
        return result

    def send_obj(self, obj: object, dst: int) -> None:
        """Send a small picklable object (metadata) as a length header plus a byte tensor.

        Only for our own ranks: unpickling data from an untrusted peer is unsafe.
        """
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        wire = self.ctx.wire_device
        self.send(torch.tensor([payload.numel()], dtype=torch.int64, device=wire), dst)
        self.send(payload.to(wire), dst)

    def recv_obj(self, src: int) -> Any:
        wire = self.ctx.wire_device
        size = self.recv((1,), torch.int64, src, out=torch.empty(1, dtype=torch.int64, device=wire))
        n = int(size.item())
        data = self.recv((n,), torch.uint8, src, out=torch.empty(n, dtype=torch.uint8, device=wire))
        return pickle.loads(data.cpu().numpy().tobytes())


def _peer_failure(op: str, peer: int, err: BaseException | None, timeout_s: float) -> PeerFailure:
    text = "" if err is None else str(err).strip()
    if err is None or "imed out" in text or "imeout" in text:
        verb = "send" if op == "recv" else "receive"
        return PeerFailure(f"rank {peer} did not {verb} within {timeout_s:g} s: it probably died; "
                           "see its log", peer)
    return PeerFailure(f"rank {peer}: connection broke during {op} ({text[:300]}): it probably "
                       "died; see its log", peer)


def _check_same(data: torch.Tensor, buf: torch.Tensor | None) -> None:
    if buf is None or data.shape != buf.shape or data.dtype != buf.dtype:
        got = None if buf is None else (tuple(buf.shape), buf.dtype)
        raise ValueError(f"loopback: sent {tuple(data.shape)} {data.dtype}, receive buffer {got}")


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
