"""What one stage holds and moves, as the cost model sees it: the work's shape (``WorkShape``)
and the bytes, FLOPs and rates a stage's time terms share for one batch shape
(``stage_sizes`` -> ``StageSizes``); ``terms`` turns them into seconds per channel. Notation
and units: see ``cost_model``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from flexgen_dist.engine.footprint import HeadLoad
from flexgen_dist.engine.prefix_shape import PrefixShape
from flexgen_dist.models.spec import ModelSpec
from flexgen_dist.planner.hardware import HardwareSpec

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


def compressed_bytes(numel: float, bits: int, group_size: int, meta_bytes: int) -> float:
    """Group-wise quantized size: packed values + a min and a scale per group."""
    return numel * bits / 8 + math.ceil(numel / group_size) * 2 * meta_bytes


@dataclass(frozen=True)
class StageSizes:
    """Derived sizes and rates that one stage's time terms share.

    Notation as in ``cost_model``'s docstring. Byte counts are per layer per block unless noted.
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
    # the host's decode attention over a compressed cache, its codes read in place (FLOP/s; 0:
    # without a compressed cache, or a profile without the figure: the cache is counted expanded)
    packed_flops: float = 0.0
    # the host's decode attention where it computes rather than reads (FLOP/s; 0: not measured):
    # in the run's dtype over a plain cache, in float32 over a compressed one's codes
    host_peak: float = 0.0
    # ... and where it reads: one head a key, in the run's dtype (FLOP/s; 0: cpu_flops')
    host_read: float = 0.0
    # where host time goes: a CPU device's host *is* the compute (one after the other), a GPU
    # computes while the host issues the next kernels (its own channel: the slower sets the pace)
    host_is_compute: bool = False
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
        packed_flops=(hw.cpu_packed_flops or 0.0) if compress_cache else 0.0,
        host_peak=((hw.cpu_att_peak_dtype or {}).get("float32", 0.0) if compress_cache else hw.cpu_att_peak) or 0.0,
        host_read=hw.cpu_att_read or 0.0,
        host_is_compute=hw.compute_device == "cpu",
        stream_overlap=hw.compute_device != "cpu", rows_pre=rows_pre)


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
