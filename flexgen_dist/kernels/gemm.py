"""Which GEMM form runs a CPU linear layer of few rows: a policy decided once per machine.

For few rows (decode: the rows are the GPU batch) the BLAS is far from its peak, since it
repacks the whole weight matrix on every call. Two other forms can beat ``F.linear``:
``w @ x.T`` (up to 1.7x with MKL: the weight is the streamed operand) and the native kernel
(each weight row read once, straight from its layout): in float32, and in bfloat16 on a CPU
with AVX512_BF16 (VDPBF16PS; on a 2-core EPYC it took the bundled model's decode of 8 rows
from 117 to 156 tok/s). Which wins depends on
the shape, the dtype, the thread count and the CPU. The forms sum in different orders, so
their results can differ in the last bit, and a greedy tie can then flip a token.

*Why a stored policy:* choosing by timing each process's first real calls let two runs of
one job pick different forms under different load, and so differ. Here a (rows, out, in,
dtype, threads) without a stored choice (the rows rounded up to a power of two,
``rows_bucket``) is timed once, on synthetic operands, and the choice
is written to ``gemm-<identity>.json`` beside the compiled kernels (``kernel_dir()``); every
later call, in this process or any other on a machine of the same identity (CPU model and
flags, torch version, native kernel build), uses it and times nothing. The timing walks a
pool of weights bigger than twice the last-level cache: a weight timed in a loop sits in
cache, as it never does in a real pass over the layers, and would favour the wrong form.
Processes that tune at once (ranks of one node) take a lock on the file, so a node stores
one choice per key. ``FLEXGEN_GEMM_TUNE=0`` turns the policy off: ``F.linear`` always.

Products of many rows (a prefill) in a half dtype have one more choice, per dtype and thread
count: the dtype's own GEMM, or widening both operands to float32 and rounding the output
once (``prefill_form``). Which is faster depends on the CPU: on one 2-core Xeon (AVX512_BF16
and AVX512_FP16, no AMX) torch's bfloat16 GEMM ran at 0.155 TFLOP/s and float32 at 0.277; on
an AMD EPYC with AVX512_BF16 bfloat16 ran at twice float32's rate and float16 at a quarter.
Both accumulate in float32 and round once, so the results agree to the dtype's rounding.
The rates are measured once per machine at a prefill-sized product (``_PREFILL_SHAPE``) and
stored with the choice; the planner's hardware profile times the chosen form again when it
measures the machine (a rate stored beside other work would mislead it; the choice does not).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from . import build_key, cpu_info, kernel_dir, linear_bf16, linear_f32, native_bf16_product

log = logging.getLogger("flexgen_dist.kernels")

MAX_ROWS = 64  # beyond this the plain form won for every shape measured
FORMS = ("plain", "t", "native")
_ROUNDS = 5  # timed passes over the pool per form; the median is kept
_MAX_COPIES = 256  # weights in the pool, at most (tiny shapes: bounds the tuning time)
_MARGIN = 0.95  # another form must be at least 5 % faster than F.linear to be chosen
PREFILL_FORMS = ("plain", "f32")
_PREFILL_SHAPE = (512, 2048, 2048)  # (rows, out, in) of the product timed per dtype
_PREFILL_ROUNDS = 3

Opt = torch.Tensor | None


def _add(y: torch.Tensor, residual: Opt) -> torch.Tensor:
    return y if residual is None else y.add_(residual)


def _plain(x: torch.Tensor, w: torch.Tensor, b: Opt, m: int, residual: Opt) -> torch.Tensor:
    return _add(F.linear(x, w, b), residual)


def _transposed(x: torch.Tensor, w: torch.Tensor, b: Opt, m: int, residual: Opt) -> torch.Tensor:
    y = torch.mm(w, x.reshape(m, x.shape[-1]).t()).t().contiguous()
    if b is not None:
        y.add_(b)
    return _add(y.view(*x.shape[:-1], w.shape[0]), residual)


def _native(x: torch.Tensor, w: torch.Tensor, b: Opt, m: int, residual: Opt) -> torch.Tensor:
    y = linear_bf16(x, w, b, residual) if x.dtype == torch.bfloat16 else linear_f32(x, w, b, residual)
    return _plain(x, w, b, m, residual) if y is None else y  # operands the kernel does not take


_FNS: tuple[Callable[[torch.Tensor, torch.Tensor, Opt, int, Opt], torch.Tensor], ...] = (
    _plain, _transposed, _native)


def identity() -> dict[str, str | None]:
    """What a stored choice is valid for: the CPU, the torch build and the native kernels."""
    return {"cpu": cpu_info("model name").partition(":")[2].strip(),
            "flags": hashlib.sha256(cpu_info("flags").encode()).hexdigest()[:16],
            "torch": torch.__version__, "native": build_key()}


def _llc_bytes() -> int:
    """The largest cache of cpu0 as sysfs reports it (32 MiB where it does not)."""
    sizes = []
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            s = (d / "size").read_text().strip()
            sizes.append(int(s[:-1]) * {"K": 2**10, "M": 2**20}[s[-1]] if s[-1] in "KM" else int(s))
    return max(sizes, default=32 * 2**20)


def time_forms(m: int, n: int, k: int, dtype: torch.dtype, forms: tuple[int, ...]) -> dict[int, float]:
    """Median seconds per call of each form on an (m, k) input and (n, k) weights.

    Each timed pass runs the form over a pool of weights of twice the last-level cache (so
    each weight arrives cold, as in a pass over the layers), the forms in a rotating order;
    the operands are seeded, so the pass is the same every time, only the clock differs. A
    weight bigger than the pool is timed on as many of its rows as fill it: a GEMM of few
    rows streams the weight either way, and tuning must not allocate a weight-sized tensor
    that no memory budget counts.
    """
    g = torch.Generator().manual_seed(m * 1_000_003 + n * 1009 + k)
    pool_bytes, row_bytes = 2 * _llc_bytes(), max(1, k * torch.empty((), dtype=dtype).element_size())
    n = max(1, min(n, pool_bytes // row_bytes))
    copies = max(1, min(_MAX_COPIES, math.ceil(pool_bytes / (n * row_bytes))))
    pool = [torch.empty(n, k, dtype=dtype).uniform_(-1, 1, generator=g) for _ in range(copies)]
    x = torch.empty(m, k, dtype=dtype).uniform_(-1, 1, generator=g)
    for f in forms:  # first-call costs (library load, thread pool) stay out of the timings
        _FNS[f](x, pool[0], None, m, None)
    times: dict[int, list[float]] = {f: [] for f in forms}
    for r in range(_ROUNDS):
        for f in forms[r % len(forms):] + forms[:r % len(forms)]:
            t0 = time.perf_counter()
            for w in pool:
                _FNS[f](x, w, None, m, None)
            times[f].append((time.perf_counter() - t0) / copies)
    return {f: statistics.median(t) for f, t in times.items()}


def rows_bucket(m: int) -> int:
    """The row count a product of ``m`` rows is keyed and timed by: the next power of two. The
    forms' order does not move within a bucket, and a run whose products vary in rows (a
    block's last GPU batch, the rows each expert of a mixture receives) then needs at most
    seven row counts per shape timed, not one per count."""
    return 1 << max(0, m - 1).bit_length()


def time_prefill(dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of a prefill-sized product (``_PREFILL_SHAPE``) in ``dtype``: its own GEMM
    ("plain") and, for a half dtype, widened to float32 with one rounding back ("f32"); the
    best of ``_PREFILL_ROUNDS`` after a warm-up, the forms alternating."""
    m, n, k = _PREFILL_SHAPE
    g = torch.Generator().manual_seed(7)
    x = torch.empty(m, k).uniform_(-1, 1, generator=g).to(dtype)
    w = torch.empty(n, k).uniform_(-1, 1, generator=g).to(dtype)
    fns = {"plain": lambda: F.linear(x, w)}
    if dtype != torch.float32:
        fns["f32"] = lambda: _widened(x, w, None)
    best = {f: float("inf") for f in fns}
    for fn in fns.values():
        fn()
    for _ in range(_PREFILL_ROUNDS):
        for f, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[f] = min(best[f], time.perf_counter() - t0)
    return {f: 2.0 * m * n * k / max(t, 1e-9) for f, t in best.items()}


def _widened(x: torch.Tensor, w: torch.Tensor, b: Opt) -> torch.Tensor:
    """``F.linear`` of half operands in float32, the output rounded once to their dtype."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def choose(med: dict[int, float]) -> int:
    """The fastest form, or the plain one unless another beats it by the margin."""
    best = min(med, key=med.__getitem__)
    return best if med[best] < _MARGIN * med[0] else 0


Key = tuple[int, int, int, torch.dtype, int]  # rows, out, in, dtype, threads


def _name(key: Key) -> str:
    m, n, k, dtype, threads = key
    return f"{m}x{n}x{k}:{str(dtype).replace('torch.', '')}:t{threads}"


class GemmPolicy:
    """The stored form of each (rows, out, in, dtype, threads) on this machine.

    ``form`` answers from memory after a key's first lookup; a key the file lacks is timed
    under the file's lock (after re-reading it: another process may have stored it
    meanwhile) and written back atomically. Without a writable file (``path`` None, or an
    error) choices are kept for this process only, and ``summary`` says so.
    """

    def __init__(self, path: Path | None, tune: bool = True) -> None:
        self.path = path
        self.tune = tune
        self.stored: dict[str, str] = {}  # the file's choices, as last read (and added to)
        self.rates: dict[str, dict[str, float]] = {}  # measured FLOP/s of each prefill form, per key
        self.tuned = 0  # keys this process timed
        self.tune_s = 0.0
        self.error: str | None = None
        self._used: dict[Key, int] = {}
        self._used_prefill: dict[str, tuple[str, dict[str, float]]] = {}
        self._read_done = False
        self._lock = threading.Lock()

    def form(self, m: int, n: int, k: int, dtype: torch.dtype) -> int:
        """The index in ``FORMS`` of the form for an (m, k) input and an (n, k) weight (the
        form stored for m's bucket, ``rows_bucket``)."""
        key = (rows_bucket(m), n, k, dtype, torch.get_num_threads())
        f = self._used.get(key)
        return self._resolve(key) if f is None else f

    def _resolve(self, key: Key) -> int:
        name = _name(key)
        with self._lock:
            if key in self._used:
                return self._used[key]
            with self._file_lock():
                self._read()
                if self.stored.get(name) not in self._forms(key[3]):
                    self.stored[name] = FORMS[self._time(key)]
                    self._write()
            self._used[key] = f = FORMS.index(self.stored[name])
        return f

    def prefill(self, dtype: torch.dtype) -> tuple[str, dict[str, float]]:
        """The form of a many-row product in ``dtype`` at this thread count ("plain": the
        dtype's own GEMM, "f32": widened to float32) and the measured rate of each form."""
        name = f"prefill:{str(dtype).replace('torch.', '')}:t{torch.get_num_threads()}"
        hit = self._used_prefill.get(name)
        if hit is not None:
            return hit
        with self._lock:
            with self._file_lock():
                self._read()
                if self.stored.get(name) not in PREFILL_FORMS or name not in self.rates:
                    t0 = time.perf_counter()
                    self.rates[name] = time_prefill(dtype)
                    self.tune_s += time.perf_counter() - t0
                    self.tuned += 1
                    plain, wide = self.rates[name]["plain"], self.rates[name].get("f32", 0.0)
                    self.stored[name] = "f32" if wide * _MARGIN > plain else "plain"
                    self._write()
            self._used_prefill[name] = out = (self.stored[name], dict(self.rates[name]))
        return out

    @staticmethod
    def _forms(dtype: torch.dtype) -> tuple[str, ...]:
        """The forms that run for ``dtype`` here: the native one in float32 where the kernels
        built, in bfloat16 where the CPU also has VDPBF16PS."""
        native = build_key() is not None and (dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16_product()))
        return FORMS if native else FORMS[:2]

    def _time(self, key: Key) -> int:
        m, n, k, dtype, _ = key
        t0 = time.perf_counter()
        med = time_forms(m, n, k, dtype, tuple(FORMS.index(f) for f in self._forms(dtype)))
        self.tune_s += time.perf_counter() - t0
        self.tuned += 1
        f = choose(med)
        log.debug("GEMM %s: %s (%s)", _name(key), FORMS[f],
                  ", ".join(f"{FORMS[i]} {t * 1e6:.1f} us" for i, t in med.items()))
        return f

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        fd = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                self._fail(e)
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def _read(self) -> None:
        self._read_done = True
        if self.path is None:
            return
        try:
            data = json.loads(self.path.read_text())
            choices = data["choices"]
            self.stored.update({k: v for k, v in choices.items()
                                if v in (PREFILL_FORMS if k.startswith("prefill:") else FORMS)})
            for k, r in (data.get("rates") or {}).items():
                if isinstance(r, dict) and all(isinstance(v, (int, float)) and v > 0 for v in r.values()) \
                        and "plain" in r:
                    self.rates[k] = {f: float(v) for f, v in r.items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("GEMM policy %s unreadable (%s): its shapes are timed again", self.path, e)

    def _write(self) -> None:
        if self.path is None:
            return
        text = json.dumps({"identity": identity(), "choices": dict(sorted(self.stored.items())),
                           "rates": dict(sorted(self.rates.items()))}, indent=1)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=self.path.name, suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, self.path)  # readers see the old file or the new one, never half
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        log.warning("GEMM policy %s cannot be stored (%s): this process keeps its choices to itself",
                    self.path, e)
        self.error, self.path = str(e), None

    def summary(self) -> dict[str, Any]:
        """For the run's metrics: two runs whose ``digest`` is equal used the same forms."""
        if not self._read_done and self.tune:
            with self._lock:
                self._read()
        used = sorted((_name(k), FORMS[f]) for k, f in self._used.items())
        used += sorted((k, f) for k, (f, _) in self._used_prefill.items())
        return {"gemm_tune": self.tune, "file": str(self.path) if self.path else None, "error": self.error,
                "stored": len(self.stored), "used": len(used),
                "digest": hashlib.sha256(json.dumps(used).encode()).hexdigest()[:12],
                "tuned": self.tuned, "tune_s": round(self.tune_s, 3)}


def tuning_enabled() -> bool:
    return os.environ.get("FLEXGEN_GEMM_TUNE", "1").lower() not in ("0", "false", "no", "off")


_process: dict[str, GemmPolicy] = {}
_process_lock = threading.Lock()


def policy() -> GemmPolicy:
    """This process's policy, opened on first use: the file for this machine's identity."""
    p = _process.get("policy")
    if p is None:
        with _process_lock:
            if "policy" not in _process:
                tune = tuning_enabled()
                digest = hashlib.sha256(json.dumps(identity(), sort_keys=True).encode()).hexdigest()[:16]
                _process["policy"] = GemmPolicy(kernel_dir() / f"gemm-{digest}.json" if tune else None, tune)
            p = _process["policy"]
    return p


def summary() -> dict[str, Any]:
    """The kernel policy this process ran with (file, tuning on or off, choices, digest).
    A process that has not run a CPU GEMM of few rows (a GPU run) reports it unopened
    rather than building the native kernels to name its file."""
    p = _process.get("policy")
    return p.summary() if p is not None else GemmPolicy(None, tuning_enabled()).summary()


def linear(x: torch.Tensor, w: torch.Tensor, b: Opt = None, residual: Opt = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` (+ ``residual``) on the CPU, through the form the policy stores
    for its shape; more than ``MAX_ROWS`` rows run ``F.linear``, in float32 for a half dtype
    where that is faster on this machine (``prefill_form``); the policy off: ``F.linear``."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    p = policy()
    if not p.tune or x.dim() < 2 or m <= 0:
        return _plain(x, w, b, m, residual)
    if m > MAX_ROWS:
        if x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype and p.prefill(x.dtype)[0] == "f32":
            return _add(_widened(x, w, b), residual)
        return _plain(x, w, b, m, residual)
    return _FNS[p.form(m, w.shape[0], k, x.dtype)](x, w, b, m, residual)
