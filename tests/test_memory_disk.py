"""The disk tier: files and their cleanup, O_DIRECT and its fallback, errors, async I/O."""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from flexgen_dist.memory import disk
from flexgen_dist.memory.disk import ALIGN, DiskStore, DiskStoreError


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make os.open behave like a file system without O_DIRECT support (e.g. old tmpfs)."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def test_per_rank_dir_files_exist_during_use_and_go_at_close(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, rank=3)
    name = Path(store.dir).name
    assert name.startswith(f"flexgen-rank3-{os.getpid()}-")
    d = store.allocate("layer0/w q", (10, 10), torch.float32)
    d.write(torch.ones(10, 10))
    assert Path(d.path).is_file() and Path(d.path).parent == Path(store.dir)
    assert os.path.getsize(d.path) % ALIGN == 0 and store.allocated_bytes == ALIGN
    store.close()
    assert not Path(store.dir).exists() and list(tmp_path.iterdir()) == []
    store.close()  # idempotent
    with pytest.raises(DiskStoreError, match="closed"):
        store.allocate("x", (1,), torch.float32)


def test_a_store_closed_while_another_thread_allocates_leaves_nothing(tmp_path: Path) -> None:
    """A dead peer's monitor (or a stop) closes the store from another thread while weights are
    still being placed: whatever the interleaving, the dir is gone after the close (a file
    created during the removal used to keep it alive, with no owner left to reclaim it), and
    the placing thread is told the store is closed."""
    import threading
    import time

    outcomes = []
    for i in range(40):
        store = DiskStore(tmp_path / "off", rank=0, num_workers=1, direct_io="off")
        started, errors = threading.Event(), []

        def place() -> None:
            n = 0
            while True:
                try:
                    store.allocate(f"w{n}", (256,), torch.float32)
                except DiskStoreError as e:
                    errors.append(str(e))
                    return
                n += 1
                started.set()

        t = threading.Thread(target=place)
        t.start()
        started.wait(5)
        time.sleep(0.0005 * (i % 5))
        store.close()
        t.join(10)
        outcomes.append((not t.is_alive(), Path(store.dir).exists(), bool(errors) and "closed" in errors[0]))
    assert all(o == (True, False, True) for o in outcomes), outcomes
    assert not any((tmp_path / "off").iterdir())


def test_exception_inside_with_removes_files(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with DiskStore(tmp_path) as store:
            d = store.allocate("x", (4,), torch.float32)
            assert Path(d.path).exists()
            raise RuntimeError("boom")
    assert not Path(store.dir).exists()


def test_two_stores_same_root_do_not_collide(tmp_path: Path) -> None:
    with DiskStore(tmp_path, rank=0) as a, DiskStore(tmp_path, rank=0) as b:
        assert a.dir != b.dir
        da, db = a.allocate("x", (2,), torch.float32), b.allocate("x", (2,), torch.float32)
        da.write(torch.zeros(2))
        db.write(torch.ones(2))
        assert torch.equal(da.read(), torch.zeros(2))


def test_o_direct_is_used_on_a_normal_filesystem(tmp_path: Path, caplog, monkeypatch) -> None:
    with caplog.at_level(logging.WARNING, logger="flexgen_dist"):
        store = DiskStore(tmp_path)
    with store:
        if not store.direct:  # this file system refuses O_DIRECT: then we must have said so
            assert any("O_DIRECT unavailable" in r.getMessage() for r in caplog.records)
            pytest.skip("file system under tmp_path refuses O_DIRECT")
        opened: list[int] = []
        real_open = os.open
        monkeypatch.setattr(os, "open",
                            lambda p, f, *a: opened.append(f) or real_open(p, f, *a))
        x = _rand((1000, 1027), torch.float16)  # ~2 MiB, not a multiple of 4096 bytes
        d = store.allocate("big", x.shape, x.dtype)
        opened.clear()
        d.write(x)
        assert torch.equal(d.read(), x)
        assert len(opened) == 2 and all(f & os.O_DIRECT for f in opened)
        assert store.bytes_written == store.bytes_read == x.numel() * 2


def test_fallback_to_buffered_io_logs_one_line(tmp_path: Path, caplog, monkeypatch) -> None:
    _refuse_o_direct(monkeypatch)
    with caplog.at_level(logging.INFO, logger="flexgen_dist"):
        store = DiskStore(tmp_path)
    with store:
        assert store.direct is False
        lines = [r.getMessage() for r in caplog.records if r.name == "flexgen_dist"]
        assert len(lines) == 1
        assert "O_DIRECT unavailable" in lines[0] and "EINVAL" in lines[0]
        assert "buffered" in lines[0]
        x = _rand((37, 11), torch.bfloat16)
        d = store.allocate("x", x.shape, x.dtype)
        d.write(x[5:9], rows=(20, 24))
        assert torch.equal(d.read(rows=(20, 24)), x[5:9])


def test_direct_io_on_refuses_and_off_is_silent(tmp_path: Path, caplog, monkeypatch) -> None:
    with caplog.at_level(logging.INFO, logger="flexgen_dist"):
        with DiskStore(tmp_path, direct_io="off") as off:
            assert off.direct is False
    assert not caplog.records
    _refuse_o_direct(monkeypatch)
    with pytest.raises(DiskStoreError, match="does not support O_DIRECT"):
        DiskStore(tmp_path, direct_io="on")
    assert list(tmp_path.iterdir()) == []  # the failed store cleaned up after itself
    with pytest.raises(ValueError, match="direct_io"):
        DiskStore(tmp_path, direct_io="maybe")


def test_unwritable_root_gives_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(DiskStoreError, match="--offload-dir") as info:
        DiskStore(blocker / "offload")
    assert str(blocker) in str(info.value)
    assert isinstance(info.value, OSError)


def test_check_space_message(tmp_path: Path, monkeypatch) -> None:
    with DiskStore(tmp_path) as store:
        store.check_space(1)  # a byte always fits
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(disk.shutil, "disk_usage",
                            lambda p: usage(10 * 2**30, 0, int(1.2 * 2**30)))
        with pytest.raises(DiskStoreError) as info:
            store.check_space(int(3.4 * 2**30))
    assert str(info.value) == (
        f"offload dir {tmp_path} has 1.20 GiB free but the policy needs 3.40 GiB on disk: "
        f"free space, pick another --offload-dir, or lower the disk share")


def test_allocate_enospc_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with DiskStore(tmp_path) as store:
        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(DiskStoreError, match="ran out of space.*--offload-dir"):
            store.allocate("kv", (1024, 1024), torch.float16)
        assert os.listdir(store.dir) == [".owner"]


@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
def test_random_row_ranges_match_reference(tmp_path: Path, monkeypatch, direct_io: str,
                                           dtype: torch.dtype) -> None:
    # A tiny staging buffer forces multi-chunk transfers and many partial edge blocks.
    monkeypatch.setattr(disk, "STAGING_BYTES", 3 * ALIGN)
    g = torch.Generator().manual_seed(7)
    ref = _rand((301, 47), dtype)  # 47 elements per row: rows never align to 4 KiB
    with DiskStore(tmp_path, direct_io=direct_io) as store:
        d = store.allocate("t", ref.shape, dtype)
        d.write(ref)
        for i in range(40):
            r0 = int(torch.randint(0, 301, (1,), generator=g))
            r1 = int(torch.randint(r0, 302, (1,), generator=g))
            if i % 2:
                new = _rand((r1 - r0, 47), dtype, seed=i)
                # An unaligned source buffer: storage offset of one element.
                src = torch.empty((r1 - r0) * 47 + 1, dtype=dtype)[1:].view(r1 - r0, 47)
                src.copy_(new)
                d.write(src, rows=(r0, r1))
                ref[r0:r1] = new
            else:
                assert torch.equal(d.read(rows=(r0, r1)), ref[r0:r1])
        assert torch.equal(d.read(), ref)


def test_async_io_and_concurrent_writes_sharing_blocks(tmp_path: Path) -> None:
    x = _rand((1000, 3), torch.float16)  # 6-byte rows: neighbouring ranges share blocks
    with DiskStore(tmp_path, num_workers=4) as store:
        d = store.allocate("kv", x.shape, x.dtype)
        futures = [store.submit_write(d, x[r:r + 7], rows=(r, min(r + 7, 1000)))
                   for r in range(0, 1000, 7)]
        assert [f.result() for f in futures] == [None] * len(futures)
        out = torch.empty(500, 3, dtype=x.dtype)
        assert store.submit_read(d, out, rows=(250, 750)).result() is out
        assert torch.equal(out, x[250:750])
        assert torch.equal(store.submit_read(d).result(), x)


def test_async_errors_propagate_through_the_future(tmp_path: Path) -> None:
    with DiskStore(tmp_path) as store:
        d = store.allocate("x", (8, 4), torch.float32)
        bad = store.submit_read(d, torch.empty(3, 4))
        with pytest.raises(ValueError, match="expected"):
            bad.result(timeout=30)
        store.free(d)
        with pytest.raises(FileNotFoundError):
            store.submit_write(d, torch.zeros(8, 4)).result(timeout=30)


def test_zero_dim_and_empty_ranges(tmp_path: Path) -> None:
    with DiskStore(tmp_path) as store:
        s = store.allocate("scalar", (), torch.bfloat16)
        s.write(torch.tensor(2.5, dtype=torch.bfloat16))
        assert s.read().item() == 2.5 and s.read().shape == ()
        e = store.allocate("rows", (5, 2), torch.float32)
        assert e.byte_range() == (0, 40) and e.byte_range((1, 3)) == (8, 24)
        # A fresh read buffer sits at the file offset mod ALIGN, so O_DIRECT can fill it.
        assert e.read(rows=(1, 3)).data_ptr() % ALIGN == 8
        assert e.read(rows=(3, 3)).shape == (0, 2)
        with pytest.raises(ValueError, match="out of range"):
            e.read(rows=(4, 6))
        with pytest.raises(ValueError, match="expected"):
            e.write(torch.zeros(5, 2, dtype=torch.float16))


_CHILD = textwrap.dedent("""
    import signal, sys, threading, torch
    from flexgen_dist.memory.disk import DiskStore
    if sys.argv[2] == "prev-handler":
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))
    with DiskStore(sys.argv[1]) as store:
        store.allocate("w", (64, 64), torch.float16).write(torch.ones(64, 64).half())
        print(store.dir, flush=True)
        threading.Event().wait()   # until the parent's SIGTERM
""")


@pytest.mark.parametrize("mode,returncode", [("default", -signal.SIGTERM),
                                             ("prev-handler", 3)])
def test_sigterm_removes_files(tmp_path: Path, mode: str, returncode: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), mode],
                            stdout=subprocess.PIPE, text=True)
    try:
        store_dir = Path(proc.stdout.readline().strip())
        assert store_dir.is_dir() and len(list(store_dir.iterdir())) == 2  # a tensor and the .owner file
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == returncode
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not store_dir.exists()


def test_stale_dirs_of_dead_runs_are_removed(tmp_path: Path, caplog) -> None:
    """A dir whose owner on this host is dead goes (a SIGKILLed run's); a live owner's, another
    host's, a reused pid's owner being alive, and a dir without an owner file stay."""
    import json
    import socket

    from flexgen_dist.memory.owners import OWNER_FILE, _proc_start

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()

    def make(name: str, owner: dict | None, size: int = 0) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "kv").write_bytes(b"x" * size)
        if owner is not None:
            (d / OWNER_FILE).write_text(json.dumps(owner))
        return d

    gone = make("flexgen-rank0-dead", {"host": host, "pid": dead.pid, "start": None}, 1 << 20)
    reused = make("flexgen-rank1-reused", {"host": host, "pid": os.getpid(), "start": -1})
    live = make("flexgen-rank0-live", {"host": host, "pid": os.getpid(), "start": _proc_start(os.getpid())})
    other = make("flexgen-rank0-other", {"host": host + "-elsewhere", "pid": dead.pid, "start": None})
    legacy = make("flexgen-rank0-legacy", None)
    with caplog.at_level("WARNING", logger="flexgen_dist.memory.disk"):
        with DiskStore(tmp_path) as store:
            assert json.loads((Path(store.dir) / OWNER_FILE).read_text())["pid"] == os.getpid()
    assert not gone.exists() and not reused.exists()
    assert live.exists() and other.exists() and legacy.exists()
    assert "removed 2 dir(s)" in caplog.text and "1.01 MiB freed" in caplog.text


_KILLED_WHILE_REMOVING = textwrap.dedent("""
    import os, signal, sys, torch
    from flexgen_dist.memory.disk import DiskStore
    store = DiskStore(sys.argv[1])
    for i in range(8):
        store.allocate(f"w{i}", (16, 16), torch.float16).write(torch.ones(16, 16).half())
    print(store.dir, flush=True)
    real, done = os.unlink, []
    def unlink(path, *a, **k):   # the run is SIGKILLed part way through removing its files
        if len(done) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        done.append(path)
        real(path, *a, **k)
    os.unlink = unlink
    store.close()
""")


def test_the_owner_file_is_removed_last(tmp_path: Path, monkeypatch) -> None:
    """Closing a store removes every other file before the ``.owner`` file (then the dir), so
    no moment of the removal has files without the owner that names them."""
    from flexgen_dist.memory.owners import OWNER_FILE

    store = DiskStore(tmp_path)
    for i in range(24):
        store.allocate(f"w{i}", (4, 4), torch.float16)
    real, order = os.unlink, []

    def unlink(path, *a, **k):
        order.append(os.path.basename(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    store.close()
    assert len(order) == 25 and order[-1] == OWNER_FILE, order
    assert not Path(store.dir).exists()


def test_a_run_killed_while_removing_its_dir_is_reclaimed(tmp_path: Path, caplog) -> None:
    """A run SIGKILLed in the middle of removing its offload dir (its job done, a kill arriving
    as it exits) leaves a dir that still names its dead owner, and the next run under the root
    removes it: no orphan weight files."""
    from flexgen_dist.memory.owners import OWNER_FILE

    proc = subprocess.run([sys.executable, "-c", _KILLED_WHILE_REMOVING, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = Path(proc.stdout.strip())
    names = sorted(p.name for p in left.iterdir())
    assert OWNER_FILE in names and len(names) == 6, names  # 3 of 8 files removed, the owner kept
    with caplog.at_level("WARNING", logger="flexgen_dist.memory.disk"):
        with DiskStore(tmp_path):
            assert not left.exists()
    assert "removed 1 dir(s)" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_dir_is_never_visible_without_its_owner(tmp_path: Path, monkeypatch) -> None:
    """The dir appears under its name only with its ``.owner`` file in it (made hidden, then
    renamed); a hidden one left by a run that died creating it is reclaimed like the others."""
    import json
    import socket

    from flexgen_dist.memory import owners

    seen = []
    real_rename = Path.rename

    def rename(self, target):
        seen.append(sorted(p.name for p in self.iterdir()))
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with DiskStore(tmp_path) as store:
        assert Path(store.dir).name.startswith("flexgen-rank0-")
    assert seen == [[owners.OWNER_FILE]]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    hidden = tmp_path / ".flexgen-rank0-x"
    hidden.mkdir()
    (hidden / owners.OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(),
                                                         "pid": dead.pid, "start": None}))
    assert owners.remove_stale_dirs(tmp_path)[0] == 1
    assert not hidden.exists()


def test_tilde_offload_dir_means_the_home_directory(tmp_path: Path, monkeypatch) -> None:
    """A "~" offload dir (the default) lands under $HOME, never as a directory named "~" in the cwd:
    the disk tier, the profiler and the budgets all read the one expanded spelling."""
    from flexgen_dist.budgets import free_disk
    from flexgen_dist.config import RunConfig
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    cfg = RunConfig()
    assert cfg.offload_dir == str(home / ".cache/flexgen_dist/offload")
    with DiskStore("~/off", rank=0) as store:
        assert Path(store.dir).parent == home / "off"
    assert free_disk("~/off") > 0
    assert list(cwd.iterdir()) == []
