"""Point-to-point transfers between stages, with bounded waits.

`StageComm` moves hidden states and token ids between neighbouring stages; every wait is
bounded by the context's timeout and a dead peer becomes a `PeerFailure` naming its rank.
Sending to one's own rank loops back in process, so a one-stage pipeline (world size 1, no
process group) runs the same send/recv code as an m-stage one.

A dead peer's failure reaches the other ranks through ``monitor.FailureMonitor``.
"""

from __future__ import annotations

import collections
import logging
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
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
