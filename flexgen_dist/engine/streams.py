"""CUDA streams of the engine: where the weights' copies are queued.

Every copy and kernel is issued on the default CUDA stream unless ``LOAD_STREAM_ENV`` is set:
then an I/O thread queues a slot's weight copies and expansions on a load stream
(``WeightStore.queued_load``), records an event after them (``OnStream``), and the compute thread
makes its stream wait on that event before the slot (``ready``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# On a GPU, with this set to 1, an I/O thread queues a slot's weight copies (and expansions) on
# a stream of their own, which the compute stream waits on by event (``OnStream``): the copies
# then run beside the kernels before them instead of after. Off by default until a GPU has
# measured it against the default stream (docs/architecture.md, "The block schedule is data").
LOAD_STREAM_ENV = "FLEXGEN_CUDA_LOAD_STREAM"


def load_stream(device: torch.device) -> Any:
    """The stream ``WeightStore.queued_load`` queues on: a new one on a GPU with
    ``LOAD_STREAM_ENV`` set to 1, else None (the compute stream)."""
    if device.type == "cuda" and os.environ.get(LOAD_STREAM_ENV) == "1":
        return torch.cuda.Stream(device)
    return None


@dataclass
class OnStream:
    """A slot's weights loaded on the load stream, and the event after their copies."""

    weights: dict[str, Any]
    event: Any  # torch.cuda.Event


def ready(loaded: Any) -> dict[str, Any]:
    """A slot's loaded weights for the compute stream. From the load stream (``OnStream``): the
    compute stream waits for the copies, and each tensor is marked as used there, so the caching
    allocator does not give its memory to the load stream's next allocation while the compute
    may still read it."""
    if not isinstance(loaded, OnStream):
        return loaded
    cur = torch.cuda.current_stream()
    cur.wait_event(loaded.event)
    for t in loaded.weights.values():
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(cur)
    return loaded.weights
