"""The table of model families: what each family (OPT, LLaMA, Gemma, Cohere) does differently, by name.

A family module (``opt.py``, ``llama.py``) provides pure functions over weight dicts with
canonical names and registers them here when it is imported (``register(Family(...))``);
``models/__init__.py`` imports every family module, so the table is full as soon as anything
under ``flexgen_dist.models`` is. The engine, the loader and the benchmarks look a family up
by ``spec.family`` (``get_family``). This module imports no family module and ``common.py``
(the math the families share) neither, so the imports run one way: family -> common, family
-> here. The engine never sees family-specific names; the loader maps checkpoint names to
canonical ones through the family's ``hf_names``.

The attention itself is not family math: ``layer_forward`` receives an ``attend`` callable
``(q, k, v) -> out`` where q is (b, t, num_heads, head_dim), k and v are
(b, t, num_kv_heads, head_dim) and out is (b, t, num_heads * head_dim), and the layer's
index (for what differs by layer, such as a local layer's RoPE base). The engine's
``attend`` writes k and v into its preallocated cache (wherever that lives) and attends over
it, on the compute device or on the CPU. Rows of x are independent outside ``attend``, so
the engine may pass the rows of several GPU batches at once with an ``attend`` that splits
them again (merged decode, see ``engine/stage.py``).

A linear-attention layer (``spec.linear(layer)``: Qwen3-Next's gated delta rule) has no KV
cache; it receives a ``Recurrent`` in place of ``attend``: the state its rows carry from token
to token, which the layer reads and overwrites in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kernels.qweight import QWeight
from .spec import ModelSpec

Weights = dict[str, torch.Tensor | QWeight]  # a compressed matrix stays packed on a CPU device
# attend(q, k, v) or attend(q, k, v, sinks): the engine's cache write + attention; sinks (heads,)
# are gpt-oss's per-head logits joining the softmax's denominator
Attend = Callable[..., torch.Tensor]
Shapes = Callable[..., dict[str, tuple[int, ...]]]


@dataclass
class Recurrent:
    """What a linear-attention layer carries per sequence, for the rows it is given: ``conv``
    (b, conv channels, kernel - 1), the convolution's last inputs in the model's dtype, and
    ``ssm`` (b, v heads, k dim, v dim) float32, the delta rule's state; both views of the
    engine's buffers, written in place. ``fresh``: the rows start from zero (a prefill).
    ``valid``: (b, t) True at real positions where a prefill is left-padded (else None): padded
    inputs are zeroed, so the state they leave is zero."""

    conv: torch.Tensor
    ssm: torch.Tensor
    fresh: bool
    valid: torch.Tensor | None = None  # (spec) for embed/head; (spec, layer) for layer


ROWS = "#rows="  # in ``hf_names``, "name#rows=a:b" is rows [a, b) of a fused checkpoint tensor
INDEX = "#index="  # "name#index=e" is entry e of a 3-D tensor (one expert of all); before any #rows=
# "name#index=e#T" is that entry transposed (a checkpoint storing in x out), before any #rows=;
# "#rows=a:b:s" takes every s-th row of [a, b) (gate and up interleaved), "#rows=a:b,c:d" rows [a, b) then [c, d)
TRANSPOSED = "#T"
# "name_blocks#mxfp4..." is an MXFP4 tensor (gpt-oss's experts as OpenAI ships them): the 4-bit
# codes in name_blocks, their power-of-two scales in name_scales, expanded on read
MXFP4 = "#mxfp4"

@dataclass
class Family:
    """The functions of one family. The ``*_shapes`` dicts also fix each part's canonical
    weight names and their order (which placement walks). ``pos`` is a (b, t) tensor of
    position ids or a ``common.Positions``.

    Not frozen: a test may monkeypatch one function for the length of the test.
    """

    name: str
    layer_shapes: Shapes
    embed_shapes: Shapes
    head_shapes: Shapes
    hf_names: Callable[[ModelSpec, str, int | None], dict[str, list[str]]]
    embed: Callable[[ModelSpec, Weights, torch.Tensor, Any], torch.Tensor]
    layer_forward: Callable[[ModelSpec, Weights, torch.Tensor, Any, Attend, int], torch.Tensor]
    head: Callable[[ModelSpec, Weights, torch.Tensor], torch.Tensor]
    # the head's input before the vocabulary matrix: the final norm (and OPT's project_out),
    # (..., hidden) -> (..., embed_dim), what transformers' last_hidden_state holds (embeddings)
    final_norm: Callable[[ModelSpec, Weights, torch.Tensor], torch.Tensor]


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to the table (a family module calls this once, at import)."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice: "
                         "give the new family module another name")
    _FAMILIES[family.name] = family
    return family


LORA_A, LORA_B = ".lora_a", ".lora_b"  # suffixes of a matrix's stacked adapters (``ModelSpec.lora_stacks``)


def part_shapes(spec: ModelSpec, part: str, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of the weights of ``part`` ('embed', 'layer' or 'head'); a
    layer's depend on which layer it is where some layers are sparse (mixtures of experts)."""
    fam = get_family(spec.family)
    if part != "layer":
        return getattr(fam, f"{part}_shapes")(spec)
    shapes = fam.layer_shapes(spec, layer)
    for key, n, r, i, o in spec.lora_stacks:  # adapters served per request (``lora_stack.py``)
        if key in shapes:
            shapes[f"{key}{LORA_A}"], shapes[f"{key}{LORA_B}"] = (n, r, i), (n, o, r)
    return shapes


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> Family:
    """The registered family called ``name`` (``spec.family``)."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}: known families are "
                         f"{', '.join(family_names()) or 'none'} (a family module registers "
                         "itself when models/__init__.py imports it)")
    return _FAMILIES[name]
