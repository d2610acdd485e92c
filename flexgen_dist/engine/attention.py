"""Attention over a KV cache laid out as rows of (batch, kv_head).

The cache of one layer and one GPU batch is K, V of shape (b * kv_heads, max_len, head_dim).
A row is one (sequence, kv head) pair; rows are independent, so a cache whose rows are split
across tiers is attended chunk by chunk, each chunk on the device that holds it (CPU-delegated
attention moves q to the cache instead of the cache to q).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels import attend as native
from ..memory.quant import INT, QTensor


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """(b, t, kvh, d) -> (b * kvh, t, d)."""
    b, t, kvh, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b * kvh, t, d)


def q_to_rows(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, t, nh, d) -> (b * kvh, G, t, d) with G = nh // kvh query heads per kv head."""
    b, t, nh, d = q.shape
    g = nh // kv_heads
    return q.view(b, t, kv_heads, g, d).permute(0, 2, 3, 1, 4).reshape(b * kv_heads, g, t, d)


def rows_to_out(o: torch.Tensor, batch: int) -> torch.Tensor:
    """(b * kvh, G, t, d) -> (b, t, nh * d)."""
    r, g, t, d = o.shape
    kvh = r // batch
    return o.view(batch, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(batch, t, kvh * g * d)


def mask_to_rows(mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, t, L) bool -> (b * kvh, 1, t, L), a broadcastable view (no copy)."""
    b, t, L = mask.shape
    return mask[:, None, None].expand(b, kv_heads, 1, t, L).reshape(b * kv_heads, 1, t, L)


def sink_rows(sinks: torch.Tensor | None, batch: int, kv_heads: int) -> torch.Tensor | None:
    """Per-head attention sinks (nh,) as the rows of ``q_to_rows``: (b * kvh, G)."""
    if sinks is None:
        return None
    return sinks.view(1, kv_heads, -1).expand(batch, -1, -1).reshape(batch * kv_heads, -1)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float | None = None, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt attention on the compute device over the fresh k, v (no cache read).

    q (b, t, nh, d), k/v (b, t, kvh, d), mask (b, 1, t, t) bool -> (b, t, nh * d); with a
    shared prefix, the queries are the last t of the keys' tk and the mask (b, 1, t, tk). A fused
    kernel with grouped-query support; nothing of size (t, t) per head is materialised.
    ``mask`` None: plainly causal (no padding, no window), which lets SDPA take its causal
    kernels (on a GPU flash attention, which skips the masked half; an explicit mask rules
    it out). ``scale``: of q.k (None: d ** -0.5). ``softcap`` > 0 caps the scores
    (cap * tanh(s / cap), Gemma 2), which no fused kernel does: those scores are
    materialised, one sequence at a time; so are they with ``sinks`` (nh,), gpt-oss's logit
    per head that joins each softmax's denominator and is then dropped.
    """
    b, t, nh, d = q.shape
    tk = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    if softcap > 0 or sinks is not None:
        if mask is None:
            mask = torch.ones((t, t), dtype=torch.bool, device=q.device).tril_()[None, None].expand(b, 1, t, t)
        kvh = k.shape[2]
        out = torch.empty((b, t, nh * d), dtype=q.dtype, device=q.device)
        for i in range(b):  # per sequence: the (heads, t, tk) scores of one at a time
            o = attend_rows(q_to_rows(q[i:i + 1], kvh), to_rows(k[i:i + 1]), to_rows(v[i:i + 1]),
                            mask[i:i + 1].expand(1, kvh, t, tk).reshape(kvh, 1, t, tk),
                            scale=scale, softcap=softcap, sinks=sink_rows(sinks, 1, kvh))
            out[i:i + 1] = rows_to_out(o, 1)
        return out
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, is_causal=mask is None,
                                       enable_gqa=k.shape[2] != nh, scale=scale)
    return o.transpose(1, 2).reshape(b, t, nh * d)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                sparsity: float = 1.0, scale: float | None = None, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for rows: q (R, G, t, d), k/v (R, L, d), mask (R, 1, t, L) -> (R, G, t, d).

    Every query row must have at least one visible key (the engine guarantees it: padding
    queries see themselves). With ``sparsity`` < 1, each query keeps only its top-k keys
    (k = ceil(sparsity * L)) and reads only those V rows. ``scale`` and ``softcap`` as for
    ``prefill_attention``; ``sinks`` (R, G) as ``sink_rows`` lays them out. The keys may come
    in any order (a ring-buffer cache holds a sliding window's positions rotated): attention
    over a set does not depend on it.
    """
    r, g, t, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    if sparsity < 1.0:
        return _sparse_attend(q, k, v, mask, sparsity, scale, softcap, sinks)
    if softcap > 0:
        return _bmm_attend(q, k, v, mask, scale, softcap, sinks)
    if t == 1 and q.device.type == "cpu":
        # Decode on the CPU: the native kernel reads each cache row once, in place (strided
        # rows of a row-major chunk or a position-major staged disk chunk), for the G query
        # heads of its kv head, in float32 arithmetic whatever the dtype (None where it does
        # not apply). bfloat16, 8 x 32 rows x 256 positions x 64: 5.3 ms for torch's SDPA.
        o = native.attention(q, k, v, mask, scale, sinks)
        if o is not None:
            return o
    if sinks is not None:  # no fused kernel takes them
        return _bmm_attend(q, k, v, mask, scale, softcap, sinks)
    if t == 1 and (q.device.type != "cpu" or q.dtype in (torch.bfloat16, torch.float16)):
        # On the CPU without the kernel, in a half type: bmm would first copy the strided
        # cache rows (measured 2.1 ms vs 0.4 ms for SDPA's fused kernel on 128 rows x 264
        # positions x 64 in bfloat16; 13 ms vs 0.7 ms over a position-major staged disk chunk).
        # On a GPU, one fused kernel instead of the bmm path's seven (scores, scale, mask,
        # softmax, cast, product), whose launches a decode step's host time is made of. SDPA
        # reads the rows in place.
        return _sdpa_decode(q, k, v, mask, scale)
    return _bmm_attend(q, k, v, mask, scale, softcap)


def attend_rows_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend_rows`` (no sparsity, softcap or sinks) and each query's log-sum-exp of its
    scores, (R, G, t) float32: what merging it with attention over other keys takes
    (``merge_lse``). A decode on the CPU runs the native kernel, as ``attend_rows`` does, its
    output left in float32 for the merge to round once."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[2] == 1 and q.device.type == "cpu":
        got = native.attention_lse(q, k, v, mask, scale)
        if got is not None:
            return got
    r, g, t, d = q.shape
    scores = _scores(q, k, scale, 0.0).masked_fill_(~mask, float("-inf")).float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return torch.bmm(probs.reshape(r, g * t, k.shape[1]), v).view(r, g, t, d), lse


def attend_packed(q: torch.Tensor, k: QTensor, v: QTensor, mask: torch.Tensor, pos_major: bool, lse: bool,
                  scale: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """``attend_rows`` (``lse``: ``attend_rows_lse``) of a decode step on the CPU over a compressed
    cache, read as its codes (``kernels.attend.attention_packed``): k/v (rows, L, d) grouped along d,
    or (L, rows, d) where ``pos_major`` (a staged disk chunk), in memory on the CPU. The same
    values as expanding the cache and attending, without writing the expansion out and reading it
    back. None where the kernel does not apply; the caller expands then."""
    if (q.device.type != "cpu" or q.shape[2] != 1 or k.bits != v.bits or k.group_size != v.group_size
            or any(x.fmt != INT or x.dim != 2 or not isinstance(x.data, torch.Tensor)
                   or x.data.device.type != "cpu" for x in (k, v))):
        return None

    def rows_first(x: QTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ps = (x.data, x.mins, x.scales)
        return tuple(p.transpose(0, 1) for p in ps) if pos_major else ps  # type: ignore[return-value]

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    got = native.attention_packed(q, rows_first(k), rows_first(v), k.bits, k.group_size, mask, scale, sinks, lse)
    if got is None:
        return None
    return (got[0], got[1]) if lse else got[0]  # type: ignore[return-value]


def prefix_attention(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every row over keys all rows share (a block's shared prefix, held once):
    q (R, G, t, d) with row r on kv head r % kv_heads, pk/pv (kv_heads, L, d) float32 -> the output
    (R, G, t, d) float32 and each query's log-sum-exp (R, G, t) float32. One product per kv head over
    the queries of all its rows: the prefix is read once a step, not once per row. In float32
    whatever the dtype, as the native decode kernel computes (the prefix is one row's keys)."""
    r, g, t, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    kvh = pk.shape[0]
    b = r // kvh
    qh = q.reshape(b, kvh, g * t, d).transpose(0, 1).reshape(kvh, b * g * t, d).float()
    scores = torch.bmm(qh, pk.transpose(1, 2)).mul_(scale)  # (kvh, b * g * t, L)
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.bmm(scores.sub_(lse[..., None]).exp_(), pv)
    return (o.view(kvh, b, g, t, d).transpose(0, 1).reshape(r, g, t, d),
            lse.view(kvh, b, g, t).transpose(0, 1).reshape(r, g, t))


def merge_lse(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
              dtype: torch.dtype) -> torch.Tensor:
    """One attention output from two over disjoint key sets, each (output, log-sum-exp): each
    weighted by its share of the whole softmax's denominator, in float32, rounded once to ``dtype``."""
    (oa, la), (ob, lb) = a, b
    m = torch.maximum(la, lb)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    out = (oa.float() * wa[..., None] + ob.float() * wb[..., None]) / (wa + wb)[..., None]
    return out.to(dtype)


Part = tuple[int, int, tuple[torch.Tensor, torch.Tensor]]  # (first row, end row, (output, log-sum-exp))


def merge_parts(whole: tuple[torch.Tensor, torch.Tensor], parts: list[Part], dtype: torch.dtype) -> torch.Tensor:
    """``merge_lse`` of attention over one key set for every row, ``whole`` (output,
    log-sum-exp) on the compute device, with each chunk's over another,
    [(first row, end row, (output, log-sum-exp))] wherever the chunk attended."""
    op, lp = whole
    dev = op.device
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1] == op.shape[0]:
        o, lse = parts[0][2]
        return merge_lse((op, lp), (o.to(dev), lse.to(dev)), dtype)
    out = torch.empty(op.shape, dtype=dtype, device=dev)
    for r0, r1, (o, lse) in parts:
        out[r0:r1] = merge_lse((op[r0:r1], lp[r0:r1]), (o.to(dev), lse.to(dev)), dtype)
    return out


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """One query position per head with SDPA: the G query heads of a row become G queries
    over its one kv head, so k and v (R, L, d) are read as they lie, never broadcast."""
    r, g, _, d = q.shape
    L = k.shape[1]
    args = (q.view(r, 1, g, d), k.unsqueeze(1), v.unsqueeze(1))
    if not q.is_cuda:
        return F.scaled_dot_product_attention(*args, attn_mask=mask.view(r, 1, 1, L), scale=scale).view(r, g, 1, d)
    # Not cuDNN's attention, which SDPA picks first on a Hopper GPU: on an H100 its host time was
    # ~1 ms per call (self time, plan lookup and set-up; 0.36 ms of GPU time), so a decode
    # step of OPT-6.7B spent 32-48 of its ~70 ms issuing attention. The memory-efficient kernel
    # takes the same boolean mask in one launch. (The flag is the process's; it is restored
    # at once. Prefill keeps cuDNN: there its host time hides behind the GPU's products.)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        o = F.scaled_dot_product_attention(*args, attn_mask=mask.view(r, 1, 1, L), scale=scale)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    return o.view(r, g, 1, d)


def _bmm_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Two batched matmuls over rows. k and v may be strided views of a preallocated cache
    (each row contiguous): bmm reads them in place, where SDPA's broadcast over the G query
    heads would first copy the whole cache."""
    r, g, t, d = q.shape
    L = k.shape[1]
    scores = _scores(q, k, scale, softcap).masked_fill_(~mask, float("-inf"))
    probs = _softmax(scores, sinks).to(v.dtype)
    return torch.bmm(probs.reshape(r, g * t, L), v).view(r, g, t, d)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The float32 softmax of (R, G, t, n) scores over their last dim; with ``sinks`` (R, G),
    over the scores and the row's sink together, the sink's share then dropped (gpt-oss)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.to(scores.device, scores.dtype)[:, :, None, None].expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """(R, G, t, L) scaled (and capped) q.k, in the reference's order of operations."""
    r, g, t, d = q.shape
    scores = torch.bmm(q.reshape(r, g * t, d), k.transpose(1, 2)).view(r, g, t, k.shape[1]).mul_(scale)
    if softcap > 0:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def _sparse_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sparsity: float, scale: float, softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    r, g, t, d = q.shape
    L = k.shape[1]
    scores = _scores(q, k, scale, softcap).masked_fill_(~mask, float("-inf"))
    top = max(1, math.ceil(sparsity * L))
    vals, idx = scores.topk(min(top, L), dim=-1)
    probs = _softmax(vals.float(), sinks).to(v.dtype)  # (r, g, t, top)
    picked = torch.gather(v[:, None, None].expand(r, g, t, L, d), 3,
                          idx[..., None].expand(*idx.shape, d))
    return (probs[..., None] * picked).sum(dim=3)


def merge_partial(outs: list[tuple[int, int, torch.Tensor]], rows: int, device: torch.device) -> torch.Tensor:
    """Concatenate per-chunk outputs [(r0, r1, out)] back into (rows, G, t, d) on ``device``."""
    if len(outs) == 1:
        return outs[0][2].to(device, non_blocking=True)
    first = outs[0][2]
    res = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=device)
    for r0, r1, o in outs:
        res[r0:r1].copy_(o, non_blocking=True)
    return res
