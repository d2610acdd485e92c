"""LoRA adapters served per request (``--lora-modules NAME=DIR ...``, ``LLM(lora_modules=...)``):
the base weights stay as they are, and every layer also holds, per adapted matrix, the A and B
of each adapter stacked (``KEY.lora_a`` (n, r, in), ``KEY.lora_b`` (n, out, r), B times its
scale, zero-padded to the largest rank, zero where an adapter leaves the matrix alone). The
stacks are weights like any other: placed on GPU, RAM or disk by the policy's fractions, counted
by the planner (``ModelSpec.lora_stacks``), loaded with their layer. Each request names its
adapter (or none); a batch mixes them freely and each row gets its own (``lora_rows.py``).

Where one adapter serves a whole call, ``--lora`` (``lora.py``) merges it into the weights
instead, at no cost per token.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from .families import LORA_A, LORA_B
from .lora import Hits, LoraAdapter, WrappedSource, _rows_of, adapted_keys, checked_update
from .packed import PackedWeight
from .source import ModelLoadError, WeightSource

if TYPE_CHECKING:
    from .loader import LoadedModel

log = logging.getLogger("flexgen_dist")


class StackedLoraSource(WrappedSource):
    """``base``'s weights, each layer with its adapters' stacks (module doc); ``spec`` is the
    base's with ``lora_stacks`` set (``with_lora_modules``)."""

    def __init__(self, base: WeightSource, adapters: list[LoraAdapter], hits: list[Hits], spec: Any) -> None:
        super().__init__(base, spec)
        self.adapters, self._hits = adapters, hits

    def _stacks(self, layer: int) -> dict[str, torch.Tensor]:
        base = self.base.shapes("layer", layer)
        out = {}
        for key, n, r, i, o in self.spec.lora_stacks:
            if key not in base:
                continue
            a_all, b_all = torch.zeros(n, r, i), torch.zeros(n, o, r)
            for s, (adapter, hits) in enumerate(zip(self.adapters, self._hits)):
                if key not in hits[("layer", layer)]:
                    continue
                module, rows = hits[("layer", layer)][key]
                a, b, scale = adapter.modules[module]
                a_all[s, :a.shape[0]] = a.float()
                b_all[s, :, :a.shape[0]] = (_rows_of(b, rows) if rows else b).float() * scale
            out[key + LORA_A], out[key + LORA_B] = a_all.to(self.dtype), b_all.to(self.dtype)
        return out

    def get(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor]:
        out = dict(self.base.get(part, layer))
        return out | self._stacks(layer) if part == "layer" and layer is not None else out

    def get_packed(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor | PackedWeight]:
        out = dict(self.base.get_packed(part, layer))
        return out | self._stacks(layer) if part == "layer" and layer is not None else out

    def packed_formats(self, part: str, layer: int | None = None) -> dict[str, tuple[Any, ...]]:
        return self.base.packed_formats(part, layer)


def with_lora_modules(model: LoadedModel, modules: list[tuple[str, str]]) -> LoadedModel:
    """``model`` serving the named adapters per request (module doc): its spec with their
    stacks, its source handing them out with each layer, ``adapters`` their names in order
    (a request's adapter index is its name's position + 1; 0 is the base model)."""
    adapters = [LoraAdapter(path) for _, path in modules]
    hits = [adapted_keys(model.source, a) for a in adapters]
    stacks: dict[str, list[int]] = {}  # key -> [rank, in, out]
    for j in range(model.spec.num_layers):
        shapes = model.source.shapes("layer", j)
        for adapter, h in zip(adapters, hits):
            for key, (module, rows) in h[("layer", j)].items():
                checked_update(adapter, module, rows, shapes[key], f"{key} of layer {j}")
                i, o = shapes[key][1], shapes[key][0]
                r = int(adapter.modules[module][0].shape[0])
                have = stacks.setdefault(key, [r, i, o])
                if (have[1], have[2]) != (i, o):
                    raise ModelLoadError(f"{adapter.path}: {key} is {(o, i)} in layer {j} but {(have[2], have[1])} in "
                                         "another: adapters of matrices whose shape differs by layer are not served "
                                         "per request; merge one with --lora")
                have[0] = max(have[0], r)
    spec = replace(model.spec, lora_stacks=tuple((k, len(adapters), r, i, o) for k, (r, i, o) in stacks.items()))
    names = tuple(n for n, _ in modules)
    per_layer = spec.lora_numel() * model.source.dtype.itemsize
    log.info("LoRA adapters served per request: %s (%d matrices a layer, %.1f MB a layer for all of them)",
             ", ".join(names), len(stacks), per_layer / 1e6)
    return replace(model, spec=spec, source=StackedLoraSource(model.source, adapters, hits, spec), adapters=names,
                   origin=f"{model.origin} + LoRA adapters {', '.join(names)} (per request)")
