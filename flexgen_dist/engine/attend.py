"""The ``attend`` callables a model layer calls (``Family.layer_forward``): the layer's cache
write and its attention, for one GPU batch (``attend_fn``: a prefill over the fresh keys with
a shared prefix's in front, or a decode step against the cache) or for a merged decode's whole
layer at once (``attend_layer_fn``). The model code only ever sees ``attend(q, k, v, sinks)``;
where the keys go and which kernel reads them is decided here and in ``kvcache.py``."""
from __future__ import annotations

from typing import Callable

import torch

from ..models.spec import ModelSpec
from .attention import prefill_attention, q_to_rows, rows_to_out, sink_rows, to_rows
from .block_state import BlockState, merged_mask
from .prefix import with_prefix
from .twins import Twins

Attend = Callable[..., torch.Tensor]


def attend_fn(spec: ModelSpec, sparsity: float, st: BlockState, layer: int, k: int, mask: torch.Tensor | None,
              pos0: int, twins: Twins | None = None) -> Attend:
    """GPU batch ``k``'s ``attend`` at ``layer``: at a prefill (``pos0`` 0) its keys and values
    written to the cache (the block's shared prefix's in front, where it has one) and attended
    over; at a decode step the new ones written and the cache attended (``BlockCache.attend``,
    the policy's ``attn_sparsity``). ``twins``: the prefill computed only the batch's first
    row of each prompt (``mask`` is theirs), whose keys and values every row of the cache takes."""
    kvh, scale, softcap = spec.num_kv_heads, spec.softmax_scale, spec.attn_softcap
    cache = st.cache
    assert cache is not None

    if pos0 == 0:
        shared = st.meta.shared

        def prefill(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
            if shared:  # the batch computed positions [L, s); the prefix's are shared
                kk, vv = with_prefix(st, layer, k, kk, vv, None if twins is None else twins.reps)
            if twins is None:
                cache.write_prefill(layer, k, kk, vv)
            elif cache.groups is not None:  # each prompt kept once: the rows computed are those
                cache.write_prefill(layer, k, kk, vv, firsts=True)
            else:  # a latent cache's one tensor (``BlockCache.shared``) stays one
                wk = twins.widen(kk)
                cache.write_prefill(layer, k, wk, wk if vv is kk else twins.widen(vv))
            return prefill_attention(q, kk, vv, mask, scale, softcap, sinks)

        return prefill

    def attend(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        o = cache.attend(layer, k, q_to_rows(q, kvh), to_rows(kk), to_rows(vv), mask, pos0,
                         sparsity, scale, softcap, sink_rows(sinks, q.shape[0], kvh))
        return rows_to_out(o, q.shape[0])

    return attend


def attend_layer_fn(spec: ModelSpec, sparsity: float, st: BlockState, layer: int, i: int, num_gb: int,
                    device: torch.device) -> Attend:
    """Merged decode's ``attend`` where the layer's cache is one buffer for every GPU batch
    (``BlockCache.whole_layer``): one cache write and one attention over the rows of all of
    them, with the batches' masks side by side (built once per token)."""
    mask, pos0 = merged_mask(st, i, num_gb, spec.window(layer), spec.num_kv_heads, device, spec.chunked(layer))
    kvh, scale, softcap = spec.num_kv_heads, spec.softmax_scale, spec.attn_softcap
    cache = st.cache
    assert cache is not None

    def attend(q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        o = cache.attend_layer(layer, q_to_rows(q, kvh), to_rows(kk), to_rows(vv), mask, pos0,
                               sparsity, scale, softcap, sink_rows(sinks, q.shape[0], kvh))
        return rows_to_out(o, q.shape[0])

    return attend
