"""Predicted peak bytes per tier of a stage under a policy (``budgets.check_budgets`` checks them
against the run's budgets before anything is allocated).

The prediction mirrors what the engine allocates: weights by ``choose_tiers``, the KV cache of
one block by ``split_rows`` (packed codes plus group metadata per position when
``compress_cache``), activations of one block, plus the compute device's working set (two
slots of weights in flight when they live off the device, one GPU batch's activations and
attention scores).
"""
from __future__ import annotations

from typing import Callable

from ..memory.tiers import Tier
from ..models.families import get_family
from ..models.spec import ModelSpec
from .kvcache import cache_bytes_per_position, split_rows
from .policy import Policy
from .weights import TIED, choose_tiers, stored_nbytes


def predict_peaks(spec: ModelSpec, policy: Policy, layers: tuple[int, int], *, has_embed: bool,
                  has_head: bool, prompt_len: int, gen_len: int, dtype_bytes: int,
                  num_blocks_in_flight: int = 1,
                  packed: Callable[[str, int | None], dict[str, tuple[int, int]]] | None = None) -> dict[str, int]:
    """``packed`` (a source's ``packed_formats``) gives the (bits, group size) of the weights
    kept in their checkpoint's own blocks under ``compress_weight``."""
    fam = get_family(spec.family)
    peak = {t.value: 0 for t in Tier}
    parts = ([("embed", None)] if has_embed else []) + [("layer", j) for j in range(*layers)] + \
        ([("head", None)] if has_head else [])
    max_off = 0
    for part, j in parts:
        shapes = getattr(fam, f"{part}_shapes")(spec)
        if part == "head" and has_embed:
            shapes = {k: v for k, v in shapes.items() if k != TIED}  # stored once, with the embedding
        fmt = packed(part, j) if packed is not None and policy.compress_weight else {}
        default = (policy.comp_bits, policy.comp_group_size) if policy.compress_weight else None
        sizes = [stored_nbytes(sh, dtype_bytes, fmt.get(k, default)) for k, sh in shapes.items()]
        tiers = choose_tiers(sizes, policy.fractions("w"))
        off = 0
        for size, tier in zip(sizes, tiers):
            peak[tier.value] += size
            off += size if tier != Tier.GPU else 0
        max_off = max(max_off, sum(_numel(s) for s in shapes.values()) * dtype_bytes if off else 0)
    total = prompt_len + gen_len
    nl = layers[1] - layers[0]
    b = policy.gpu_batch_size
    cache = {t.value: 0 for t in Tier}
    per_pos = cache_bytes_per_position(spec.head_dim, dtype_bytes, policy.compress_cache,
                                       policy.comp_bits, policy.comp_group_size)
    for tier, r0, r1 in split_rows(b * spec.num_kv_heads, policy.fractions("cache")):
        cache[tier.value] += 2 * (r1 - r0) * total * per_pos
    acts = {t.value: 0 for t in Tier}
    for tier, r0, r1 in split_rows(b, policy.fractions("act")):
        acts[tier.value] += (r1 - r0) * prompt_len * spec.hidden_size * dtype_bytes
    blocks = policy.num_gpu_batches * num_blocks_in_flight
    for t in peak:
        peak[t] += cache[t] * nl * blocks + acts[t] * blocks
    # compute-device working set: weights of two slots in flight, one batch's activations,
    # its MLP intermediate and its prefill attention scores, its expanded cache chunk
    work = 2 * max_off
    work += b * prompt_len * (2 * spec.hidden_size + spec.ffn_size) * dtype_bytes
    work += b * spec.num_heads * prompt_len * prompt_len * 4
    if policy.compress_cache:  # one GPU batch's K and V of a layer, expanded for its attention
        work += 2 * b * spec.num_kv_heads * total * spec.head_dim * dtype_bytes
    if has_head:
        work += b * spec.vocab_size * 4
    peak[Tier.GPU.value] += work
    return peak


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def needs_disk(policies: list[Policy]) -> bool:
    """Whether any of ``policies`` puts weights, cache or activations on the disk tier."""
    return any(p.fractions(kind)[2] > 1e-9 for p in policies for kind in ("w", "cache", "act"))
