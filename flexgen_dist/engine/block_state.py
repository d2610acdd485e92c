"""One block's state on one stage, and what each (token, GPU batch) step computes with.

``BlockState`` holds a block's cache, activations and valid key positions; ``step_inputs``
derives the positions, attention mask rows and cache offset of token i in GPU batch k (shared
by every layer with the same window), and ``merged_positions`` / ``merged_mask`` the same for
the rows of every GPU batch at once (merged decode). Each is built once per token and kept in
the state.
"""
from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..memory.disk import DiskStore
from ..memory.tiers import MemoryTracker
from ..models.common import Positions
from ..models.families import Recurrent
from ..models.spec import ModelSpec
from .activations import ActStore
from .attention import mask_to_rows
from .blocks import BlockMeta
from .kvcache import BlockCache
from .policy import Policy
from .prompt_groups import cache_layout
from .states import StateStore


@dataclass
class BlockState:
    meta: BlockMeta
    cache: BlockCache | None
    acts: ActStore
    valid: list[torch.Tensor]  # per GPU batch: (b, s + n) bool, key positions that are real
    outputs: list[Any] = field(default_factory=list)
    # per (GPU batch, window, chunked): (token, positions, mask, cache offset) of the last token asked
    step_inputs: dict[tuple[int, int, bool], tuple[int, Any, torch.Tensor | None, int]] = field(default_factory=dict)
    merged_pos: tuple[int, Positions] | None = None  # (token, positions of every batch's rows)
    # (window, chunked) -> (token, mask rows of every batch, cache offset)
    merged_masks: dict[tuple[int, bool], tuple[int, torch.Tensor, int]] = field(default_factory=dict)
    merged_out: tuple[list[torch.Tensor], torch.Tensor] | None = None  # the last merged slot's (batch views, output)
    out_base: int = 0  # the first GPU batch of the current run (outputs[k - out_base])
    # Prefill on a last stage: each GPU batch's last-position hidden rows wait here for the
    # block's last GPU batch, then one head GEMM serves them all (``head.prefill_head``);
    # logits of batches outside the sweep that ran it wait in ``logits`` for ``prefill_logits``.
    head_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # the linear-attention layers' states of every row of the block, GPU batches in order
    # (``recurrent``)
    states: StateStore | None = None
    # (token, first batch, last batch) -> (first row, end row, prefill padding): the same for
    # every linear layer of the token, so built once per token (``recurrent``)
    rec_rows: dict[tuple[int, int, int], tuple[int, int, torch.Tensor | None]] = field(default_factory=dict)
    # A shared prefix (``meta.shared`` = L): its one row's input to the next slot (ids on a
    # first stage, then hidden states; after the stage's last layer, what the next stage gets),
    # and each layer's (k, v) of it until the block's last GPU batch has used them
    # (``prefix.prefix_pass``, run at each slot before the block's first GPU batch)
    prefix: torch.Tensor | None = None
    prefix_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # per GPU batch (or "merged", "prefix"): which rows use which LoRA adapter (``StageEngine._lora``)
    lora_rows: dict[Any, Any] = field(default_factory=dict)
    prefix_index: dict[int, torch.Tensor] = field(default_factory=dict)  # per GPU batch: ``prefix.with_prefix``'s
    twins: dict[int, Any] = field(default_factory=dict)  # per GPU batch with repeats: its ``twins.Twins``
    # beam search: per (linear layer, GPU batch), the rows its states take from (each row's
    # parent), applied at the layer's next use (``recurrent``), wherever the states live
    state_perm: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


def block_cache(spec: ModelSpec, policy: Policy, meta: BlockMeta, layers: list[int], device: torch.device,
                dtype: torch.dtype, tracker: MemoryTracker, disk: DiskStore | None, tag: str = "") -> BlockCache:
    """A block's KV cache on a stage's ``layers`` (a linear-attention layer keeps a state per
    sequence instead), placed by the policy, leaving out of each row what ``cache_layout``
    says (a shared prefix held once, or each GPU batch's prompts kept once)."""
    held, groups = cache_layout(spec, policy, meta, device)
    return BlockCache([j for j in layers if not spec.linear(j)], meta.batch_sizes, spec.num_kv_heads,
                      meta.prompt_len + meta.gen_len, spec.head_dim, policy.fractions("cache"), device, dtype,
                      tracker, disk, policy.cpu_attention, tag, compress=policy.compress_cache, bits=policy.comp_bits,
                      group_size=policy.comp_group_size, windows={j: spec.window(j) for j in layers},
                      shared=spec.cache_tensors == 1, held=held, groups=groups)


def block_states(spec: ModelSpec, policy: Policy, layers: list[int], rows: int, device: torch.device,
                 dtype: torch.dtype, tracker: MemoryTracker, disk: DiskStore | None, pool: Executor,
                 tag: str = "") -> StateStore:
    """Each linear-attention layer's states for ``rows`` sequences: the convolution's last
    inputs (the model's dtype) and the delta rule's (float32), placed by whole layers by the
    policy's state fractions (``states.py``), written before they are read (a prefill starts from
    zeros without reading them)."""
    return StateStore([j for j in layers if spec.linear(j)], rows,
                      (spec.lin_conv_dim, spec.lin_conv_kernel - 1), (spec.lin_v_heads, spec.lin_k_dim, spec.lin_v_dim),
                      policy.fractions("state"), device, dtype, tracker, disk, pool, tag)


def valid_keys(meta: BlockMeta, device: torch.device) -> list[torch.Tensor]:
    """Per GPU batch, (b, s + n) bool: the key positions that are real (a left-padded prompt's
    padding is not)."""
    total = meta.prompt_len + meta.gen_len
    out = []
    for lens in meta.prompt_lens:
        v = torch.ones((len(lens), total), dtype=torch.bool, device=device)
        for r, n in enumerate(lens):
            v[r, : meta.prompt_len - n] = False
        out.append(v)
    return out


def recurrent(st: BlockState, layer: int, i: int, ks: range) -> Recurrent:
    """The state a linear-attention layer computes with for token i of GPU batches ``ks`` (one,
    or every batch of a merged decode): views of the block's buffers over those rows, and the
    prefill's padding (None where those rows are unpadded)."""
    key = (i, ks[0], ks[-1])
    if key not in st.rec_rows:
        if any(k[0] != i for k in st.rec_rows):  # a new token: the last one's are done with
            st.rec_rows.clear()
        sizes = st.meta.batch_sizes
        a = sum(sizes[:ks[0]])
        valid = None
        if i == 0 and any(n != st.meta.prompt_len for k in ks for n in st.meta.prompt_lens[k]):
            valid = torch.cat([st.valid[k][:, :st.meta.prompt_len] for k in ks])
        st.rec_rows[key] = (a, a + sum(sizes[k] for k in ks), valid)
    a, b, valid = st.rec_rows[key]
    conv, ssm, base = st.states.views(layer)  # type: ignore[union-attr]
    conv, ssm = conv[a - base:b - base], ssm[a - base:b - base]
    if st.state_perm:  # a beam search's last step: each row continues its parent's state
        r0 = 0
        for k in ks:
            n, p = st.meta.batch_sizes[k], st.state_perm.pop((layer, k), None)
            if p is not None:
                for x in (conv, ssm):
                    x[r0:r0 + n] = x[r0:r0 + n].index_select(0, p.to(x.device))
            r0 += n
    return Recurrent(conv, ssm, fresh=i == 0, valid=valid)


def step_inputs(st: BlockState, i: int, k: int, window: int, kv_heads: int,
                device: torch.device, chunked: bool = False) -> tuple[Positions, torch.Tensor | None, int]:
    """Positions, attention mask rows and cache offset of (token i, batch k), shared by all
    layers that attend to ``window`` positions (0: all), or (``chunked``) within their chunk
    of ``window`` positions, chunks counted from each sequence's first token (Llama 4). The
    prefill mask is None where the batch is unpadded and has no window (plainly causal:
    ``attention.prefill_attention``)."""
    cached = st.step_inputs.get((k, window, chunked))
    if cached is not None and cached[0] == i:
        return cached[1], cached[2], cached[3]
    s = st.meta.prompt_len
    valid = st.valid[k]
    if i == 0:
        pos = (valid[:, :s].long().cumsum(-1) - 1).clamp_(min=0)
        mask: torch.Tensor | None = None
        shared = st.meta.shared  # the batch computes positions [shared, s): the mask's rows of those
        # no padding (read from the block's lengths on the host, not from ``valid`` on the
        # device), no window and no shared prefix: plainly causal, no mask built
        if shared or not (all(n == s for n in st.meta.prompt_lens[k]) and not (window and window < s)):
            causal = torch.ones((s, s), dtype=torch.bool, device=device).tril_()
            if window and window < s and not chunked:  # a key more than window - 1 positions back is out of sight
                causal.triu_(1 - window)
            m = causal[None] & valid[:, None, :s]
            if chunked and window < s:  # a key in an earlier chunk than the query's is out of sight
                m &= (pos[:, :, None] // window) == (pos[:, None, :] // window)
            m |= torch.eye(s, dtype=torch.bool, device=device)[None]  # padding sees itself
            mask = m[:, None, shared:]
        out = (Positions(pos[:, shared:]), mask, 0)
        st.step_inputs[(k, window, chunked)] = (i, *out)
        return out
    pos0 = s + i - 1
    pos_ids = valid[:, : s + i].sum(-1, keepdim=True) - 1
    cap = st.meta.prompt_len + st.meta.gen_len
    if window and window < cap:  # a ring of ``window`` slots: slot c holds the latest position
        # p <= pos0 with p % window == c (none yet where that is negative)
        slots = torch.arange(min(pos0 + 1, window), device=device)  # those written so far
        held = pos0 - torch.remainder(pos0 - slots, window)
        keys = valid[:, held.clamp(min=0)] & (held >= 0)[None]
    else:
        held = torch.arange(s + i, device=device)
        keys = valid[:, : s + i]
        base = 0 if st.cache is None else st.cache.held
        if base and st.cache.groups is not None:  # type: ignore[union-attr]
            keys = keys[:, base:]  # the prompt kept once (``prompt_groups.py``): a row holds what it generates
        elif base:  # a shared prefix held once (``held.py``): the cache holds positions [L, s + i),
            # and a row's own are those past its prefix (its left padding, then L positions)
            keys = keys[:, base:] & keys[:, :-base]
    if chunked:  # only the keys of the query's own chunk: the query's slot pos0 is its position
        # pos_ids plus the row's padding, so the chunk starts pos_ids % window slots back
        keys = keys & (held[None] >= pos0 - pos_ids % window)
    out = (Positions(pos_ids), mask_to_rows(keys[:, None], kv_heads), pos0)
    st.step_inputs[(k, window, chunked)] = (i, *out)
    return out


def merged_positions(st: BlockState, i: int, num_gb: int, kv_heads: int, device: torch.device) -> Positions:
    """One ``Positions`` for the rows of every GPU batch, shared by the slots of token i."""
    if st.merged_pos is None or st.merged_pos[0] != i:
        ids = torch.cat([step_inputs(st, i, kk, 0, kv_heads, device)[0].ids for kk in range(num_gb)])
        st.merged_pos = (i, Positions(ids))
    return st.merged_pos[1]


def merged_mask(st: BlockState, i: int, num_gb: int, window: int, kv_heads: int,
                device: torch.device, chunked: bool = False) -> tuple[torch.Tensor, int]:
    """(mask rows of every GPU batch side by side, cache offset) of decode token i."""
    got = st.merged_masks.get((window, chunked))
    if got is None or got[0] != i:
        parts = [step_inputs(st, i, kk, window, kv_heads, device, chunked) for kk in range(num_gb)]
        got = st.merged_masks[(window, chunked)] = (i, torch.cat([m for _, m, _ in parts]),  # type: ignore[misc]
                                                    parts[0][2])
    return got[1], got[2]


def step_targets(st: BlockState, i: int, k: int) -> torch.Tensor:
    """Scoring: the targets of token i's positions in GPU batch k, (b, s) or (b, 1)."""
    tg, s = st.meta.targets[k], st.meta.prompt_len  # type: ignore[index]
    return tg[:, st.meta.shared:s] if i == 0 else tg[:, s + i - 1:s + i]  # a shared prefix's slots: unscored
