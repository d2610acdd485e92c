"""Policy: how one stage places its weights, KV cache and activations, and how it batches.

Percentages follow the CLI (``--percent WG WC CG CC HG HC``): for each of weights (W),
cache (C) and activations (H) the GPU and CPU shares in percent; disk gets the rest.
"GPU" means the compute device (which is the CPU itself on a CPU-only machine).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

def merge_decode(device: str, cache_on_disk: bool, cache_on_device: bool, cpu_attention: bool) -> bool:
    """Whether a decode step runs a layer once over the rows of every GPU batch of a block
    (its activations on the compute device), the rule the engine and the cost model share:
    wherever no batch's cache has to travel to the compute device first.

    On a CPU device wherever no cache chunk of the layer is on disk (chunks in RAM are attended
    in place). On a GPU where the layer's whole cache is on the device, or, with CPU
    attention, off disk (q goes to the chunks in RAM); otherwise the schedule overlaps each
    batch's cache transfer with the previous batch's compute.
    """
    if device == "cpu" or cpu_attention:
        return not cache_on_disk
    return cache_on_device


PERCENT_FIELDS = ("w_gpu_percent", "w_cpu_percent", "cache_gpu_percent", "cache_cpu_percent",
                  "act_gpu_percent", "act_cpu_percent")
STATE_FIELDS = ("state_gpu_percent", "state_cpu_percent")


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 8
    num_gpu_batches: int = 1
    w_gpu_percent: float = 100.0
    w_cpu_percent: float = 0.0
    cache_gpu_percent: float = 100.0
    cache_cpu_percent: float = 0.0
    act_gpu_percent: float = 100.0
    act_cpu_percent: float = 0.0
    # linear-attention layers' states (Qwen3-Next), by whole layers: ``engine/states.py``
    state_gpu_percent: float = 100.0
    state_cpu_percent: float = 0.0
    overlap: bool = True
    cpu_attention: bool = True
    compress_weight: bool = False
    compress_cache: bool = False
    attn_sparsity: float = 1.0
    comp_group_size: int = 64
    comp_bits: int = 4

    def __post_init__(self) -> None:
        for f in ("gpu_batch_size", "num_gpu_batches"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"policy {f}={v!r}: must be an integer >= 1")
        for f in PERCENT_FIELDS + STATE_FIELDS:
            v = getattr(self, f)
            if not 0.0 <= float(v) <= 100.0:
                raise ValueError(f"policy {f}={v}: must be between 0 and 100")
        for prefix, label in (("w", "weights"), ("cache", "cache"), ("act", "activations"),
                              ("state", "linear-attention states")):
            g, c = getattr(self, f"{prefix}_gpu_percent"), getattr(self, f"{prefix}_cpu_percent")
            if g + c > 100.0 + 1e-9:
                raise ValueError(
                    f"policy {prefix}_gpu_percent + {prefix}_cpu_percent = {g + c:g} > 100 "
                    f"for {label}: lower one of them (disk gets the rest)")
        if not 0.0 < self.attn_sparsity <= 1.0:
            raise ValueError(f"policy attn_sparsity={self.attn_sparsity}: must be in (0, 1]")
        if self.comp_bits not in (4, 8):
            raise ValueError(f"policy comp_bits={self.comp_bits}: use 4 or 8")
        if self.comp_group_size < 2 or self.comp_group_size % 2:
            raise ValueError(f"policy comp_group_size={self.comp_group_size}: use an even number >= 2")

    # derived -----------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Sequences sharing one pass over the layers: gpu_batch_size * num_gpu_batches."""
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def w_disk_percent(self) -> float:
        return max(0.0, 100.0 - self.w_gpu_percent - self.w_cpu_percent)

    @property
    def cache_disk_percent(self) -> float:
        return max(0.0, 100.0 - self.cache_gpu_percent - self.cache_cpu_percent)

    @property
    def act_disk_percent(self) -> float:
        return max(0.0, 100.0 - self.act_gpu_percent - self.act_cpu_percent)

    @property
    def state_disk_percent(self) -> float:
        return max(0.0, 100.0 - self.state_gpu_percent - self.state_cpu_percent)

    def merges_decode(self, device: str) -> bool:
        """``merge_decode`` for every layer of this placement on a ``device`` ("cpu"/"cuda")
        compute device: more than one GPU batch, every activation on the device."""
        if self.num_gpu_batches == 1 or self.act_gpu_percent < 100:
            return False
        return merge_decode(device, self.cache_disk_percent > 0, self.cache_gpu_percent >= 100, self.cpu_attention)

    def fractions(self, kind: str) -> tuple[float, float, float]:
        """(gpu, cpu, disk) fractions in [0, 1] for kind 'w', 'cache', 'act' or 'state'."""
        g = getattr(self, f"{kind}_gpu_percent") / 100.0
        c = getattr(self, f"{kind}_cpu_percent") / 100.0
        return g, c, max(0.0, 1.0 - g - c)

    def percent(self) -> tuple[float, ...]:
        return tuple(getattr(self, f) for f in PERCENT_FIELDS)

    def placement(self) -> str:
        """``percent=WG WC CG CC HG HC``, and ``state_percent=SG SC`` where not the default."""
        out = f"percent={' '.join(f'{x:g}' for x in self.percent())}"
        if (self.state_gpu_percent, self.state_cpu_percent) != (100.0, 0.0):
            out += f" state_percent={self.state_gpu_percent:g} {self.state_cpu_percent:g}"
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Policy":
        """Build from a mapping; ``percent: [WG, WC, CG, CC, HG, HC]`` and ``state_percent:
        [SG, SC]`` are accepted too."""
        d = dict(d)
        known = {f.name for f in fields(cls)}
        for key, names, what in (("percent", PERCENT_FIELDS, "six numbers WG WC CG CC HG HC"),
                                 ("state_percent", STATE_FIELDS, "two numbers SG SC")):
            if key in d:
                p = d.pop(key)
                if len(p) != len(names):
                    raise ValueError(f"policy {key}={p!r}: give {what}")
                d.update(zip(names, (float(x) for x in p)))
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"policy: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(known | {'percent', 'state_percent'}))}")
        return cls(**d)
