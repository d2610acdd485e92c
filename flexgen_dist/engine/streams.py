"""CUDA streams of the engine: where the weights' copies are queued.

On a GPU an I/O thread queues a slot's weight copies and expansions on a load stream
(``WeightStore.queued_load``), records an event after them (``OnStream``), and the compute thread
makes its stream wait on that event before the slot (``ready``). ``LOAD_STREAM_ENV=0`` issues
them on the compute stream instead, one after the kernels before them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# On a GPU an I/O thread queues a slot's weight copies (and expansions) on a stream of their
# own, which the compute stream waits on by event (``OnStream``): the copies run beside the
# kernels before them instead of after. On by default since an H200 measured it against the
# compute stream (OPT-6.7B, half its weights in RAM: total x1.15); this set to 0 turns it off
# (docs/architecture.md, "The block schedule is data").
LOAD_STREAM_ENV = "FLEXGEN_CUDA_LOAD_STREAM"


def uses_load_stream(device: torch.device) -> bool:
    """Whether weights loaded for ``device`` go through a load stream: on a GPU, unless
    ``LOAD_STREAM_ENV`` is 0."""
    flag = os.environ.get(LOAD_STREAM_ENV, "1").strip()
    if flag not in ("0", "1"):
        raise ValueError(f"{LOAD_STREAM_ENV}={flag!r}: use 1 (weights copied on a load stream, the default) or 0")
    return device.type == "cuda" and flag == "1"


def load_stream(device: torch.device) -> Any:
    """The stream ``WeightStore.queued_load`` queues on: a new one where ``uses_load_stream``,
    else None (the compute stream)."""
    return torch.cuda.Stream(device) if uses_load_stream(device) else None


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
