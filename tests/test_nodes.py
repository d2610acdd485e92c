"""Node isolation helpers (bench/nodes.py): the disk device lookup, the per-node disk cgroup a
child really joins, and the scaling benchmark's --disk-gbps arguments. Nothing times anything:
the cgroup's own configuration and byte count are what is checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import nodes, scaling


def test_block_device_of_a_disk_path(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    if os.major(dev) == 0:
        pytest.skip(f"{tmp_path} is not on a block device here")
    major, minor = nodes.block_device(tmp_path)
    disk = Path(f"/sys/dev/block/{major}:{minor}")
    assert disk.is_dir() and not (disk / "partition").exists()  # a whole disk, the unit throttles apply to
    own = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not (own / "partition").exists():
        assert (major, minor) == (os.major(dev), os.minor(dev))
    else:  # the disk whose partition holds the path
        assert own.resolve().parent == disk.resolve()


def test_partition_maps_to_its_whole_disk(tmp_path: Path) -> None:
    """sysfs puts a partition's directory inside its disk's; a fake tree of that shape."""
    disk = tmp_path / "devices" / "sda"
    part = disk / "sda1"
    part.mkdir(parents=True)
    (disk / "dev").write_text("8:0\n")
    (part / "dev").write_text("8:1\n")
    (part / "partition").write_text("1\n")
    block = tmp_path / "dev" / "block"
    block.mkdir(parents=True)
    (block / "8:1").symlink_to(part)
    (block / "8:0").symlink_to(disk)
    assert nodes.whole_disk(8, 1, block) == (8, 0)
    assert nodes.whole_disk(8, 0, block) == (8, 0)


def test_block_device_refuses_tmpfs() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.major(os.stat(shm).st_dev) != 0:
        pytest.skip("/dev/shm is not tmpfs here")
    with pytest.raises(SystemExit) as e:
        nodes.block_device(shm)
    msg = str(e.value)
    assert "\n" not in msg and "--workdir" in msg and "disk-backed" in msg


def test_cgroup_hierarchy_from_mounts(tmp_path: Path) -> None:
    v1 = tmp_path / "blkio"
    v1.mkdir()
    (v1 / "blkio.throttle.read_bps_device").write_text("")
    v2 = tmp_path / "unified"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu io memory\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"cgroup2 {v2} cgroup2 rw 0 0\ncgroup {v1} cgroup rw,blkio 0 0\n")
    assert nodes.cgroup_hierarchy(mounts) == ("v1", v1)  # v1 blkio first: io cannot move to v2 then
    mounts.write_text(f"cgroup2 {v2} cgroup2 rw 0 0\n")
    assert nodes.cgroup_hierarchy(mounts) == ("v2", v2)
    (v2 / "cgroup.controllers").write_text("hugetlb\n")
    assert nodes.cgroup_hierarchy(mounts) is None


def _disk_limit_skip(path: Path) -> str | None:
    if os.geteuid() != 0:
        return "needs root (cgroups)"
    if nodes.cgroup_hierarchy() is None:
        return "no cgroup v1 blkio or v2 io controller here"
    if os.major(os.stat(path).st_dev) == 0:
        return f"{path} is not on a block device"
    return None


def test_disk_limit_child_joins_its_node_cgroup(tmp_path: Path) -> None:
    """A child started with preexec(cpus, disk) is in node 0's cgroup (its /proc/<pid>/cgroup
    says so), on its CPUs, under a limit file naming the workdir's disk and 0.2e9 B/s, and the
    cgroup counts the bytes it reads with O_DIRECT from that disk."""
    why = _disk_limit_skip(tmp_path)
    if why:
        pytest.skip(why)
    data = tmp_path / "data"
    data.write_bytes(os.urandom(8 << 20))
    cpus = sorted(os.sched_getaffinity(0))[:1]
    with nodes.DiskLimit(2, 0.2, tmp_path) as lim:
        major, minor = nodes.block_device(tmp_path)
        assert lim.device == f"{major}:{minor}" and lim.bps == 200_000_000
        for r in range(2):
            for f in lim.files(r):
                assert f"{lim.device} " in f.read_text()
                assert "200000000" in f.read_text()
        desc = lim.describe()
        assert desc["device"] == lim.device and desc["gbps"] == 0.2 and len(desc["files"]) == 2 * len(lim.files(0))
        json.dumps(desc)
        code = ("import os, sys; print(open(f'/proc/{os.getpid()}/cgroup').read()); "
                "print(sorted(os.sched_getaffinity(0))); "
                "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT); import mmap; "
                "buf = mmap.mmap(-1, 1 << 20); n = 0\n"
                "while True:\n    k = os.readv(fd, [buf])\n    n += k\n    if k < len(buf): break\n"
                "print(n)")
        p = subprocess.run([sys.executable, "-c", code, str(data)], capture_output=True, text=True, timeout=120,
                           preexec_fn=nodes.preexec(cpus, lim))
        assert p.returncode == 0, p.stderr
        cg_text, affinity, nread = _split(p.stdout)
        name = lim.cgroups[0].name
        assert f"/{name}" in cg_text and lim.cgroups[1].name not in cg_text
        assert affinity == str(cpus) and int(nread) == 8 << 20
        assert lim.bytes_read(0) >= 8 << 20 and lim.bytes_read(1) == 0
        made = list(lim.cgroups)
    assert not any(cg.exists() for cg in made)  # removed on exit


def _split(out: str) -> tuple[str, str, str]:
    """The child's /proc/<pid>/cgroup text, its affinity and its byte count."""
    lines = out.strip().splitlines()
    return "\n".join(lines[:-2]), lines[-2], lines[-1]


def test_disk_limit_needs_a_positive_rate(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        nodes.DiskLimit(1, 0, tmp_path)


def test_scaling_disk_gbps_arguments(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        scaling.parse_args(["--disk-gbps", "0.5", "--shared-cores"])
    assert "not with --shared-cores" in capsys.readouterr().err
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            scaling.parse_args(["--disk-gbps", bad, "--nodes", "1"])
        assert "--disk-gbps must be > 0" in capsys.readouterr().err
    assert scaling.parse_args(["--nodes", "1"]).disk_gbps is None


def test_scaling_dry_run_shows_the_disk_limit(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.json"
    scaling.main(["--dry-run", "--nodes", "1", "--disk-gbps", "0.5", "--workdir", str(tmp_path / "w"),
                  "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["disk_gbps"] == 0.5 and data["disk_limit"] is None  # a dry run makes no cgroup
    assert "# each node in its own disk cgroup: 0.5 GB/s" in capsys.readouterr().out
    scaling.main(["--dry-run", "--nodes", "1", "--workdir", str(tmp_path / "w"), "--json", str(out)])
    assert json.loads(out.read_text())["disk_gbps"] is None
    assert "disk cgroup" not in capsys.readouterr().out


def _fake_reporting(tmp_path: Path, order: str = "9") -> Path:
    params = tmp_path / "page_reporting" / "parameters"
    params.mkdir(parents=True)
    (params / "page_reporting_order").write_text(order + "\n")
    (params / "reported_kib").write_text("1000\n")
    return params


def test_node_memory_turns_reporting_off_and_restores_it(tmp_path: Path) -> None:
    """A fake sysfs directory: the order goes above the largest page order while inside and
    back after, even when the runs fail; the touch really writes the pages it is given."""
    params = _fake_reporting(tmp_path)
    mem = nodes.NodeMemory(params, touch_bytes=8 << 20)
    with mem:
        assert (params / "page_reporting_order").read_text() == "11"
        (params / "reported_kib").write_text("1000\n")
    assert (params / "page_reporting_order").read_text() == "9"
    assert mem.info["page_reporting_order"] == [9, 11] and mem.info["backed_bytes"] == 8 << 20
    assert mem.info["reported_kib_during_runs"] == 0
    with pytest.raises(RuntimeError, match="run failed"):
        with nodes.NodeMemory(params, touch_bytes=0):
            raise RuntimeError("run failed")
    assert (params / "page_reporting_order").read_text() == "9"


def test_node_memory_restores_the_order_when_backing_fails(tmp_path: Path, monkeypatch) -> None:
    params = _fake_reporting(tmp_path)

    def no_memory(n: int) -> None:
        raise MemoryError

    monkeypatch.setattr(nodes, "_touch", no_memory)
    with pytest.raises(MemoryError):
        with nodes.NodeMemory(params, touch_bytes=1 << 20):
            pass
    assert (params / "page_reporting_order").read_text() == "9"


def test_node_memory_without_reporting_or_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    with nodes.NodeMemory(tmp_path / "absent") as mem:
        pass
    assert "absent" in str(mem.info["page_reporting"]) and "nothing to turn off" in capsys.readouterr().out
    params = _fake_reporting(tmp_path)
    real_write = Path.write_text

    def refuse(self: Path, text: str, *a, **k):  # a stock kernel: orders above 10 are EINVAL
        if self.name == "page_reporting_order" and text.strip() == "11":
            raise OSError(22, "Invalid argument")
        return real_write(self, text, *a, **k)

    monkeypatch.setattr(Path, "write_text", refuse)
    with pytest.raises(SystemExit, match="cannot turn free page reporting off .*Invalid argument.*leave the flag out"):
        with nodes.NodeMemory(params, touch_bytes=0):
            pass
    assert (params / "page_reporting_order").read_text() == "9\n"  # left as it was


def test_scaling_physical_memory_dry_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "s.json"
    scaling.main(["--dry-run", "--nodes", "1", "--physical-memory", "--workdir", str(tmp_path / "w"),
                  "--json", str(out)])
    assert json.loads(out.read_text())["physical_memory"] is None  # a dry run changes nothing
    assert "free page reporting goes off" in capsys.readouterr().out
