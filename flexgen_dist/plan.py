"""The typed records of a run: what is asked (``Workload``) and what will be done (``RunPlan``,
one ``StagePlan`` per stage), with the reason for each choice.

These are the values that cross module and rank boundaries: rank 0 builds the workload and
the plan once and sends both to every rank (``Workload.header()`` leaves the prompts' text
behind), the engine and the pipeline loop read their fields, and ``--metrics`` and
``--explain`` report them. Only ``to_dict`` sees them as dicts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .engine.beams import BEAM_BYTES, BeamConfig
from .engine.prefix_shape import PrefixShape
from .engine.footprint import HeadLoad
from .engine.head import score_width
from .engine.policy import Policy
from .engine.sampling import MAX_LOGPROBS, SamplingConfig, choice_bytes
from .prompts import Prompt, StopStrings

TIERS = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class Workload:
    """One call's requests: prompt lengths, generation limits, sampling, scoring targets.

    ``gen_len`` is the call's number of token steps; ``max_new_tokens`` (one per request,
    each in [1, gen_len]) cuts a request's completion shorter. ``samplings`` (one per request)
    give requests their own sampling (default: ``sampling`` for all). ``stops`` (one tuple of strings per request) end a
    completion at the first of its stop strings. ``keys`` are the requests' sampling keys
    (default: their index in the call). ``logprobs`` (None: off) asks for each generated
    token's log-probability and that many most likely alternatives (scoring: each scored
    token's). ``targets`` (scoring) are, per sequence, the id that
    follows each position, -1 where it is not scored. ``prompts`` (rank 0 only) keep each
    request's ids and text; ``header()`` drops them for the wire."""

    lens: tuple[int, ...]
    gen_len: int
    sampling: SamplingConfig = SamplingConfig()
    keys: tuple[int, ...] | None = None
    max_new_tokens: tuple[int, ...] | None = None
    targets: tuple[tuple[int, ...], ...] | None = None
    samplings: tuple[SamplingConfig, ...] | None = None
    stops: tuple[tuple[str, ...], ...] | None = None
    logprobs: int | None = None
    # per request, its prompt's ids where its sampling has a repetition penalty (else ()): the
    # last stage applies it, and the header (which has no prompts) carries them there
    seen: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)
    # per request, the leading tokens every prompt of its block shares (``blocks.shared_prefixes``;
    # None or 0: none): rank 0 finds them once the blocks are cut, the header carries them
    shared: tuple[int, ...] | None = None
    # per request, its prefix group within its window (``blocks.prefix_groupings``; -1: none;
    # None: blocks cut by length alone): rank 0 chooses them with the prefixes, the header carries them
    groups: tuple[int, ...] | None = None
    # per request, whether its block takes its shared prefix's keys and values from the block
    # before (``blocks.prefix_reuse``; None: none does)
    reuse: tuple[bool, ...] | None = None
    # the fewest positions a row's cache leaves out in any block of the call where the blocks'
    # shared prefixes are held through decode (``engine/held.py``; ``held.held_floor``), or their
    # GPU batches' repeated prompts kept once (``engine/prompt_groups.py``): what the memory
    # check counts on; rank 0 sets it with the prefixes
    held: int = 0
    # per request, its LoRA adapter served per request (``models/lora_stack.py``): 0 the base
    # model, a > 0 the model's a-th adapter (``LoadedModel.adapters``); None: every request the base
    adapters: tuple[int, ...] | None = None
    # per request, the first request with the same prompt and adapter (``blocks.repeated_prompts``;
    # None: no prompt repeats another, or repeats are computed each): rank 0 finds them, the header
    # carries them; a GPU batch's prefill computes each prompt once (``engine/twins.py``)
    twins: tuple[int, ...] | None = None
    # embedding: no token is generated (gen_len 1, the prefill); each request's result is its
    # last hidden state after the final norm (``head.embed``)
    embed: bool = False
    # beam search (``engine/beams.py``; None: none): each prompt runs as ``beams.width``
    # consecutive requests, its beams, one GPU batch holding all of them
    beams: BeamConfig | None = None
    # what shared prefixes save the call's prefill (``prefix_shape.PrefixShape``; None: none or not
    # shared): what the planner's cost model expects a block not to compute. Rank 0's alone
    prefix: PrefixShape | None = field(default=None, compare=False, repr=False)
    prompts: tuple[Prompt, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.lens)
        if n == 0 or min(self.lens) < 1:
            raise ValueError("a workload needs at least one request, each of >= 1 token")
        if self.gen_len < 1:
            raise ValueError(f"gen_len {self.gen_len}: must be >= 1")
        for name in ("keys", "max_new_tokens", "targets", "samplings", "stops", "seen", "shared", "groups", "reuse",
                     "adapters", "twins"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"{name} has {len(v)} entries for {n} requests: give one per request")
        if self.max_new_tokens is not None:
            bad = [m for m in self.max_new_tokens if not 1 <= m <= self.gen_len]
            if bad:
                raise ValueError(f"max_new_tokens {bad[0]}: each must be in [1, gen_len={self.gen_len}]")
        if self.beams is not None and n % self.beams.width:
            raise ValueError(f"a beam search of {self.beams.width} beams runs whole prompts: {n} requests")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs {self.logprobs}: give 0 (the chosen token's only) to {MAX_LOGPROBS} "
                             "alternatives per token, or None")

    @property
    def num_prompts(self) -> int:
        return len(self.lens)

    @property
    def prompt_len(self) -> int:
        """The longest prompt: a block's padded length at most."""
        return max(self.lens)

    @property
    def scoring(self) -> bool:
        return self.targets is not None

    @property
    def head_load(self) -> HeadLoad:
        """What this call asks of the last stage's head beyond its weights (the peak model's
        ``HeadLoad``): the bytes choosing the next tokens holds per (row, vocabulary entry)
        (``engine.sampling.choice_bytes``), or scoring and its per-token rows."""
        if self.embed:
            return HeadLoad(embed=True)
        if self.scoring:
            return HeadLoad(scoring=True, score_width=0 if self.logprobs is None else score_width(self.logprobs))
        cfgs = self.samplings or (self.sampling,)
        beams = BEAM_BYTES if self.beams is not None else 0  # a beam search's log-softmax and its sums
        return HeadLoad(choice_bytes(cfgs, self.logprobs) + beams,
                        sorts=any(not c.greedy and c.top_p < 1.0 for c in cfgs))

    @property
    def structured(self) -> bool:
        """Whether any request's completion must match a structure (``engine/structure.py``)."""
        return any(c.structure is not None for c in self.samplings or (self.sampling,))

    def header(self) -> Workload:
        """What the other ranks need: everything but the prompts' ids and text."""
        return replace(self, prompts=(), prefix=None)

    def limit(self, n: int) -> int:
        """Request ``n``'s own number of new tokens at most."""
        return self.gen_len if self.max_new_tokens is None else self.max_new_tokens[n]

    def sampling_of(self, n: int) -> SamplingConfig:
        """Request ``n``'s sampling."""
        return self.sampling if self.samplings is None else self.samplings[n]

    def stop_strings(self, tokenizer: Any) -> StopStrings | None:
        """The requests' stop strings, each counted past its ``min_tokens`` (None: no request
        has any)."""
        if self.stops is None or not any(self.stops):
            return None
        return StopStrings(self.stops, tokenizer, [self.sampling_of(n).min_tokens for n in range(len(self.lens))])


@dataclass(frozen=True)
class Peaks:
    """Predicted peak bytes per tier: gpu is the compute device (host RAM on a CPU-only
    machine), cpu is host RAM, disk the offload directory."""

    gpu: int
    cpu: int
    disk: int

    @classmethod
    def of(cls, d: dict[str, int]) -> Peaks:
        return cls(*(int(d[t]) for t in TIERS))

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Choice:
    """One decision of the plan: what was chosen, and why (for ``--explain`` and metrics)."""

    name: str
    value: str
    why: str


@dataclass(frozen=True)
class Prediction:
    """The cost model's figures for the planned workload (absent without a hardware profile)."""

    prefill_throughput: float
    decode_throughput: float
    total_throughput: float
    prefill_time_s: float
    decode_time_s: float
    hardware: tuple[str, ...]

    @classmethod
    def of(cls, d: dict[str, Any]) -> Prediction:
        return cls(float(d["prefill_throughput"]), float(d["decode_throughput"]), float(d["total_throughput"]),
                   float(d["prefill_time_s"]), float(d["decode_time_s"]), tuple(d.get("hardware", ())))


@dataclass(frozen=True)
class StagePlan:
    """One stage: its layers [lo, hi), its policy, its predicted peak bytes per tier, and (with
    a hardware profile) the cost model's seconds for one block's prefill and one decode step."""

    index: int
    layers: tuple[int, int]
    policy: Policy
    peaks: Peaks
    prefill_s: float | None = None
    decode_step_s: float | None = None

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class RunPlan:
    """What a run will do: one ``StagePlan`` per stage (rank), the micro-batch groups in
    flight, how a block's prefill crosses the stages, the pipeline schedule, the blocks of the
    planned workload, the planner's prediction, and the reason for each choice."""

    stages: tuple[StagePlan, ...]
    num_micro_batches: int
    prefill_items: str  # "block" or "batch"
    schedule: str  # "sequential" or "overlapped"
    num_blocks: int
    prediction: Prediction | None = None
    choices: tuple[Choice, ...] = ()
    sort_window: int = 0  # blocks' worth of requests grouped by length at a time (0: input order)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a plan needs at least one stage")
        sizes = {s.policy.block_size for s in self.stages}
        if len(sizes) != 1:
            raise ValueError(f"stage policies have block sizes {sorted(sizes)} (gpu_batch_size x "
                             "num_gpu_batches): every stage must use the same block size")
        if self.prefill_items not in ("block", "batch") or self.schedule not in ("sequential", "overlapped"):
            raise ValueError(f"plan prefill_items={self.prefill_items!r}, schedule={self.schedule!r}")
        if self.num_micro_batches < 1:
            raise ValueError(f"plan num_micro_batches={self.num_micro_batches}: must be >= 1")

    @property
    def block_size(self) -> int:
        return self.stages[0].policy.block_size

    @property
    def blocks_in_flight(self) -> int:
        """Blocks whose cache a stage holds at once: G, two per group when prefill rides."""
        return self.num_micro_batches * (2 if self.schedule == "overlapped" else 1)

    @property
    def policies(self) -> tuple[Policy, ...]:
        return tuple(s.policy for s in self.stages)

    def stage(self, rank: int) -> StagePlan:
        return self.stages[rank]

    def to_dict(self) -> dict[str, Any]:
        """The plan as the metrics report it (JSON-able)."""
        return {"stages": [{"stage": s.index, "layers": list(s.layers), "policy": s.policy.to_dict(),
                            "predicted_peak_bytes": s.peaks.as_dict(), "predicted_prefill_s": s.prefill_s,
                            "predicted_decode_step_s": s.decode_step_s} for s in self.stages],
                "num_micro_batches": self.num_micro_batches, "prefill_items": self.prefill_items,
                "schedule": self.schedule, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "sort_window": self.sort_window,
                "prediction": None if self.prediction is None else asdict(self.prediction),
                "choices": [asdict(c) for c in self.choices]}

    def explain(self) -> str:
        """The plan in words: each stage, then each choice with its reason."""
        lines = []
        for s in self.stages:
            p, pk = s.policy, s.peaks
            lines.append(f"stage {s.index}: layers [{s.layers[0]}, {s.layers[1]}) gbs={p.gpu_batch_size} "
                         f"num_gb={p.num_gpu_batches} {p.placement()} "
                         f"cpu_attention={p.cpu_attention} compress_weight={p.compress_weight} "
                         f"compress_cache={p.compress_cache}; predicted peaks: "
                         + ", ".join(f"{t} {_gib(getattr(pk, t))}" for t in TIERS)
                         + (f"; predicted times: prefill {s.prefill_s:.2f} s per block, decode "
                            f"{s.decode_step_s:.3f} s per step" if s.prefill_s is not None
                            and s.decode_step_s is not None else ""))
        lines += [f"{c.name} = {c.value}: {c.why}" for c in self.choices]
        if self.prediction is not None:
            pr = self.prediction
            lines.append(f"predicted: prefill {pr.prefill_throughput:.1f} tok/s, decode "
                         f"{pr.decode_throughput:.1f} tok/s, total {pr.total_throughput:.1f} tok/s "
                         f"(hardware: {', '.join(pr.hardware)})")
        return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
