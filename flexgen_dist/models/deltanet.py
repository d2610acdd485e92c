"""The gated delta rule: Qwen3-Next's and Qwen3.5's linear-attention layers.

Per sequence and value head the layer keeps a state S (k dim x v dim) instead of a cache of
keys and values. Token t decays it, corrects what it predicts for the token's key towards the
token's value, and reads it with the token's query:

    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - k_t^T S));  o_t = q_t^T S

with q and k L2-normalised, q also scaled by k_dim ** -0.5, g_t <= 0 a learned decay (from
``A_log`` and ``dt_bias``) and beta_t = sigmoid(b_t) the step size. q, k and v come from one
projection through a causal depthwise convolution (kernel ``lin_conv_kernel``) and SiLU, so the
layer also keeps the convolution's last kernel - 1 inputs. The output is RMS-normalised per
head, gated by silu(z) and projected back.

A prefill computes the rule over chunks of 64 positions (``chunked_rule``: within a chunk the
corrections are solved as one triangular system, from chunk to chunk the state is carried),
the form transformers' reference computes and the same operations in the same order, so the
float32 results agree with it; a decode step is the recurrence itself (``step_rule``), as
batched matrix products over every (sequence, head). Left padding is harmless: padded inputs are
zeroed (``Recurrent.valid``), which leaves q, k, v zero there, so the state stays zero until the
sequence's first token, whose convolution then sees zeros before it as a sequence alone does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import linear
from .families import Recurrent, Weights
from .spec import ModelSpec

CHUNK = 64  # positions per chunk of a prefill (the reference's)


def lin_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """A linear layer's mixer weights under canonical names."""
    h, vd, hv = spec.hidden_size, spec.lin_v_heads * spec.lin_v_dim, spec.lin_v_heads
    return {"lin_qkv.w": (spec.lin_conv_dim, h), "lin_z.w": (vd, h), "lin_b.w": (hv, h), "lin_a.w": (hv, h),
            "lin_conv.w": (spec.lin_conv_dim, 1, spec.lin_conv_kernel), "lin_dt.b": (hv,), "lin_A_log": (hv,),
            "lin_norm.w": (spec.lin_v_dim,), "lin_o.w": (h, vd)}


def head_ranges(heads: int, stride: int, offset: int, n: int) -> str:
    """Rows ``offset`` to ``offset + n`` of each of ``heads`` blocks of ``stride`` rows, as a
    checkpoint name's ``#rows=`` list (``a:b,c:d,...``)."""
    return ",".join(f"{g * stride + offset}:{g * stride + offset + n}" for g in range(heads))


def fused_rows(spec: ModelSpec) -> dict[str, str]:
    """Qwen3-Next's fused projections taken apart: the rows of ``in_proj_qkvz`` (per key head
    q, k, then its share of v and z) that are ``lin_qkv.w`` and ``lin_z.w``, and those of
    ``in_proj_ba`` (per key head its b, then its a) that are ``lin_b.w`` and ``lin_a.w``."""
    hk, dk, dv, r = spec.lin_k_heads, spec.lin_k_dim, spec.lin_v_dim, spec.lin_v_heads // spec.lin_k_heads
    per = 2 * dk + 2 * r * dv  # one key head's rows of in_proj_qkvz
    qkv = ",".join(head_ranges(hk, per, a, n) for a, n in ((0, dk), (dk, dk), (2 * dk, r * dv)))
    return {"lin_qkv.w": qkv, "lin_z.w": head_ranges(hk, per, 2 * dk + r * dv, r * dv),
            "lin_b.w": head_ranges(hk, 2 * r, 0, r), "lin_a.w": head_ranges(hk, 2 * r, r, r)}


def lin_hf_names(spec: ModelSpec, prefix: str) -> dict[str, list[str]]:
    """Checkpoint names of a linear layer's weights under ``prefix`` (``model.layers.{j}.``):
    Qwen3.5's separate projections, or the rows of Qwen3-Next's fused ones (``fused_rows``)."""
    p = prefix + "linear_attn."
    rows = fused_rows(spec)
    return {"lin_qkv.w": [f"{p}in_proj_qkv.weight", f"{p}in_proj_qkvz.weight#rows={rows['lin_qkv.w']}"],
            "lin_z.w": [f"{p}in_proj_z.weight", f"{p}in_proj_qkvz.weight#rows={rows['lin_z.w']}"],
            "lin_b.w": [f"{p}in_proj_b.weight", f"{p}in_proj_ba.weight#rows={rows['lin_b.w']}"],
            "lin_a.w": [f"{p}in_proj_a.weight", f"{p}in_proj_ba.weight#rows={rows['lin_a.w']}"],
            "lin_conv.w": [f"{p}conv1d.weight"], "lin_dt.b": [f"{p}dt_bias"], "lin_A_log": [f"{p}A_log"],
            "lin_norm.w": [f"{p}norm.weight"], "lin_o.w": [f"{p}out_proj.weight"]}


def linear_attention(spec: ModelSpec, w: Weights, x: torch.Tensor, rec: Recurrent) -> torch.Tensor:
    """The mixer of the normalised x (b, t, hidden) -> (b, t, v heads * v dim), before
    ``lin_o.w``; reads and overwrites ``rec``'s states."""
    b, t, _ = x.shape
    hk, hv, dk, dv = spec.lin_k_heads, spec.lin_v_heads, spec.lin_k_dim, spec.lin_v_dim
    if rec.valid is not None:
        x = x * rec.valid[:, -t:, None].to(x.dtype)
    mixed = _conv(linear(x, w["lin_qkv.w"]).transpose(1, 2), w["lin_conv.w"], rec).transpose(1, 2)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)
    beta = linear(x, w["lin_b.w"]).sigmoid()
    g = -w["lin_A_log"].float().exp() * F.softplus(linear(x, w["lin_a.w"]).float() + w["lin_dt.b"])
    if t == 1 and not rec.fresh:
        o = step_rule(q, k, v, g, beta, rec.ssm, spec.lin_v_tiled)
    else:
        o = chunked_rule(q, k, v, g, beta, None if rec.fresh else rec.ssm, rec.ssm, spec.lin_v_tiled)
    z = linear(x, w["lin_z.w"]).view(b, t, hv, dv)
    return _gated_norm(o, z, w["lin_norm.w"], spec.norm_eps).reshape(b, t, hv * dv)


def _conv(xc: torch.Tensor, weight: torch.Tensor, rec: Recurrent) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of xc (b, channels, t), continuing from
    ``rec.conv`` (zeros where ``fresh``), whose last kernel - 1 inputs are then kept there."""
    taps = weight.shape[-1]
    t = xc.shape[-1]
    full = F.pad(xc, (taps - 1, 0)) if rec.fresh else torch.cat([rec.conv, xc], dim=-1)
    rec.conv.copy_(full[..., -(taps - 1):])
    if t == 1:  # a decode step: one output per channel, a dot product of its taps (a
        # convolution call costs more than the arithmetic here), summed in float32 and rounded
        # once as the convolution does
        out = (full.float() * weight[:, 0].float()).sum(-1, keepdim=True).to(weight.dtype)
    else:
        out = F.conv1d(full.to(weight.dtype), weight, None, groups=xc.shape[1])[..., -t:]
    return F.silu(out).to(xc.dtype)


def _l2norm_(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x²) + 1e-6) over the last dim, in place (x is a float32 copy)."""
    return x.mul_(torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6))


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 tiled: bool = False) -> tuple[torch.Tensor, ...]:
    """(b, t, heads, d) inputs as float32 (b, v heads, t, d), q and k repeated for the value
    heads that share them (each in turn, or ``tiled``: all of them again and again) and
    L2-normalised (q and k are new tensors: the caller's are not written; the others may be
    views of the caller's)."""
    q, k = (_spread(a, v.shape[2], tiled) for a in (q, k))
    v, beta, g = (a.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for a in (v, beta, g))
    return _l2norm_(q), _l2norm_(k), v, g, beta


def _spread(x: torch.Tensor, heads: int, tiled: bool) -> torch.Tensor:
    """x (b, t, k heads, d) as a new float32 (b, heads, t, d), each k head repeated for the v
    heads that read it: one copy that turns, repeats and converts at once."""
    b, t, hk, d = x.shape
    rep = heads // hk
    out = torch.empty((b, heads, t, d), dtype=torch.float32, device=x.device)
    src = x.permute(0, 2, 1, 3)  # (b, hk, t, d)
    if tiled:  # v head h reads k head h % hk
        out.view(b, rep, hk, t, d).copy_(src[:, None].expand(b, rep, hk, t, d))
    else:  # v head h reads k head h // rep
        out.view(b, hk, rep, t, d).copy_(src[:, :, None].expand(b, hk, rep, t, d))
    return out


def chunked_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor | None, out_state: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """The rule over t positions from ``state`` (None: zero), in chunks of ``CHUNK``: q, k
    (b, t, k heads, k dim), v (b, t, v heads, v dim), g and beta (b, t, v heads); ``tiled``: the
    v heads' order (``ModelSpec.lin_v_tiled``). Returns the outputs (b, t, v heads, v dim) in
    v's dtype; the final state goes to ``out_state``."""
    dtype, t = v.dtype, q.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, tiled)
    q.mul_(q.shape[-1] ** -0.5)
    pad = (CHUNK - t % CHUNK) % CHUNK
    if pad:  # zero positions after the last: k = 0 and beta = 0 leave the state as it is
        q, k, v = (F.pad(a, (0, 0, 0, pad)) for a in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    b, h, n = q.shape[0], q.shape[1], (t + pad) // CHUNK
    q, k, v = (a.reshape(b, h, n, CHUNK, a.shape[-1]) for a in (q, k, v))
    beta = beta.reshape(b, h, n, CHUNK, 1)
    kb = k * beta
    # the right-hand sides of the two solves, written column-major per chunk: the layout the
    # solver works in, so it solves them in place instead of copying each into it
    vb, kd = (torch.empty((b, h, n, a.shape[-1], CHUNK), dtype=torch.float32, device=q.device).mT for a in (v, k))
    torch.mul(v, beta, out=vb)
    cum = g.reshape(b, h, n, CHUNK).cumsum(dim=-1)  # log of the decay from each chunk's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    # (in place where a temporary is done with: each is the size of the whole prompt's heads,
    # and on a CPU every fresh one costs its page faults)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(upper, float("-inf")).exp_()
    system = (kb @ k.transpose(-1, -2)).mul_(decay)  # the corrections' unit lower-triangular system
    intra = (q @ k.transpose(-1, -2)).mul_(decay)  # attention within the chunk
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True, out=vb)
    torch.mul(kb, cum.exp()[..., None], out=kd)
    w_ = torch.linalg.solve_triangular(system, kd, upper=False, unitriangular=True, out=kd)
    s = torch.zeros(b, h, k.shape[-1], v.shape[-1], dtype=torch.float32, device=q.device) if state is None \
        else state.to(torch.float32)
    out = torch.empty_like(u, memory_format=torch.contiguous_format)  # every chunk is written below
    q.mul_(cum.exp()[..., None])  # (q and k are this function's own from here)
    k.mul_((cum[..., -1:] - cum).exp()[..., None])
    last = cum[..., -1].exp()[..., None, None]
    for c in range(n):  # chunk to chunk: the state read, corrected and carried
        v_new = u[:, :, c] - w_[:, :, c] @ s
        out[:, :, c] = q[:, :, c] @ s + intra[:, :, c] @ v_new
        s = s * last[:, :, c] + k[:, :, c].transpose(-1, -2) @ v_new
    out_state.copy_(s)
    out = out.reshape(b, h, -1, v.shape[-1])[:, :, :t]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def step_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, tiled: bool = False) -> torch.Tensor:
    """One decode position (t = 1) from ``state`` (b, v heads, k dim, v dim), updated in place."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, tiled)  # (b, h, 1, d); g, beta (b, h, 1)
    q.div_(q.shape[-1] ** 0.5)
    decay = g.exp()[..., None]  # (b, h, 1, 1)
    # The state is the one large operand (v heads x k dim x v dim per sequence): it is read once
    # for k's and q's products, then updated in place once, and q reads the new state through
    # q.S' = decay (q.S) + (q.k) delta, so no pass over it reads it again.
    kq = torch.cat([k, q], dim=2) @ state  # (b, h, 2, dv)
    delta = (v - decay * kq[:, :, :1]) * beta[..., None]  # (b, h, 1, dv)
    flat = state.view(-1, *state.shape[2:])
    flat.mul_(decay.reshape(-1, 1, 1)).baddbmm_(k.transpose(-1, -2).flatten(0, 1), delta.flatten(0, 1))
    o = decay * kq[:, :, 1:] + (q * k).sum(-1, keepdim=True) * delta
    return o.transpose(1, 2).to(dtype)


def _gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output (float32, cast back before its weight), times silu(z) in
    float32, cast to the model's dtype."""
    dtype = o.dtype
    o32 = o.float()
    o = w * (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (o * F.silu(z.float())).to(dtype)
