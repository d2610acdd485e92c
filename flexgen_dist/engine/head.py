"""The LM head's passes on a last stage: prefill's one head per block, scoring, and embeddings.

Both take the stage's family, spec and head weights; the decode head is the family's ``head``
over the step's rows (``StageEngine._compute``).
"""
from __future__ import annotations

import torch

from ..models.common import linear
from ..models.families import Family
from ..models.spec import ModelSpec
from .block_state import BlockState


def prefill_head(family: Family, spec: ModelSpec, st: BlockState, w: dict[str, torch.Tensor], k: int,
                 x: torch.Tensor) -> torch.Tensor:
    """Prefill's LM head, once per block: GPU batch k's last-position rows wait until the
    block's last batch has its own, then one GEMM over every batch's rows gives all logits.

    The head is a few rows against the whole vocabulary matrix, so its time is mostly the
    matrix's read, whatever the rows (opt-350m fp32, one core, a 32-prompt prefill: 16 heads
    of 2 rows took 60 ms, 2 of 16 rows 15 ms). It used to run once per GPU batch (on the
    last of several stages, once per prefill piece). Logits of batches outside the sweep that runs
    the last batch (the pipeline's per-batch pieces) wait for ``prefill_logits``; the sweep's
    own batches get theirs as outputs (None before the last batch). Returns the batch's rows,
    which stand in for its hidden states."""
    row = st.head_rows[k] = x[:, -1].clone()  # not a view: the batch's activations can go
    if len(st.head_rows) < len(st.meta.prompt_lens):  # some batch's prefill is still to come
        return row
    ks = sorted(st.head_rows)
    rows = [st.head_rows.pop(kk) for kk in ks]
    y = family.head(spec, w, torch.cat(rows))
    for kk, part in zip(ks, y.split([r.shape[0] for r in rows])):
        if 0 <= kk - st.out_base < len(st.outputs):
            st.outputs[kk - st.out_base] = part
        else:
            st.logits[kk] = part
    return row


def prefill_logits(st: BlockState, upto: int) -> list[torch.Tensor]:
    """Prefill logits of GPU batches [0, upto) that a later sweep computed (see
    ``prefill_head``), in batch order; they leave the state."""
    return [st.logits.pop(k) for k in range(upto)]


def embed(family: Family, spec: ModelSpec, w: dict[str, torch.Tensor], x: torch.Tensor,
          lens: list[int] | None = None) -> torch.Tensor:
    """(b, pooled_dim) float64: each sequence's last hidden states after the final norm (and
    OPT's project_out), what transformers' ``last_hidden_state`` holds, pooled as the model
    says (``ModelSpec.pooling``): the last position, as decoder embedding models (Qwen3-Embedding,
    e5-mistral, gte-Qwen2) pool, or over each sequence's ``lens`` true (left-padded) positions
    (``pool``). Normalizing is the caller's (``LLM.embed``), after any truncation to fewer
    dimensions. A sequence classifier's head then gives its labels' logits, as transformers'
    ``*ForSequenceClassification`` scores the last token (left padding: the last position)."""
    if spec.pooling == "last" or spec.num_labels:
        y = family.final_norm(spec, w, x[:, -1])
    else:
        assert lens is not None and len(lens) == x.shape[0] and max(lens) <= x.shape[1], "pooling needs every position"
        y = pool(family.final_norm(spec, w, x).double(), lens, spec.pooling)
    if "score.w" in w:  # a sequence classifier: its labels' logits (``ModelSpec.num_labels``)
        y = linear(y, w["score.w"])
    return y.double()


def pool(y: torch.Tensor, lens: list[int], how: str) -> torch.Tensor:
    """(b, d) of (b, s, d) states whose row r holds its ``lens[r]`` true positions last (left
    padding), as sentence-transformers pools them: their mean, sum / sqrt(length), mean
    weighted by position (1, 2, ... from the first true token), maximum, or first ("cls").
    Padded positions never count (whatever they hold)."""
    b, s, _ = y.shape
    n = torch.tensor(lens, device=y.device)
    first = s - n  # each row's first true position
    at = torch.arange(s, device=y.device)[None] - first[:, None]  # (b, s): 0 at the first true token
    keep = (at >= 0)[..., None]
    if how == "cls":
        return y[torch.arange(b, device=y.device), first]
    if how == "max":
        return y.masked_fill(~keep, float("-inf")).amax(1)
    weight = (at + 1).clamp_min(0).double()[..., None] if how == "weighted_mean" else keep.double()
    total = torch.where(keep, y * weight, 0).sum(1)
    if how == "mean":
        return total / n[:, None]
    if how == "mean_sqrt_len":
        return total / n.double().sqrt()[:, None]
    if how == "weighted_mean":
        return total / weight.sum(1)
    raise ValueError(f"pooling {how!r}")


SCORE_CHUNK_BYTES = 64 << 20  # float32 logits of the positions the head scores at once


def score_width(k: int) -> int:
    """Values per scored position with k alternatives: its log-probability, k ids, k
    log-probabilities, its rank (``score``)."""
    return 2 + 2 * k


def score(family: Family, spec: ModelSpec, w: dict[str, torch.Tensor], x: torch.Tensor,
          targets: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """(b, 3) float64 per sequence: sum of -log p(target), positions scored, top-1 hits.

    With ``k`` (per-token log-probabilities), (b, 3 + t * (2 + 2k)) for x of t positions: after
    the sums, per position the log-probability of its target, the ids and log-probabilities
    of its k most likely next tokens, most likely first, and the target's rank (1: the most
    likely; zeros where the position is not scored). The head runs on the scored positions only, in chunks of ~64 MB
    of float32 logits, so a window of s positions never holds (b, s, vocab) logits at once."""
    b, s, h = x.shape
    device = x.device
    flat_x, flat_t = x.reshape(b * s, h), targets.reshape(-1).to(device)
    rows = torch.arange(b, device=device).repeat_interleave(s)
    out = torch.zeros((b, 3), dtype=torch.float64, device=device)
    width = 0 if k is None else score_width(k)
    per = torch.zeros((b * s, width), dtype=torch.float64, device=device) if width else None
    step = max(1, SCORE_CHUNK_BYTES // (4 * spec.vocab_size))
    for a in range(0, b * s, step):
        t = flat_t[a:a + step]
        keep = t >= 0
        lg = family.head(spec, w, flat_x[a:a + step][keep]).float()
        if lg.shape[0] == 0:
            continue
        tk = t[keep]
        lse, own = torch.logsumexp(lg, -1), lg.gather(-1, tk[:, None])
        nll = lse - own.squeeze(-1)
        hit = lg.max(-1).indices == tk
        r = rows[a:a + step][keep]
        out[:, 0].index_add_(0, r, nll.double())
        out[:, 1].index_add_(0, r, torch.ones_like(nll, dtype=torch.float64))
        out[:, 2].index_add_(0, r, hit.double())
        if per is not None:
            where = torch.arange(a, a + t.shape[0], device=device)[keep]
            per[where, 0] = -nll.double()
            per[where, -1] = (lg > own).sum(-1).double() + 1
            if k:  # the top k of the logits are those of the log-probabilities: no (rows, vocab) copy
                vals, top = lg.topk(k, dim=-1)
                per[where, 1:1 + k] = top.double()
                per[where, 1 + k:1 + 2 * k] = (vals - lse[:, None]).double()
    if per is None:
        return out
    return torch.cat([out, per.view(b, s * width)], dim=1)
