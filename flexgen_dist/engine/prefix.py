"""A block's shared prefix, computed once (``blocks.shared_prefixes`` finds it).

Where every prompt of a block begins with the same L tokens, the prefix runs through each
slot as one row of its own before the block's GPU batches (``prefix_pass``), and each GPU
batch's prefill computes only its positions [L, s), taking the prefix's keys and values for
the first L (``with_prefix``); the block's cache is the same as without. Between stages the
prefix's row travels with the block's first GPU batch (``distributed/pipeline.py``).
"""
from __future__ import annotations

from typing import Any

import torch

from ..models.common import Positions
from ..models.families import Family
from ..models.spec import ModelSpec
from .attention import prefill_attention
from .block_state import BlockState


def shares_prefix(spec: ModelSpec) -> bool:
    """Whether a block's shared prefix can be computed once for this model: every layer
    attends and caches its keys and values (a linear-attention layer's state, or a latent
    cache, would have to continue from the prefix at another place in each row)."""
    return spec.cache_tensors == 2 and not any(spec.linear(j) for j in range(spec.num_layers))


def longest_sharing(spec: ModelSpec) -> int | None:
    """The longest prompt whose block may share a prefix (None: any): a LongRoPE model's
    original context, since a row past it turns every position, its prefix's too, with the long
    frequencies, which the prefix's own shorter row would not."""
    sc = spec.rope_scaling
    return sc.original_max_position_embeddings if sc is not None and sc.rope_type == "longrope" else None


def chain_prefix(st: BlockState, kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
                 ) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """A new block's place in a chain of blocks of one prefix (``blocks.prefix_reuse``): a
    reusing block takes ``kept``, the per-layer keys and values the block before left; returns
    what the stage keeps for the next block (this block's, where ``meta.keep``)."""
    meta = st.meta
    if not meta.shared:
        return kept
    if meta.reuse:
        if kept is None:
            raise RuntimeError("a block reuses a shared prefix no earlier block left: the blocks of a call must "
                               "reach each stage in order")
        st.prefix_kv = kept
    return st.prefix_kv if meta.keep else None


def prefix_pass(family: Family, spec: ModelSpec, st: BlockState, slot: tuple[str, Any],
                w: dict[str, torch.Tensor], device: torch.device) -> None:
    """Run the block's shared prefix (one row of L positions, ``st.prefix``: ids on a first
    stage, else hidden states) through ``slot``, once per block, before its GPU batches: a
    layer keeps the prefix's keys and values, which every row's prefill then takes as its
    first positions (``with_prefix``); ``st.prefix`` becomes the slot's output."""
    L = st.meta.shared
    if slot[0] == "head":  # a last stage: the prefix has left its last layer's keys, nothing to pass on
        st.prefix = None
        return
    x = st.prefix
    assert x is not None, "a shared prefix's input comes with the block's first GPU batch"
    pos = Positions(torch.arange(L, device=device)[None])
    if slot[0] == "embed":
        st.prefix = family.embed(spec, w, x.to(device), pos)
        return
    layer: int = slot[1]
    window, mask = spec.window(layer), None
    if window and window < L:  # a sliding (or chunked) layer's band over the one row
        mask = torch.ones((L, L), dtype=torch.bool, device=device).tril_()
        p = torch.arange(L, device=device)
        mask = mask & ((p[:, None] // window) == (p[None, :] // window)) if spec.chunked(layer) \
            else mask.triu_(1 - window)
        mask = mask[None, None]
    scale, softcap = spec.softmax_scale, spec.attn_softcap

    def keep(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        st.prefix_kv[layer] = (kk, vv)
        return prefill_attention(q, kk, vv, mask, scale, softcap, sinks)

    st.prefix = family.layer_forward(spec, w, x, pos, keep, layer)


def with_prefix(st: BlockState, layer: int, k: int, kk: torch.Tensor,
                vv: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU batch k's keys and values over all s positions: positions [0, L) from the shared
    prefix's (row r, left-padded by p_r, holds prefix position c - p_r at slot c; its padding
    slots take any, masked), then the batch's own [L, s). ``rows``: the batch's rows computed
    (``twins.Twins.reps``; None: all)."""
    pk, pv = st.prefix_kv[layer]
    idx = st.prefix_index.get(k)
    if idx is None:  # once per GPU batch of the block
        lens = st.meta.prompt_lens[k] if rows is None else [st.meta.prompt_lens[k][r] for r in rows.tolist()]
        pads = torch.tensor([st.meta.prompt_len - n for n in lens], device=kk.device)
        idx = st.prefix_index[k] = (torch.arange(st.meta.shared, device=kk.device)[None] - pads[:, None]).clamp_(min=0)
    return torch.cat([pk[0][idx], kk], 1), torch.cat([pv[0][idx], vv], 1)
