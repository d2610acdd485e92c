"""The engine's own host time, which the cost model's ``host`` channel counts.

Every layer the engine computes is a few dozen operators that the host issues (Python,
torch's dispatch, a GPU's kernel launches). ``measure_host_overhead`` times the engine itself
on a model too small to compute anything, so what it measures is that issuing.
"""
from __future__ import annotations

import torch

# Two layer counts and two GPU-batch counts separate the share that runs once per layer in a
# (merged) decode step from the share that repeats per GPU batch.
_HOST_LAYERS = (2, 12)
_HOST_GBS = (1, 6)


def _per_layer(device: str, quick: bool, **policy: bool) -> dict[int, float]:
    """Seconds per layer per decode step of the tiny model at each of ``_HOST_GBS`` GPU
    batches (the two layer counts take the step's fixed part out), under ``policy``'s knobs."""
    # the engine is imported here: the planner's modules are imported by it
    from flexgen_dist.distributed.local import generate
    from flexgen_dist.engine.policy import Policy
    from flexgen_dist.engine.sampling import SamplingConfig
    from flexgen_dist.engine.stage import StageEngine
    from flexgen_dist.models.dummy import DummySource
    from flexgen_dist.models.spec import ModelSpec

    dtype = torch.float16 if device == "cuda" else torch.float32
    steps = 8 if quick else 32
    per: dict[tuple[int, int], float] = {}
    for layers in _HOST_LAYERS:
        spec = ModelSpec(name=f"host-probe-{layers}", family="opt", num_layers=layers, hidden_size=64,
                         ffn_size=128, num_heads=4, vocab_size=256, max_positions=128)
        for ngb in _HOST_GBS:
            eng = StageEngine(spec, DummySource(spec, dtype), (0, layers), has_embed=True, has_head=True,
                              policy=Policy(1, ngb, **policy), device=torch.device(device), dtype=dtype)
            try:
                prompts = [[5 + i] * 8 for i in range(ngb)]
                generate(eng, prompts, 3, SamplingConfig(ignore_eos=True))  # warm-up
                times = []
                for _ in range(3 if quick else 7):
                    _, t = generate(eng, prompts, steps + 1, SamplingConfig(ignore_eos=True))
                    times.append(t.decode_s / steps)
                per[(layers, ngb)] = min(times)  # the host's own time: interruptions only add
            finally:
                eng.close()
    lo, hi = _HOST_LAYERS
    return {g: max(0.0, (per[(hi, g)] - per[(lo, g)]) / (hi - lo)) for g in _HOST_GBS}


def _split(layer: dict[int, float]) -> tuple[float, float]:
    """(per layer, per layer and GPU batch) of ``layer_s + num_gb * batch_s``."""
    g1, g2 = _HOST_GBS
    batch_s = max(0.0, (layer[g2] - layer[g1]) / (g2 - g1))
    return max(0.0, layer[g1] - g1 * batch_s), batch_s


def measure_host_overhead(device: str, quick: bool = False) -> tuple[float, float]:
    """(seconds per layer per decode step, seconds per layer per step per GPU batch) of host
    time: the engine's decode of a tiny OPT-shaped model (dummy weights, every tier on the
    device, the merged decode that applies there), fitted as ``layer_s + num_gb * batch_s``
    per layer and step, with the step's fixed part (embedding, head, sampling) taken out by
    the two layer counts."""
    return _split(_per_layer(device, quick))


def measure_cache_batch_overhead(device: str, quick: bool = False, batch_s: float = 0.0) -> float:
    """Seconds per layer per step per GPU batch that a compressed cache adds to the host's
    time (beyond ``batch_s``, the uncompressed share): there each GPU batch's cache is
    quantized, expanded and attended on its own, where an uncompressed one is attended once
    for all of them. The same probe with ``compress_cache``."""
    return max(0.0, _split(_per_layer(device, quick, compress_cache=True))[1] - batch_s)
