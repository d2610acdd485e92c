"""The profiler's compute probes: each times the engine's own work at sizes that look like it
(matrix products of a prefill and of a decode step, the decode GEMM's weight stream, prompt
and decode attention) and gives its rate. ``profiler.profile_hardware`` calls them, with the
copy, disk and network probes beside it there.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from flexgen_dist.kernels import gemm
from flexgen_dist.planner.hardware import DECODE_ROWS, DTYPES

# Sizes are chosen to look like the work they stand for (a linear layer of a 7B-30B model, a
# decode-attention block, a layer of weights) while keeping the whole profile under a minute
# on a 2-core CPU (quick mode: under ten seconds, for tests).
_MM_SHAPES = {("cpu", False): (512, 4096, 4096), ("cpu", True): (128, 1024, 1024),
              ("cuda", False): (4096, 8192, 8192), ("cuda", True): (2048, 4096, 4096)}
_ATTN_SHAPES = {False: (512, 1024, 128), True: (128, 512, 128)}  # (batch*heads, keys, head_dim)
# Decode-shaped linear layers: a GPU batch of rows against weights that do not fit the caches.
_GEMM_ROWS = 8
_GEMM_SHAPE = {"cpu": (1024, 4096), "cuda": (4096, 16384)}  # (in, out) of one weight matrix
_GEMM_BYTES = {False: 512 * 2**20, True: 64 * 2**20}  # weights streamed per pass


def _timeit(fn: Callable[[], Any], reps: int, sync: Callable[[], Any]) -> float:
    """Median seconds of ``fn`` after one warm-up call (median: achievable, not a lucky peak)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _sync_of(device: str) -> Callable[[], Any]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure_mm_flops(device: str, quick: bool = False, dtype: torch.dtype | None = None) -> float:
    """Dense matmul FLOP/s at linear-layer sizes (default dtype: fp16 on cuda, fp32 on cpu)."""
    m, k, n = _MM_SHAPES[(device, quick)]
    dtype = dtype or (torch.float16 if device == "cuda" else torch.float32)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    # a shared VM's rate moves from call to call; a median over more calls is steadier
    t = _timeit(lambda: a @ b, 2 if quick else 9, _sync_of(device))
    return 2.0 * m * k * n / t


def measure_prefill_flops(device: str, dtype: torch.dtype, quick: bool = False) -> float:
    """FLOP/s of a prefill's products in ``dtype`` as the engine runs them: on a CPU the form the
    GEMM policy stores for the dtype (its own GEMM, or float32 where that is faster), timed now
    (``kernels/gemm.py``'s prefill-sized product); on a GPU the dtype's GEMM.

    *Why timed now, not the policy's stored rate:* the policy measures once per machine, at
    whatever moment a run first needs the choice, possibly beside other work (a test suite in
    two workers, another job), and keeps it: measuring the machine again did not refresh it.
    The choice between forms, timed alternating, survives such a moment; the absolute rate
    does not. On the development VM the stored bfloat16 rate was 185 GFLOP/s where the same
    product, timed again on the idle machine, ran at 230-415 (float32: 118 stored, 88-157
    again), and the planner predicted bfloat16 prefill at 0.66 of the measured throughput.
    Timed with the rest of the profile, the figure is of the same moment as the others."""
    if device == "cpu":
        form, _ = gemm.policy().prefill(dtype)
        return gemm.time_prefill(dtype)[form]
    return measure_mm_flops(device, quick, dtype)


def measure_prompt_attention_flops(device: str, dtype: torch.dtype, quick: bool = False) -> float:
    """FLOP/s of prompt attention in ``dtype`` as the engine runs it (``prefill_attention`` over
    a left-padded block, with its mask), counted as the cost model counts it: ``4 rows s q``
    a layer, rows = sequences x positions, q = heads x head dim.

    *Why not the matmul rate:* a fused attention kernel is far from a GEMM's rate on a CPU, in
    bfloat16 most of all: on the development VM, SmolLM2's 400-token prefill spent 27 % of its
    time in attention at ~130 GFLOP/s beside products at ~420, and the planner predicted
    bfloat16 prefill at 0.70 of its measured time."""
    from flexgen_dist.engine.attention import prefill_attention

    b, t, nh, d = (2, 128, 8, 64) if quick else (4, 512, 8, 64)
    q, k, v = (torch.randn(b, t, nh, d, device=device).to(dtype) for _ in range(3))
    lens = torch.tensor([t - 7 * i for i in range(b)], device=device)  # left padding, as blocks have
    pos = torch.arange(t, device=device)
    valid = pos[None, :] >= (t - lens)[:, None]  # (b, t): not padding
    mask = (pos[None, :] <= pos[:, None])[None, None] & valid[:, None, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool, device=device)[None, None]  # a padded row sees itself
    t_s = _timeit(lambda: prefill_attention(q, k, v, mask), 2 if quick else 5, _sync_of(device))
    return 4.0 * b * t * t * nh * d / t_s


def _gemm_walk(device: str, quick: bool, dtype: torch.dtype | None, rows: tuple[int, ...],
               shapes: list[tuple[int, int]], walk_bytes: int) -> tuple[list[float], int, int]:
    """Median seconds of a walk through distinct weight matrices of ``shapes`` ((out, in),
    repeated to ``walk_bytes``: more than any cache holds, multiplied one after another as a
    decode step walks the layers) by the engine's own product, for each count of ``rows`` on
    the same weights, with the walk's weight bytes and elements."""
    from flexgen_dist.models.common import linear

    dtype = dtype or (torch.float16 if device == "cuda" else torch.float32)
    esize = torch.empty((), dtype=dtype).element_size()
    per = sum(n * k for n, k in shapes)
    count = max(2, walk_bytes // (per * esize))
    g = torch.Generator(device=device).manual_seed(0)
    ws = [torch.randn(n, k, device=device, generator=g).to(dtype) for _ in range(count) for n, k in shapes]
    times = []
    for r in rows:
        xs = {k: torch.randn(r, k, device=device, generator=g).to(dtype) for _, k in shapes}

        def walk() -> None:
            for w in ws:
                linear(xs[w.shape[1]], w)

        times.append(_timeit(walk, 2 if quick else 5, _sync_of(device)))
    return times, count * per * esize, count * per


def measure_gemm_bw(device: str, quick: bool = False, dtype: torch.dtype | None = None) -> float:
    """Bytes/s of weights a decode-shaped linear layer streams (``_GEMM_ROWS`` rows), through
    the engine's own product (on a CPU, the form its GEMM policy stores for the shape).

    Small-batch linear layers are neither compute-bound nor at the memory's copy bandwidth:
    the GEMM library's skinny kernels set the pace. Distinct weight matrices (more bytes than
    any cache holds) are multiplied one after another, as a decode step walks the layers.
    """
    k, n = _GEMM_SHAPE[device]
    (t,), nbytes, _ = _gemm_walk(device, quick, dtype, (_GEMM_ROWS,), [(n, k)], _GEMM_BYTES[quick])
    return nbytes / t


def _decode_layer(hidden: int) -> list[tuple[int, int]]:
    """The products of one decoder layer of width ``hidden``, (out, in): q, k and v (a quarter
    of q: grouped-query attention), o, gate and up (2.75 x hidden), down."""
    kv, ffn = hidden // 4, hidden * 11 // 4
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden), (hidden, ffn)]


def measure_decode_flops(device: str, quick: bool = False, dtype: torch.dtype | None = None) -> float:
    """FLOP/s of a decode step's products at ``DECODE_ROWS`` rows: a walk through decoder
    layers' products (``_decode_layer`` at ``gemm_bw``'s width), timed with ``_GEMM_ROWS`` and
    with ``DECODE_ROWS`` rows on the same weights. On a CPU the same cores stream and
    multiply, and the cost model adds the two, so the rate is of the rows beyond
    ``_GEMM_ROWS`` (the time the walk grew by); on a GPU they overlap, and the rate is of the
    whole walk at ``DECODE_ROWS`` rows.

    *Why a rate of its own:* a product of a few dozen rows is neither a prefill's GEMM nor a
    skinny one. On a 2-core Xeon (AVX512_BF16, no AMX) 64 rows multiplied at ~150 GFLOP/s in
    bfloat16 beyond their stream, where the prefill-sized product ran at ~250: counted at the
    prefill rate, the bundled model's bfloat16 decode was predicted 1.8x faster than it ran.
    *Why a layer's mix of shapes:* small products run further below the peak; one 1024 x 4096
    shape measured ~350 GFLOP/s in float32, a layer's mix at that width ~295, SmolLM2's ~260.
    The walk is 64 MiB: the rows multiply its time, and a dtype without a fast product here
    (float16 without AVX512_FP16) would take long."""
    shapes = _decode_layer(_GEMM_SHAPE[device][0])
    (t_few, t_rows), _, numel = _gemm_walk(device, quick, dtype, (_GEMM_ROWS, DECODE_ROWS), shapes,
                                           _GEMM_BYTES[True])
    if device == "cuda":
        return 2.0 * DECODE_ROWS * numel / t_rows
    grew = max(t_rows - t_few, 0.05 * t_rows)  # at least a twentieth of the walk: noise
    return 2.0 * (DECODE_ROWS - _GEMM_ROWS) * numel / grew


def measure_attention_flops(device: str, quick: bool = False) -> float:
    """FLOP/s of decode attention (one query against many cached keys, with a key mask).

    Uses the engine's own decode attention over rows of (sequence, kv head) in float32 (on a
    CPU its native kernel, elsewhere ``scaled_dot_product_attention``), so the rate includes
    what that kernel really does on this device.
    """
    from flexgen_dist.engine.attention import attend_rows

    bh, keys, hd = _ATTN_SHAPES[quick]
    dtype = torch.float16 if device == "cuda" else torch.float32
    q = torch.randn(bh, 1, 1, hd, dtype=dtype, device=device)
    k = torch.randn(bh, keys, hd, dtype=dtype, device=device)
    v = torch.randn(bh, keys, hd, dtype=dtype, device=device)
    mask = torch.ones(bh, 1, 1, keys, dtype=torch.bool, device=device)

    def attn() -> torch.Tensor:
        return attend_rows(q, k, v, mask)

    t = _timeit(attn, 3 if quick else 5, _sync_of(device))
    return 4.0 * bh * keys * hd / t


def measure_host_attention(quick: bool = False, heads: int = 1, dtypes: tuple[str, ...] = DTYPES) -> dict[str, float]:
    """FLOP/s of the host's decode attention (``attend_rows``) per dtype over
    ``measure_attention_flops``' cache, with ``heads`` query heads a key and value: with one,
    reading the cache sets the pace (``cpu_att_read``); with eight (grouped-query attention),
    computing does (``cpu_att_peak``). The two place the kernel's time per byte read and per
    FLOP for any heads a key (``planner/terms.py``). Both read the same cache, larger than any
    last-level cache: the eight-head probe read an eighth of it before, which stayed in part in
    cache from one repetition to the next, as a decode step's never does, and measured 81
    GFLOP/s in float32 on the 2-core development VM where the cold cache gives 46."""
    from flexgen_dist.engine.attention import attend_rows

    bh, keys, hd = _ATTN_SHAPES[quick]
    out = {}
    for name in dtypes:
        dt = getattr(torch, name)
        q = torch.randn(bh, heads, 1, hd, dtype=dt)
        k, v = torch.randn(bh, keys, hd, dtype=dt), torch.randn(bh, keys, hd, dtype=dt)
        mask = torch.ones(bh, 1, 1, keys, dtype=torch.bool)
        t = _timeit(lambda: attend_rows(q, k, v, mask), 3 if quick else 5, lambda: None)
        out[name] = 4.0 * bh * heads * keys * hd / t
    return out


def measure_packed_attention_flops(quick: bool = False) -> float | None:
    """FLOP/s of the host's decode attention over a 4-bit compressed cache (groups of 64), its
    codes read in place (``engine.attention.attend_packed``), at ``measure_attention_flops``' shape
    in float32: what the host's share of a compressed cache costs a decode step. None where the
    native kernel is not built here (the engine expands such a cache, as the cost model then counts)."""
    from flexgen_dist.engine.attention import attend_packed
    from flexgen_dist.memory.quant import quantize

    bh, keys, hd = _ATTN_SHAPES[quick]
    q = torch.randn(bh, 1, 1, hd)
    k, v = (quantize(torch.randn(bh, keys, hd), 4, 64) for _ in range(2))
    mask = torch.ones(bh, 1, 1, keys, dtype=torch.bool)
    if attend_packed(q, k, v, mask, False, False) is None:
        return None
    t = _timeit(lambda: attend_packed(q, k, v, mask, False, False), 3 if quick else 5, lambda: None)
    return 4.0 * bh * keys * hd / t
