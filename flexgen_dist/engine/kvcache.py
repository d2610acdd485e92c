"""The KV cache of one stage for one block: preallocated, split by rows across tiers.

For each (layer, GPU batch) the cache has R = batch * kv_heads rows. The first rows go to the
compute device, the next to CPU RAM, the rest to disk, by the policy's cache fractions.
In RAM and on the device a chunk is K, V of shape (rows, max_len, head_dim), row-major so
attention reads each row contiguously. On disk it is position-major (max_len, rows, head_dim)
so that a prefill writes one contiguous range, each decode step appends one contiguous slab,
and a read of the first L positions is one sequential read.

Decode attention on a chunk that is not on the compute device runs on the CPU when
``cpu_attention`` is on (q goes to the cache); otherwise the chunk is copied to the device.

With ``compress`` every chunk holds K and V as :class:`QTensor` s in the same layouts, grouped
along head_dim, so each (row, position) is whole groups and positions are written and read
independently. New k/v are quantized on the compute device before they move anywhere, stay
compressed on every tier (disk included), and a chunk is dequantized on the device that runs
its attention, right before use (on the CPU the native kernel reads the codes in place
instead, ``attention.attend_packed``, where it takes them). The group is capped at head_dim:
a group never spans positions, so a larger one would only store padding.

With ``shared`` the values are the keys (latent attention: DeepSeek-V3 caches one latent per
token and attends it as both), so a chunk stores K alone and its V is the same tensor: half
the memory, half the disk traffic, one write and one expansion per step.

With ``held`` = L (a block's shared prefix held once, ``held.py``) a row keeps positions
[L, max_len) only, at slots [0, max_len - L), and decode merges each chunk's attention with the
prefix's (``HeldPrefix.attend``).

With ``groups`` (a GPU batch's repeated prompts kept once, ``prompt_groups.py``) ``held`` is the
prompt's length: each row keeps only the positions it generates, and ``prompts``, a cache of
its own with a row per distinct prompt, the prompts' positions; decode merges each row's
attention with its prompt's (``_prompt_part``).
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any

import torch

from ..memory.disk import DiskStore
from ..memory.quant import QTensor, dequantize, empty_qtensor, quantize
from ..memory.tiers import MemoryTracker, Tier, copy_between
from .attention import attend_packed, attend_rows, attend_rows_lse, merge_partial, merge_parts, to_rows
from .cache_layout import (Chunk, Stored, cache_group_size, copy_rows, dense, each_kv, host_copy, pairs, parts,
                           permute_rows, positions, ring_pieces, split_rows, staged_nbytes)
from .held import HeldPrefix
from .prompt_groups import PromptGroups


class BlockCache:
    """KV cache of every (layer, GPU batch) of one block on one stage.

    ``windows`` (layer -> positions it attends to, 0: all): a sliding layer whose window is
    shorter than the block keeps only the window, as a ring (``Chunk.slot``), so its memory
    and its disk reads stop growing with the sequence."""

    def __init__(self, layers: list[int], batch_sizes: list[int], kv_heads: int, max_len: int,
                 head_dim: int, fractions: tuple[float, float, float], device: torch.device,
                 dtype: torch.dtype, tracker: MemoryTracker, disk: DiskStore | None,
                 cpu_attention: bool, tag: str = "", *, compress: bool = False, bits: int = 4,
                 group_size: int = 64, windows: dict[int, int] | None = None,
                 shared: bool = False, held: int = 0, groups: PromptGroups | None = None) -> None:
        self.device, self.dtype, self.tracker = device, dtype, tracker
        self.shared = shared
        self.max_len, self.head_dim, self.kv_heads = max_len, head_dim, kv_heads
        self.cpu_attention = cpu_attention
        self.compress, self.bits = compress, bits
        self.group_size = cache_group_size(head_dim, group_size)
        self.held = held
        # where a disk chunk's staged copy is counted: host RAM beside a GPU, else the compute
        # tier's memory (the footprint's ``W[1, 0, 5]`` on a CPU device)
        self._host_tier = Tier.CPU if device.type == "cuda" else Tier.GPU
        self.prefix = HeldPrefix(held, device, dtype, tracker, (bits, self.group_size) if compress else None) \
            if held and groups is None else None
        self.groups = groups
        # rows x positions of a layer without holding, and what holding spares of them
        self.positions = sum(batch_sizes) * max_len
        self.spared = held * (sum(batch_sizes) - (sum(groups.sizes) if groups is not None else 1)) if held else 0
        # each GPU batch's distinct prompts' positions, a row per prompt (``prompt_groups.py``)
        self.prompts = BlockCache(layers, groups.sizes, kv_heads, held, head_dim, fractions, device, dtype,
                                  tracker, disk, cpu_attention, tag + "p", compress=compress, bits=bits,
                                  group_size=group_size, shared=shared) if groups is not None else None
        self._disk_store = disk
        self.chunks: dict[tuple[int, int], list[Chunk]] = {}
        self._bytes: list[tuple[Tier, int]] = []
        # compressed, on a CPU: reused dense K and V of one chunk at full length, because
        # fresh ones each step cost more in page faults than the dequantization itself
        self._scratch: dict[str, torch.Tensor] = {}
        self._whole: dict[int, Chunk] = {}  # layer -> one chunk over every GPU batch's rows
        # beam search: (layer, GPU batch) -> its rows' new order, applied at its next write (``reorder``)
        self._perm: dict[tuple[int, int], torch.Tensor] = {}
        for j in layers:
            cap = min(max_len, (windows or {}).get(j) or max_len)
            if held and cap < max_len:
                raise ValueError("a shared prefix is held once only where every layer attends to all positions")
            cap -= held
            splits = [split_rows(b * kv_heads, fractions) for b in batch_sizes]
            # one buffer per in-memory tier for every GPU batch of the layer, each batch's
            # chunk a slice of it in batch order (a slice of rows is laid out as a buffer of
            # its own would be), so a merged decode can write and attend them all at once
            bufs = {tier: self._alloc(tier, 0, sum(r1 - r0 for sp in splits for t, r0, r1 in sp if t == tier),
                                      cap, f"kv{tag}-l{j}")
                    for tier in (Tier.GPU, Tier.CPU) if any(t == tier for sp in splits for t, _, _ in sp)}
            at = dict.fromkeys(bufs, 0)
            for kb, sp in enumerate(splits):
                row_chunks = []
                for tier, r0, r1 in sp:
                    if tier == Tier.DISK:
                        row_chunks.append(self._alloc(tier, r0, r1, cap, f"kv{tag}-l{j}-b{kb}"))
                        continue
                    buf, a = bufs[tier], at[tier]
                    at[tier] += r1 - r0
                    k, v = each_kv(buf.k, buf.v, lambda x: positions(x, a, a + r1 - r0, 0))
                    row_chunks.append(Chunk(tier, r0, r1, k, v, cap, held))
                self.chunks[(j, kb)] = row_chunks
            if len(bufs) == 1 and all(len(sp) == 1 and sp[0][0] != Tier.DISK for sp in splits):
                self._whole[j] = next(iter(bufs.values()))
        self._disk_layers = {j for (j, _), chs in self.chunks.items() if any(ch.tier == Tier.DISK for ch in chs)}
        self._off_device = {j for (j, _), chs in self.chunks.items() if any(ch.tier != Tier.GPU for ch in chs)}
        if self.prompts is not None:
            self._disk_layers |= self.prompts._disk_layers
            self._off_device |= self.prompts._off_device

    def _alloc(self, tier: Tier, r0: int, r1: int, cap: int, name: str) -> Chunk:
        n = r1 - r0
        if tier == Tier.DISK:
            shape = (cap, n, self.head_dim)
            k = self._disk(name + "-k", shape)
            v = k if self.shared else self._disk(name + "-v", shape)
        else:
            dev = self.device if tier == Tier.GPU else torch.device("cpu")
            # never read before written: prefill fills [0, s), each decode step its position;
            # RAM's chunks pinned as allocated where the compute device is a GPU
            pin = tier == Tier.CPU and self.device.type == "cuda"
            k = self._empty((n, cap, self.head_dim), dev, pin)
            v = k if self.shared else self._empty(k.shape, dev, pin)
        nbytes = int(k.nbytes + (0 if v is k else v.nbytes))
        self.tracker.add(tier, nbytes)
        self._bytes.append((tier, nbytes))
        return Chunk(tier, r0, r1, k, v, cap, self.held)

    def _empty(self, shape: tuple[int, ...], device: torch.device, pin: bool = False) -> Stored:
        if self.compress:
            return empty_qtensor(shape, self.dtype, self.bits, self.group_size, dim=-1, device=device,
                                 pin_memory=pin)
        return torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin)

    def _disk(self, name: str, shape: tuple[int, ...]) -> Stored:
        store = self._disk_store
        if store is None:
            raise RuntimeError("cache on disk needs an offload directory (--offload-dir)")
        if self.compress:
            return store.allocate_qtensor(name, shape, self.dtype, self.bits, self.group_size, dim=-1)
        return store.allocate(name, shape, self.dtype)

    def _encode(self, x: torch.Tensor) -> Stored:
        """What is stored for new k/v rows: quantized (on x's device) when compressing."""
        if not self.compress:
            return x
        # in the cache dtype, as a dense cache would hold it (k may arrive in float32)
        return quantize(x.to(self.dtype), self.bits, self.group_size, dim=-1)

    def on_disk(self, j: int) -> bool:
        """Whether any chunk of layer j (any GPU batch) is on disk."""
        return j in self._disk_layers

    def on_device(self, j: int) -> bool:
        """Whether every chunk of layer j (every GPU batch) is on the compute device."""
        return j not in self._off_device

    def free(self) -> None:
        if self.prefix is not None:
            self.prefix.free()
        if self.prompts is not None:
            self.prompts.free()
        for buf in self._scratch.values():
            self.tracker.sub(Tier.GPU, buf.nbytes)
        self._scratch.clear()
        for tier, n in self._bytes:
            self.tracker.sub(tier, n)
        self._bytes.clear()
        for chunks in self.chunks.values():
            for ch in chunks:
                for f in ch.futures:
                    f.cancel()
                if ch.tier == Tier.DISK and self._disk_store is not None:
                    for p in parts(ch.k) + (() if ch.v is ch.k else parts(ch.v)):
                        self._disk_store.free(p)
        self.chunks.clear()

    def reorder(self, perms: dict[int, torch.Tensor]) -> None:
        """Beam search: from the next decode step on, row r of GPU batch kb continues the
        sequence of its row ``perms[kb][r]`` (a beam taking over its parent's history): every
        layer's keys and values of the positions held so far follow, each layer's as its next
        attention writes there (``_append``). A batch's cache is one chunk for this (one tier,
        ``beams.beams_refusal``); a disk chunk is rewritten whole from its staged copy."""
        layers = sorted({j for j, _ in self.chunks})
        for kb, p in perms.items():
            chs = self.chunks[(layers[0], kb)] if layers else []
            if len(chs) != 1 or chs[0].r0 != 0:
                raise RuntimeError("beam search needs each GPU batch's cache on one tier")
            rows = (p.to(torch.long)[:, None] * self.kv_heads
                    + torch.arange(self.kv_heads, device=p.device)).reshape(-1)
            for j in layers:
                self._perm[(j, kb)] = rows

    def _whole_perm(self, j: int) -> torch.Tensor | None:
        """The rows' new order over layer j's whole buffer (every GPU batch, in order), or None."""
        if not self._perm:  # no beam search: nothing to look up per layer
            return None
        kbs = sorted(kb for jj, kb in self.chunks if jj == j)
        if not any((j, kb) in self._perm for kb in kbs):
            return None
        out, base = [], 0
        for kb in kbs:
            n = self.chunks[(j, kb)][0].r1
            p = self._perm.pop((j, kb), None)
            out.append((torch.arange(n) if p is None else p.cpu()) + base)
            base += n
        return torch.cat(out)

    # --- overlapped I/O steps ----------------------------------------------------------
    def load(self, j: int, kb: int, length: int) -> None:
        """Prefetch: read the first ``length`` positions of disk chunks into RAM (async)."""
        if self.prompts is not None and length:  # a decode step reads the prompts' positions too
            self.prompts.load(j, kb, self.held)
        for ch in self.chunks.get((j, kb), []):
            if ch.tier != Tier.DISK or length == 0:
                continue
            shape = (ch.held(length + 1), ch.r1 - ch.r0, self.head_dim)
            kbuf = self._empty(shape, torch.device("cpu"))
            vbuf = kbuf if self.shared else self._empty(shape, torch.device("cpu"))
            self.tracker.add(self._host_tier, staged_nbytes((kbuf, vbuf)))
            ch.staged = (kbuf, vbuf)
            n = ch.held(length)
            ch.futures = [p.store.submit_read(p, out=b[:n], rows=(0, n))
                          for src, buf in pairs(ch.k, kbuf, ch.v, vbuf)
                          for p, b in zip(parts(src), parts(buf))]

    def store(self, j: int, kb: int) -> list[Future]:
        """Write what compute produced for disk chunks (async); returns the futures."""
        futs: list[Future] = [] if self.prompts is None else self.prompts.store(j, kb)
        for ch in self.chunks.get((j, kb), []):
            for slot0, kk, vv in ch.pending:
                rows = (slot0, slot0 + kk.shape[0])
                for dst, src in pairs(ch.k, kk, ch.v, vv):
                    futs += [p.store.submit_write(p, s, rows=rows)
                             for p, s in zip(parts(dst), parts(src))]
            ch.pending = []
            if ch.staged is not None:
                self.tracker.sub(self._host_tier, staged_nbytes(ch.staged))
                ch.staged = None
        return futs

    # --- compute ------------------------------------------------------------------------
    def _non_blocking(self, ch: Chunk) -> bool:
        # the CPU reads a RAM chunk right after this write when it runs the attention itself
        return ch.tier == Tier.GPU or not self.cpu_attention

    def write_prefill(self, j: int, kb: int, k_new: torch.Tensor, v_new: torch.Tensor,
                      firsts: bool = False) -> None:
        """Store the prompt's k/v, (b, s, kv_heads, d) as the projection made them, into each
        chunk at positions [0, s) (a ring: the last ``cap`` of them, at their slots).

        Uncompressed, each chunk's rows are gathered straight from that layout into the cache
        (one copy, not a row-major copy first and then the cache write). A held prefix's
        positions are not stored. With ``groups`` the prompts' cache takes each prompt's keys and
        values (``firsts``: k_new and v_new hold those rows alone, as a prefill computing each
        prompt once made them) and the rows' own caches none."""
        if self.prompts is not None:
            g = self.groups
            assert g is not None
            kv = (k_new, v_new) if firsts else each_kv(k_new, v_new, lambda x: g.firsts(x, kb))
            self.prompts.write_prefill(j, kb, *kv)
            return
        if self.held:
            k_new, v_new = k_new[:, self.held:], v_new[:, self.held:]
        s = k_new.shape[1]
        if self.compress:  # quantization works on rows
            k_rows = to_rows(k_new)
            v_rows = k_rows if self.shared else to_rows(v_new)
        for ch in self.chunks[(j, kb)]:
            for p0, slot0, n in ring_pieces(s, ch.cap):
                if self.compress:
                    kn, vn = each_kv(k_rows, v_rows, lambda x: x[ch.r0:ch.r1, p0:p0 + n])
                    if ch.tier == Tier.DISK:
                        ch.pending.append((slot0, *each_kv(kn, vn, lambda x: host_copy(self._encode(x.transpose(0, 1))))))
                    else:
                        for dst, src in pairs(ch.k, kn, ch.v, vn):
                            copy_between(positions(dst, slot0, slot0 + n, 1), self._encode(src),
                                         non_blocking=self._non_blocking(ch))
                elif ch.tier == Tier.DISK:
                    # position-major host buffers an async disk write can own
                    bufs = [torch.empty((n, ch.r1 - ch.r0, self.head_dim), dtype=self.dtype)
                            for _ in range(1 if self.shared else 2)]
                    for buf, src in zip(bufs, (k_new, v_new)):
                        copy_rows(buf.transpose(0, 1), src[:, p0:p0 + n], ch.r0, ch.r1)
                    ch.pending.append((slot0, bufs[0], bufs[-1]))
                else:
                    for dst, src in pairs(ch.k, k_new, ch.v, v_new):
                        copy_rows(dst.narrow(1, slot0, n), src[:, p0:p0 + n], ch.r0, ch.r1,
                                  non_blocking=self._non_blocking(ch))

    def attend(self, j: int, kb: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               mask: torch.Tensor, pos0: int, sparsity: float = 1.0, scale: float | None = None,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode: write k_new/v_new (rows, 1, d) at pos0 and attend over [0, pos0] (a ring:
        over the slots it holds, in slot order).

        q (rows, G, 1, d), mask (rows, 1, 1, L) over what the chunks hold (L = ``held``). Each
        chunk is attended where it lives. ``scale``, ``softcap``, ``sinks`` (rows, G): see
        ``attend_rows``.
        """
        perm = self._perm.pop((j, kb), None)
        outs = [(ch.r0, ch.r1, self._attend_chunk(ch, q, k_new, v_new, mask, pos0, sparsity, scale, softcap, sinks,
                                                  perm))
                for ch in self.chunks[(j, kb)]]
        if self.prefix is not None:
            return self.prefix.attend(j, q, outs, scale)
        if self.prompts is not None:
            return merge_parts(self._prompt_part(j, kb, q, scale), outs, q.dtype)
        return merge_partial(outs, q.shape[0], self.device)

    def whole_layer(self, j: int) -> bool:
        """Whether ``attend_layer`` can run layer j: each GPU batch's cache is one chunk, all on
        one in-memory tier (one buffer, batch after batch), uncompressed (an expanded
        compressed chunk is sized for one GPU batch)."""
        return j in self._whole and not self.compress

    def attend_layer(self, j: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     mask: torch.Tensor, pos0: int, sparsity: float = 1.0, scale: float | None = None,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``attend`` for the rows of every GPU batch of the block at once (merged decode, where
        ``whole_layer(j)``): one cache write and one attention over the layer's buffer, the
        batches' rows in batch order."""
        out = self._attend_chunk(self._whole[j], q, k_new, v_new, mask, pos0, sparsity, scale, softcap, sinks,
                                 self._whole_perm(j))
        if self.prefix is not None:
            return self.prefix.attend(j, q, [(0, q.shape[0], out)], scale)
        if self.prompts is not None:
            at = self.groups.starts  # type: ignore[union-attr]
            got = [self._prompt_part(j, kb, q[at[kb]:at[kb + 1]], scale) for kb in range(len(at) - 1)]
            return merge_parts((torch.cat([o for o, _ in got]), torch.cat([lse for _, lse in got])),
                               [(0, q.shape[0], out)], q.dtype)
        return out.to(self.device, non_blocking=True)

    def _attend_chunk(self, ch: Chunk, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      mask: torch.Tensor, pos0: int, sparsity: float, scale: float | None,
                      softcap: float, sinks: torch.Tensor | None = None,
                      perm: torch.Tensor | None = None) -> Any:
        """Write the chunk's rows of k_new/v_new at pos0 and attend its rows where it lives
        (``perm``: the rows' new order first, ``reorder``); with a held prefix, the output and
        its log-sum-exps (``attend_rows_lse``)."""
        length = pos0 + k_new.shape[1]
        kn, vn = k_new[ch.r0:ch.r1], v_new[ch.r0:ch.r1]
        qr, m = q[ch.r0:ch.r1], mask[ch.r0:ch.r1]
        sinks = None if sinks is None else sinks[ch.r0:ch.r1]
        kc, vc, pos_major = self._append(ch, kn, vn, pos0, length, perm)
        return self._attend_stored(ch, kc, vc, pos_major, qr, m, self.held > 0, sparsity, scale, softcap, sinks)

    def _attend_stored(self, ch: Chunk, kc: Stored, vc: Stored, pos_major: bool, qr: torch.Tensor, m: torch.Tensor,
                       lse: bool, sparsity: float = 1.0, scale: float | None = None, softcap: float = 0.0,
                       sinks: torch.Tensor | None = None) -> Any:
        """Attend ``qr`` over a chunk's stored K, V where the chunk lives (the CPU, where it is in
        RAM and ``cpu_attention``); a compressed one read there as its codes (``attend_packed``), or
        else expanded first; ``lse``: the output and its log-sum-exps (``attend_rows_lse``), for a
        merge with a held prefix's or prompt's part."""
        dev = self.device
        if ch.tier != Tier.GPU and kc.device != self.device and self.cpu_attention:
            dev = torch.device("cpu")  # move q (small) to the cache, not the cache to q
            qr, m = qr.to(dev), m.to(dev)
        if isinstance(kc, QTensor) and dev.type == "cpu" and sparsity == 1.0 and softcap == 0.0:
            got = attend_packed(qr, kc, vc, m, pos_major, lse, scale, None if lse else sinks)  # type: ignore[arg-type]
            if got is not None:  # read as codes: no expansion written out
                return got
        kd = self._expand(kc, dev, pos_major, "k")
        vd = kd if vc is kc else self._expand(vc, dev, pos_major, "v")
        if lse:
            return attend_rows_lse(qr, kd, vd, m, scale)
        return attend_rows(qr, kd, vd, m, sparsity, scale, softcap, sinks)

    def _prompt_part(self, j: int, kb: int, q: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of GPU batch kb's rows (q: (b * kvh, G, 1, d)) over their prompts'
        positions, each prompt's rows at once over its one row (``PromptGroups.gather``): every
        row's output and log-sum-exp on the compute device (float32)."""
        g, pc = self.groups, self.prompts
        assert g is not None and pc is not None
        qg, mask = g.gather(q, kb), g.mask(kb)
        outs = []
        for ch in pc.chunks[(j, kb)]:
            kc, vc, pos_major = pc._stored(ch)
            o, lse = pc._attend_stored(ch, kc, vc, pos_major, qg[ch.r0:ch.r1], mask[ch.r0:ch.r1], True,
                                            scale=scale)
            outs.append((o.to(self.device), lse.to(self.device)))
        o, lse = outs[0] if len(outs) == 1 else (torch.cat([o for o, _ in outs]), torch.cat([x for _, x in outs]))
        return g.scatter(o.float(), lse, kb)

    def _stored(self, ch: Chunk) -> tuple[Stored, Stored, bool]:
        """A chunk's K, V over every slot, as stored, in memory (a disk chunk's staged copy, once
        its reads have landed), and whether position-major. For a cache only read at decode
        (the prompts')."""
        if ch.tier == Tier.DISK:
            kbuf, vbuf = ch.landed()
            return (*each_kv(kbuf, vbuf, lambda x: positions(x, 0, ch.cap, 0)), True)
        return ch.k, ch.v, False

    def _expand(self, x: Stored, device: torch.device, pos_major: bool, key: str) -> torch.Tensor:
        """``dense``, into a reused buffer where a compressed chunk expands on the CPU."""
        if not (isinstance(x, QTensor) and device.type == "cpu"):
            return dense(x, device, pos_major)
        rows = x.shape[1] if pos_major else x.shape[0]
        need = rows * (self.max_len - self.held) * self.head_dim  # the most slots a chunk holds
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < need:
            if buf is not None:
                self.tracker.sub(Tier.GPU, buf.nbytes)
            buf = self._scratch[key] = torch.empty(need, dtype=self.dtype)
            self.tracker.add(Tier.GPU, buf.nbytes)
        out = dequantize(x, device, out=buf[:math.prod(x.shape)].view(x.shape))
        return out.transpose(0, 1) if pos_major else out

    def _append(self, ch: Chunk, kn: torch.Tensor, vn: torch.Tensor, pos0: int,
                length: int, perm: torch.Tensor | None = None) -> tuple[Stored, Stored, bool]:
        """Write positions [pos0, length) (one decode step: one position, at its slot); return
        K, V over the slots held, as stored, in memory, and whether they are position-major (a
        staged disk chunk). ``perm``: the rows' new order, applied to the slots held before."""
        a, b, n = ch.slot(pos0), ch.slot(pos0) + length - pos0, ch.held(length)
        if ch.tier == Tier.DISK:
            kbuf, vbuf = ch.landed()
            if perm is not None and ch.held(pos0):
                old = ch.held(pos0)
                permute_rows((kbuf,) if vbuf is kbuf else (kbuf, vbuf), perm, old, pos_major=True)
                ch.pending.append((0, *each_kv(kbuf, vbuf, lambda x: positions(x, 0, old, 0))))
            for dst, src in pairs(kbuf, kn, vbuf, vn):
                copy_between(positions(dst, a, b, 0), self._encode(src.transpose(0, 1)))
            ch.pending.append((a, *each_kv(kbuf, vbuf, lambda x: positions(x, a, b, 0))))
            return (*each_kv(kbuf, vbuf, lambda x: positions(x, 0, n, 0)), True)
        nb = self._non_blocking(ch)
        if perm is not None and ch.held(pos0):
            if ch.tier != Tier.GPU and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the last step's writes into RAM have landed
            permute_rows((ch.k,) if ch.v is ch.k else (ch.k, ch.v), perm, ch.held(pos0), pos_major=False)
        for dst, src in pairs(ch.k, kn, ch.v, vn):
            copy_between(positions(dst, a, b, 1), self._encode(src), non_blocking=nb)
        return (*each_kv(ch.k, ch.v, lambda x: positions(x, 0, n, 1)), False)
