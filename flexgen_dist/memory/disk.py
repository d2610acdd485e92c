"""The disk tier: one file per tensor under a per-rank offload dir, O_DIRECT where possible.

O_DIRECT keeps the page cache out of the way, so "disk" bytes do not silently sit in RAM and
the cpu budget stays honest. It needs offsets, lengths and buffer addresses aligned to
:data:`ALIGN`; files are padded to a multiple of it, aligned middles of a transfer go
straight into/out of the caller's tensor when its address allows, and everything else (edge
blocks, misaligned buffers) passes through a page-aligned staging buffer per thread. Writes
that only cover part of an edge block read-modify-write it under a per-file lock. Where the
file system refuses O_DIRECT, ``direct_io="auto"`` falls back to buffered I/O and logs why.

Files are removed by ``close()``, at interpreter exit, when the store is garbage-collected,
and on SIGTERM (a handler is installed only over the default action; it removes the files
and re-raises the signal so the exit status still says SIGTERM). A process killed outright
(SIGKILL, a lost node) cannot clean up: each dir carries an ``.owner`` file, and the next
run under the same root removes the dirs of dead owners (both in ``memory/owners.py``).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexgen_dist.interrupts import submit
from flexgen_dist.memory.owners import FileGate, make_dir, reclaim_stale_dirs, remove_at_exit
from flexgen_dist.memory.quant import QTensor, qtensor_layout
from flexgen_dist.memory.units import format_bytes

log = logging.getLogger("flexgen_dist")

ALIGN = 4096                   # O_DIRECT alignment: covers 512 B and 4 KiB logical blocks
STAGING_BYTES = 8 * 2**20      # per-thread staging buffer (multiple of ALIGN)
MAX_IO = 256 * 2**20           # split single syscalls below Linux's ~2 GiB cap
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_SPACE_FIX = "free space, pick another --offload-dir, or lower the disk share"


DROP_CACHES = "/proc/sys/vm/drop_caches"


def can_drop_page_cache() -> bool:
    """Whether this process may drop the page cache (root on Linux)."""
    return os.access(DROP_CACHES, os.W_OK)


def drop_page_cache() -> bool:
    """Write back and drop the page cache, so the next buffered or mapped reads hit the
    device (profiling, benchmarks). False, doing nothing, where it is not allowed."""
    if not can_drop_page_cache():
        return False
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")
    return True


class DiskStoreError(OSError):
    """The offload dir cannot be used as configured; the message says what to change."""


def aligned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *,
                  pin: bool = False, offset: int = 0) -> torch.Tensor:
    """Uninitialised contiguous CPU tensor whose address is ``offset`` mod :data:`ALIGN`.

    Reading file bytes ``[a, b)`` into a buffer at address ``a mod ALIGN`` lets O_DIRECT go
    straight into it for all but the edge blocks.
    """
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (offset - raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes].view(dtype).view(shape)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view sharing memory with contiguous CPU tensor ``t``."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _pread_full(fd: int, buf: np.ndarray, off: int) -> None:
    done, n = 0, buf.nbytes
    while done < n:
        got = os.preadv(fd, [memoryview(buf[done:done + MAX_IO])], off + done)
        if got <= 0:
            raise OSError(errno.EIO, f"short read at offset {off + done}")
        done += got


def _pwrite_full(fd: int, buf: np.ndarray, off: int) -> None:
    done, n = 0, buf.nbytes
    while done < n:
        done += os.pwrite(fd, memoryview(buf[done:done + MAX_IO]), off + done)


def _up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


class DiskTensor:
    """A tensor stored in one file of a :class:`DiskStore` (made by ``DiskStore.allocate``)."""

    def __init__(self, store: DiskStore, path: str, shape: torch.Size, dtype: torch.dtype):
        self.store = store
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        self.file_bytes = _up(self.nbytes)
        self._lock = threading.Lock()  # serialises read-modify-write of shared edge blocks

    def __repr__(self) -> str:
        return f"DiskTensor(shape={tuple(self.shape)}, dtype={self.dtype}, path={self.path!r})"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # where read() delivers

    def byte_range(self, rows: tuple[int, int] | None = None) -> tuple[int, int]:
        """File bytes ``[a, b)`` holding rows ``[r0, r1)`` of dim 0 (all bytes for None).

        A buffer at address ``a mod ALIGN`` (``aligned_empty(..., offset=a)``) lets O_DIRECT
        move the aligned middle without staging.
        """
        return self._range(rows)[1:]

    def _range(self, rows: tuple[int, int] | None) -> tuple[torch.Size, int, int]:
        if rows is None:
            return self.shape, 0, self.nbytes
        r0, r1 = rows
        if len(self.shape) == 0 or not 0 <= r0 <= r1 <= self.shape[0]:
            raise ValueError(f"rows {rows} out of range for {self!r}")
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        return torch.Size((r1 - r0,)) + self.shape[1:], r0 * row_bytes, r1 * row_bytes

    def read(self, out: torch.Tensor | None = None,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Read all of it, or rows ``[r0, r1)`` of dim 0, into ``out`` (CPU) or a new tensor."""
        shape, a, b = self._range(rows)
        if out is None:
            out = aligned_empty(shape, self.dtype, offset=a)
        if out.shape != shape or out.dtype != self.dtype or out.device.type != "cpu":
            raise ValueError(f"read: out is {tuple(out.shape)} {out.dtype} on {out.device}, "
                             f"expected {tuple(shape)} {self.dtype} on cpu")
        target = out if out.is_contiguous() else torch.empty(shape, dtype=self.dtype)
        if b > a:
            self.store._read_bytes(self, a, b, _as_bytes(target))
        if target is not out:
            out.copy_(target)
        return out

    def write(self, src: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Write CPU tensor ``src`` to all of it, or to rows ``[r0, r1)`` of dim 0."""
        shape, a, b = self._range(rows)
        if src.shape != shape or src.dtype != self.dtype or src.device.type != "cpu":
            raise ValueError(f"write: src is {tuple(src.shape)} {src.dtype} on {src.device}, "
                             f"expected {tuple(shape)} {self.dtype} on cpu")
        if b > a:
            self.store._write_bytes(self, a, b, _as_bytes(src.contiguous()))


class DiskStore:
    """Owns a per-rank offload dir, its files and an I/O thread pool."""

    def __init__(self, root: str | os.PathLike, rank: int = 0, num_workers: int = 4,
                 direct_io: str = "auto") -> None:
        if direct_io not in ("auto", "on", "off"):
            raise ValueError(f"direct_io={direct_io!r}: use 'auto', 'on' or 'off'")
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: must be >= 1")
        self.root = Path(root).expanduser()
        name = f"flexgen-rank{rank}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            reclaim_stale_dirs(self.root)
            make_dir(self.root, name)
        except OSError as e:
            raise DiskStoreError(
                f"offload dir {self.root} is not usable ({e.strerror or e}): pass a writable "
                f"--offload-dir, or create it and give this user write permission") from None
        self.dir = str(self.root / name)
        self.rank = rank
        self.bytes_written = 0
        self.bytes_read = 0
        self.allocated_bytes = 0
        self._count = 0
        self._stats_lock = threading.Lock()
        self._local = threading.local()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=num_workers,
                                            thread_name_prefix=f"flexgen-disk-r{rank}")
        self._gate = FileGate()  # allocate and the removal of the dir, one at a time
        self._finalizer = remove_at_exit(self, self.dir, self._executor, self._gate)
        self.direct = False
        if direct_io != "off":
            reason = self._probe_direct()
            if reason is None:
                self.direct = True
            elif direct_io == "on":
                self.close()
                raise DiskStoreError(f"offload dir {self.root} does not support O_DIRECT "
                                     f"({reason}): use direct_io 'auto' or 'off', or another "
                                     f"--offload-dir")
            else:
                log.warning("offload dir %s: O_DIRECT unavailable (%s); using buffered I/O, "
                            "so the page cache may hold disk-tier bytes in RAM", self.root, reason)

    def _probe_direct(self) -> str | None:
        """None if an aligned O_DIRECT write+read round-trips here, else why not."""
        if not _O_DIRECT:
            return "this OS has no O_DIRECT"
        path = os.path.join(self.dir, ".direct-probe")
        buf = self._staging()[:ALIGN]
        buf[:] = 0xA5
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_DIRECT, 0o600)
            try:
                _pwrite_full(fd, buf, 0)
                _pread_full(fd, buf, 0)
            finally:
                os.close(fd)
        except OSError as e:
            return f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror or e}"
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return None

    # lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for running I/O, drop queued I/O, remove all files and the dir. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # allocation -----------------------------------------------------------------------
    def check_space(self, nbytes: int) -> None:
        free = shutil.disk_usage(self.dir).free
        if nbytes > free:
            raise DiskStoreError(f"offload dir {self.root} has {format_bytes(free)} free but "
                                 f"the policy needs {format_bytes(nbytes)} on disk: {_SPACE_FIX}")

    def allocate(self, name: str, shape: tuple[int, ...] | torch.Size,
                 dtype: torch.dtype) -> DiskTensor:
        """A new file-backed tensor (contents unspecified until written)."""
        with self._stats_lock:
            self._count += 1
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]
        path = os.path.join(self.dir, f"{self._count:06d}-{safe}.bin")
        dt = DiskTensor(self, path, torch.Size(shape), dtype)
        with self._gate.lock:  # never a file created while (or after) the dir is removed
            if self._closed or self._gate.closed:
                raise DiskStoreError(f"DiskStore {self.dir} is closed")
            self._create(dt, path, name)
        with self._stats_lock:
            self.allocated_bytes += dt.file_bytes
        return dt

    def _create(self, dt: DiskTensor, path: str, name: str) -> None:
        """The file of ``dt``, its bytes reserved (sparse where the fs cannot)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if dt.file_bytes:
                try:
                    os.posix_fallocate(fd, 0, dt.file_bytes)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise
                    os.ftruncate(fd, dt.file_bytes)  # fs without fallocate: sparse file
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            if e.errno == errno.ENOSPC:
                raise DiskStoreError(f"offload dir {self.root} ran out of space allocating "
                                     f"{name} ({format_bytes(dt.file_bytes)}): {_SPACE_FIX}"
                                     ) from None
            raise
        os.close(fd)

    def allocate_qtensor(self, name: str, shape: tuple[int, ...] | torch.Size,
                         dtype: torch.dtype, bits: int = 4, group_size: int = 64,
                         dim: int = -1) -> QTensor:
        """A QTensor whose three parts are DiskTensors (layout as ``quant.empty_qtensor``)."""
        data_shape, meta_shape = qtensor_layout(shape, bits, group_size, dim)
        return QTensor(data=self.allocate(f"{name}.data", data_shape, torch.uint8),
                       mins=self.allocate(f"{name}.mins", meta_shape, dtype),
                       scales=self.allocate(f"{name}.scales", meta_shape, dtype),
                       shape=torch.Size(shape), dtype=dtype, dim=dim % len(shape),
                       group_size=group_size, bits=bits)

    def store_qtensor(self, name: str, q: QTensor) -> QTensor:
        """``q`` (its parts in memory) written to files: the same QTensor with DiskTensor parts."""
        parts = {}
        for part in ("data", "mins", "scales"):
            x = getattr(q, part).contiguous().cpu()
            parts[part] = self.allocate(f"{name}.{part}", x.shape, x.dtype)
            parts[part].write(x)
        return replace(q, **parts)

    def free(self, dt: DiskTensor) -> None:
        """Delete one tensor's file early (the rest go at close)."""
        if os.path.exists(dt.path):
            os.unlink(dt.path)
            with self._stats_lock:
                self.allocated_bytes -= dt.file_bytes

    # async ----------------------------------------------------------------------------
    def submit_read(self, dt: DiskTensor, out: torch.Tensor | None = None,
                    rows: tuple[int, int] | None = None) -> Future[torch.Tensor]:
        if self._closed:
            raise DiskStoreError(f"DiskStore {self.dir} is closed")
        return submit(self._executor, dt.read, out, rows)

    def submit_write(self, dt: DiskTensor, src: torch.Tensor,
                     rows: tuple[int, int] | None = None) -> Future[None]:
        if self._closed:
            raise DiskStoreError(f"DiskStore {self.dir} is closed")
        return submit(self._executor, dt.write, src, rows)

    # byte I/O -------------------------------------------------------------------------
    def _staging(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:  # anonymous mmap: page-aligned, as O_DIRECT needs
            buf = self._local.buf = np.frombuffer(mmap.mmap(-1, STAGING_BYTES), np.uint8)
        return buf

    def _count_io(self, read: int = 0, written: int = 0) -> None:
        with self._stats_lock:
            self.bytes_read += read
            self.bytes_written += written

    @staticmethod
    def _split(a: int, b: int, buf: np.ndarray) -> tuple[int, int]:
        """The aligned middle ``[x, y)`` of ``[a, b)`` that ``buf`` can take directly."""
        if (buf.ctypes.data - a) % ALIGN:
            return a, a
        x, y = _up(a), b - b % ALIGN
        return (x, y) if y > x else (a, a)

    def _read_bytes(self, dt: DiskTensor, a: int, b: int, out: np.ndarray) -> None:
        if not self.direct:
            fd = os.open(dt.path, os.O_RDONLY)
            try:
                _pread_full(fd, out, a)
            finally:
                os.close(fd)
            self._count_io(read=b - a)
            return
        x, y = self._split(a, b, out)
        fd = os.open(dt.path, os.O_RDONLY | _O_DIRECT)
        try:
            if y > x:
                _pread_full(fd, out[x - a:y - a], x)
            st = self._staging()
            for s, e in ((a, x), (y, b)) if y > x else ((a, b),):
                blk = s - s % ALIGN
                while blk < e:
                    end = min(blk + st.nbytes, _up(e))
                    _pread_full(fd, st[:end - blk], blk)
                    lo, hi = max(s, blk), min(e, end)
                    out[lo - a:hi - a] = st[lo - blk:hi - blk]
                    blk = end
        finally:
            os.close(fd)
        self._count_io(read=b - a)

    def _write_bytes(self, dt: DiskTensor, a: int, b: int, src: np.ndarray) -> None:
        try:
            if not self.direct:
                fd = os.open(dt.path, os.O_WRONLY)
                try:
                    _pwrite_full(fd, src, a)
                finally:
                    os.close(fd)
            elif a % ALIGN or b % ALIGN:
                with dt._lock:  # edge blocks are shared with neighbouring row ranges
                    self._write_direct(dt, a, b, src)
            else:
                self._write_direct(dt, a, b, src)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise DiskStoreError(f"offload dir {self.root} is full writing {dt.path}: "
                                     f"{_SPACE_FIX}") from None
            raise
        self._count_io(written=b - a)

    def _write_direct(self, dt: DiskTensor, a: int, b: int, src: np.ndarray) -> None:
        x, y = self._split(a, b, src)
        fd = os.open(dt.path, os.O_RDWR | _O_DIRECT)
        try:
            if y > x:
                _pwrite_full(fd, src[x - a:y - a], x)
            st = self._staging()
            for s, e in ((a, x), (y, b)) if y > x else ((a, b),):
                blk = s - s % ALIGN
                while blk < e:
                    end = min(blk + st.nbytes, _up(e))
                    lo, hi = max(s, blk), min(e, end)
                    if lo > blk:   # keep the bytes of the first block that are not ours
                        _pread_full(fd, st[:ALIGN], blk)
                    if hi < end:   # ... and of the last one
                        _pread_full(fd, st[end - blk - ALIGN:end - blk], end - ALIGN)
                    st[lo - blk:hi - blk] = src[lo - a:hi - a]
                    _pwrite_full(fd, st[:end - blk], blk)
                    blk = end
        finally:
            os.close(fd)
