"""The linear coefficient tables of one stage: what each channel costs per layer as linear
functions of the nine placement fractions, beside the stage's memory footprint.

``stage_sizes`` derives a stage's bytes, FLOPs and rates for one batch shape; the builders
``prefill_terms`` and ``decode_terms`` turn them into the time tables of a ``StageTerms``,
which ``cost_model`` evaluates at a policy and ``search`` optimises over. Memory is not
modelled here: ``StageTerms`` carries the engine's own footprint (``engine.footprint``), read
linearly by the LP and exactly by the repair and the run's budget check. Notation and units:
see ``cost_model``.
"""
from __future__ import annotations

import math
from typing import Any, Callable
from dataclasses import dataclass

import numpy as np

from flexgen_dist.engine.footprint import Footprint, HeadLoad, Packed, StageShape, stage_footprint
from flexgen_dist.engine.held import planned_hold
from flexgen_dist.engine.prefix_shape import PrefixShape
from flexgen_dist.models.spec import ModelSpec
from flexgen_dist.planner.hardware import HardwareSpec

CHANNELS = ("ctog", "gtoc", "dtoc", "ctod", "comp", "net", "host")
COMP, HOST = CHANNELS.index("comp"), CHANNELS.index("host")
TIERS = ("gpu", "cpu", "disk")
PHASES = ("prefill", "decode")
WG, WC, WD, CG, CC, CD, HG, HC, HD = range(9)
CONST = 9  # column of the constant term
TOKEN_ID_BYTES = 8  # int64 token ids the last stage sends back to the first


@dataclass(frozen=True)
class WorkShape:
    """What is generated, as the cost model sees it: padded prompt length, tokens per
    sequence, bytes per element (the run's full workload is ``plan.Workload``)."""

    prompt_len: int
    gen_len: int
    dtype_bytes: int = 2
    head: HeadLoad = HeadLoad()  # what the last stage's head holds (``plan.Workload.head_load``)
    # what shared prefixes save a block's prefill (``plan.Workload.prefix``; None: nothing)
    prefix: PrefixShape | None = None

    def prefill_rows(self, block_rows: int, gbs: int = 0) -> float:
        """Positions a block of ``block_rows`` requests (GPU batches of ``gbs``) computes in
        its prefill: each row's padded prompt, less what the shared prefixes save
        (``PrefixShape.saved``), of the rows a batch computes once each prompt it repeats
        (``PrefixShape.computed_share``)."""
        if self.prefix is None:
            return float(block_rows * self.prompt_len)
        rows = max(float(block_rows), block_rows * self.prompt_len - self.prefix.saved(block_rows))
        return rows * self.prefix.computed_share(gbs) if gbs else rows

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.gen_len < 1:
            raise ValueError(f"WorkShape prompt_len={self.prompt_len}, gen_len={self.gen_len}: "
                             "both must be >= 1")
        if self.prefix is not None and not 0 <= self.prefix.opening < self.prompt_len:
            raise ValueError(f"shared prefix {self.prefix.opening}: must be in [0, prompt_len={self.prompt_len})")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"WorkShape.dtype_bytes={self.dtype_bytes}: use 2 (fp16/bf16) or 4 "
                             "(fp32)")


@dataclass(frozen=True, eq=False)
class StageTerms:
    """Coefficient tables of one stage for one (gbs, num_gb, cpu_attention, compression).

    ``prefill``/``decode``: (7 channels, 10) seconds per layer per block, columns = the nine
    fractions + constant. Memory is the engine's own model (``engine.footprint``): ``peaks``
    reads it exactly, ``peak_rows`` linearly for the LP, with its steps and the rounding
    reserve of whole tensors switched on by which splits the LP allows.
    """

    num_layers: int
    block_size: int
    prompt_len: int
    gen_len: int
    prefill: np.ndarray
    decode: np.ndarray
    footprint: Footprint
    prefill_net_s: float
    decode_net_s: float
    overlap: bool = True  # False: channels run one after another (sum instead of max)

    @property
    def peak_base(self) -> np.ndarray:
        """(2 phases, 3 tiers, 10) linear peak bytes, without steps and rounding."""
        return self.footprint.linear()[0]

    @property
    def gpu_slack(self) -> float:
        """What the compute tier adds once weights leave it: read buffers and rounding."""
        _, gpu_step, _, rounding = self.footprint.linear()
        return gpu_step + rounding

    def peak_rows(self, gpu_split: bool, disk_split: bool) -> np.ndarray:
        """The LP's rows: linear bytes plus, where weights may split off the gpu (onto disk),
        the read buffers (host staging) and one whole tensor of rounding on each tier."""
        base, gpu_step, cpu_step, rounding = self.footprint.linear()
        rows = base.copy()
        rows[:, 0, CONST] += gpu_step * (gpu_split or self.footprint.compress_weight) + rounding * gpu_split
        rows[:, 1, CONST] += rounding * (gpu_split or disk_split) + cpu_step * disk_split
        rows[:, 2, CONST] += rounding * disk_split
        return rows

    def peaks(self, x: np.ndarray) -> np.ndarray:
        """(2, 3) peak bytes at fractions ``x`` (length 9), as the run's budget check counts."""
        return self.footprint.peaks(x)

    def layer_times(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel seconds per layer per block: (prefill[6], decode[6])."""
        v = np.append(x, 1.0)
        return self.prefill @ v, self.decode @ v

    def block_time(self, x: np.ndarray) -> tuple[float, float]:
        """(prefill seconds, decode seconds for all n-1 steps) of one block."""
        tp, tg = self.layer_times(x)
        if self.overlap:
            tp_, tg_ = float(tp.max()), float(tg.max())
        else:
            tp_, tg_ = float(tp.sum()), float(tg.sum())
        return self.num_layers * tp_, (self.gen_len - 1) * self.num_layers * tg_


def compressed_bytes(numel: float, bits: int, group_size: int, meta_bytes: int) -> float:
    """Group-wise quantized size: packed values + a min and a scale per group."""
    return numel * bits / 8 + math.ceil(numel / group_size) * 2 * meta_bytes


@dataclass(frozen=True)
class StageSizes:
    """Derived sizes and rates that one stage's time terms share.

    Notation as in the module docstring. Byte counts are per layer per block unless noted.
    """

    l: int
    s: int
    n: int
    b: int
    num_gb: int
    bls: int
    q: int
    V: int
    e: int
    mem_bw: float
    stream_bw: float
    lnum: float  # elements of one layer's weights (the mean over the stage's model)
    wl_io: float  # weight bytes a decode step moves per layer (a mixture of experts: the experts its tokens choose)
    kv_tok: int
    c_pre: float
    c_avg: float
    c_new: float
    ctx: float  # positions a decode step's attention reads per layer, on average
    a_pre: int
    a_dec: int
    hop: float
    streams: int
    deq_w: float
    net_p: float
    net_d: float
    cpu_attention: bool
    compress_cache: bool
    has_head: bool
    head_share: float = 1.0  # of the block's one prefill head pass this item pays (a piece: 1/nb)
    merged: bool = False  # decode runs each layer once for all GPU batches
    host_layer: float = 0.0  # host seconds to issue a layer: per step, and per step and GPU batch
    host_batch: float = 0.0
    host_cache_batch: float = 0.0  # what a compressed cache adds per GPU batch (0 without one)
    host_row: int = HOST  # where host time goes: its own channel (a GPU runs ahead of the host), or compute
    # a product's weight stream and its arithmetic overlap (a GPU: the slower sets the pace) or
    # add up (a CPU: the same cores load and multiply)
    stream_overlap: bool = True
    # a mixture of experts reads and computes less than all of a layer: the elements one token
    # computes with, and the share of a layer's weights a block's prefill reads
    # (a dense layer: lnum and 1)
    lnum_active: float = 0.0
    pre_share: float = 1.0
    dec_numel: float = 0.0  # elements a decode step streams per layer (dense: lnum)
    wl_io_pre: float = 0.0  # weight bytes a prefill moves per layer
    # the linear layers' states off the compute device, per layer (the mean over the model):
    # a decode step brings them in and sends them back, a prefill sends them out (``states.py``)
    r_move: float = 0.0  # over the host link (host RAM on a GPU host; the disk's pass through it there)
    r_disk: float = 0.0  # to and from the disk
    rows_pre: float = 0.0  # positions a block's prefill computes (``WorkShape.prefill_rows``)


def _extra_io_numel(spec: ModelSpec, has_embed: bool, has_head: bool) -> int:
    """Elements of the stage's embedding and head loaded per token: a tied head reads the
    embedding matrix, so a stage with both loads it twice (they are separate slots)."""
    io = (spec.embed_numel() if has_embed else 0) + (spec.head_numel() if has_head else 0)
    if has_head and spec.tie_word_embeddings and not spec.num_labels:  # a classifier's head is its score rows
        io += spec.vocab_size * spec.embed_dim
    return io


def _net_times(hw: HardwareSpec, bls: int, a_pre: int, a_dec: int, has_head: bool,
               num_stages: int) -> tuple[float, float]:
    """Seconds of one block's send (prefill, decode step): hidden states, or token ids back."""
    if num_stages <= 1:
        return 0.0, 0.0
    sent_p = bls * TOKEN_ID_BYTES if has_head else a_pre
    sent_d = bls * TOKEN_ID_BYTES if has_head else a_dec
    return hw.net_latency + sent_p / hw.net_bw, hw.net_latency + sent_d / hw.net_bw


def stage_sizes(spec: ModelSpec, num_layers: int, hw: HardwareSpec, workload: WorkShape, *,
                gpu_batch_size: int, num_gpu_batches: int, cpu_attention: bool,
                has_embed: bool, has_head: bool, compress_weight: bool = False,
                compress_cache: bool = False, comp_bits: int = 4, comp_group_size: int = 64,
                num_stages: int = 1, head_share: float = 1.0, merged: bool = False,
                state_fractions: tuple[float, float, float] = (1.0, 0.0, 0.0)) -> StageSizes:
    """The sizes and rates :func:`stage_terms` needs, derived once (arguments as there)."""
    l, s, n, b = num_layers, workload.prompt_len, workload.gen_len, workload.dtype_bytes
    bls = gpu_batch_size * num_gpu_batches
    # Decode attention reads 2*kv*b cache bytes per 4*q FLOPs; the profiler measures it with
    # MHA, so bmm_flops * b / 2 is the device's memory bandwidth (dequantization traffic).
    mem_bw = hw.bmm_flops * b / 2

    def wbytes(numel: float) -> float:
        return compressed_bytes(numel, comp_bits, comp_group_size, b) if compress_weight else numel * b

    def cbytes(numel: float) -> float:
        return compressed_bytes(numel, comp_bits, comp_group_size, b) if compress_cache else numel * b

    lnum = spec.layer_numel()
    wl = wbytes(lnum)
    io_numel = _extra_io_numel(spec, has_embed, has_head)
    # a mixture of experts: a decode step reads the experts its block's tokens choose (the
    # engine reads a sparse layer's experts when chosen, once per sweep for every GPU batch),
    # a prefill those of all its tokens (E (1 - (1 - k/E)^T) of E, uniform routing assumed)
    dec_share, pre_share = _read_share(spec, bls), _read_share(spec, bls * s)
    kv_tok = spec.kv_numel_per_token()  # cache elements per token per sequence per layer
    # a block's shared prefix held once: each row's cache leaves it out (``engine/held.py``)
    hp = workload.prefix.held_positions(bls) if workload.prefix is not None else 0.0
    if workload.prefix is not None:  # or each GPU batch's repeated prompts kept once (``engine/prompt_groups.py``)
        hp = max(hp, workload.prefix.kept_once(s, gpu_batch_size, hp))
    # a shared prefix is computed once a block, or not at all; a batch's repeated prompt once
    rows_pre = workload.prefill_rows(bls, gpu_batch_size)
    a_pre, a_dec = int(rows_pre * spec.hidden_size * b), bls * spec.hidden_size * b  # hidden states
    # Disk bytes pass through host RAM on their way to/from a GPU; on a CPU device the
    # compute tier *is* host RAM, so disk reads and writes land in place (no second hop).
    hop = 1.0 if hw.compute_device == "cuda" else 0.0
    net_p, net_d = _net_times(hw, bls, a_pre, a_dec, has_head, num_stages)
    r_state = bls * spec.recurrent_bytes(b) * sum(spec.linear(j) for j in range(spec.num_layers)) / spec.num_layers
    return StageSizes(
        l=l, s=s, n=n, b=b, num_gb=num_gpu_batches, bls=bls, q=spec.q_dim, V=spec.vocab_size,
        e=spec.embed_dim,  # the LM head is (vocab, embed_dim)
        mem_bw=mem_bw,
        # Small-batch linear layers stream their weights at the skinny-GEMM rate the profiler
        # measures (gemm_bw); on a CPU that is ~2x below mem_bw. Spec-sheet files without it
        # fall back to mem_bw.
        stream_bw=hw.gemm_bw or mem_bw,
        lnum=lnum,
        wl_io=wl * dec_share + io_numel * b / l,  # weight traffic per layer, extras spread over the layers
        wl_io_pre=wl * pre_share + io_numel * b / l,
        lnum_active=_mean(spec, spec.active_layer_numel), pre_share=pre_share, dec_numel=lnum * dec_share,
        kv_tok=kv_tok,
        # a sliding layer keeps (and reads) at most its window: these are means over the layers
        c_pre=bls * cbytes((_held(spec, s) - hp) * kv_tok),  # cache written by a block's prefill, per layer
        c_avg=bls * cbytes((_held(spec, s + n / 2) - hp) * kv_tok),  # cache read per decode step, per layer
        ctx=_held(spec, s + n / 2),
        # cache written per decode step, per layer (a linear-attention layer writes none)
        c_new=bls * cbytes(kv_tok) * sum(not spec.linear(j) for j in range(spec.num_layers)) / spec.num_layers,
        # host RAM on a CPU device is where the states are used: only the disk's move
        r_move=r_state * (state_fractions[1] + state_fractions[2]) * hop, r_disk=r_state * state_fractions[2],
        a_pre=a_pre, a_dec=a_dec, hop=hop,
        # How often a decode step streams each weight matrix through the compute units: once
        # per GPU batch, or once per block where the engine runs the GPU batches of a block
        # as one GEMM (``merged``: ``engine.policy.merge_decode``)
        streams=1 if merged else num_gpu_batches,
        deq_w=(lnum * b + wl) / mem_bw if compress_weight else 0.0,
        net_p=net_p, net_d=net_d,
        cpu_attention=cpu_attention, compress_cache=compress_cache, has_head=has_head,
        head_share=head_share, merged=merged, host_layer=hw.host_layer_s or 0.0,
        host_batch=hw.host_batch_s or 0.0,
        host_cache_batch=(hw.host_cache_batch_s or 0.0) if compress_cache else 0.0,
        # a GPU computes while the host issues the next kernels (the slower of the two sets
        # the pace); a CPU device's host *is* the compute, one after the other
        host_row=COMP if hw.compute_device == "cpu" else HOST,
        stream_overlap=hw.compute_device != "cpu", rows_pre=rows_pre)


def _held_terms(workload: WorkShape, block_size: int) -> dict[str, Any]:
    """The footprint's held-prefix terms (``StageShape.shared``, ``hold``, ``held``): the opening
    every prompt shares, held once through decode (``PrefixShape.floor``), where a block of one
    request (which shares nothing) still fits a full block's cache."""
    held = planned_hold(workload.prefix, workload.prompt_len + workload.gen_len, block_size)
    return {"shared": held, "hold": True, "held": held} if held else {}


def _held(spec: ModelSpec, length: float) -> float:
    """Cache positions a layer holds at ``length``, averaged over the model's layers (a sliding
    layer holds at most its window, a linear-attention layer none: its states are ``r_move``'s)."""
    return sum(0 if spec.linear(j) else min(length, spec.window(j) or length)
               for j in range(spec.num_layers)) / spec.num_layers


def _mean(spec: ModelSpec, f: Callable[[int], float]) -> float:
    return sum(f(j) for j in range(spec.num_layers)) / spec.num_layers


def _read_share(spec: ModelSpec, tokens: float) -> float:
    """Of a layer's weights (mean over the model's layers), the share ``tokens`` tokens read:
    1 for a dense layer; a sparse one's without the routed experts none of them chose."""
    if not spec.num_experts:
        return 1.0
    touched = spec.experts_touched(tokens)
    return _mean(spec, lambda j: (spec.layer_numel(j) - spec.mlp_numel(j) + spec.mlp_numel(j, touched))
                 / spec.layer_numel(j) if spec.is_moe(j) else 1.0)


def _gemm(z: StageSizes, hw: HardwareSpec, rows: float, passes: int, numel: float | None = None) -> float:
    """Linear layers of one block: the arithmetic (each token computes with ``lnum_active``
    elements: a mixture of experts' chosen ones) and reading ``numel`` elements (all of a
    layer's by default) ``passes`` times, overlapped or not (``_stream``)."""
    flops = 2.0 * rows * (z.lnum_active or z.lnum)
    return _stream(z, flops / hw.mm_flops, passes * (z.lnum if numel is None else numel) * z.b / z.stream_bw)


def _head_time(z: StageSizes, hw: HardwareSpec, passes: float) -> float:
    """LM head of one block, streamed ``passes`` times: logits of the last position only."""
    if not z.has_head:
        return 0.0
    return _stream(z, 2.0 * z.bls * z.e * z.V / hw.mm_flops, passes * z.V * z.e * z.b / z.stream_bw)


def _stream(z: StageSizes, compute_s: float, read_s: float) -> float:
    """A product's time from its arithmetic and its weight stream. On a GPU they overlap (the
    slower sets the pace). On a CPU the same cores load and multiply: measured on a 2-core
    VM (docs/benchmarks.md, "CPU decode by block rows"), decode steps of 4, 20 and 64 rows
    took about the sum of the two, where the larger alone under-counted 20 and 64 rows by a
    half and a third."""
    return max(compute_s, read_s) if z.stream_overlap else compute_s + read_s


def prefill_terms(z: StageSizes, hw: HardwareSpec) -> np.ndarray:
    """(7 channels, 10) prefill seconds per layer per block.

    Weights and the block's activations come in from the cpu/disk shares, the prompt's cache
    and the activations go out; disk shares take a second hop through host RAM on a GPU.
    Compute is the linear layers, the s x s attention, dequantization and the head (one pass
    over the vocabulary matrix per block: the engine runs it once, at the block's last GPU
    batch; a prefill piece pays ``head_share`` of it).
    """
    hop, a_pre = np.array([1.0, z.hop]), z.a_pre
    P = np.zeros((len(CHANNELS), 10))
    P[0, [WC, WD]] = hop * z.wl_io_pre / hw.ctog_bw
    P[0, [HC, HD]] += hop * a_pre / hw.ctog_bw
    P[1, [CC, CD]] = hop * z.c_pre / hw.gtoc_bw
    P[1, [HC, HD]] += hop * a_pre / hw.gtoc_bw
    P[1, CONST] += z.r_move / hw.gtoc_bw
    P[2, WD] = z.wl_io_pre / hw.dtoc_bw
    P[2, HD] += a_pre / hw.dtoc_bw
    P[3, CD] = z.c_pre / hw.ctod_bw
    P[3, CONST] += z.r_disk / hw.ctod_bw
    P[3, HD] += a_pre / hw.ctod_bw
    deq_c_pre = z.bls * z.s * z.kv_tok * z.b / z.mem_bw if z.compress_cache else 0.0
    # prefill attention (s x s per head) at its own measured rate (``att_flops``), else the GEMM's
    P[4, CONST] = (_gemm(z, hw, z.rows_pre, z.num_gb, z.lnum * z.pre_share)
                   + 4.0 * z.rows_pre * z.s * z.q / (hw.att_flops or hw.mm_flops)
                   + z.deq_w + deq_c_pre + _head_time(z, hw, z.head_share) / z.l)
    P[5, CONST] = z.net_p / z.l
    P[z.host_row, CONST] += z.num_gb * (z.host_layer + z.host_batch + z.host_cache_batch)  # GPU batch by GPU batch
    _add_disk_cpu(P, hw)
    return P


def decode_terms(z: StageSizes, hw: HardwareSpec) -> np.ndarray:
    """(7 channels, 10) seconds per layer per block of one decode step.

    Weights and one token's activations come in, the new token's cache goes out. With
    ``cpu_attention`` the cpu/disk share of the cache stays put and only q and the attention
    output cross; otherwise the average cache (s + n/2 tokens) comes to the compute device.
    """
    hop, a_dec, bls, b = np.array([1.0, z.hop]), z.a_dec, z.bls, z.b
    D = np.zeros((len(CHANNELS), 10))
    D[0, [WC, WD]] = hop * z.wl_io / hw.ctog_bw
    D[0, [HC, HD]] += hop * a_dec / hw.ctog_bw
    D[1, [HC, HD]] = hop * a_dec / hw.gtoc_bw
    D[1, [CC, CD]] += hop * z.c_new / hw.gtoc_bw
    if z.cpu_attention:  # q goes to the cache, the attention output comes back
        D[0, [CC, CD]] += bls * z.q * b / hw.ctog_bw
        D[1, [CC, CD]] += bls * z.q * b / hw.gtoc_bw
    else:  # the cache comes to the compute device
        D[0, [CC, CD]] += hop * z.c_avg / hw.ctog_bw
    D[0, CONST] += z.r_move / hw.ctog_bw
    D[1, CONST] += z.r_move / hw.gtoc_bw
    D[2, WD] = z.wl_io / hw.dtoc_bw
    D[2, HD] += a_dec / hw.dtoc_bw
    D[2, CD] += z.c_avg / hw.dtoc_bw
    D[2, CONST] += z.r_disk / hw.dtoc_bw
    D[3, HD] = a_dec / hw.ctod_bw
    D[3, CD] += z.c_new / hw.ctod_bw
    D[3, CONST] += z.r_disk / hw.ctod_bw
    att_flops = 4.0 * bls * z.ctx * z.q
    deq_c = bls * z.ctx * z.kv_tok * b if z.compress_cache else 0.0  # bytes to expand
    D[4, CONST] = _gemm(z, hw, bls, z.streams, z.dec_numel) + z.deq_w + _head_time(z, hw, z.streams) / z.l
    D[4, CG] = att_flops / hw.bmm_flops + deq_c / z.mem_bw
    if z.cpu_attention:  # fp32 on the host: 4*q FLOPs per 2*kv*4 bytes -> bw = 2 * cpu_flops
        D[4, [CC, CD]] = att_flops / hw.cpu_flops + deq_c / (2 * hw.cpu_flops)
    else:
        D[4, [CC, CD]] = att_flops / hw.bmm_flops + deq_c / z.mem_bw
    D[5, CONST] = z.net_d / z.l
    # the host issues each layer's linear part once per step where decode merges the GPU
    # batches, and its attention once per GPU batch either way
    D[z.host_row, CONST] += z.host_layer * (1 if z.merged else z.num_gb) + (z.host_batch + z.host_cache_batch) * z.num_gb
    _add_disk_cpu(D, hw)
    return D


def _add_disk_cpu(T: np.ndarray, hw: HardwareSpec) -> None:
    """On a CPU device, disk traffic also takes compute time: ``disk_cpu`` seconds per byte
    read or written (the bytes are the disk channels' seconds times their rates)."""
    if hw.compute_device == "cpu" and hw.disk_cpu:
        T[4] += hw.disk_cpu * (T[2] * hw.dtoc_bw + T[3] * hw.ctod_bw)


def stage_terms(spec: ModelSpec, num_layers: int, hw: HardwareSpec, workload: WorkShape, *,
                gpu_batch_size: int, num_gpu_batches: int, cpu_attention: bool,
                has_embed: bool, has_head: bool, compress_weight: bool = False,
                compress_cache: bool = False, comp_bits: int = 4, comp_group_size: int = 64,
                num_micro_batches: int = 1, num_stages: int = 1,
                overlap: bool = True, head_share: float = 1.0, first_layer: int = 0,
                packed: Packed | None = None, merged: bool = False,
                state_fractions: tuple[float, float, float] = (1.0, 0.0, 0.0)) -> StageTerms:
    """Build the linear coefficient tables (see module docstring) for one stage.

    ``merged``: decode runs each layer once over the rows of every GPU batch (the placements
    where ``engine.policy.merge_decode`` holds; the search pins them when it sets this).
    ``state_fractions``: where the linear layers' states live (the policy's; constants here)."""
    z = stage_sizes(spec, num_layers, hw, workload, gpu_batch_size=gpu_batch_size,
                    num_gpu_batches=num_gpu_batches, cpu_attention=cpu_attention,
                    has_embed=has_embed, has_head=has_head, compress_weight=compress_weight,
                    compress_cache=compress_cache, comp_bits=comp_bits,
                    comp_group_size=comp_group_size, num_stages=num_stages, head_share=head_share,
                    merged=merged, state_fractions=state_fractions)
    return StageTerms(num_layers=z.l, block_size=z.bls, prompt_len=z.s, gen_len=z.n,
                      prefill=prefill_terms(z, hw), decode=decode_terms(z, hw),
                      footprint=stage_footprint(spec, StageShape(
                          num_layers=num_layers, has_embed=has_embed, has_head=has_head,
                          prompt_len=workload.prompt_len, gen_len=workload.gen_len,
                          dtype_bytes=workload.dtype_bytes, gpu_batch_size=gpu_batch_size,
                          num_gpu_batches=num_gpu_batches, blocks_in_flight=num_micro_batches,
                          cpu_attention=cpu_attention, compress_weight=compress_weight,
                          compress_cache=compress_cache, comp_bits=comp_bits,
                          comp_group_size=comp_group_size, num_stages=num_stages,
                          cuda=hw.compute_device == "cuda", first_layer=first_layer,
                          head=workload.head, state_fractions=state_fractions,
                          **_held_terms(workload, gpu_batch_size * num_gpu_batches)), packed),
                      prefill_net_s=z.net_p, decode_net_s=z.net_d, overlap=overlap)
