"""The profiler: measures this machine as a :class:`HardwareSpec`.

``profile_hardware`` times, at sizes that look like the engine's work, dense matmuls and
decode-shaped weight streaming in each compute dtype (through the engine's own products),
decode attention (the engine's kernel) (those in ``compute_probes.py``), host<->device copies,
the engine's own disk path and the loopback network. Keeping the result per host is
``profile_cache.py``'s.
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
from typing import Any

import torch

from flexgen_dist.memory.disk import DiskStore, aligned_empty, drop_page_cache
from flexgen_dist.planner.compute_probes import (_sync_of, _timeit, measure_attention_flops, measure_decode_flops,
                                                 measure_gemm_bw, measure_host_attention, measure_mm_flops,
                                                 measure_packed_attention_flops, measure_prefill_flops,
                                                 measure_prompt_attention_flops)
from flexgen_dist.planner.hardware import DEVICES, DTYPES, HardwareSpec
from flexgen_dist.planner.host import measure_cache_batch_overhead, measure_host_overhead


# Sizes of the copy, disk and network probes (the compute probes': ``compute_probes.py``).
_COPY_BYTES = {False: 256 * 2**20, True: 32 * 2**20}
_DISK_BYTES = {False: 2048 * 2**20, True: 32 * 2**20}
# The engine reads offloaded weights tensor by tensor into reused buffers, one after another
# on one thread: the disk sees one request of a tensor's size at a time. 16 MiB is a
# linear layer's weight at hidden 1024 in fp32 (or 2048 in fp16); on the development VM that
# pattern reads ~10% slower than single 256 MiB requests (what the profiler used to time).
_DISK_TENSOR_BYTES = {False: 16 * 2**20, True: 4 * 2**20}
_NET_BYTES = {False: 256 * 2**20, True: 16 * 2**20}


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
    cpu_read = {"float32": cpu_att, **measure_host_attention(quick, 1, ("bfloat16", "float16"))}  # float32's: cpu_flops
    cpu_packed = measure_packed_attention_flops(quick)
    cpu_peak = measure_host_attention(quick, 8)
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
