"""Shared pieces of model math and the protocol every family module follows.

A family module (``opt.py``, ``llama.py``) provides pure functions over weight dicts with
canonical names. The engine never sees family-specific names; the loader maps checkpoint
names to canonical ones through the family's ``hf_names``/``gguf_names``.

The attention itself is not model math here: ``layer_forward`` receives an ``attend``
callable ``(q, k, v) -> out`` where q is (b, t, num_heads, head_dim), k and v are
(b, t, num_kv_heads, head_dim) and out is (b, t, num_heads * head_dim). The engine's
``attend`` writes k and v into its preallocated cache (wherever that lives) and attends over
it, on the compute device or on the CPU.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from .spec import ModelSpec

Weights = dict[str, torch.Tensor]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Family(Protocol):
    """What a model family module exposes. The ``*_shapes`` dicts also fix each part's
    canonical weight names and their order (which placement walks)."""

    def layer_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]: ...
    def embed_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]: ...
    def head_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]: ...
    def hf_names(self, spec: ModelSpec, part: str, layer: int | None) -> dict[str, list[str]]: ...
    def embed(self, spec: ModelSpec, w: Weights, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor: ...
    def layer_forward(self, spec: ModelSpec, w: Weights, x: torch.Tensor, pos: torch.Tensor,
                      attend: Attend) -> torch.Tensor: ...
    def head(self, spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor: ...


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 and cast back, as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class Positions:
    """Integer positions (b, t) of a batch, with the rotary tables memoised.

    Every layer of a stage sees the same positions for one (token, GPU batch), so the engine
    builds one ``Positions`` and the layers share its cos/sin instead of recomputing them.
    """

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._rope: dict[tuple[int, float, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (head_dim, theta, dtype)
        if key not in self._rope:
            self._rope[key] = rope_cos_sin(self.ids, head_dim, theta, dtype)
        return self._rope[key]


def as_positions(pos: "torch.Tensor | Positions") -> Positions:
    return pos if isinstance(pos, Positions) else Positions(pos)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (b, t, 1, head_dim) for integer positions (b, t)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device,
                                             dtype=torch.int64).float() / head_dim))
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on x of shape (b, t, heads, head_dim), rotate-half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def family_module(spec: ModelSpec) -> Family:
    """The module implementing ``spec.family``."""
    from . import llama, opt  # local import: both import this module

    return {"opt": opt, "llama": llama}[spec.family]  # type: ignore[return-value]
