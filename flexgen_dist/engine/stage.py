"""StageEngine: one stage's layers, weights, caches and activations; runs the block schedule.

A stage owns a contiguous range of decoder layers, plus the embedding if it is the first stage
and the final norm + LM head if it is the last. The same code serves one stage (the whole
model) and the stages of a pipeline: a stage is the model minus what it does not own.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .. import kernels
from ..interrupts import submit
from ..kernels import gemm
from ..memory.disk import DiskStore
from ..memory.quant import QTensor
from ..memory.tiers import MemoryTracker, Tier
from ..memory.units import format_bytes
from ..models.common import Positions
from ..models.families import get_family
from ..models.lora_rows import LoraRows, with_rows
from ..models.source import WeightSource
from ..models.spec import ModelSpec
from . import head
from .activations import ActStore
from .attend import attend_fn, attend_layer_fn
from .block_state import (BlockState, block_cache, block_states, merged_positions, recurrent, step_inputs,
                          step_targets, valid_keys)
from .blocks import BlockMeta
from .policy import Policy, merge_decode
from .prefix import chain_prefix, prefix_pass
from .schedule import Step, sweep_steps
from .streams import load_stream, ready
from .twins import Twins, twins_at
from .weights import Slot, WeightStore, expert_of


@dataclass
class StageTimes:
    compute_s: float = 0.0
    io_wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "io_wait_s": self.io_wait_s}


class StageEngine:
    def __init__(self, spec: ModelSpec, source: WeightSource, layers: tuple[int, int], *,
                 has_embed: bool, has_head: bool, policy: Policy, device: torch.device,
                 dtype: torch.dtype, disk: DiskStore | None = None,
                 tracker: MemoryTracker | None = None) -> None:
        self.spec, self.policy, self.device, self.dtype = spec, policy, device, dtype
        self.family = get_family(spec.family)
        self.layers = list(range(*layers))
        self.slots: list[Slot] = ([("embed", None)] if has_embed else []) + \
            [("layer", j) for j in self.layers] + ([("head", None)] if has_head else [])
        self.has_embed, self.has_head = has_embed, has_head
        self.tracker = tracker or MemoryTracker()
        self.disk = disk
        self.times = StageTimes()
        # the blocks' cache positions (rows x positions of a layer), and those of them a prefix
        # held once or a prompt kept once spared (``BlockCache.spared``)
        self.cache_positions = [0, 0]
        # compressed: a checkpoint's own quantized blocks (GGUF Q4/Q8) are kept, not re-quantized
        read = source.get_packed if policy.compress_weight else source.get
        self.weights = WeightStore(self.slots, read, policy.fractions("w"), device, dtype,
                                   self.tracker, disk, compress=policy.compress_weight,
                                   group_size=policy.comp_group_size, bits=policy.comp_bits)
        # Every weight is placed now: release the checkpoint's handles, so memory maps that no
        # placed tensor uses are unmapped (mapped pages would also pin the page cache).
        source.close()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fg-load")
        if policy.overlap:
            self.weights.load_stream = load_stream(device)
        self.weights.executor = self._pool  # a sparse layer's chosen experts are read there
        self._wbuf: dict[int, Any] = {}
        # The next sweep's first slot, loading during this sweep's last one (``run_sweep(more=)``)
        self._ahead: Future | None = None
        self._more = False
        # a shared prefix's keys and values per layer, left by a block for the next (``BlockMeta.keep``)
        self._kept_prefix: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._pending: list[Future] = []
        self._runs: list[tuple[BlockState, int, int]] = []  # the current sweep's batches
        self._spans: list[tuple[int, int, int, int]] = []  # their parts' (see ``run_sweep``)
        self._compute_of: dict[int, float] = {}
        self.sweep_compute: list[float] = []  # compute seconds of each part of the last sweep

    def prepare(self, rows: set[int]) -> dict[str, float]:
        """One-time costs, paid now rather than inside the first timed step: the native CPU
        kernels' build (first use on a machine) and the GEMM form of every few-row CPU product
        this stage will run with ``rows`` rows, and a mixture's experts with any fewer (each shape
        and row bucket timed once per machine and stored, ``kernels/gemm.py``). Returns the
        seconds each took and the shapes timed now."""
        out = {"kernel_build_s": 0.0, "gemm_tune_s": 0.0, "gemm_shapes_tuned": 0}
        if self.device.type != "cpu" and not self.policy.cpu_attention:
            return out
        t0 = time.perf_counter()
        kernels.library()
        out["kernel_build_s"] = time.perf_counter() - t0
        if self.device.type != "cpu" or not gemm.tuning_enabled():
            return out
        dense: set[tuple[int, ...]] = set()
        routed: set[tuple[int, ...]] = set()  # an expert's products get any row count up to all the rows
        for slot in self.slots:
            for name, p in self.weights.placed[slot].items():
                if len(p.shape) == 2 and not isinstance(p.data, QTensor) and \
                        not (slot[0] == "embed" and name in ("tok.w", "pos.w")):  # lookups, not products
                    (routed if expert_of(name) is not None else dense).add(tuple(p.shape))
        policy = gemm.policy()
        before = policy.tuned
        t0 = time.perf_counter()
        if self.dtype != torch.float32:  # a prefill's products: the dtype's GEMM or float32's
            policy.prefill(self.dtype)
        buckets = sorted({gemm.rows_bucket(r) for r in rows if 0 < r <= gemm.MAX_ROWS})
        every = [1 << i for i in range(max(buckets, default=0).bit_length())]  # 1, 2, 4, ... the largest
        for shapes, ms in ((dense, buckets), (routed, every)):
            for m in ms:
                for n, k in sorted(shapes):
                    policy.form(m, n, k, self.dtype)
        out["gemm_tune_s"] = time.perf_counter() - t0
        out["gemm_shapes_tuned"] = policy.tuned - before
        return out

    # --- blocks -------------------------------------------------------------------------
    def new_block(self, meta: BlockMeta, tag: str = "") -> BlockState:
        total = meta.prompt_len + meta.gen_len
        if total > self.spec.max_positions:
            raise ValueError(f"prompt length {meta.prompt_len} + gen-len {meta.gen_len} = {total} exceeds "
                             f"the model's {self.spec.max_positions} positions: shorten prompts or --gen-len")
        cache = block_cache(self.spec, self.policy, meta, self.layers, self.device, self.dtype, self.tracker,
                            self.disk, tag) if self.layers else None
        if cache is not None:
            self.cache_positions[0] += cache.positions
            self.cache_positions[1] += cache.spared
        acts = ActStore(meta.batch_sizes, total * self.spec.hidden_size, self.policy.fractions("act"),
                        self.device, self.dtype, self.tracker, self.disk, tag)
        st = BlockState(meta, cache, acts, valid_keys(meta, self.device),
                        states=block_states(self.spec, self.policy, self.layers, sum(meta.batch_sizes), self.device,
                                            self.dtype, self.tracker, self.disk, self._pool, tag))
        self._kept_prefix = chain_prefix(st, self._kept_prefix)
        return st

    def free_block(self, st: BlockState) -> None:
        if st.cache is not None:
            st.cache.free()
        st.acts.free()
        if st.states is not None:
            st.states.free()

    # --- one token of one block ---------------------------------------------------------
    @torch.no_grad()
    def run_token(self, st: BlockState, i: int, inputs: list[torch.Tensor], first_batch: int = 0) -> list[torch.Tensor]:
        """Run token i over this stage's slots for GPU batches ``first_batch, first_batch + 1, ...``
        of the block (one per input; decode steps run every batch of the block).

        inputs[k]: token ids (b, t) for a first stage, else hidden states (b, t, hidden).
        Returns per GPU batch: last-position logits (b, vocab) for a last stage, else hidden
        states (b, t, hidden). A prefill run over a part of the block (the pipeline's finer
        prefill items) loads each off-device weight once for that part; on a last stage its
        logits come with the block's last GPU batch (None before; ``prefill_logits`` gives the
        earlier batches' then).
        """
        return self.run_sweep([(st, i, inputs, first_batch)])[0]

    @torch.no_grad()
    def run_sweep(self, parts: list[tuple[BlockState, int, list[torch.Tensor], int]],
                  more: bool = False) -> list[list[torch.Tensor]]:
        """One sweep over this stage's slots that runs several (block, token) parts: each
        slot's weights are loaded once and serve every part's GPU batches in turn (the
        overlapped schedule: a decode step of one block and a prefill piece of the next).
        ``parts``: (state, token i, inputs, first GPU batch) as for ``run_token``; returns
        each part's outputs.

        ``more``: another sweep follows. Its first slot's weights are then read while this
        sweep's last slot computes (and while the pipeline passes messages between the two),
        so an off-device first slot (often the embedding, the largest) does not stall the
        start of every step and the disk does not idle between steps. The two slots in flight
        are the same two the memory budget counts. ``drop_prefetch`` ends a speculative read
        that no sweep used."""
        self._more = more and self.policy.overlap
        runs: list[tuple[BlockState, int, int]] = []  # per flat batch q: (state, token, batch k)
        spans: list[tuple[int, int, int, int]] = []  # per q: its part's (first q, last q, first row, end row)
        for st, i, inputs, first in parts:
            ks = range(first, first + len(inputs))
            if i > 0 and len(ks) != len(st.meta.prompt_lens):
                raise ValueError(f"decode step {i} runs every GPU batch of the block, got batches {list(ks)}")
            st.outputs = [None] * len(inputs)
            st.out_base = first
            st.acts.set_inputs([x.to(self.device) for x in inputs], ks)
            sizes = st.meta.batch_sizes
            span = (len(runs), len(runs) + len(ks) - 1, sum(sizes[:first]), sum(sizes[:ks.stop]))
            runs += [(st, i, k) for k in ks]
            spans += [span] * len(ks)
        self._runs, self._spans = runs, spans
        self._compute_of = {id(st): 0.0 for st, _, _, _ in parts}
        for step in sweep_steps(len(self.slots), len(runs), self.policy.overlap):
            self._do(step)
        self.sweep_compute = [self._compute_of[id(st)] for st, _, _, _ in parts]
        return [st.outputs for st, _, _, _ in parts]

    def _do(self, s: Step) -> None:
        kind = s.kind
        st, i, k = self._runs[max(s.k, 0)]  # (a sync's k is -1 before the first batch)
        if kind == "compute":
            if self._more and s.j == len(self.slots) - 1 and s.k == 0:
                self._prefetch_first()
            t0, io0 = time.perf_counter(), self.times.io_wait_s
            self._compute(st, i, s.j, k)  # its wait for the slot's weights is I/O wait, not compute
            if s.k == len(self._runs) - 1:  # every batch of the sweep has used this slot's weights
                self.weights.release(self.slots[s.j], self._wbuf.pop(s.j))
            spent = time.perf_counter() - t0 - (self.times.io_wait_s - io0)
            self.times.compute_s += spent
            self._compute_of[id(st)] += spent
        elif kind == "load_weight":
            slot = self.slots[s.j]
            if s.j == 0 and self._ahead is not None:  # read during the previous sweep
                self._wbuf[0], self._ahead = self._ahead, None
            elif slot in self.weights.resident:
                self._wbuf[s.j] = self.weights.load(slot)
            else:
                fut = submit(self._pool, self.weights.queued_load, slot, self.weights.next_buffers())
                self._wbuf[s.j] = fut
                if not self.policy.overlap:
                    self._wait([fut])
        elif kind in ("load_cache", "store_cache") and self._staged(st, s):
            # a staged linear layer: the rows of the part's batches, at its first and last batch
            first, last, a, b = self._spans[s.k]
            j = self.slots[s.j][1]
            if kind == "load_cache" and s.k == first:
                self._pending += st.states.load(j, a, b, read=i > 0)  # type: ignore[union-attr,arg-type]
            elif kind == "store_cache" and s.k == last:
                self._pending += st.states.store(j)  # type: ignore[union-attr,arg-type]
        elif kind == "load_cache":
            if st.cache is not None and i > 0 and self.slots[s.j][0] == "layer":
                st.cache.load(self.slots[s.j][1], k, st.meta.prompt_len + i - 1)  # type: ignore[arg-type]
                if not self.policy.overlap:
                    self._wait([f for ch in st.cache.chunks.get((self.slots[s.j][1], k), []) for f in ch.futures])
        elif kind == "store_cache":
            if st.cache is not None and self.slots[s.j][0] == "layer":
                self._pending += st.cache.store(self.slots[s.j][1], k)  # type: ignore[arg-type]
        elif kind == "load_act":
            self._pending += st.acts.load(k)
        elif kind == "store_act":
            if s.j < len(self.slots) - 1:
                self._pending += st.acts.store(k)
        if kind == "sync" or not self.policy.overlap:
            self._wait(self._pending)
            self._pending = []

    def _staged(self, st: BlockState, s: Step) -> bool:
        """Whether step ``s`` is on a linear layer whose states ``st`` stages (``states.py``)."""
        slot = self.slots[s.j]
        return slot[0] == "layer" and st.states is not None and st.states.is_staged(slot[1])  # type: ignore[arg-type]

    def _prefetch_first(self) -> None:
        """Start reading the first slot's weights for the next sweep (see ``run_sweep``)."""
        if self._ahead is None and self.slots[0] not in self.weights.resident:
            self._ahead = submit(self._pool, self.weights.queued_load, self.slots[0], self.weights.next_buffers())

    def drop_prefetch(self) -> None:
        """Wait out and release a first-slot read that no sweep used (the end of a run)."""
        if self._ahead is not None:
            fut, self._ahead = self._ahead, None
            self.weights.release(self.slots[0], ready(fut.result()))

    def _wait(self, futs: list[Future]) -> None:
        t0 = time.perf_counter()
        for f in futs:
            f.result()
        self.times.io_wait_s += time.perf_counter() - t0

    def _weights(self, j: int) -> dict[str, torch.Tensor]:
        fut = self._wbuf[j]
        if isinstance(fut, Future):
            self._wait([fut])
            fut = fut.result()
        self._wbuf[j] = ready(fut)
        return self._wbuf[j]

    def _merged(self, st: BlockState, i: int, slot: Slot, num_gb: int) -> bool:
        """Whether decode runs this slot once over the rows of every GPU batch of the block.

        A decode GEMM of a few rows is bound by reading its weight matrix, and one GEMM over
        the rows of all GPU batches reads it once where batch by batch reads it ``num_gb``
        times: on a CPU device (bfloat16, opt-350m-sized layers) 8 GEMMs of 8 rows take
        207 ms against one of 64 rows 61 ms; on a GPU the weight streams from device memory
        once per step instead of once per GPU batch, with 1/num_gb of the linear layers' launches.
        The layer is row-wise except for attention, which still runs per GPU batch over that
        batch's own cache chunks. Only where nothing has to move between the batches'
        computes (``merge_decode``)."""
        if i == 0 or num_gb == 1 or not st.acts.on_device:
            return False
        if slot[0] == "head":
            return True
        if slot[0] != "layer" or st.cache is None:
            return False
        j = slot[1]
        return merge_decode(self.device.type, st.cache.on_disk(j), st.cache.on_device(j),  # type: ignore[arg-type]
                            self.policy.cpu_attention)

    def _compute_merged(self, st: BlockState, i: int, j: int, w: dict[str, torch.Tensor], num_gb: int) -> None:
        """Slot j for every GPU batch of the block at once (see ``_merged``)."""
        slot, spec = self.slots[j], self.spec
        w = self._lora(st, w, slot, "merged")
        xs = [st.acts.get(kk) for kk in range(num_gb)]
        bounds = [0]
        for x in xs:
            bounds.append(bounds[-1] + x.shape[0])
        spans = list(zip(bounds[:-1], bounds[1:]))
        last = st.merged_out
        # the slot before was merged too and its outputs are still the batches' inputs: its
        # output is the whole input, no copy (one concatenation per layer saved)
        x = last[1] if last is not None and all(a is b for a, b in zip(last[0], xs)) else torch.cat(xs)
        if slot[0] == "head":
            y = self.family.head(spec, w, x[:, -1]) if st.meta.targets is None else \
                head.score(self.family, spec, w, x, torch.cat([step_targets(st, i, kk) for kk in range(num_gb)]),
                           st.meta.score_k)
        else:
            assert st.cache is not None
            layer = slot[1]
            if spec.linear(layer):  # type: ignore[arg-type]
                attend = recurrent(st, layer, i, range(num_gb))  # type: ignore[arg-type,assignment]
            elif st.cache.whole_layer(layer):  # type: ignore[arg-type]
                attend = attend_layer_fn(self.spec, self.policy.attn_sparsity, st, layer, i, num_gb,  # type: ignore[arg-type]
                                         self.device)
            else:
                fns = []
                for kk in range(num_gb):
                    _, mrows, pos0 = self._step_inputs(st, i, kk, layer)  # type: ignore[arg-type]
                    fns.append(attend_fn(spec, self.policy.attn_sparsity, st, layer, kk, mrows, pos0))  # type: ignore[arg-type]

                def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
                    return torch.cat([f(q[a:b], k[a:b], v[a:b], sinks) for f, (a, b) in zip(fns, spans)])

            pos = merged_positions(st, i, num_gb, spec.num_kv_heads, self.device)
            y = self.family.layer_forward(spec, w, x, pos, attend, slot[1])
        views = [y[a:b] for a, b in spans]
        for kk, yk in enumerate(views):
            if j == len(self.slots) - 1:
                st.outputs[kk] = yk
            st.acts.put(kk, yk)
        st.merged_out = (views, y)

    def _compute(self, st: BlockState, i: int, j: int, k: int) -> None:
        slot = self.slots[j]
        w = self._weights(j)
        num_gb = len(st.meta.prompt_lens)
        if i == 0 and k == 0 and st.meta.shared and not st.meta.reuse:  # before the block's first GPU batch here
            # the prefix's row: its block's prompts share their adapter (``worker.with_shared_prefixes``)
            prefix_pass(self.family, self.spec, st, slot, self._lora(st, w, slot, "prefix"), self.device)
        if self._merged(st, i, slot, num_gb):
            if k == 0:  # every batch of the block, now; the steps of k > 0 find them done
                self._compute_merged(st, i, j, w, num_gb)
            return
        x = st.acts.get(k)
        spec = self.spec
        tw = twins_at(st, i, k, self.device)  # a prefill computing each prompt of the batch once
        if tw is not None and j == 0:
            x = tw.narrow(x)
        w = self._lora(st, w, slot, k, tw)
        pos, mrows, pos0 = self._step_inputs(st, i, k, slot[1] if slot[0] == "layer" else None)  # type: ignore[arg-type]
        if tw is not None and slot[0] != "head":
            layer = slot[1] if slot[0] == "layer" else None
            pos, mrows = tw.narrow_inputs((0, False) if layer is None else (spec.window(layer), spec.chunked(layer)),
                                          pos, mrows)
        elif tw is not None:  # every row again, for the head
            x = tw.widen(x if st.meta.embed else x[:, -1:])
        if slot[0] == "embed":
            y = self.family.embed(spec, w, x, pos)
        elif slot[0] == "head" and st.meta.embed:  # embeddings: the prefill's last hidden states
            y = head.embed(self.family, spec, w, x, st.meta.prompt_lens[k])
            st.outputs[k - st.out_base] = y
        elif slot[0] == "head" and i == 0 and st.meta.targets is None:
            st.acts.put(k, head.prefill_head(self.family, spec, st, w, k, x))  # the batch's rows, not its hidden states
            return
        elif slot[0] == "head":
            y = self.family.head(spec, w, x[:, -1]) if st.meta.targets is None else \
                head.score(self.family, spec, w, x, step_targets(st, i, k), st.meta.score_k)
            st.outputs[k - st.out_base] = y
        elif spec.linear(slot[1]):  # type: ignore[arg-type]
            rec = recurrent(st, slot[1], i, range(k, k + 1))  # type: ignore[arg-type]
            run = rec if tw is None else tw.recurrent(rec)
            y = self.family.layer_forward(spec, w, x, pos, run, slot[1])
            if tw is not None:  # the computed rows' states to every row
                tw.copy_states(run, rec)
        else:
            attend = attend_fn(spec, self.policy.attn_sparsity, st, slot[1], k, mrows, pos0, tw)  # type: ignore[arg-type]
            y = self.family.layer_forward(spec, w, x, pos, attend, slot[1])
            if i == 0 and k == num_gb - 1:  # every batch has used the prefix's keys
                if st.cache is not None and st.cache.prefix is not None and not st.meta.embed:  # decode attends to them
                    st.cache.prefix.hold(slot[1], *st.prefix_kv[slot[1]])  # type: ignore[index]
                if not st.meta.keep:
                    st.prefix_kv.pop(slot[1], None)  # type: ignore[arg-type]
        if tw is not None and slot[0] != "head" and j == len(self.slots) - 1:  # the stage's rows leave whole
            y = tw.widen(y)
        if slot[0] != "head" and j == len(self.slots) - 1:
            st.outputs[k - st.out_base] = y
        st.acts.put(k, y)

    def _lora(self, st: BlockState, w: dict[str, Any], slot: Slot, k: int | str, tw: Twins | None = None
              ) -> dict[str, Any]:
        """A layer's weights with its adapted matrices adding each row's LoRA adapter
        (``models/lora_rows.py``): the rows of GPU batch k, of every batch ("merged"), the
        shared prefix's one row ("prefix"), or (``tw``) batch k's rows a prefill computes;
        ``w`` itself where no row has one."""
        adapters = st.meta.adapters
        if adapters is None or slot[0] != "layer":
            return w
        key = k if tw is None else ("twins", k)
        rows = st.lora_rows.get(key)
        if rows is None:
            ids = [a for batch in adapters for a in batch] if k == "merged" else \
                adapters[0][:1] if k == "prefix" else adapters[k]  # type: ignore[index]
            if tw is not None:
                ids = [ids[r] for r in tw.reps.tolist()]
            rows = st.lora_rows[key] = LoraRows.of(ids)
        return with_rows(w, rows)

    def _step_inputs(self, st: BlockState, i: int, k: int,
                     layer: int | None = None) -> tuple[Positions, torch.Tensor | None, int]:
        """``step_inputs`` for layer ``layer``'s window (None: the embedding's and head's, all positions)."""
        if layer is None:
            return step_inputs(st, i, k, 0, self.spec.num_kv_heads, self.device)
        return step_inputs(st, i, k, self.spec.window(layer), self.spec.num_kv_heads, self.device,
                           self.spec.chunked(layer))

    prefill_logits = staticmethod(head.prefill_logits)

    # --- reporting and cleanup ----------------------------------------------------------
    def peak_bytes(self) -> dict[str, int]:
        return self.tracker.peak_bytes()

    def describe(self) -> str:
        b = self.weights.bytes_per_tier()
        return ", ".join(f"{t}: {format_bytes(n)}" for t, n in b.items() if n)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["StageEngine", "BlockMeta", "BlockState", "StageTimes", "Tier"]
