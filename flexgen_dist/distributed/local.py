"""The generation loop on one engine that owns the whole model: no ranks, no files. For
engines built by hand (the planner's host measurements, the benchmarks); users call
``flexgen_dist.LLM``, which runs the same ``Pipeline``."""
from __future__ import annotations

from ..engine.blocks import plan_blocks
from ..engine.sampling import SamplingConfig
from ..engine.stage import StageEngine
from ..metrics import Timings
from .pipeline import Pipeline, Progress


def generate(engine: StageEngine, prompts: list[list[int]], gen_len: int, sampling: SamplingConfig,
             progress: Progress | None = None, keys: list[int] | None = None, *,
             schedule: str = "sequential", num_groups: int = 1) -> tuple[list[list[int]], Timings]:
    """The loop on one engine that owns the whole model (no ranks, no files): token lists in
    input order and the timings. For engines built by hand (tests, benchmarks); users call
    ``flexgen_dist.LLM``. ``schedule="overlapped"``: next blocks' prefill rides on decode."""
    if schedule not in ("sequential", "overlapped"):
        raise ValueError(f"schedule={schedule!r}: 'sequential' or 'overlapped'")
    blocks = plan_blocks([len(p) for p in prompts], engine.policy.block_size)
    pipe = Pipeline(engine, blocks, gen_len=gen_len, sampling=sampling, keys=keys, num_groups=num_groups,
                    ride=schedule == "overlapped", seen=prompts if sampling.repeats else None)
    outs: list[list[int]] = []
    for _, block_outs in pipe.run(prompts, progress):
        outs.extend(block_outs)
    return outs, pipe.timings
