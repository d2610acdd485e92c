"""One rank's place in the ring of stages, and the messages the generation loop sends round it.

Stage s receives hidden states from s-1 and sends its own to s+1; the last stage sends each
step's token ids (or a block's scores) back to stage 0. Every hidden-state message is
preceded by a one-element header: go on, or skip the block from here (it ended early).
``Ring`` knows the neighbours, posts and waits for the receives, bounds the sends in flight
and counts the time spent waiting; what to send and when is the loop's (``pipeline.py``).
With one stage there is no communicator: the loop keeps its tokens on the device and the
ring only says that rank 0 is both first and last.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from .comm import StageComm
from .topology import DistContext


class Ring:
    """This rank's neighbours and its messages (``comm`` None with one stage)."""

    def __init__(self, ctx: DistContext | None, device: torch.device, max_sends: int) -> None:
        ctx = ctx if ctx is not None and ctx.world_size > 1 else None
        self.comm: StageComm | None = None
        self.first = self.last = True
        self.prev: int | None = None
        self.next: int | None = None
        self.last_rank = 0
        self.wire = device  # where messages are built and received
        if ctx is not None:
            t = ctx.topology
            self.comm = StageComm(ctx)
            self.first, self.last = t.is_first, t.is_last
            self.prev, self.next = t.prev_rank, t.next_rank
            self.last_rank = t.world_size - 1
            self.wire = ctx.wire_device
        self.wait_s = 0.0  # time spent waiting for messages since the loop's clocks started
        self.max_sends = max_sends
        self._sends: list[Any] = []
        self._go, self._skip = (torch.tensor([v], dtype=torch.long, device=self.wire) for v in (0, 1))

    def start_together(self) -> None:
        """Every stage's clock starts when all are ready (a barrier of bounded waits: a rank
        that failed while getting ready is named, as in any receive)."""
        if self.comm is None:
            return
        one = torch.zeros((1,), dtype=torch.long, device=self.wire)
        if self.first:
            for r in range(1, self.last_rank + 1):
                self.wait(self.comm.irecv(torch.empty_like(one), r))
            for r in range(1, self.last_rank + 1):
                self.wait(self.comm.isend(one, r))
        else:
            self.wait(self.comm.isend(one, 0))
            self.wait(self.comm.irecv(torch.empty_like(one), 0))
        self.wait_s = 0.0

    # --- receives --------------------------------------------------------------------------
    def post_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, tail: int = 0) -> tuple[Any, Any]:
        """The header (with ``tail`` more ids: a beam step's parent rows) and the hidden states
        of the next item from the previous stage."""
        assert self.comm is not None and self.prev is not None
        header = torch.empty((1 + tail,), dtype=torch.long, device=self.wire)
        buf = torch.empty(shape, dtype=dtype, device=self.wire)
        return self.comm.irecv(header, self.prev), self.comm.irecv(buf, self.prev)

    def post_from_last(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """Stage 0: a message from the last stage (token ids with the early-stop flag, or scores)."""
        assert self.comm is not None
        return self.comm.irecv(torch.empty(shape, dtype=dtype, device=self.wire), self.last_rank)

    def hidden(self, handle: tuple[Any, Any]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The hidden states ``post_hidden`` received (None where the header says skip), and the
        header's tail."""
        header, body = handle
        head = self.wait(header)
        x = self.wait(body)
        return (x if int(head[0].item()) == 0 else None), head[1:]

    def wait(self, handle: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.comm.wait(handle)  # type: ignore[union-attr]
        self.wait_s += time.perf_counter() - t0
        return out  # type: ignore[return-value]

    # --- sends -----------------------------------------------------------------------------
    def send_hidden(self, y: torch.Tensor, tail: torch.Tensor | None = None) -> None:
        """The item's hidden states to the next stage, behind a go header (and its ``tail``)."""
        self._send(self._go if tail is None else torch.cat([self._go, tail.to(self.wire)]), self.next)  # type: ignore[arg-type]
        self._send(y, self.next)  # type: ignore[arg-type]

    def send_skip(self, shape: tuple[int, ...], dtype: torch.dtype, tail: int = 0) -> None:
        """Tell the next stage to drop the block from this item on: a skip header (padded to the
        ``tail`` its receive expects), then an unread tensor of the shape that stage has posted
        its receive for (every receive it posted is matched, so none is left waiting)."""
        self._send(self._skip if not tail else torch.cat([self._skip, self._skip.new_zeros(tail)]),
                   self.next)  # type: ignore[arg-type]
        self._send(torch.empty(shape, dtype=dtype, device=self.wire), self.next)  # type: ignore[arg-type]

    def send_tokens(self, ids: torch.Tensor, ended: bool, logprobs: torch.Tensor | None = None) -> None:
        """The last stage: a step's sampled ids to stage 0, then (if asked for) their (b, w)
        float64 logprob rows bit for bit as int64, then the early-stop flag: one message."""
        parts = [ids.to(self.wire)]
        if logprobs is not None:
            parts.append(logprobs.contiguous().view(torch.long).reshape(-1).to(self.wire))
        self._send(torch.cat([*parts, self._skip if ended else self._go]), 0)

    def send_beams(self, step: Any, steps: int) -> None:
        """The last stage: a beam search step of a block to stage 0 (``Ledger.take``): its ids,
        each row's parent row, then its results (rows x ``steps`` ids, and the rows' float64
        scores bit for bit; zeros until the search is over), then the end flag: one message."""
        n = step.ids.shape[0]
        ids, scores = step.results if step.results is not None else \
            (torch.zeros((n, steps), dtype=torch.long), torch.zeros(n, dtype=torch.float64))
        parts = [step.ids, step.parents, ids.reshape(-1), scores.to(torch.float64).view(torch.long)]
        self._send(torch.cat([*(p.to(self.wire) for p in parts), self._skip if step.ended else self._go]), 0)

    def send_scores(self, acc: torch.Tensor) -> None:
        """The last stage: a block's summed scores to stage 0."""
        self._send(acc.to(self.wire), 0)

    def flush(self) -> None:
        """Wait for every send still in flight."""
        for h in self._sends:
            self.wait(h)
        self._sends.clear()

    def _send(self, x: torch.Tensor, dst: int) -> None:
        self._sends.append(self.comm.isend(x, dst))  # type: ignore[union-attr]
        if len(self._sends) > self.max_sends:  # bound the sends in flight
            self.wait(self._sends.pop(0))
