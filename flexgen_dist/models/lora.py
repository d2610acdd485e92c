"""LoRA adapters (PEFT's saved format), merged into the base weights as they are read.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``rank_pattern``/``alpha_pattern``, ``target_modules``, ...) and ``adapter_model.safetensors``
(or ``adapter_model.bin``) with, per adapted linear layer ``M``, ``base_model.model.M.lora_A.weight``
(r, in) and ``base_model.model.M.lora_B.weight`` (out, r). The adapted weight is

    W + (B @ A) * scale,    scale = alpha / r   (alpha / sqrt(r) with ``use_rslora``)

computed in float32 as PEFT's ``merge_and_unload`` computes it, then rounded to the run's dtype
once. ``LoraSource`` wraps a model's weight source and merges as each part is read, so the
engine, the planner and every rank see ordinary weights of unchanged shapes, at no cost per
token: the batch jobs this engine runs use one adapter for a whole call.

What is not merged is refused in one line, before anything is placed: DoRA, trained biases,
LoRA on embeddings (``lora_embedding_A``), ``modules_to_save`` (whole modules trained beside the
adapter), layers stored transposed (``fan_in_fan_out``), and any adapted module the model's
family does not read (a vision tower's, say), or reads only as part of a tensor it cuts
(one expert of a 3-D tensor).
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .families import INDEX, MXFP4, ROWS, TRANSPOSED
from .packed import PackedWeight
from .source import ModelLoadError, WeightSource

if TYPE_CHECKING:
    from .loader import LoadedModel

log = logging.getLogger("flexgen_dist")
PREFIX = "base_model.model."


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module override (``rank_pattern``, ``alpha_pattern``): the value of the
    first key that names the module (``.*\\.KEY$``, or the whole name), else ``default``."""
    for key, value in pattern.items():
        if re.fullmatch(key, module) or re.match(rf".*\.{key}$", module):
            return value
    return default


class LoraAdapter:
    """One PEFT LoRA adapter: per adapted module (its name in the model's checkpoint, without
    ``.weight``) its A, B and scale."""

    def __init__(self, path: str | Path) -> None:
        self.path = p = Path(path).expanduser()
        cfg_file = p / "adapter_config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{p}: not a LoRA adapter directory (no adapter_config.json): give the directory "
                                 "PEFT's save_pretrained wrote")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{cfg_file}: cannot read it ({e}): save the adapter again") from None
        self.config = cfg
        self._refuse_unmerged(cfg)
        tensors = self._tensors(p)
        self.modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
            b = tensors.get(key.replace(".lora_A.weight", ".lora_B.weight"))
            if b is None:
                raise ModelLoadError(f"{p}: {key} has no lora_B beside it: the adapter is incomplete; save it again")
            r = int(_pattern_value(cfg.get("rank_pattern") or {}, module, cfg.get("r", a.shape[0])))
            alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", r)))
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
                why = ("an adapter of a 3-D parameter (a mixture's experts: PEFT's target_parameters, or "
                       "'all-linear' on a fused experts tensor) is not supported; adapt attention and dense layers"
                       if "experts" in module.split(".") else "corrupt adapter?")
                raise ModelLoadError(f"{p}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                                     f"of rank {r} (the config's): {why}")
            scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            self.modules[module] = (a, b, scale)
        others = sorted(k for k in tensors if not k.endswith((".lora_A.weight", ".lora_B.weight")))
        if others:
            raise ModelLoadError(f"{p}: adapter tensor {others[0]} is not a LoRA A or B matrix: only LoRA's linear "
                                 "layers are merged (no trained biases, embeddings or saved modules)")
        if not self.modules:
            raise ModelLoadError(f"{p}: the adapter holds no lora_A / lora_B matrices")

    @staticmethod
    def _refuse_unmerged(cfg: dict[str, Any]) -> None:
        kind = cfg.get("peft_type", "LORA")
        problem = (f"a {kind} adapter is not supported (LoRA is)" if kind != "LORA" else
                   "DoRA (use_dora) is not supported" if cfg.get("use_dora") else
                   f"trained biases (bias {cfg.get('bias')!r}) are not supported" if cfg.get("bias", "none") != "none" else
                   "modules_to_save (whole modules trained beside the adapter) are not supported"
                   if cfg.get("modules_to_save") else
                   "fan_in_fan_out layers (GPT-2's Conv1D) are not supported" if cfg.get("fan_in_fan_out") else None)
        if problem:
            raise ModelLoadError(f"LoRA adapter: {problem}; merge it with PEFT's merge_and_unload and load the result")

    @staticmethod
    def _tensors(p: Path) -> dict[str, torch.Tensor]:
        st, pt = p / "adapter_model.safetensors", p / "adapter_model.bin"
        try:
            if st.is_file():
                from safetensors.torch import load_file

                return load_file(str(st))
            if pt.is_file():
                return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
            raise ModelLoadError(f"{p}: cannot read the adapter's weights ({type(e).__name__}: {e}); save it again") \
                from None
        raise ModelLoadError(f"{p}: no adapter_model.safetensors or adapter_model.bin beside adapter_config.json")

    def delta(self, module: str) -> torch.Tensor:
        """(out, in) float32: ``(B @ A) * scale`` of an adapted module, as PEFT merges it."""
        a, b, scale = self.modules[module]
        return (b.float() @ a.float()) * scale


def _rows_of(t: torch.Tensor, rows: str) -> torch.Tensor:
    """The rows ``rows`` ("a:b", "a:b:step" or several joined by ",") of a fused tensor, as the
    checkpoint's readers cut them (``hf_names``)."""
    parts = []
    for rng in rows.split(","):
        r0, r1, step = (int(r) for r in (rng + ":1").split(":")[:3])
        parts.append(t[r0:r1:step])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


Hits = dict[tuple[str, int | None], dict[str, tuple[str, str]]]  # (part, layer) -> key -> (module, rows)


def adapted_keys(source: WeightSource, adapter: LoraAdapter) -> Hits:
    """Per part of the model, each canonical key the adapter adapts: (its module in the
    adapter, the rows of the fused tensor it is cut from or ""); an adapted module the
    model's family does not read as a whole linear layer is refused in one line."""
    spec = source.spec
    hits: Hits = {}
    used: set[str] = set()
    for part, layer in [("embed", None)] + [("layer", j) for j in range(spec.num_layers)] + [("head", None)]:
        out = {}
        for k, candidates in source.family.hf_names(spec, part, layer).items():
            for c in candidates:
                name, _, marks = c.partition("#")
                module = name.removesuffix(".weight")
                if not name.endswith(".weight") or module not in adapter.modules:
                    continue
                marks = "#" + marks if marks else ""
                if part != "layer" or any(m in marks for m in (INDEX, TRANSPOSED, MXFP4)):
                    break  # an embedding, a head, an expert of a 3-D tensor: left unused, refused below
                out[k] = (module, marks.partition(ROWS)[2])
                break
        hits[(part, layer)] = out
        used.update(m for m, _ in out.values())
    unused = sorted(set(adapter.modules) - used)
    if unused:
        raise ModelLoadError(f"{adapter.path}: the adapter adapts {unused[0]}"
                             + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
                             + f", which this {spec.family}-family model does not read as a whole linear "
                               "layer: an adapter of another model, or of a part this engine does not merge "
                               "(embeddings, the head, one expert of a fused tensor)")
    return hits


def checked_update(adapter: LoraAdapter, module: str, rows: str, shape: tuple[int, ...], what: str) -> None:
    """Refuse, in one line, an adapter whose update of ``module`` (cut to ``rows``) is not
    ``shape``, the model's matrix ``what``."""
    a, b, _ = adapter.modules[module]
    out = _rows_of(b, rows).shape[0] if rows else b.shape[0]
    if (out, a.shape[1]) != tuple(shape):
        raise ModelLoadError(f"{adapter.path}: {module}'s update is {(out, a.shape[1])} but the model's "
                             f"{what} is {tuple(shape)}: an adapter of another model")


class WrappedSource(WeightSource):
    """A source that reads through another (``base``) and changes some of what it hands out;
    everything else (its packing switch, its files, its own fields) is the base's."""

    def __init__(self, base: WeightSource, spec: Any = None) -> None:
        super().__init__(spec or base.spec, base.dtype)
        self.base = base

    @property  # type: ignore[override]
    def keep_packed(self) -> bool:
        return self.base.keep_packed

    @keep_packed.setter
    def keep_packed(self, value: bool) -> None:
        self.base.keep_packed = value

    def _read(self, part: str, layer: int | None) -> dict[str, torch.Tensor]:
        raise AssertionError(f"{type(self).__name__} reads through its base source")  # get/get_packed delegate

    def close(self) -> None:
        self.base.close()

    def __getattr__(self, name: str) -> Any:  # the base source's own fields (its path, its head, ...)
        if name.startswith("__") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)


class LoraSource(WrappedSource):
    """A weight source with an adapter merged into what it reads (module doc)."""

    def __init__(self, base: WeightSource, adapter: LoraAdapter) -> None:
        super().__init__(base)
        self.adapter = adapter
        self._hits = adapted_keys(base, adapter)

    def _merge(self, part: str, layer: int | None, out: dict[str, Any]) -> dict[str, Any]:
        for k, (module, rows) in self._hits.get((part, layer), {}).items():
            w = out[k]
            checked_update(self.adapter, module, rows, tuple(w.shape), f"{k} of {part} {layer}")
            d = self.adapter.delta(module)
            out[k] = (w.float() + (_rows_of(d, rows) if rows else d)).to(self.dtype)
        return out

    def get(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor]:
        return self._merge(part, layer, dict(self.base.get(part, layer)))

    def get_packed(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor | PackedWeight]:
        out = dict(self.base.get_packed(part, layer))
        hits = self._hits.get((part, layer), {})
        if any(isinstance(out[k], PackedWeight) for k in hits):  # an adapted matrix is merged dense
            dense = self.base.get(part, layer)
            out.update({k: dense[k] for k in hits})
        return self._merge(part, layer, out)

    def packed_formats(self, part: str, layer: int | None = None) -> dict[str, tuple[Any, ...]]:
        hits = self._hits.get((part, layer), {})
        return {k: v for k, v in self.base.packed_formats(part, layer).items() if k not in hits}

    def shapes(self, part: str, layer: int | None = None) -> dict[str, tuple[int, ...]]:
        return self.base.shapes(part, layer)


def with_lora(model: LoadedModel, adapter: str) -> LoadedModel:
    """``model`` with a LoRA adapter directory merged into its weights as they are read
    (``lora.LoraSource``); refused in one line where it does not fit the model."""
    a = LoraAdapter(adapter)
    ranks = sorted({int(t[0].shape[0]) for t in a.modules.values()})
    source = LoraSource(model.source, a)
    log.info("LoRA adapter %s: %d matrices (rank %s) merged as they are read", a.path, len(a.modules),
             "/".join(map(str, ranks)))
    return replace(model, source=source,
                   origin=f"{model.origin} + LoRA {a.path.name} ({len(a.modules)} matrices, rank {'/'.join(map(str, ranks))})")
