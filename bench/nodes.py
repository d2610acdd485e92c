"""Node isolation for benchmarks that run several "nodes" on one machine.

``bench.scaling`` runs every node of a pipeline as its own process here. Pinning gives each
node CPUs of its own; the helpers below give it the rest of what a separate machine has:

* :class:`Network`: a network namespace per node, joined through a bridge by shaped links.
* :class:`DiskLimit`: a block-I/O cgroup per node whose reads and writes on the workdir's disk
  are throttled to a fixed rate. Real nodes each have a disk of their own; the nodes here
  share the VM's one disk, whose rate also moves between runs, so without a limit a 2-node
  run gets a different disk than a 1-node run. Under a limit below the disk's share, every
  node gets the same rate whatever the others do.
* :class:`NodeMemory` (``--physical-memory``): memory that behaves as a physical machine's,
  on a VM that hands freed guest memory back to its host.
* :func:`preexec`: one ``preexec_fn`` that pins a child to its CPUs and joins its cgroup.
* :func:`profile_node` and :func:`disk_share`: what a node measures of its hardware (once,
  alone) and of its disk (while every node of a run reads at once), for the predictions.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from flexgen_dist.planner.profile_cache import default_cache_path

_ROOT_ERROR = "--disk-gbps needs root and a cgroup blkio/io controller; run without it"
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")
_REPORTING_OFF = 11  # above the largest page order (10): no free block is ever reported


class NodeMemory:
    """Free page reporting off, and the free memory backed, for the runs.

    A VM with free page reporting (virtio-balloon) hands the memory its guest frees back to the
    host, and the next process to touch those pages waits while the host backs them anew: 1.0-1.4 s
    per GB on this project's VM, against 0.2 s per GB for memory the guest holds (what a physical
    machine's fresh pages cost). One node writes its KV cache into memory its own loader freed a
    moment before; a pipeline stage writes most of its cache into pages the host took back. That
    is a cost of emulating nodes in one VM, not of the work (docs/benchmarks-log.md, runs P-R).

    Entering raises ``page_reporting_order`` above the largest order (root; a kernel that
    refuses is an error naming the fix), then touches ``touch_bytes`` (default: the free memory
    less ``margin``) once and frees it, so every free page is backed. Leaving restores the order.
    """

    def __init__(self, params: Path = PAGE_REPORTING, touch_bytes: int | None = None,
                 margin: int = 2 << 30) -> None:
        self.params, self.touch_bytes, self.margin = Path(params), touch_bytes, margin
        self.old: str | None = None
        self._reported0: int | None = None
        self.info: dict[str, object] = {}

    def __enter__(self) -> NodeMemory:
        order = self.params / "page_reporting_order"
        if not order.exists():
            self.info = {"page_reporting": "absent: memory already stays with this machine"}
            print(f"# {order} absent: no free page reporting here, nothing to turn off", flush=True)
            return self
        old = order.read_text().strip()
        try:
            order.write_text(str(_REPORTING_OFF))
        except OSError as e:
            raise SystemExit(f"error: --physical-memory: cannot turn free page reporting off ({order}: "
                             f"{e.strerror or e}): run as root on a kernel that takes page_reporting_order "
                             f"{_REPORTING_OFF}, or leave the flag out") from None
        self.old = old
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")  # MemFree
        n = self.touch_bytes if self.touch_bytes is not None else max(0, free - self.margin)
        print(f"# free page reporting off (page_reporting_order {old} -> {_REPORTING_OFF}); "
              f"backing {n / 1e9:.1f} GB of free memory", flush=True)
        t = time.perf_counter()
        try:
            _touch(n)
        except BaseException:  # __exit__ does not run when __enter__ fails: restore here
            self.__exit__()
            raise
        self.info = {"page_reporting_order": [int(old), _REPORTING_OFF], "backed_bytes": n,
                     "back_s": round(time.perf_counter() - t, 2)}
        self._reported0 = self._reported()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.old is None:
            return
        r = self._reported()
        if r is not None and self._reported0 is not None:
            self.info["reported_kib_during_runs"] = r - self._reported0  # 0: reporting stayed off
        (self.params / "page_reporting_order").write_text(self.old)
        self.old = None

    def _reported(self) -> int | None:
        f = self.params / "reported_kib"  # not in every kernel
        return int(f.read_text()) if f.exists() else None


def _touch(n: int, chunk: int = 1 << 28) -> None:
    """Write one byte per page of n bytes of fresh memory, all held at once, then free it."""
    import mmap

    maps = []
    try:
        for off in range(0, n, chunk):
            size = min(chunk, n - off)
            m = mmap.mmap(-1, size)
            m[::mmap.PAGESIZE] = b"\1" * (-(-size // mmap.PAGESIZE))
            maps.append(m)
    finally:
        for m in maps:
            m.close()


class Network:
    """m network namespaces on one bridge, each node's veth egress shaped by ``tc tbf``."""

    def __init__(self, m: int, gbit: float | None) -> None:
        tag = f"{os.getpid() % 1000:03d}{random.randrange(100):02d}"
        net = f"10.{random.randrange(100, 250)}.{random.randrange(256)}"
        self.bridge = f"fgb{tag}"
        self.nodes = [(f"fgs{tag}n{k}", f"fgs{tag}v{k}", f"fgs{tag}p{k}", f"{net}.{k + 1}") for k in range(m)]
        self.gbit = gbit
        self._made: list[str] = []

    @staticmethod
    def _sh(*cmd: str) -> None:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            raise SystemExit(f"error: {' '.join(cmd)}: {p.stderr.strip()} (--netns needs root and iproute2)")

    def __enter__(self) -> Network:
        try:
            self._sh("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append("bridge")
            self._sh("ip", "link", "set", self.bridge, "up")
            for ns, veth, peer, addr in self.nodes:
                self._sh("ip", "netns", "add", ns)
                self._made.append(ns)
                self._sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
                self._sh("ip", "link", "set", veth, "netns", ns)
                self._sh("ip", "link", "set", peer, "master", self.bridge)
                self._sh("ip", "link", "set", peer, "up")
                self._sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
                self._sh("ip", "-n", ns, "link", "set", "lo", "up")
                self._sh("ip", "-n", ns, "link", "set", veth, "up")
                if self.gbit:
                    self._sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", veth, "root", "tbf",
                             "rate", f"{int(self.gbit * 1000)}mbit", "burst", "256kb", "latency", "50ms")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self._made):  # a namespace takes its end of the veth pair along
            cmd = ["ip", "link", "del", self.bridge] if name == "bridge" else ["ip", "netns", "del", name]
            subprocess.run(cmd, capture_output=True, timeout=30)
        self._made.clear()

    @property
    def master(self) -> str:
        return self.nodes[0][3]

    def wrap(self, rank: int, cmd: list[str]) -> tuple[list[str], dict[str, str]]:
        ns, veth, _, _ = self.nodes[rank]
        return ["ip", "netns", "exec", ns, *cmd], {"GLOO_SOCKET_IFNAME": veth}


def whole_disk(major: int, minor: int, sys_block: Path = Path("/sys/dev/block")) -> tuple[int, int]:
    """The whole disk holding block device ``major:minor``: throttles apply per whole-disk
    device, so a partition is replaced by its parent (sysfs puts a partition's directory
    inside its disk's)."""
    node = sys_block / f"{major}:{minor}"
    if (node / "partition").exists():
        ma, mi = (node.resolve().parent / "dev").read_text().strip().split(":")
        return int(ma), int(mi)
    return major, minor


def block_device(path: Path, sys_block: Path = Path("/sys/dev/block")) -> tuple[int, int]:
    """(major, minor) of the whole disk holding ``path``; one-line SystemExit when no block
    device does (tmpfs, overlay: their device numbers have major 0)."""
    dev = os.stat(path).st_dev
    if os.major(dev) == 0:
        raise SystemExit(f"error: {path} is on no block device (tmpfs/overlay), so --disk-gbps cannot "
                         f"throttle it: put --workdir on a disk-backed file system")
    return whole_disk(os.major(dev), os.minor(dev), sys_block)


def cgroup_hierarchy(mounts: Path = Path("/proc/self/mounts")) -> tuple[str, Path] | None:
    """("v1", mount) of a cgroup-v1 blkio hierarchy, else ("v2", mount) of a unified hierarchy
    offering ``io``, else None. v1 first: on a hybrid system the unified mount exists but a
    controller bound to v1 cannot be enabled there."""
    v2: list[Path] = []
    for line in mounts.read_text().splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        where, fstype, opts = Path(parts[1]), parts[2], parts[3].split(",")
        if fstype == "cgroup" and "blkio" in opts and (where / "blkio.throttle.read_bps_device").exists():
            return "v1", where
        if fstype == "cgroup2":
            v2.append(where)
    for where in v2:
        ctl = where / "cgroup.controllers"
        if ctl.exists() and "io" in ctl.read_text().split():
            return "v2", where
    return None


class DiskLimit:
    """One block-I/O cgroup per node, ``flexgen-node{r}-{pid}``, whose reads and writes on the
    disk holding ``path`` are limited to ``gbps`` GB/s (1 GB = 1e9 bytes) each.

    Processes join with :meth:`join` (in ``preexec_fn``); their children inherit the cgroup.
    The engine's disk tier reads and writes with O_DIRECT, which both cgroup versions throttle
    (v1 does not throttle buffered writeback)."""

    def __init__(self, m: int, gbps: float, path: Path) -> None:
        if gbps <= 0:
            raise ValueError(f"gbps must be > 0, got {gbps}")
        self.m, self.gbps, self.path = m, gbps, Path(path)
        self.bps = int(gbps * 1e9)
        self.version: str | None = None
        self.device: str | None = None
        self.cgroups: list[Path] = []

    def __enter__(self) -> DiskLimit:
        major, minor = block_device(self.path)
        self.device = f"{major}:{minor}"
        found = cgroup_hierarchy()
        if os.geteuid() != 0 or found is None:
            raise SystemExit(f"error: {_ROOT_ERROR}")
        self.version, root = found
        try:
            if self.version == "v2":
                ctl = root / "cgroup.subtree_control"
                if "io" not in ctl.read_text().split():
                    ctl.write_text("+io")
            for r in range(self.m):
                cg = root / f"flexgen-node{r}-{os.getpid()}"
                cg.mkdir(exist_ok=True)
                self.cgroups.append(cg)
                if self.version == "v1":
                    (cg / "blkio.throttle.read_bps_device").write_text(f"{self.device} {self.bps}")
                    (cg / "blkio.throttle.write_bps_device").write_text(f"{self.device} {self.bps}")
                else:
                    (cg / "io.max").write_text(f"{self.device} rbps={self.bps} wbps={self.bps}")
        except OSError as e:
            self.__exit__()
            raise SystemExit(f"error: {_ROOT_ERROR} ({e})") from None
        return self

    def __exit__(self, *exc: object) -> None:
        for cg in self.cgroups:  # empty once the node's processes have exited; reaping may lag a little
            for attempt in range(20):
                try:
                    cg.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if attempt == 19:
                        print(f"warning: could not remove cgroup {cg}: {e}", file=sys.stderr)
                    time.sleep(0.1)
        self.cgroups.clear()

    def files(self, rank: int) -> list[Path]:
        """The files holding node ``rank``'s limits."""
        names = (["blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"]
                 if self.version == "v1" else ["io.max"])
        return [self.cgroups[rank] / n for n in names]

    def join(self, rank: int) -> Callable[[], None]:
        """A callable for ``preexec_fn``: moves the calling (child) process into node
        ``rank``'s cgroup. Plain os calls only, since it runs between fork and exec."""
        procs = str(self.cgroups[rank] / "cgroup.procs")

        def _join() -> None:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

        return _join

    def bytes_read(self, rank: int) -> int:
        """Bytes node ``rank``'s processes have read from the limited disk (the cgroup's own count)."""
        if self.version == "v1":
            for line in (self.cgroups[rank] / "blkio.throttle.io_service_bytes").read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == self.device and parts[1] == "Read":
                    return int(parts[2])
            return 0
        for line in (self.cgroups[rank] / "io.stat").read_text().splitlines():
            dev, *kv = line.split()
            if dev == self.device:
                return int(dict(x.split("=", 1) for x in kv).get("rbytes", 0))
        return 0

    def describe(self) -> dict[str, object]:
        """What the result JSON records: the device, the rate and the cgroup files."""
        return {"gbps": self.gbps, "bytes_per_s": self.bps, "device": self.device,
                "cgroup": None if self.version is None else f"cgroup {self.version}",
                "files": [str(f) for r in range(len(self.cgroups)) for f in self.files(r)]}


def preexec(cpus: list[int], disk: DiskLimit | None = None, rank: int = 0) -> Callable[[], None]:
    """One ``preexec_fn`` for node ``rank``'s process: pin it to ``cpus`` and, under a
    :class:`DiskLimit`, put it in the node's disk cgroup (``preexec_fn`` takes one callable)."""
    join = disk.join(rank) if disk is not None else None

    def _pre() -> None:
        os.sched_setaffinity(0, cpus)
        if join is not None:
            join()

    return _pre


def node_cpus(rank: int, cores_per_node: int) -> list[int]:
    """The CPUs of node ``rank``: the next ``cores_per_node`` of this process's allowed CPUs."""
    allowed = sorted(os.sched_getaffinity(0))
    return allowed[rank * cores_per_node:(rank + 1) * cores_per_node]


def profile_node(args: argparse.Namespace, work: Path, disk: DiskLimit | None = None) -> Path | None:
    """Node 0's hardware profile, measured once on its own cores, and on its own throttled
    disk under --disk-gbps (or --hardware as given)."""
    if args.no_predict:
        return None
    if args.hardware:
        return Path(args.hardware)
    threads = args.cores_per_node if not args.shared_cores else len(os.sched_getaffinity(0))
    if getattr(args, "defaults", False):  # this host's cached profile, where the runs look for it
        out = default_cache_path("cpu", threads)
        cmd = [sys.executable, "-m", "flexgen_dist.planner", "profile", "--device", "cpu",
               "--offload-dir", str(work), "--threads", str(threads)]
    else:
        # a profile of the unthrottled disk must not stand in for a throttled one, nor the reverse
        out = work / ("node.yaml" if args.disk_gbps is None else f"node-disk{args.disk_gbps:g}.yaml")
        cmd = [sys.executable, "-m", "flexgen_dist.planner", "profile", "--device", "cpu", "--out", str(out),
               "--offload-dir", str(work)]
    if out.exists():
        return out
    if args.quick_profile:
        cmd.append("--quick")
    if args.netns:  # the shaped link, not the loopback the profiler would measure
        cmd += ["--net-bw", str(args.link_gbit * 1e9 / 8), "--net-latency", "0.0002"]
    cpus = node_cpus(0, threads)
    print(f"# profiling a node: CPUs {cpus}", flush=True)
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, capture_output=True, text=True,
                       timeout=args.timeout, preexec_fn=preexec(cpus, disk))
    if p.returncode != 0:
        raise SystemExit(f"profiling failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return out


_PROBE = ("import json, sys; from flexgen_dist.planner.profiler import measure_disk_bw; "
          "r, w, c = measure_disk_bw(sys.argv[1], quick=sys.argv[2] == '1', device='cpu'); "
          "print(json.dumps({'dtoc_bw': r, 'ctod_bw': w, 'disk_cpu': c}))")


def disk_share(args: argparse.Namespace, m: int, work: Path, hardware: Path, disk: DiskLimit | None = None) -> Path:
    """A hardware file for the runs of m nodes: node 0's profile with the disk rates (and the
    compute they cost) that each node gets while all m read and write at once, measured now
    (each probe in its node's disk cgroup under --disk-gbps).

    The nodes of this benchmark share the machine's one disk, and its rate moves between
    runs on a VM: a profile taken once, alone, would credit every node with the whole disk
    at whatever rate it had then."""
    cpus = [node_cpus(r, args.cores_per_node) for r in range(m)]
    # a quick probe moves 32 MiB, less than a throttle lets through at once (its first ~100 ms
    # slice): under --disk-gbps it would measure that burst (0.7-1.3 GB/s at 0.5), not the rate
    quick = args.quick_profile and args.disk_gbps is None
    probes = []
    for r in range(m):
        d = work / f"probe-{m}-{r}"
        d.mkdir(exist_ok=True)
        probes.append(subprocess.Popen([sys.executable, "-c", _PROBE, str(d), "1" if quick else "0"],
                                       env={**os.environ, "OMP_NUM_THREADS": str(args.cores_per_node)},
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       preexec_fn=preexec(cpus[r], disk, r)))
    got = []
    for p in probes:
        out, err = p.communicate(timeout=args.timeout)
        if p.returncode != 0:
            raise SystemExit(f"disk probe failed (exit {p.returncode}):\n{err[-2000:]}")
        got.append(json.loads(out.strip().splitlines()[-1]))
    hw = yaml.safe_load(hardware.read_text())
    for k in ("dtoc_bw", "ctod_bw", "disk_cpu"):
        vals = [g[k] for g in got if g[k] is not None]
        if vals:
            hw[k] = sum(vals) / len(vals)
    out_path = work / f"node-{m}.yaml"
    out_path.write_text(yaml.safe_dump(hw, sort_keys=False))
    how = "sharing the disk" if disk is None else f"each on its own {args.disk_gbps:g} GB/s disk"
    print(f"# {m} node(s) {how}: read {hw['dtoc_bw'] / 1e9:.2f} GB/s per node", flush=True)
    return out_path
