"""The linear coefficient tables of one stage: what each channel costs per layer as linear
functions of the nine placement fractions, beside the stage's memory footprint.

``sizes.stage_sizes`` derives a stage's bytes, FLOPs and rates for one batch shape; the builders
``prefill_terms`` and ``decode_terms`` turn them into the time tables of a ``StageTerms``,
which ``cost_model`` evaluates at a policy and ``search`` optimises over. Memory is not
modelled here: ``StageTerms`` carries the engine's own footprint (``engine.footprint``), read
linearly by the LP and exactly by the repair and the run's budget check. Notation and units:
see ``cost_model``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from flexgen_dist.engine.footprint import Footprint, Packed, StageShape, stage_footprint
from flexgen_dist.engine.held import planned_hold
from flexgen_dist.models.spec import ModelSpec
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner.sizes import StageSizes, WorkShape, stage_sizes

CHANNELS = ("ctog", "gtoc", "dtoc", "ctod", "comp", "net", "host")
COMP, HOST = CHANNELS.index("comp"), CHANNELS.index("host")
TIERS = ("gpu", "cpu", "disk")
PHASES = ("prefill", "decode")
WG, WC, WD, CG, CC, CD, HG, HC, HD = range(9)
CONST = 9  # column of the constant term


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


def _held_terms(workload: WorkShape, block_size: int) -> dict[str, Any]:
    """The footprint's held-prefix terms (``StageShape.shared``, ``hold``, ``held``): the opening
    every prompt shares, held once through decode (``PrefixShape.floor``), where a block of one
    request (which shares nothing) still fits a full block's cache."""
    held = planned_hold(workload.prefix, workload.prompt_len + workload.gen_len, block_size)
    return {"shared": held, "hold": True, "held": held} if held else {}


def _gemm(z: StageSizes, hw: HardwareSpec, rows: float, passes: int, numel: float | None = None) -> float:
    """Linear layers of one block: the arithmetic (each token computes with ``lnum_active``
    elements: a mixture of experts' chosen ones) at the rate of products of ``rows / passes``
    rows (``HardwareSpec.product_flops``), and reading ``numel`` elements (all of a layer's by
    default) ``passes`` times, overlapped or not (``_stream``)."""
    flops = 2.0 * rows * (z.lnum_active or z.lnum)
    rate = hw.product_flops(rows / max(passes, 1))
    return _stream(z, flops / rate, passes * (z.lnum if numel is None else numel) * z.b / z.stream_bw)


def _head_time(z: StageSizes, hw: HardwareSpec, passes: float) -> float:
    """LM head of one block, streamed ``passes`` times: logits of the last position only (a
    decode-shaped product of the block's rows, or of a GPU batch's where it streams per batch)."""
    if not z.has_head:
        return 0.0
    rate = hw.product_flops(z.bls / max(passes, 1.0))
    return _stream(z, 2.0 * z.bls * z.e * z.V / rate, passes * z.V * z.e * z.b / z.stream_bw)


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
    P[COMP if z.host_is_compute else HOST, CONST] += z.num_gb * (z.host_layer + z.host_batch + z.host_cache_batch)  # GPU batch by GPU batch
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
    kv = bls * z.ctx * z.kv_tok  # cache elements the step's attention reads
    deq_c = kv * b if z.compress_cache else 0.0  # bytes to expand
    D[4, CONST] = _gemm(z, hw, bls, z.streams, z.dec_numel) + z.deq_w + _head_time(z, hw, z.streams) / z.l
    device = att_flops / hw.bmm_flops + deq_c / z.mem_bw
    host, measured = _host_attention(z, hw, att_flops, kv)
    on_host = hw.compute_device == "cpu" and measured  # a CPU device attends as the host does
    D[4, CG] = host if on_host else device
    D[4, [CC, CD]] = host if z.cpu_attention or on_host else device
    D[5, CONST] = z.net_d / z.l
    # the host issues each layer's linear part once per step where decode merges the GPU
    # batches, and its attention once per GPU batch either way
    D[COMP if z.host_is_compute else HOST, CONST] += z.host_layer * (1 if z.merged else z.num_gb) + (z.host_batch + z.host_cache_batch) * z.num_gb
    _add_disk_cpu(D, hw)
    return D


def _host_attention(z: StageSizes, hw: HardwareSpec, flops: float, kv: float) -> tuple[float, bool]:
    """Seconds of the host's decode attention over ``kv`` cache elements (``flops`` FLOPs), and
    whether they come from the profile's figures for it. Over a plain cache with ``host_peak``
    measured: reading and computing add up (``_read_and_compute``), so heads sharing a key
    (grouped-query attention) and narrower dtypes cost what they do. A compressed cache's codes
    are read in place: each element expanded in registers at the rate ``cpu_packed_flops``
    measured (one head a key: 2 FLOPs an element), or computed at the float32 peak, the slower;
    its FLOPs at ``cpu_packed_flops`` where the peak was not measured. Without those figures:
    FLOPs at ``cpu_flops``, a compressed cache's expansion added at ``2 cpu_flops`` bytes/s."""
    if z.packed_flops:
        return (max(2 * kv / z.packed_flops, flops / z.host_peak) if z.host_peak
                else flops / z.packed_flops), True
    if z.compress_cache:
        return flops / hw.cpu_flops + kv * z.b / (2 * hw.cpu_flops), False
    if z.host_peak:
        return _read_and_compute(kv * z.b, flops, z.host_read or hw.cpu_flops, z.host_peak, z.b), True
    return flops / hw.cpu_flops, False


def _read_and_compute(nbytes: float, flops: float, one_head: float, eight_heads: float, b: float) -> float:
    """Seconds of the host's decode attention reading ``nbytes`` of cache and computing ``flops``,
    from the kernel's rates with one and with eight query heads a key (FLOP/s, elements of
    ``b`` bytes): ``nbytes / bw + flops / peak``, with ``bw`` and ``peak`` the two the rates
    imply (a FLOP of one head a key reads ``b / 2`` bytes, of eight ``b / 16``).

    *Why a sum, not the slower of the two:* the kernel reads a key, then computes with it; on
    the 2-core development VM one, three and eight heads a key ran at 29.7, 21.2 and 11.4 GB/s
    of cache in float32 (20.2, 14.8 and 9.4 in bfloat16), and the sum fitted to the first and
    last gives 21.3 (15.1) for three, where the slower of the two gave 29.7 (20.2)."""
    inv_bw = max(1.0 / one_head - 1.0 / eight_heads, 0.0) / (7.0 * b / 16.0)
    inv_peak = max(1.0 / eight_heads - b / 16.0 * inv_bw, 0.0)
    return nbytes * inv_bw + flops * inv_peak


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
