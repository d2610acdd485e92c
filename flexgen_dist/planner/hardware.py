"""HardwareSpec: the numbers the cost model needs about one stage's machine; YAML I/O.

All fields are SI: bytes, bytes/s, FLOP/s, seconds. ``gpu_*`` always means the *compute
device*: on a CPU-only machine that is the CPU itself, so ``ctog``/``gtoc`` become memcpy
bandwidths and ``gpu_mem``/``cpu_mem`` are two shares of the same RAM (see
``configs/hardware/README.md``). :func:`flexgen_dist.planner.profiler.profile_hardware`
measures them on this machine.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from flexgen_dist.memory.units import parse_size

SOURCES = ("measured", "from specifications")
DEVICES = ("cuda", "cpu")
MEM_FIELDS = ("gpu_mem", "cpu_mem", "disk_mem")
BW_FIELDS = ("ctog_bw", "gtoc_bw", "dtoc_bw", "ctod_bw", "net_bw")
FLOPS_FIELDS = ("mm_flops", "bmm_flops", "cpu_flops")
OPTIONAL_FIELDS = ("compute_device", "gemm_bw", "disk_cpu", "mm_flops_dtype", "gemm_bw_dtype",
                   "host_layer_s", "host_batch_s", "host_cache_batch_s", "att_flops", "att_flops_dtype",
                   "cpu_packed_flops", "cpu_att_peak", "cpu_att_peak_dtype", "decode_flops", "decode_flops_dtype",
                   "cpu_att_read", "cpu_att_read_dtype")
HOST_FIELDS = ("host_layer_s", "host_batch_s", "host_cache_batch_s")
DTYPES = ("float32", "bfloat16", "float16")
# what a cached, self-measured profile carries beside the spec (profile_cache.py); not part of it
META_KEYS = ("profile_version", "identity", "measured_at")
# rows of the products ``decode_flops`` times, and of ``mm_flops``' prefill-sized one on a CPU:
# a product's arithmetic rate moves from the one to the other between them (``product_flops``)
DECODE_ROWS, PREFILL_ROWS = 64, 512


@dataclass(frozen=True)
class HardwareSpec:
    """Capacities, bandwidths and compute rates of one stage's machine.

    ``mm_flops``: dense matmul rate at linear-layer sizes on the compute device (fp16 on cuda,
    fp32 on cpu). ``bmm_flops``: decode attention (one query against the cache) on the compute
    device; that shape is memory-bound, so the cost model also derives the device's memory
    bandwidth from it. ``cpu_flops``: the same attention computed on the host CPU in fp32 (CPU-delegated
    attention). ``net_bw``/``net_latency``: hidden states to the next stage. ``gemm_bw``
    (optional): bytes of weights per second a decode-shaped linear layer streams on the
    compute device (a few rows against weights far larger than the caches); small-batch
    linear layers are bound by it. Without it the cost model falls back to the
    attention-derived bandwidth, which on a CPU overstates what a skinny GEMM achieves ~2x.
    ``disk_cpu`` (optional, CPU devices): compute seconds lost per byte moved to or from disk.
    On a CPU device the reads' thread and the kernel's I/O path run on the cores that compute
    (on a one-core node they take a large share of it); the cost model adds this time to the
    compute channel. Without it, disk traffic costs no compute.
    ``host_layer_s`` / ``host_batch_s`` (optional): the host's time to issue one layer of a
    decode step (Python, torch's dispatch, a GPU's kernel launches), once per step and once
    per step and GPU batch; small layers, and a fast GPU's, are bound by it. Without them
    the cost model counts no host time. ``host_cache_batch_s`` (optional): what a compressed
    cache adds per layer, step and GPU batch (each batch's cache quantized, expanded and
    attended on its own). ``att_flops`` (optional): prompt attention's rate, the engine's own
    kernel on a padded block (``4 rows s q`` FLOPs a layer), in the dtype of ``mm_flops``, and
    ``att_flops_dtype`` per dtype; without them the cost model counts that attention at
    ``mm_flops``, which a CPU's fused attention reaches a third of in bfloat16.
    ``cpu_packed_flops`` (optional): ``cpu_flops``' attention over a 4-bit compressed cache, its
    codes read in place (the host's decode attention where the cache is compressed); without
    it the cost model counts that cache expanded and then attended.
    ``cpu_att_peak`` (optional): the host's decode attention where it computes rather than reads:
    eight query heads a key and value (grouped-query attention), in the dtype of ``mm_flops``,
    and ``cpu_att_peak_dtype`` per dtype. ``cpu_flops``' shape (one head a key) is bound by
    reading the cache. ``cpu_att_read`` (optional): ``cpu_flops``' shape in the dtype of
    ``mm_flops``, and ``cpu_att_read_dtype`` per dtype (without it, ``cpu_flops``). The two in
    one dtype place the kernel's time per byte of cache read and per FLOP computed, which the
    cost model adds (``planner/terms.py``), so heads sharing keys and narrower dtypes cost what
    they do. Without ``cpu_att_peak`` the attention costs its FLOPs at ``cpu_flops``.
    ``decode_flops`` (optional): the arithmetic rate of a decode step's products of
    ``DECODE_ROWS`` rows on the compute device (on a CPU beyond their weight stream, which the
    cost model adds; on a GPU of the whole product, which overlaps it), in the dtype of
    ``mm_flops``, and ``decode_flops_dtype`` per dtype. A product of ``r`` rows is costed at a
    rate between it and ``mm_flops`` (``product_flops``); without it, at ``mm_flops``.
    """

    name: str
    source: str
    gpu_mem: int
    cpu_mem: int
    disk_mem: int
    ctog_bw: float
    gtoc_bw: float
    dtoc_bw: float
    ctod_bw: float
    mm_flops: float
    bmm_flops: float
    cpu_flops: float
    net_bw: float
    net_latency: float
    compute_device: str = "cuda"
    gemm_bw: float | None = None
    disk_cpu: float | None = None
    mm_flops_dtype: dict[str, float] | None = None
    gemm_bw_dtype: dict[str, float] | None = None
    host_layer_s: float | None = None
    host_batch_s: float | None = None
    host_cache_batch_s: float | None = None
    att_flops: float | None = None
    att_flops_dtype: dict[str, float] | None = None
    cpu_packed_flops: float | None = None
    cpu_att_peak: float | None = None
    cpu_att_peak_dtype: dict[str, float] | None = None
    decode_flops: float | None = None
    decode_flops_dtype: dict[str, float] | None = None
    cpu_att_read: float | None = None
    cpu_att_read_dtype: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareSpec.name={self.name!r}: give a non-empty name")
        if self.source not in SOURCES:
            raise ValueError(f"HardwareSpec.source={self.source!r}: use one of {SOURCES}")
        if self.compute_device not in DEVICES:
            raise ValueError(f"HardwareSpec.compute_device={self.compute_device!r}: "
                             f"use one of {DEVICES}")
        for f in MEM_FIELDS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"HardwareSpec.{f}={v!r}: must be a positive number of bytes "
                                 f"(e.g. '16GiB' in YAML)")
        for f in BW_FIELDS + FLOPS_FIELDS + ("net_latency",):
            v = getattr(self, f)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or v < 0 or (v == 0 and f != "net_latency"):
                what = "seconds >= 0" if f == "net_latency" else "a positive rate"
                raise ValueError(f"HardwareSpec.{f}={v!r}: must be {what}")
            object.__setattr__(self, f, float(v))
        for f in ("gemm_bw", "att_flops", "cpu_packed_flops", "cpu_att_peak", "decode_flops",
                  "cpu_att_read"):
            v = getattr(self, f)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"HardwareSpec.{f}={v!r}: must be a positive rate, or absent")
            object.__setattr__(self, f, float(v))
        for f in ("mm_flops_dtype", "gemm_bw_dtype", "att_flops_dtype", "cpu_att_peak_dtype", "decode_flops_dtype",
                  "cpu_att_read_dtype"):
            d = getattr(self, f)
            if d is None:
                continue
            if not isinstance(d, dict) or not d or any(k not in DTYPES for k in d) or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
                    for v in d.values()):
                raise ValueError(f"HardwareSpec.{f}={d!r}: must map dtypes ({', '.join(DTYPES)}) to "
                                 "positive rates, or be absent")
            object.__setattr__(self, f, {k: float(v) for k, v in d.items()})
        for f, unit in (("disk_cpu", "seconds per byte"),) + tuple((f, "seconds") for f in HOST_FIELDS):
            v = getattr(self, f)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"HardwareSpec.{f}={v!r}: must be {unit} >= 0, or absent")
            object.__setattr__(self, f, float(v))

    def __hash__(self) -> int:
        # the planner memoizes per stage by spec; the per-dtype rates are dicts, hashed as items
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v
                          for v in (getattr(self, f.name) for f in fields(self))))

    def for_dtype(self, dtype: str) -> HardwareSpec:
        """This machine as a run computing in ``dtype`` sees it: ``mm_flops``, ``gemm_bw``, prompt
        attention's rate and the host's peak decode attention from the per-dtype figures where
        the profile has them."""
        new: dict[str, float] = {}
        if self.mm_flops_dtype and dtype in self.mm_flops_dtype:
            new["mm_flops"] = self.mm_flops_dtype[dtype]
        if self.gemm_bw_dtype and dtype in self.gemm_bw_dtype:
            new["gemm_bw"] = self.gemm_bw_dtype[dtype]
        if self.att_flops_dtype and dtype in self.att_flops_dtype:
            new["att_flops"] = self.att_flops_dtype[dtype]
        if self.cpu_att_peak_dtype and dtype in self.cpu_att_peak_dtype:
            new["cpu_att_peak"] = self.cpu_att_peak_dtype[dtype]
        if self.decode_flops_dtype and dtype in self.decode_flops_dtype:
            new["decode_flops"] = self.decode_flops_dtype[dtype]
        if self.cpu_att_read_dtype and dtype in self.cpu_att_read_dtype:
            new["cpu_att_read"] = self.cpu_att_read_dtype[dtype]
        return replace(self, **new) if new else self

    def product_flops(self, rows: float) -> float:
        """The arithmetic rate of a linear layer's product of ``rows`` rows: ``decode_flops``
        up to ``DECODE_ROWS`` rows, ``mm_flops`` from ``PREFILL_ROWS``, between them
        geometric in the rows (a rate that rises, or falls, steadily with the rows' doublings);
        ``mm_flops`` at every size where the profile has no ``decode_flops``."""
        if self.decode_flops is None or rows >= PREFILL_ROWS:
            return self.mm_flops
        if rows <= DECODE_ROWS:
            return self.decode_flops
        f = math.log(rows / DECODE_ROWS) / math.log(PREFILL_ROWS / DECODE_ROWS)
        return self.decode_flops ** (1.0 - f) * self.mm_flops ** f

    def with_budgets(self, gpu_mem: int | str | None = None, cpu_mem: int | str | None = None,
                     disk_mem: int | str | None = None) -> HardwareSpec:
        """The same machine with some memory capacities replaced (sizes like '16GiB' allowed)."""
        new = {k: parse_size(v) for k, v in
               (("gpu_mem", gpu_mem), ("cpu_mem", cpu_mem), ("disk_mem", disk_mem))
               if v is not None}
        return replace(self, **new)

    # YAML ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = ("# flexgen_dist hardware spec (SI units: bytes, bytes/s, FLOP/s, seconds);\n"
                  "# fields are explained in configs/hardware/README.md\n")
        path.write_text(header + yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "hardware spec") -> HardwareSpec:
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a mapping of fields, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        d = {k: v for k, v in d.items() if k not in META_KEYS}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                             f"known keys: {', '.join(known)}")
        required = [f.name for f in fields(cls) if f.name not in OPTIONAL_FIELDS]
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
        vals = dict(d)
        convert = {**{f: parse_size for f in MEM_FIELDS}, **{f: _parse_rate for f in BW_FIELDS},
                   **{f: float for f in FLOPS_FIELDS + ("net_latency",)}}
        if vals.get("gemm_bw") is not None:
            convert["gemm_bw"] = _parse_rate
        for f in ("disk_cpu", "att_flops", "cpu_packed_flops", "cpu_att_peak", "decode_flops", "cpu_att_read") + HOST_FIELDS:
            if vals.get(f) is not None:
                convert[f] = float
        if vals.get("gemm_bw_dtype") is not None and isinstance(vals["gemm_bw_dtype"], dict):
            vals["gemm_bw_dtype"] = {k: _parse_rate(v) for k, v in vals["gemm_bw_dtype"].items()}
        for f, conv in convert.items():
            try:
                vals[f] = conv(vals[f])
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {f}={vals[f]!r}: {e}") from None
        try:
            return cls(**vals)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> HardwareSpec:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"hardware file {path} not found: pass a YAML file such as "
                                    f"configs/hardware/t4.yaml, or run "
                                    f"'python -m flexgen_dist.planner profile --out {path}'")
        return cls.from_dict(_yaml(path), where=str(path))


def _yaml(path: Path) -> Any:
    """A hardware file's contents; not YAML is a one-line error naming the file."""
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ValueError(f"hardware file {path} is not valid YAML ({str(e).splitlines()[0]}): pass a profile such "
                         "as configs/hardware/t4.yaml") from None


def load_hardware_stages(path: str | Path) -> list[HardwareSpec]:
    """One HardwareSpec, or one per stage from ``stages:`` (each a file path or a mapping).

    A pipeline whose stages run on different machines lists them in order::

        stages:
          - t4.yaml            # relative to this file
          - {name: a100, ...}  # or inline
    """
    path = Path(path)
    if not path.is_file():
        return [HardwareSpec.from_yaml(path)]  # raises the not-found error
    d = _yaml(path)
    if not (isinstance(d, dict) and "stages" in d):
        return [HardwareSpec.from_dict(d, where=str(path))]
    items = d["stages"]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: 'stages' must be a non-empty list of hardware files or mappings")
    out = []
    for n, item in enumerate(items):
        if isinstance(item, str):
            out.append(HardwareSpec.from_yaml(path.parent / item))
        else:
            out.append(HardwareSpec.from_dict(item, where=f"{path} stage {n}"))
    return out


def hardware_for_stages(hws: list[HardwareSpec], num_stages: int) -> list[HardwareSpec]:
    """The hardware of each of ``num_stages`` stages: one spec for all, or one per stage."""
    if len(hws) == 1:
        return hws * num_stages
    if len(hws) != num_stages:
        raise ValueError(f"the hardware file lists {len(hws)} stages but the pipeline has {num_stages}: "
                         "give one machine for all stages, or one per stage")
    return list(hws)


def _parse_rate(v: Any) -> float:
    """A bandwidth: a number of bytes/s, or a size string with an optional '/s' ('12GB/s')."""
    if isinstance(v, str):
        s = v.strip()
        s = s[:-2] if s.lower().endswith("/s") else s
        return float(parse_size(s))
    return float(v)
