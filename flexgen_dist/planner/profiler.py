"""The profiler: measures this machine as a :class:`HardwareSpec`.

``profile_hardware`` times, at sizes that look like the engine's work, dense matmuls and
decode-shaped weight streaming in each compute dtype (through the engine's own products),
decode attention (the engine's kernel), host<->device copies, the engine's own disk path and
the loopback network. Keeping the result per host is ``profile_cache.py``'s.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable

import torch

from flexgen_dist.kernels import gemm
from flexgen_dist.memory.disk import DiskStore, aligned_empty, drop_page_cache
from flexgen_dist.planner.hardware import DECODE_ROWS, DEVICES, DTYPES, HardwareSpec
from flexgen_dist.planner.host import measure_cache_batch_overhead, measure_host_overhead


# Sizes are chosen to look like the work they stand for (a linear layer of a 7B-30B model, a
# decode-attention block, a layer of weights) while keeping the whole run under a minute on
# a 2-core CPU (quick mode: under ten seconds, for tests).
_MM_SHAPES = {("cpu", False): (512, 4096, 4096), ("cpu", True): (128, 1024, 1024),
              ("cuda", False): (4096, 8192, 8192), ("cuda", True): (2048, 4096, 4096)}
_ATTN_SHAPES = {False: (512, 1024, 128), True: (128, 512, 128)}  # (batch*heads, keys, head_dim)
_COPY_BYTES = {False: 256 * 2**20, True: 32 * 2**20}
_DISK_BYTES = {False: 2048 * 2**20, True: 32 * 2**20}
# The engine reads offloaded weights tensor by tensor into reused buffers, one after another
# on one thread: the disk sees one request of a tensor's size at a time. 16 MiB is a
# linear layer's weight at hidden 1024 in fp32 (or 2048 in fp16); on the development VM that
# pattern reads ~10% slower than single 256 MiB requests (what the profiler used to time).
_DISK_TENSOR_BYTES = {False: 16 * 2**20, True: 4 * 2**20}
# Decode-shaped linear layers: a GPU batch of rows against weights that do not fit the caches.
_GEMM_ROWS = 8
_GEMM_SHAPE = {"cpu": (1024, 4096), "cuda": (4096, 16384)}  # (in, out) of one weight matrix
_GEMM_BYTES = {False: 512 * 2**20, True: 64 * 2**20}  # weights streamed per pass
_NET_BYTES = {False: 256 * 2**20, True: 16 * 2**20}


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


def measure_attention_read(quick: bool = False, dtypes: tuple[str, ...] = DTYPES) -> dict[str, float]:
    """FLOP/s of the host's decode attention where it reads, per dtype: ``measure_attention_flops``'
    shape (one head a key) on the CPU in each dtype. With ``measure_attention_peak``'s rates
    (eight heads a key) it places the kernel's read and compute times for any heads a key."""
    from flexgen_dist.engine.attention import attend_rows

    bh, keys, hd = _ATTN_SHAPES[quick]
    out = {}
    for name in dtypes:
        dt = getattr(torch, name)
        q = torch.randn(bh, 1, 1, hd, dtype=dt)
        k, v = torch.randn(bh, keys, hd, dtype=dt), torch.randn(bh, keys, hd, dtype=dt)
        mask = torch.ones(bh, 1, 1, keys, dtype=torch.bool)
        t = _timeit(lambda: attend_rows(q, k, v, mask), 3 if quick else 5, lambda: None)
        out[name] = 4.0 * bh * keys * hd / t
    return out


def measure_attention_peak(quick: bool = False) -> dict[str, float]:
    """FLOP/s of the host's decode attention where it computes rather than reads, per dtype:
    ``measure_attention_flops``' FLOPs with eight query heads a key and value (grouped-query
    attention), the engine's own kernel (``attend_rows``), over as large a cache as the
    one-head probe's: a cache of an eighth of it (as this probe had before) stayed in part in
    the last-level cache from one repetition to the next, as a decode step's never does, and
    measured 81 GFLOP/s in float32 on the 2-core development VM where the cold cache gives 46."""
    from flexgen_dist.engine.attention import attend_rows

    bh, keys, hd = _ATTN_SHAPES[quick]
    rows, g = bh, 8
    out = {}
    for name in DTYPES:
        dt = getattr(torch, name)
        q = torch.randn(rows, g, 1, hd, dtype=dt)
        k, v = torch.randn(rows, keys, hd, dtype=dt), torch.randn(rows, keys, hd, dtype=dt)
        mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool)
        t = _timeit(lambda: attend_rows(q, k, v, mask), 3 if quick else 5, lambda: None)
        out[name] = 4.0 * rows * g * keys * hd / t
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


def measure_copy_bw(device: str, quick: bool = False) -> tuple[float, float]:
    """(host->device, device->host) bytes/s: pinned copies on cuda, memcpy on a CPU device."""
    nbytes = _COPY_BYTES[quick]
    sync = _sync_of(device)
    if device == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        to_dev = _timeit(lambda: dev.copy_(host, non_blocking=True), 3, sync)
        to_host = _timeit(lambda: host.copy_(dev, non_blocking=True), 3, sync)
        return nbytes / to_dev, nbytes / to_host
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    t1 = _timeit(lambda: dst.copy_(src), 3, sync)
    t2 = _timeit(lambda: src.copy_(dst), 3, sync)
    return nbytes / t1, nbytes / t2


class _ComputeLoad:
    """Dense matmuls on the CPU in a background thread, for as long as the context is open.

    With overlap the engine reads weights while its compute threads keep every core busy,
    and on a CPU device the I/O thread then competes with them for cores: measured on the
    development VM, the same reads ran at 1.9 GB/s on an idle CPU and 1.2-1.5 GB/s beside two
    busy compute threads. Disk rates for a CPU device are timed under this load. The load
    also counts its matmuls, so ``rate`` over a window tells how much compute the reads took.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.done = 0

    def _run(self) -> None:
        a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
        while not self._stop.is_set():
            torch.mm(a, b)
            self.done += 1

    def rate(self, seconds: float) -> float:
        """Matmuls per second over the next ``seconds``."""
        n0, t0 = self.done, time.perf_counter()
        time.sleep(seconds)
        return (self.done - n0) / (time.perf_counter() - t0)

    def __enter__(self) -> "_ComputeLoad":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def measure_disk_bw(offload_dir: str, quick: bool = False, device: str = "cuda") -> tuple[float, float, float | None]:
    """(read, write) bytes/s of the engine's own disk path (DiskStore, O_DIRECT when allowed),
    and on a CPU device the compute seconds lost per byte moved (else None).

    Both follow the engine's pattern for offloaded weights: ``_DISK_TENSOR_BYTES`` files
    written, then read, one after another on one thread, reads into a reused pre-faulted
    aligned buffer; the page cache is dropped before the reads; medians of the repetitions.
    The files total ``_DISK_BYTES`` (2 GiB in full mode): on a VM a smaller set can be served
    partly by the host's cache (the development VM reads 512 MiB ~25% faster than 2 GiB),
    which offloaded weights, usually far larger, do not enjoy. For a CPU compute device the
    reads and writes run beside a compute load (see ``_ComputeLoad``), as the engine's do; the
    load's matmul rate during the transfers against its rate alone gives the compute they
    take (on a one-core node a large share: the I/O thread and the kernel's I/O path run on
    the core that computes).
    """
    nbytes, tbytes = _DISK_BYTES[quick], _DISK_TENSOR_BYTES[quick]
    data = torch.randint(0, 255, (tbytes,), dtype=torch.uint8)
    reads, writes, busy = [], [], 0.0
    load = _ComputeLoad() if device == "cpu" else None
    with DiskStore(offload_dir, rank=0) as store, load or contextlib.nullcontext():
        alone = load.rate(0.3 if quick else 1.0) if load is not None else 0.0
        parts = [store.allocate(f"profile-{i}", (tbytes,), torch.uint8) for i in range(nbytes // tbytes)]
        buf = aligned_empty((tbytes,), torch.uint8).zero_()  # reused and pre-faulted, as the engine's
        for _ in range(1 if quick else 3):
            t0, n0 = time.perf_counter(), load.done if load is not None else 0
            for p in parts:
                p.write(data)
            if not store.direct:
                os.sync()  # buffered fallback: count the flush, not the page-cache copy
            writes.append(time.perf_counter() - t0)
            drop_page_cache()
            t0 = time.perf_counter()
            for p in parts:
                p.read(out=buf)
            reads.append(time.perf_counter() - t0)
            if load is not None:  # compute seconds lost over the writes and reads
                lost = (writes[-1] + reads[-1]) - (load.done - n0) / max(alone, 1e-9)
                busy += max(0.0, lost)
    total = len(parts) * tbytes
    read_bw = total / max(statistics.median(reads), 1e-9)
    write_bw = total / max(statistics.median(writes), 1e-9)
    disk_cpu = busy / (2 * total * len(reads)) if load is not None else None
    return read_bw, write_bw, disk_cpu


def measure_loopback(quick: bool = False) -> tuple[float, float]:
    """(bytes/s, one-way latency s) of TCP over loopback: a stand-in for the real network."""
    nbytes, rounds = _NET_BYTES[quick], 50 if quick else 200
    chunk = 1 << 20
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(rounds):
                conn.sendall(conn.recv(1))
            left, buf = nbytes, bytearray(chunk)
            while left > 0:
                got = conn.recv_into(buf, min(chunk, left))
                if got == 0:
                    break
                left -= got
            conn.sendall(b"k")

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        with socket.create_connection(("127.0.0.1", port)) as cli:
            cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            for _ in range(rounds):
                cli.sendall(b"x")
                cli.recv(1)
            latency = (time.perf_counter() - t0) / rounds / 2
            payload = bytes(chunk)
            t0 = time.perf_counter()
            for _ in range(nbytes // chunk):
                cli.sendall(payload)
            cli.recv(1)
            bw = nbytes / (time.perf_counter() - t0)
    finally:
        th.join(timeout=10)
        srv.close()
    return bw, latency


STEADY = 0.2  # the decode GEMM's rate may move this much between a profile's start and end


def _check_steady(first: float, last: float) -> bool:
    """Whether the machine ran at one speed while it was measured: the decode GEMM's rate,
    the profile's first figure, timed again at its end. A shared host's speed moves (on the
    development VM two profiles five minutes apart differed x0.5-0.7 in every memory-bound
    figure, and the planner's predictions with them); where it moved by more than ``STEADY``
    one line says so, since every figure between may be off by as much."""
    if abs(last / first - 1.0) <= STEADY:
        return True
    print(f"hardware profile: this machine's speed moved while it was measured (decode GEMM "
          f"{first / 1e9:.1f} GB/s at the start, {last / 1e9:.1f} at the end): its figures may be off by "
          "as much; measure again when it is idle (python -m flexgen_dist.planner profile)",
          file=sys.stderr, flush=True)
    return False


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def profile_hardware(device: str = "cpu", offload_dir: str = "/tmp", quick: bool = False, *,
                     net_bw: float | None = None,
                     net_latency: float | None = None) -> HardwareSpec:
    """Measure this machine as a :class:`HardwareSpec` (under a minute; ``quick``: ~10 s).

    Capacities are what is free now, with headroom: 90% of free GPU memory, 90% of
    MemAvailable, 95% of free space under ``offload_dir``. On a CPU device the compute device
    *is* host RAM, so the available RAM is split evenly between the gpu and cpu tiers to keep
    their sum honest; override with ``with_budgets``. The network defaults to a loopback
    measurement (an upper bound: real links are slower); pass ``net_bw``/``net_latency`` to
    use your interconnect's figures.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: use one of {DEVICES}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available here: profile with --device cpu")
    mm = measure_mm_flops(device, quick)
    own = "float16" if device == "cuda" else "float32"  # the dtype of the plain figures
    mm_dtype = {d: measure_prefill_flops(device, getattr(torch, d), quick) for d in DTYPES}
    bw_dtype = {d: measure_gemm_bw(device, quick, getattr(torch, d)) for d in DTYPES}
    gemm_bw = bw_dtype[own]
    dec_dtype = {d: measure_decode_flops(device, quick, getattr(torch, d)) for d in DTYPES}
    att_dtype = {d: measure_prompt_attention_flops(device, getattr(torch, d), quick) for d in DTYPES}
    cpu_att = measure_attention_flops("cpu", quick)
    cpu_read = {"float32": cpu_att, **measure_attention_read(quick, ("bfloat16", "float16"))}  # float32's: cpu_flops
    cpu_packed = measure_packed_attention_flops(quick)
    cpu_peak = measure_attention_peak(quick)
    bmm = measure_attention_flops(device, quick) if device == "cuda" else cpu_att
    ctog, gtoc = measure_copy_bw(device, quick)
    dtoc, ctod, disk_cpu = measure_disk_bw(offload_dir, quick, device)
    host_layer_s, host_batch_s = measure_host_overhead(device, quick)
    host_cache_batch_s = measure_cache_batch_overhead(device, quick, host_batch_s)
    if net_bw is None or net_latency is None:
        lo_bw, lo_lat = measure_loopback(quick)
        net_bw = lo_bw if net_bw is None else net_bw
        net_latency = lo_lat if net_latency is None else net_latency
    _check_steady(gemm_bw, measure_gemm_bw(device, quick))
    ram = _mem_available()
    if device == "cuda":
        gpu_mem, cpu_mem = int(0.9 * torch.cuda.mem_get_info()[0]), int(0.9 * ram)
    else:
        gpu_mem = cpu_mem = int(0.45 * ram)
    disk_mem = int(0.95 * shutil.disk_usage(offload_dir).free)
    return HardwareSpec(name=f"{socket.gethostname()}-{device}", source="measured",
                        gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem,
                        ctog_bw=ctog, gtoc_bw=gtoc, dtoc_bw=dtoc, ctod_bw=ctod,
                        mm_flops=mm, bmm_flops=bmm, cpu_flops=cpu_att, cpu_packed_flops=cpu_packed,
                        cpu_att_peak=cpu_peak[own], cpu_att_peak_dtype=cpu_peak,
                        cpu_att_read=cpu_read[own], cpu_att_read_dtype=cpu_read,
                        net_bw=net_bw, net_latency=net_latency, compute_device=device,
                        gemm_bw=gemm_bw, disk_cpu=disk_cpu, mm_flops_dtype=mm_dtype, gemm_bw_dtype=bw_dtype,
                        decode_flops=dec_dtype[own], decode_flops_dtype=dec_dtype,
                        host_layer_s=host_layer_s, host_batch_s=host_batch_s,
                        host_cache_batch_s=host_cache_batch_s,
                        att_flops=att_dtype["float16" if device == "cuda" else "float32"], att_flops_dtype=att_dtype)
