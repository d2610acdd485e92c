"""Weight placement (layer granularity) and loading onto the compute device.

Each tensor of a slot lives whole on one tier (a head tied to the embedding of the same stage
shares the embedding's tensor). Within a slot, tensors are walked in order and
each goes to the tier whose share of the slot's cumulative bytes contains the tensor's middle
byte, so every slot (and hence the stage) splits its bytes by the policy's fractions, and
every layer loads the same amount from each tier (even overlap from layer to layer).
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from ..interrupts import submit
from ..kernels.qweight import QWeight
from ..memory.disk import DiskStore, DiskTensor, aligned_empty
from ..memory.tiers import MemoryTracker, Tier, copy_between, pin_if_cuda
from ..memory.quant import E4M3, INT, LUT4, QTensor, dequantize, lut4_table, qtensor_layout, quantize
from ..models.common import EXPERTS
from ..models.packed import PackedWeight
from .streams import OnStream

_PARTS = ("data", "mins", "scales")  # a compressed weight's parts, each a file on disk
# matrices --compress-weight leaves dense: a sequence classifier's score rows (a few rows of the
# hidden size: 4-bit groups would save nothing worth having and move its logits, by up to 1
# in a one-row judge's difference of head rows)
DENSE = frozenset({"score.w"})
Slot = tuple[str, int | None]  # ("embed", None) | ("layer", model layer index) | ("head", None)
TIED = "tok.w"  # the canonical name of a token embedding, and of an LM head tied to it


class TierPlacer:
    """The tier of each weight tensor of a stage, slot by slot, by the (gpu, cpu, disk)
    fractions: each slot's tensors go to the tiers in order, a tensor where its middle byte
    falls, and each slot's split carries the rounding of the slots before it (error
    diffusion). So every slot is within about one tensor of its share, and the stage's bytes
    on each tier are within one tensor (the largest) of their fraction of the total: the
    bound the planner reserves for whole tensors."""

    def __init__(self, fractions: tuple[float, float, float]) -> None:
        self.g, self.gc = fractions[0], fractions[0] + fractions[1]
        self.total = self.on_gpu = self.on_gpu_or_cpu = 0

    def place(self, sizes: list[int]) -> list[Tier]:
        end = self.total + sum(sizes)
        to_gpu = self.g * end - self.on_gpu  # what this slot should add to each running total
        to_gc = self.gc * end - self.on_gpu_or_cpu
        out, cum = [], 0
        for s in sizes:
            mid = cum + s / 2
            cum += s
            out.append(Tier.GPU if mid < to_gpu else Tier.CPU if mid < to_gc else Tier.DISK)
        self.total = end
        self.on_gpu += sum(s for s, t in zip(sizes, out) if t == Tier.GPU)
        self.on_gpu_or_cpu += sum(s for s, t in zip(sizes, out) if t != Tier.DISK)
        return out


@dataclass
class Placed:
    """One weight tensor at rest on its tier (possibly compressed)."""

    tier: Tier
    data: Any  # torch.Tensor (gpu/cpu), DiskTensor (disk), or QTensor (compressed gpu/cpu)
    shape: tuple[int, ...]
    nbytes: int


class WeightStore:
    """All weights of one stage, placed on tiers; loads a slot's weights to the compute device."""

    def __init__(self, slots: list[Slot], read: Callable[[str, int | None], dict[str, torch.Tensor]],
                 fractions: tuple[float, float, float], device: torch.device, dtype: torch.dtype,
                 tracker: MemoryTracker, disk: DiskStore | None, compress: bool = False,
                 group_size: int = 64, bits: int = 4) -> None:
        self.device, self.dtype, self.tracker, self.disk = device, dtype, tracker, disk
        self.compress, self.group_size, self.bits = compress, group_size, bits
        self.placed: dict[Slot, dict[str, Placed]] = {}
        # Two rotating sets of aligned host buffers for disk reads: at most two slots are in
        # flight (the one computing, the one prefetched), and reusing pre-faulted buffers keeps
        # the I/O thread asleep in O_DIRECT reads instead of page-faulting fresh memory, which
        # on a CPU device would steal cycles from the compute threads.
        self._bufsets: list[dict[tuple, torch.Tensor]] = [{}, {}]
        self._turn = 0
        # on a GPU: per read-buffer set, an event after the last copies out of it (``_reuse``)
        self._set_used: dict[int, Any] = {}
        self.executor: Executor | None = None  # where experts' reads run (the engine's I/O threads)
        self.load_stream: Any = None  # a CUDA stream for ``queued_load`` (``load_stream``), or None
        self.expert_stats = ExpertStats()
        placer = TierPlacer(fractions)
        for slot in slots:
            ws = read(*slot)
            tied = self._tied_head(slot, ws)
            names = [n for n in ws if tied is None or n != TIED]
            tiers = placer.place([self._stored_nbytes(n, ws[n]) for n in names])
            self.placed[slot] = {n: self._put(slot, n, ws[n], t) for n, t in zip(names, tiers)}
            if tied is not None:
                self.placed[slot][TIED] = tied
            del ws
        # slots whose every tensor is at rest on the compute device, uncompressed: loading them
        # is a dict of references, not worth a trip through the I/O thread
        self.resident = {slot for slot, ws in self.placed.items()
                         if all(isinstance(p.data, torch.Tensor) and p.data.device == device for p in ws.values())}
        self._make_buffers()

    def _make_buffers(self) -> None:
        """Make the read buffers now, while the model loads, with their pages touched (or
        pinned): made on first use, their fresh pages were faulted in by the I/O thread during
        the first sweeps, which on a CPU device shares the compute threads' cores, and on the
        critical path of a pipeline's first piece. Loads take the two sets in turn, one per
        off-device slot, so two sweeps' turns give each set exactly the buffers a run would
        make in it (with an even number of such slots a slot always gets the same set)."""
        order = [slot for slot in self.placed if slot not in self.resident]
        for n, slot in enumerate(order + order):
            for name, p in self.placed[slot].items():
                self._buffers_of(self._bufsets[n % 2], name, p)

    def _tied_head(self, slot: Slot, ws: dict[str, torch.Tensor]) -> Placed | None:
        """The embedding's placement, when ``slot`` is a head tied to an embedding of this store.

        A family names the LM head matrix "tok.w" exactly when it is the token embedding, so a
        stage holding both stores it once; a head on another stage keeps its own copy.
        """
        embed = self.placed.get(("embed", None), {})
        return embed.get(TIED) if slot == ("head", None) and TIED in ws else None

    def _stored_nbytes(self, name: str, w: torch.Tensor | PackedWeight) -> int:
        if isinstance(w, PackedWeight):
            return stored_nbytes(w.shape, self.dtype.itemsize, (w.bits, w.group_size, w.fmt))
        return stored_nbytes(tuple(w.shape), self.dtype.itemsize,
                             (self.bits, self.group_size) if self.compress and name not in DENSE else None)

    def _put(self, slot: Slot, name: str, w: torch.Tensor | PackedWeight, tier: Tier) -> Placed:
        shape = tuple(w.shape)
        if isinstance(w, PackedWeight):
            # the checkpoint's own groups (GGUF blocks, GPTQ groups, FP8 blocks' rows along the
            # input dim), adopted as they are
            w = QTensor(data=w.codes, mins=w.mins, scales=w.scales, shape=torch.Size(w.shape),  # type: ignore[assignment]
                        dtype=self.dtype, dim=1, group_size=w.group_size, bits=w.bits, fmt=w.fmt)
        elif self.compress and w.dim() == 2 and name not in DENSE:
            # grouped along the input dim (dim 1 of an (out, in) matrix), as GGUF blocks are
            w = quantize(w, bits=self.bits, group_size=self.group_size, dim=1)  # type: ignore[assignment]
        if isinstance(w, QTensor) and tier == Tier.DISK:  # compressed on disk too: ~4x less to read
            assert self.disk is not None
            data = self.disk.store_qtensor(f"w-{slot[0]}{slot[1] if slot[1] is not None else ''}-{name}", w)
            nbytes = data.nbytes
        elif tier == Tier.DISK:
            assert self.disk is not None
            dt = self.disk.allocate(f"w-{slot[0]}{slot[1] if slot[1] is not None else ''}-{name}",
                                    shape, self.dtype)
            dt.write(w)
            nbytes = dt.nbytes
            data: Any = dt
        elif tier == Tier.GPU:
            data = w.to(self.device)
            nbytes = data.nbytes
        else:
            data = w.pin() if isinstance(w, QTensor) and self.device.type == "cuda" else (
                w if isinstance(w, QTensor) else pin_if_cuda(w, self.device))
            nbytes = data.nbytes
        self.tracker.add(tier, nbytes)
        return Placed(tier, data, shape, nbytes)

    def bytes_per_tier(self) -> dict[str, int]:
        out = {t.value: 0 for t in Tier}
        for p in self.unique_placed():
            out[p.tier.value] += p.nbytes
        return out

    def unique_placed(self) -> list[Placed]:
        """Every stored tensor once (a tied head shares the embedding's)."""
        seen: dict[int, Placed] = {}
        for ws in self.placed.values():
            for p in ws.values():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def next_buffers(self) -> dict[tuple, torch.Tensor]:
        """The read-buffer set for the next load; call in schedule order (not from workers)."""
        bufs = self._bufsets[self._turn]
        self._turn ^= 1
        return bufs

    def _buffers_of(self, bufs: dict[tuple, torch.Tensor], name: str, p: Placed) -> dict[str, torch.Tensor]:
        """The host buffers in ``bufs`` that loading tensor ``name`` uses (made on first use):
        a compressed weight on disk is read part by part into "data", "mins" and "scales"; a
        dense one on disk into "dense", and on a CPU device a compressed one expands there."""
        out = {}
        if isinstance(p.data, QTensor) and isinstance(p.data.data, DiskTensor):
            for k in _PARTS:
                dt = getattr(p.data, k)
                out[k] = self._buffer(bufs, f"{name}.{k}", tuple(dt.shape), dt.dtype)
        if isinstance(p.data, DiskTensor) or (isinstance(p.data, QTensor) and self.device.type == "cpu"):
            out["dense"] = self._buffer(bufs, name, p.shape)
        return out

    def _buffer(self, bufs: dict[tuple, torch.Tensor], name: str, shape: tuple[int, ...],
                dtype: torch.dtype | None = None) -> torch.Tensor:
        key = (name, tuple(shape), dtype)
        if key not in bufs:
            cuda = self.device.type == "cuda"
            bufs[key] = aligned_empty(shape, dtype or self.dtype, pin=cuda)
            bufs[key].view(-1).view(torch.uint8).zero_()  # its pages, now (see _make_buffers)
            self.tracker.add(Tier.CPU if cuda else Tier.GPU, bufs[key].nbytes)
        return bufs[key]

    def load(self, slot: Slot, bufs: dict[tuple, torch.Tensor] | None = None) -> dict[str, Any]:
        """The slot's weights as compute-device tensors (views where already there); on a CPU
        device a compressed matrix comes as a ``QWeight``, still packed (in the read buffers
        when it was on disk), which the model math multiplies as it is. A sparse layer's
        routed experts are not read here: they come as one ``SlotExperts`` under ``EXPERTS``,
        which reads an expert when the tokens choose it.

        ``bufs`` (from ``next_buffers``) receives what is read from disk.
        """
        if bufs is None:
            bufs = self.next_buffers()
        self._reuse(bufs)
        out: dict[str, Any] = {}
        experts: dict[int, list[str]] = {}
        for name, p in self.placed[slot].items():
            e = expert_of(name)
            if e is not None:
                experts.setdefault(e, []).append(name)
                continue
            out[name] = self._load_one(name, p, bufs)
        self._mark(bufs)
        if experts:
            out[EXPERTS] = SlotExperts(self, slot, bufs, experts)
        return out

    def queued_load(self, slot: Slot, bufs: dict[tuple, torch.Tensor]) -> Any:
        """``load`` on an I/O thread: with a ``load_stream``, its copies and expansions queued
        there and an event after them (``OnStream``; the compute thread passes it to ``ready``)."""
        if self.load_stream is None:
            return self.load(slot, bufs)
        with torch.cuda.stream(self.load_stream):
            w = self.load(slot, bufs)
            ev = torch.cuda.Event()
            ev.record()
        return OnStream(w, ev)

    def _reuse(self, bufs: dict[tuple, torch.Tensor]) -> None:
        """Before the host reads from disk into read-buffer set ``bufs`` again, on a GPU: wait
        until the copies that last read it from there have run. A copy out of pinned memory
        returns before it runs, and the set comes back two slots later: with the GPU behind the
        host, the next read would overwrite bytes that a queued copy had still to move."""
        ev = self._set_used.pop(id(bufs), None)
        if ev is not None:
            ev.synchronize()

    def _mark(self, bufs: dict[tuple, torch.Tensor]) -> None:
        """After copies out of ``bufs`` were queued (a slot's load, a sparse layer's experts)."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._set_used[id(bufs)] = ev

    def _load_one(self, name: str, p: Placed, bufs: dict[tuple, torch.Tensor]) -> Any:
        """One placed tensor on the compute device (``load``)."""
        b = self._buffers_of(bufs, name, p)
        if isinstance(p.data, QTensor):
            q = p.data
            if isinstance(q.data, DiskTensor):  # read the parts, expand on the compute device
                for k in _PARTS:
                    getattr(q, k).read(out=b[k])
                q = replace(q, **{k: b[k] for k in _PARTS})
            if self.device.type == "cpu" and q.dim == 1 and len(q.shape) == 2 and (q.fmt == INT or q.fmt in LUT4):
                # packed: the product reads the codes (decode), or expands them into the
                # reused buffer (prefill); nothing is expanded here, on the I/O thread
                return QWeight(q.data, q.mins, q.scales, (int(q.shape[0]), int(q.shape[1])),
                               q.group_size, q.bits, q.dtype, b["dense"],
                               table=lut4_table(q.fmt) if q.fmt in LUT4 else None)
            if self.device.type == "cpu":  # into a reused buffer: no fresh pages to fault in
                return dequantize(q, self.device, out=b["dense"])
            t = dequantize(q, self.device)
            self.tracker.add(Tier.GPU, t.nbytes)
            return t
        if isinstance(p.data, DiskTensor):
            host = b["dense"]
            p.data.read(out=host)
            if self.device.type == "cpu":
                return host
            t = host.to(self.device, non_blocking=True)
            self.tracker.add(Tier.GPU, t.nbytes)
            return t
        if p.data.device == self.device:
            return p.data
        buf = torch.empty(p.shape, dtype=self.dtype, device=self.device)
        copy_between(buf, p.data, non_blocking=True)
        self.tracker.add(Tier.GPU, buf.nbytes)
        return buf

    def _moves(self, p: Placed) -> bool:
        """Whether loading ``p`` allocates on the compute device (released with the slot)."""
        if isinstance(p.data, (DiskTensor, QTensor)) and self.device.type == "cpu":
            return False  # a reused buffer, counted once when it was made
        return isinstance(p.data, (QTensor, DiskTensor)) or p.data.device != self.device

    def release(self, slot: Slot, loaded: dict[str, Any]) -> None:
        """Account for dropping a loaded slot (the tensors are freed by reference counting)."""
        for name, p in self.placed[slot].items():
            if expert_of(name) is None and self._moves(p):
                self.tracker.sub(Tier.GPU, loaded[name].nbytes)
        experts = loaded.get(EXPERTS)
        if isinstance(experts, SlotExperts):
            experts.release()


def expert_of(name: str) -> int | None:
    """The routed expert a canonical weight name belongs to (``experts.{e}.*``), else None."""
    if not name.startswith("experts."):
        return None
    return int(name.split(".", 2)[1])


@dataclass
class ExpertStats:
    """What a stage's sparse layers routed and read: per (slot load, GPU batch) the tokens and
    the experts they chose; the expert bytes brought to the compute device (read from disk, or
    copied from host RAM to a GPU)."""

    routings: int = 0  # (sparse layer, GPU batch) products routed
    tokens: int = 0  # tokens routed, over them
    experts_chosen: int = 0  # distinct experts chosen, over them
    experts_expected: float = 0.0  # the cost model's E (1 - (1 - k/E)^T) for the same routings
    loads: int = 0  # (sparse layer, sweep) expert sets used
    experts_loaded: int = 0  # experts brought in, over the loads
    experts_possible: int = 0  # every expert of every load
    bytes_moved: int = 0
    bytes_possible: int = 0  # what moving every expert of every load would have cost

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.__dict__)
        out["experts_loaded_fraction"] = self.experts_loaded / self.experts_possible if self.experts_possible else 0.0
        out["chosen_over_expected"] = self.experts_chosen / self.experts_expected if self.experts_expected else None
        return out

    def since(self, before: ExpertStats) -> ExpertStats:
        """What was counted after ``before`` (a copy taken then)."""
        return ExpertStats(**{k: v - getattr(before, k) for k, v in self.__dict__.items()})

    def copy(self) -> ExpertStats:
        return ExpertStats(**self.__dict__)


class SlotExperts:
    """A loaded sparse layer's routed experts, read from their tiers when first chosen (the
    model math's ``Experts``): ``prefetch`` starts the reads of the experts a batch chose, all
    at once, on the I/O threads, so the next expert's bytes arrive while one computes; ``get``
    waits for one. An expert read for one GPU batch serves every later batch of the sweep."""

    def __init__(self, store: WeightStore, slot: Slot, bufs: dict[tuple, torch.Tensor],
                 names: dict[int, list[str]]) -> None:
        self.store, self.slot, self.bufs, self.names = store, slot, bufs, names
        self.loaded: dict[int, Any] = {}  # expert -> its weights, or a Future of them
        self._lock = threading.Lock()
        store.expert_stats.loads += 1
        store.expert_stats.experts_possible += len(names)
        store.expert_stats.bytes_possible += sum(self._moved_bytes(e) for e in names)

    def _moved_bytes(self, e: int) -> int:
        placed = self.store.placed[self.slot]
        return sum(placed[n].nbytes for n in self.names[e] if _on_disk(placed[n]) or self.store._moves(placed[n]))

    def _read(self, e: int) -> dict[str, Any]:
        placed = self.store.placed[self.slot]
        out = {n.split(".", 2)[2]: self.store._load_one(n, placed[n], self.bufs) for n in self.names[e]}
        self.store._mark(self.bufs)
        return out

    def prefetch(self, ids: list[int]) -> None:
        pool = self.store.executor
        with self._lock:
            for e in ids:
                if e in self.loaded:
                    continue
                moved = self._moved_bytes(e)
                st = self.store.expert_stats
                st.experts_loaded += 1
                st.bytes_moved += moved
                # bytes to read go to the I/O threads; an expert already in place is a view
                self.loaded[e] = submit(pool, self._read, e) if pool is not None and moved else self._read(e)

    def note_routing(self, tokens: int, chosen: int, expected: float) -> None:
        """One product's routing: ``tokens`` routed, ``chosen`` distinct experts, ``expected``
        by the cost model's formula (for the metrics)."""
        st = self.store.expert_stats
        st.routings += 1
        st.tokens += tokens
        st.experts_chosen += chosen
        st.experts_expected += expected

    def get(self, e: int) -> dict[str, Any]:
        if e not in self.loaded:
            self.prefetch([e])
        w = self.loaded[e]
        if isinstance(w, Future):
            w = self.loaded[e] = w.result()
        return w

    def release(self) -> None:
        """Account for dropping the experts this load brought to a GPU."""
        placed = self.store.placed[self.slot]
        for e, w in self.loaded.items():
            if isinstance(w, Future):
                w = w.result()
            for n in self.names[e]:
                if self.store._moves(placed[n]):
                    self.store.tracker.sub(Tier.GPU, w[n.split(".", 2)[2]].nbytes)
        self.loaded.clear()


def _on_disk(p: Placed) -> bool:
    return isinstance(p.data, DiskTensor) or (isinstance(p.data, QTensor) and isinstance(p.data.data, DiskTensor))


def stored_nbytes(shape: tuple[int, ...], dtype_bytes: int, packed: tuple[Any, ...] | None = None) -> int:
    """Bytes a weight of ``shape`` takes at rest: dense, or with ``packed = (bits, group_size)``
    codes plus a min and a scale per group along dim 1 (the layout of a compressed weight);
    ``(8, group_size, "e4m3")``: FP8 codes and a float32 scale per group (no mins); ``(4,
    group_size, fmt)`` of a 4-bit table format (``LUT4``) alike, with 4-bit codes."""
    if packed is None or len(shape) != 2:
        return math.prod(shape) * dtype_bytes
    data_shape, meta_shape = qtensor_layout(shape, packed[0], packed[1], dim=1)
    if len(packed) > 2 and (packed[2] == E4M3 or packed[2] in LUT4):
        return math.prod(data_shape) + 4 * math.prod(meta_shape)
    return math.prod(data_shape) + 2 * math.prod(meta_shape) * dtype_bytes
