"""The one peak-memory model of a stage: what the engine allocates, per phase and tier.

``stage_footprint`` describes a stage's memory once, from its shape and policy knobs:

- **placed** bytes, split over the tiers by the policy's fractions: the weights (whole
  tensors per part, by ``choose_tiers``), the KV cache of the blocks in flight (rows of
  ``split_rows``; packed codes plus group metadata when ``compress_cache``) and their
  activations (rows of ``split_rows``); the linear-attention layers' states, whole layers by
  the policy's own state fractions (not an LP variable: fixed per footprint), those off the
  compute device staged on it;
- **working sets**, linear in the fractions plus a constant: one GPU batch's activations, MLP
  intermediate and attention scores on the compute device, the next/previous GPU batch's
  hidden states and cache in transit, CPU attention's scratch, disk staging on a GPU host,
  the hidden states a pipeline stage sends and receives, the expanded compressed cache, the
  logits;
- **steps**: the read buffers of the weights that live off the compute device (two slots in
  flight), present as soon as any weight does (always when compressed: they are expanded).

It has two readings, which is what keeps the planner and the run's budget check in step:

- ``Footprint.peaks(x)``: exact bytes (2 phases x 3 tiers) at the nine fractions ``x`` with the
  engine's own rounding; ``predict_peaks`` (the larger phase) is what a run checks;
- ``Footprint.linear()``: the same terms as linear functions of the fractions (rounding left
  out), the steps as constants the LP switches on, and the largest rounding error of the
  weights, which the LP reserves. The planner rounds its answer to whole percents and repairs
  it against ``peaks``, so every plan it returns passes the run's check.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..memory.tiers import Tier
from ..models.deltanet import CHUNK
from ..models.families import part_shapes
from ..models.spec import ModelSpec
from .head import SCORE_CHUNK_BYTES
from .cache_layout import cache_bytes_per_position, split_rows
from .policy import Policy
from .states import STAGED_LAYERS, staged, state_tiers
from .weights import DENSE, TIED, TierPlacer, stored_nbytes

TIERS = tuple(t.value for t in Tier)  # gpu (the compute device), cpu (host RAM), disk
KINDS = ("w", "cache", "act")
Packed = Callable[[str, int | None], dict[str, tuple[Any, ...]]]


@dataclass(frozen=True, eq=False)
class Footprint:
    """One stage's allocations (see the module docstring). Column ``3 * kind + tier`` of the
    linear tables is the fraction of kind (w, cache, act) on tier (gpu, cpu, disk), column 9
    the constant.

    ``parts``: each slot's weights in the engine's order, as (stored bytes per tensor, dense
    bytes).
    ``cache``/``acts``: (rows, bytes per row, copies): a GPU batch's rows split by the policy,
    repeated over layers and blocks in flight. ``work``: working sets, (2, 3, 10).
    ``states``: bytes per tier of the linear layers' states, constant in the LP's fractions
    (``_state_bytes``).
    ``staging``: True on a GPU host, where disk weights pass through host read buffers."""

    parts: tuple[tuple[tuple[int, ...], int], ...]
    cache: tuple[int, int, int]
    acts: tuple[int, int, int]
    work: np.ndarray
    states: np.ndarray
    staging: bool
    compress_weight: bool

    def weights_at(self, g: float, c: float) -> tuple[np.ndarray, int, int]:
        """Weight bytes per tier at fractions (g, c, 1-g-c), as ``TierPlacer`` places them,
        with the dense size of the largest slot with a tensor off the compute device and the
        largest slot's bytes on disk (what the read buffers hold)."""
        return _weights_at(self.parts, self.compress_weight, round(g, 9), round(c, 9))

    def peaks(self, x: np.ndarray) -> np.ndarray:
        """(2 phases, 3 tiers) bytes at fractions ``x`` (length 9), rounded as the engine rounds."""
        out = self.work @ np.append(np.asarray(x, dtype=float), 1.0)
        w, off, disk = self.weights_at(float(x[0]), float(x[1]))
        placed = w.copy()
        for k, (rows, per_row, copies) in ((1, self.cache), (2, self.acts)):
            for tier, r0, r1 in split_rows(rows, _triple(x, k)):
                placed[TIERS.index(tier.value)] += (r1 - r0) * per_row * copies
        out += placed + self.states
        out[:, 0] += 2 * off
        out[:, 1] += 2 * disk * self.staging
        return out

    def linear(self) -> tuple[np.ndarray, float, float, float]:
        """``(base, gpu_step, cpu_step, rounding)``: ``base`` (2, 3, 10) linear bytes;
        ``gpu_step`` to add to the compute tier when weights leave it (or are compressed),
        ``cpu_step`` to the host when weights are on disk (a GPU host's staging); ``rounding``
        the most whole tensors can put on a tier beyond its fraction of the weights."""
        return self._linear

    @functools.cached_property
    def _linear(self) -> tuple[np.ndarray, float, float, float]:
        base = self.work.copy()
        total = sum(sum(sizes) for sizes, _ in self.parts)
        for t in range(3):
            base[:, t, t] += total
            base[:, t, 3 + t] += self.cache[0] * self.cache[1] * self.cache[2]
            base[:, t, 6 + t] += self.acts[0] * self.acts[1] * self.acts[2]
        base[:, :, 9] += self.states
        dense = max((d for _, d in self.parts), default=0)
        stored = max((sum(s) for s, _ in self.parts), default=0)
        largest = max((max(s) for s, _ in self.parts if s), default=0)
        return base, 2.0 * dense, 2.0 * stored * self.staging, float(largest)


# (id of a stage's parts, compressed, g, c) -> (the parts, their placement): the weights' placement
# depends on the fractions alone, not on the batch shape, so every candidate block of a search
# shares it (a mixture of experts' stage is tens of thousands of tensors: placing them took
# most of a plan's time when each candidate placed its own)
_PLACED: dict[tuple[int, bool, float, float], tuple[tuple, tuple[np.ndarray, int, int]]] = {}
_PLACED_MAX = 4096


def _weights_at(parts: tuple, compress_weight: bool, g: float, c: float) -> tuple[np.ndarray, int, int]:
    key = (id(parts), compress_weight, g, c)
    got = _PLACED.get(key)
    if got is not None and got[0] is parts:
        return got[1]
    placed, off, disk = np.zeros(3), 0, 0
    placer = TierPlacer((g, c, max(0.0, 1.0 - g - c)))
    for sizes, dense in parts:
        tiers = placer.place(list(sizes))
        for size, tier in zip(sizes, tiers):
            placed[TIERS.index(tier.value)] += size
        if compress_weight or any(t != Tier.GPU for t in tiers):
            off = max(off, dense)
        disk = max(disk, sum(sz for sz, t in zip(sizes, tiers) if t == Tier.DISK))
    if len(_PLACED) >= _PLACED_MAX:
        _PLACED.clear()
    _PLACED[key] = (parts, (placed, off, disk))  # the parts kept alive: their id stays theirs
    return placed, off, disk


def _triple(x: np.ndarray, kind: int) -> tuple[float, float, float]:
    g, c = float(x[3 * kind]), float(x[3 * kind + 1])
    return g, c, max(0.0, 1.0 - g - c)


@dataclass(frozen=True)
class HeadLoad:
    """What a call asks of the last stage's head besides its weights (``plan.Workload.head_load``):
    generation holds every GPU batch's logits and, one batch at a time, their float32 copy and
    what choosing a token holds per (row, vocab entry) (``choice_bytes``); scoring holds the
    head's chunk of float32 logits and its temporaries, and with per-token log-probabilities
    (``score_width`` = 2 + 2K values per position, ``head.score_width``) their rows."""

    choice_bytes: int = 0
    scoring: bool = False
    score_width: int = 0
    sorts: bool = False  # some row samples with top-p: its probabilities are sorted
    embed: bool = False  # embeddings: no logits, each batch's (rows, embed_dim) float64 and the block's


# A sort of (rows, vocab) float32 probabilities with int64 order on a GPU also holds its radix
# sort's alternate keys and values and a copy of its input: 16 bytes per entry (on a CPU the
# sort works in place of those; ``SAMPLE_BYTES`` counts what both hold).
CUDA_SORT_BYTES = 16


@dataclass(frozen=True)
class StageShape:
    """What a stage's footprint depends on besides the model: its layers and ends, the
    workload's lengths and element size, and the policy's batch and compression knobs."""

    num_layers: int
    has_embed: bool
    has_head: bool
    prompt_len: int
    gen_len: int
    dtype_bytes: int
    gpu_batch_size: int
    num_gpu_batches: int
    blocks_in_flight: int = 1
    cpu_attention: bool = True
    compress_weight: bool = False
    compress_cache: bool = False
    comp_bits: int = 4
    comp_group_size: int = 64
    num_stages: int = 1
    cuda: bool = False
    first_layer: int = 0
    head: HeadLoad = field(default_factory=lambda: HeadLoad())  # what the last stage's head holds
    state_fractions: tuple[float, float, float] = (1.0, 0.0, 0.0)  # the linear layers' states (policy's)
    shared: int = 0  # the longest prefix a block's prompts share (computed once: its row's keys are held)
    # a shared prefix held once through decode (``held.py``): its keys stay on the compute device,
    # and each row's cache leaves out ``held`` positions (the fewest any block's rows leave out,
    # a GPU batch's repeated prompts kept once, ``prompt_groups.py``, counted so too)
    hold: bool = False
    held: int = 0


def stage_footprint(spec: ModelSpec, z: StageShape, packed: Packed | None = None) -> Footprint:
    """The footprint of one stage; ``packed`` (a source's ``packed_formats``) gives the
    (bits, group size) of weights kept in their checkpoint's own blocks when compressed."""
    return Footprint(parts=_weight_parts(spec, z, packed), cache=_cache_rows(spec, z),
                     acts=(z.gpu_batch_size, z.prompt_len * spec.hidden_size * z.dtype_bytes,
                           z.num_gpu_batches * z.blocks_in_flight),
                     work=_working_sets(spec, z), states=_state_bytes(spec, z), staging=z.cuda, compress_weight=z.compress_weight)


def _weight_parts(spec: ModelSpec, z: StageShape, packed: Packed | None) -> tuple:
    fmt = (z.comp_bits, z.comp_group_size) if z.compress_weight else None
    args = (spec, z.first_layer, z.num_layers, z.has_embed, z.has_head, z.dtype_bytes, fmt)
    if packed is not None and z.compress_weight:  # a source's formats: not cached (it would keep the source alive)
        return _slots(*args, packed)
    return _cached_slots(*args)


@functools.lru_cache(maxsize=512)
def _cached_slots(spec: ModelSpec, first: int, num_layers: int, has_embed: bool, has_head: bool,
                  dtype_bytes: int, default: tuple[int, int] | None) -> tuple:
    """``_slots`` of a stage without checkpoint formats: the planner asks for the same stage's
    slots for every batch shape it weighs."""
    return _slots(spec, first, num_layers, has_embed, has_head, dtype_bytes, default, None)


def _slots(spec: ModelSpec, first: int, num_layers: int, has_embed: bool, has_head: bool,
           dtype_bytes: int, default: tuple[int, int] | None, packed: Packed | None) -> tuple:
    """(stored bytes per tensor, dense bytes) of each slot, in the engine's order."""
    names = ([("embed", None)] if has_embed else []) + \
        [("layer", j) for j in range(first, first + num_layers)] + ([("head", None)] if has_head else [])
    parts = []
    for part, j in names:
        shapes = part_shapes(spec, part, j)
        if part == "head" and has_embed:
            shapes = {k: v for k, v in shapes.items() if k != TIED}  # stored once, with the embedding
        fmt = packed(part, j) if packed is not None else {}
        sizes = tuple(stored_nbytes(sh, dtype_bytes, None if k in DENSE else fmt.get(k, default))
                      for k, sh in shapes.items())
        dense = sum(_numel(sh) for sh in shapes.values()) * dtype_bytes
        parts.append((sizes, dense))
    return tuple(parts)


def cache_positions(spec: ModelSpec, first_layer: int, num_layers: int, total: int) -> list[int]:
    """Positions each of the layers keeps in its cache for a sequence of ``total``: all of
    them, or a sliding layer's window (a ring); a linear-attention layer none (its state is
    ``recurrent_bytes``'s)."""
    return [0 if spec.linear(j) else min(total, spec.window(j) or total)
            for j in range(first_layer, first_layer + num_layers)]


def recurrent_bytes(spec: ModelSpec, z: StageShape) -> int:
    """The linear-attention layers' states of every sequence in flight, wherever they live:
    per layer and sequence the convolution's (the dtype) and the delta rule's (float32)."""
    layers, per_layer = _state_layers(spec, z)
    return len(layers) * per_layer


def _state_layers(spec: ModelSpec, z: StageShape) -> tuple[list[int], int]:
    """(the stage's linear layers, bytes of one layer's states for the blocks in flight)."""
    layers = [j for j in range(z.first_layer, z.first_layer + z.num_layers) if spec.linear(j)]
    return layers, z.gpu_batch_size * z.num_gpu_batches * z.blocks_in_flight * spec.recurrent_bytes(z.dtype_bytes)


def _state_bytes(spec: ModelSpec, z: StageShape) -> np.ndarray:
    """(2 phases, 3 tiers) bytes of the linear layers' states: whole layers where the state
    fractions place them (``states.state_tiers``), the staged layers' buffers on the compute
    device (at most ``STAGED_LAYERS`` a block) and, on a GPU host, a disk transfer's host
    buffers (a read and a write)."""
    layers, per_layer = _state_layers(spec, z)
    out = np.zeros((2, 3))
    tiers = state_tiers(layers, z.state_fractions)
    for tier in tiers.values():
        out[:, TIERS.index(tier.value)] += per_layer
    moved = sum(staged(t, z.cuda) for t in tiers.values())
    out[:, 0] += min(moved, STAGED_LAYERS) * per_layer
    if z.cuda and Tier.DISK in tiers.values():
        out[:, 1] += 2 * per_layer
    return out


def _prefill_scores_bytes(spec: ModelSpec, z: StageShape) -> int:
    """What one GPU batch's prompt attention holds beyond q, k, v and its output
    (``attention.prefill_attention``): its (b, 1, s, s) bool mask, and the scores where they
    are materialised. On a CPU device SDPA's fused kernel materialises none (its largest
    allocation is the output, measured with torch's profiler, grouped-query heads and an
    explicit mask included); softcapped scores (Gemma 2) and sinks (gpt-oss) are computed one
    sequence at a time: its float32 scores, with the sinks' column, their softmax and
    temporaries (four such tensors, measured at most ~3.4). On a GPU every
    head's float32 scores are counted: with an explicit mask and grouped-query heads SDPA may
    fall back to its math kernel, which materialises them."""
    b, s, nh = z.gpu_batch_size, z.prompt_len, spec.num_heads
    mask = b * s * s
    if z.cuda:
        return mask + b * nh * s * s * 4
    if spec.attn_softcap > 0 or spec.attn_sinks:
        return mask + 4 * nh * s * s * 4
    return mask


def _linear_prefill_bytes(spec: ModelSpec, z: StageShape) -> int:
    """One GPU batch's temporaries of a linear layer's prefill (``deltanet.chunked_rule``): the
    chunk-square decay, system and attention matrices and the float32 q, k, v and outputs."""
    if not any(spec.linear(j) for j in range(z.first_layer, z.first_layer + z.num_layers)):
        return 0
    s = z.prompt_len + (-z.prompt_len) % CHUNK
    hv, dk, dv = spec.lin_v_heads, spec.lin_k_dim, spec.lin_v_dim
    return z.gpu_batch_size * s * 4 * (3 * hv * CHUNK + hv * (4 * dk + 4 * dv) + 2 * spec.lin_conv_dim)


def _cache_rows(spec: ModelSpec, z: StageShape) -> tuple[int, int, int]:
    """(rows, bytes per row over every layer of the stage, copies): a row of a layer holds K and
    V (or the latent alone: ``spec.cache_tensors``) of what ``cache_positions`` says."""
    per_pos = cache_bytes_per_position(spec.head_dim, z.dtype_bytes, z.compress_cache, z.comp_bits,
                                       z.comp_group_size)
    per_layer = cache_positions(spec, z.first_layer, z.num_layers, z.prompt_len + z.gen_len)
    held = sum(max(0, n - z.held) if n else 0 for n in per_layer) if z.hold else sum(per_layer)
    return (z.gpu_batch_size * spec.num_kv_heads, spec.cache_tensors * held * per_pos,
            z.num_gpu_batches * z.blocks_in_flight)


def _working_sets(spec: ModelSpec, z: StageShape) -> np.ndarray:
    """(2 phases, 3 tiers, 10) working sets: one GPU batch at a time on the compute device."""
    W = np.zeros((2, 3, 10))
    b, s, n, e = z.gpu_batch_size, z.prompt_len, z.gen_len, z.dtype_bytes
    h, q, kv, nh = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.num_heads
    mlp = spec.ffn_size * (1 if spec.family == "opt" or not spec.mlp_gated else 2)  # gate and up (SwiGLU, GeGLU)
    if spec.num_experts:  # an expert's (or the shared one's) gate and up, the gathered rows, the sums,
        # the router's float32 probabilities
        mlp = max(mlp, 2 * max(spec.expert_ffn_size, spec.shared_expert_ffn_size) + 3 * h + 2 * spec.num_experts)
    seq_cache = spec.cache_tensors * kv * e  # one position's K and V (or latent) of one sequence, expanded
    host = 1 if z.cuda else 0  # where host-side scratch lives: the host, or the compute tier
    # the most positions one layer's attention reads (a sliding layer: its window)
    held = max(cache_positions(spec, z.first_layer, z.num_layers, s + n), default=s + n)
    for ph, toks, ctx in ((0, s, s), (1, 1, held)):
        # attention's scores, or (prefill) a linear layer's temporaries: never both at once
        scores = _prefill_scores_bytes(spec, z) if ph == 0 else b * nh * toks * ctx * 4
        mixer = max(scores, _linear_prefill_bytes(spec, z) if ph == 0 else 0)
        # beside the layer's input (the block's activations): attention's normalised input, q,
        # k, v and its output; then the residual stream, the MLP's normalised input, its
        # intermediate and its output (the layer forwards drop q, k, v before the MLP)
        W[ph, 0, 9] += b * toks * e * max(h + 2 * q + 2 * kv, 3 * h + mlp) + mixer
        W[ph, 0, [7, 8]] += 2 * b * toks * h * e  # the next GPU batch's hidden states in, the last out
        if z.compress_cache:  # one GPU batch's K and V of a layer, expanded for its attention
            W[ph, 0, 9] += b * held * seq_cache
        if z.has_head:
            W[ph, 0, 9] += _head_bytes(spec, z, ph)
        if z.num_stages > 1:  # a send and a receive buffer of one block's hidden states
            W[ph, 0, 9] += 2 * z.gpu_batch_size * z.num_gpu_batches * toks * h * e
        if z.cuda:  # disk traffic of hidden states and cache passes through host buffers
            W[ph, 1, 8] += 2 * b * toks * h * e
            W[ph, 1, 5] += 2 * b * ctx * seq_cache
    W[0, 0, [4, 5]] += 2 * b * s * seq_cache  # the prompt's cache of one GPU batch, going out
    if z.shared:  # a shared prefix's keys and values, each layer's until the block's last batch has
        # used them (every layer of the stage, with a prefill item per GPU batch), and its row's states
        W[0, 0, 9] += z.shared * (seq_cache * z.num_layers + 2 * h * e)
        if z.hold:  # every layer's held copy (kv heads first, float32) through decode; at the prefill,
            # one layer's beside the prefix's own keys (each layer's leave when its copy is made)
            copy = z.shared * spec.cache_tensors * kv * 4
            W[0, 0, 9] += copy
            W[1, 0, 9] += copy * z.num_layers
    if z.cpu_attention:  # q goes to the cache and the output comes back; scores on the host
        W[1, 0, [4, 5]] += 2 * b * (q + 2 * kv) * e
        W[1, host, 9] += b * nh * held * 4 + 2 * b * q * 4
        if not z.cuda:  # the disk share of the cache is read into host buffers
            W[1, 0, 5] += 2 * b * held * seq_cache
    else:  # the off-device cache of one GPU batch comes to the compute device
        W[1, 0, [4, 5]] += 2 * b * held * seq_cache
    return W


def _head_bytes(spec: ModelSpec, z: StageShape, ph: int) -> float:
    """The last stage's head beyond its weights in phase ``ph`` (0 prefill, 1 decode).

    Generation: every GPU batch's logits until the block's choice (the head runs over all
    their rows at once: prefill's head, merged decode), then one batch at a time their float32
    copy and what choosing holds. Scoring (``head.score``): a chunk of at most
    ``SCORE_CHUNK_BYTES`` of float32 logits with the head's own output being cast or a
    temporary of the same size (the log-sum-exp's), then the per-token
    rows of the step (float64) and each block's accumulated rows."""
    V, b, e, ngb, h = spec.vocab_size, z.gpu_batch_size, z.dtype_bytes, z.num_gpu_batches, z.head
    if h.embed:  # ``head.embed``: a batch's last rows normed, then the blocks' accumulated float64 rows
        return b * spec.pooled_dim * (e + 8) + b * spec.embed_dim * e + z.blocks_in_flight * ngb * b * spec.pooled_dim * 8
    if not h.scoring:
        sort = CUDA_SORT_BYTES if h.sorts and z.cuda else 0
        return V * (ngb * b * e + b * ((4 if e < 4 else 0) + h.choice_bytes + sort))
    rows = b * z.prompt_len if ph == 0 else ngb * b  # a prefill's head per GPU batch, decode's merged
    chunk = min(SCORE_CHUNK_BYTES, rows * V * 4)
    w = h.score_width
    held = z.blocks_in_flight * ngb * b * (3 + (z.prompt_len + z.gen_len) * w) * 8
    # the float32 chunk beside the head's output being cast, or beside the log-sum-exp's
    # temporary: two chunks at most
    return chunk * 2 + rows * w * 8 + held


def predict_peaks(spec: ModelSpec, policy: Policy, layers: tuple[int, int], *, has_embed: bool,
                  has_head: bool, prompt_len: int, gen_len: int, dtype_bytes: int,
                  num_blocks_in_flight: int = 1, packed: Packed | None = None, num_stages: int = 1,
                  cuda: bool = False, head: HeadLoad | None = None, shared: int = 0,
                  held: int | None = None) -> dict[str, int]:
    """Peak bytes per tier of a stage under ``policy`` (the larger of prefill and decode),
    which a run checks against its budgets before anything is allocated. ``held``: a shared
    prefix is held once through decode, and every row's cache leaves out at least that many
    positions (None: prefixes are not held)."""
    z = StageShape(num_layers=layers[1] - layers[0], has_embed=has_embed, has_head=has_head,
                   prompt_len=prompt_len, gen_len=gen_len, dtype_bytes=dtype_bytes,
                   gpu_batch_size=policy.gpu_batch_size, num_gpu_batches=policy.num_gpu_batches,
                   blocks_in_flight=num_blocks_in_flight, cpu_attention=policy.cpu_attention,
                   compress_weight=policy.compress_weight, compress_cache=policy.compress_cache,
                   comp_bits=policy.comp_bits, comp_group_size=policy.comp_group_size,
                   num_stages=num_stages, cuda=cuda, first_layer=layers[0], head=head or HeadLoad(),
                   state_fractions=policy.fractions("state"), shared=shared, hold=held is not None,
                   held=held or 0)
    x = np.array([f for kind in KINDS for f in policy.fractions(kind)])
    pk = stage_footprint(spec, z, packed).peaks(x).max(axis=0)
    return {t: int(np.ceil(pk[i] - 1e-6)) for i, t in enumerate(TIERS)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def needs_disk(policies: list[Policy], states: bool = True) -> bool:
    """Whether any of ``policies`` puts weights, cache, activations or (``states``: the stages
    have linear-attention layers) their states on the disk tier."""
    kinds = ("w", "cache", "act", "state") if states else ("w", "cache", "act")
    return any(p.fractions(kind)[2] > 1e-9 for p in policies for kind in kinds)
