"""Layers -> stages: stage s owns the half-open layer range [a_s, b_s)."""

from __future__ import annotations

from collections.abc import Sequence


def partition_layers(
    num_layers: int, num_stages: int, stage_layers: Sequence[int] | None = None,
    layer_weights: Sequence[float] | None = None,
) -> list[tuple[int, int]]:
    """Split `num_layers` consecutive layers into `num_stages` contiguous ranges.

    Without `stage_layers` the split is equal up to one layer, earlier stages taking the
    extra ones (stage 0 also carries the embedding, but the last stage carries the LM head and
    sampling, which usually weigh more; callers with a cost model pass `stage_layers`).
    With `stage_layers`, stage s gets exactly stage_layers[s] layers. With `layer_weights`
    that differ (a mixture of experts whose dense and sparse layers weigh differently), the
    split instead makes the heaviest stage's sum of weights as light as it can be.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} stages for {num_layers} layers leaves a stage without layers; "
            f"use at most {num_layers} processes"
        )
    if stage_layers is None and layer_weights is not None and len(set(layer_weights)) > 1:
        if len(layer_weights) != num_layers:
            raise ValueError(f"layer_weights has {len(layer_weights)} entries for {num_layers} layers")
        counts = _balanced(list(layer_weights), num_stages)
    elif stage_layers is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        counts = [int(c) for c in stage_layers]
        if len(counts) != num_stages:
            raise ValueError(
                f"stage_layers has {len(counts)} entries {counts} but there are {num_stages} "
                "stages; give one layer count per rank"
            )
        if any(c < 1 for c in counts):
            raise ValueError(f"every stage needs at least 1 layer, got stage_layers={counts}")
        if sum(counts) != num_layers:
            raise ValueError(
                f"stage_layers={counts} sums to {sum(counts)} but the model has {num_layers} "
                "layers; make the counts add up to the layer count"
            )
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def _balanced(w: list[float], m: int) -> list[int]:
    """Layer counts of m contiguous stages minimising the heaviest stage's sum of ``w`` (the
    linear partition problem, by dynamic programming; ties go to the earlier cut)."""
    n = len(w)
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(m + 1)]  # best[s][i]: first i layers over s stages
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for s in range(1, m + 1):
        for i in range(s, n - (m - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], pre[i] - pre[j])
                if v < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = v, j
    counts, i = [], n
    for s in range(m, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]
