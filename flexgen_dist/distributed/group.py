"""The ranks of a run as one object that always exists: a single process is a group of one.

``RankGroup`` is what the API talks to: rank 0 broadcasts the workload and the plan, every
rank gathers its stage record to rank 0, and a failure on one rank is reported to the others
(``FailureMonitor``). With one rank every call is local and no monitor runs, so callers never
ask whether there is a process group.
"""
from __future__ import annotations

from typing import Any, Callable

from .comm import PeerFailure, StageComm
from .monitor import FailureMonitor
from .topology import DistContext


class RankGroup:
    """Rank 0 and its peers over a ``DistContext`` (world size 1: rank 0 alone)."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self.rank, self.size = ctx.topology.rank, ctx.topology.world_size
        self._comm = StageComm(ctx)
        self._monitor: FailureMonitor | None = None

    def start_monitor(self) -> None:
        """Report this rank's failures to the others and exit on theirs (several ranks only)."""
        if self.size > 1 and self._monitor is None:
            self._monitor = FailureMonitor(self.ctx).start()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others' argument is ignored)."""
        if self.size == 1:
            return obj
        if self.is_driver:
            for r in range(1, self.size):
                self._comm.send_obj(obj, r)
            return obj
        return self._comm.recv_obj(0)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order on rank 0; an empty list on the others."""
        if not self.is_driver:
            self._comm.send_obj(obj, 0)
            return []
        return [obj] + [self._comm.recv_obj(r) for r in range(1, self.size)]

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when a peer's failure ends this rank (one rank: nothing to watch)."""
        if self._monitor is not None:
            self._monitor.add_cleanup(fn)

    def report(self, exc: BaseException) -> PeerFailure | None:
        """Tell the peers that this rank failed with ``exc``; the failure to name instead of
        ``exc`` when ``exc`` is the echo of an earlier failure on another rank."""
        if self._monitor is None:
            return None
        cause = self._monitor.earlier_failure() if isinstance(exc, PeerFailure) else None
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self._monitor.report(exc, quiet=True)
        return None if cause is None else PeerFailure(cause[1], cause[0])

    def close(self) -> None:
        """Stop the monitor (rank 0 waits here until its peers are done), leave the group."""
        try:
            if self._monitor is not None:
                self._monitor.stop()
        finally:
            self.ctx.close()
