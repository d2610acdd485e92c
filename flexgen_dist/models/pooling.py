"""How an embedding model pools its last hidden states into one vector (``ModelSpec.pooling``),
as its own files say: a sentence-transformers directory's ``modules.json`` and its Pooling
module's ``config.json`` (the format Qwen3-Embedding, gte-Qwen2, stella and KaLM ship in), or a
GGUF file's ``{arch}.pooling_type``; the last token where neither says (decoder embedding
models such as e5-mistral). ``--pooling`` overrides it.

After pooling, a pipeline's ``Dense`` projections (a linear map with a bias and an
activation, as stella's 1024-wide head) are applied on rank 0 to each pooled vector
(``Projection``: small, float64); any other step there is not computed, and
``ModelSpec.embed_refusal`` says so: ``embed`` refuses the model in one line rather than give
other vectors."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .source import ModelLoadError

log = logging.getLogger("flexgen_dist")

# pooling modes (``ModelSpec.pooling``): the last token; the mean, the square-root-of-length
# scaled sum, the position-weighted mean (weights 1, 2, ...) or the maximum over the input's
# tokens; its first token
POOLINGS = ("last", "mean", "cls", "max", "mean_sqrt_len", "weighted_mean")
# sentence-transformers' Pooling config fields -> mode
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
            "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
            "pooling_mode_weightedmean_tokens": "weighted_mean"}
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_* (0: none)
ST_KEPT = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
           "sentence_transformers.models.Normalize", "sentence_transformers.models.Dense"}  # what ``embed`` computes
# a Dense module's activation_function -> its function (float64 tensors)
ACTIVATIONS = {"Identity": lambda x: x, "Tanh": torch.tanh, "ReLU": torch.relu, "Sigmoid": torch.sigmoid,
               "GELU": torch.nn.functional.gelu}


@dataclass(frozen=True)
class Projection:
    """A sentence-transformers pipeline's ``Dense`` steps after pooling, in order: each
    ``act(W v + b)`` (float64)."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor | None, str], ...]

    @property
    def out_dim(self) -> int:
        return int(self.layers[-1][0].shape[0])

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        v = v.double()
        for w, b, act in self.layers:
            v = ACTIVATIONS[act](torch.nn.functional.linear(v, w, b))
        return v

    @classmethod
    def load(cls, dirs: list[Path], width: int) -> Projection:
        """The Dense modules in ``dirs`` (each its ``config.json`` and weights: ``linear.weight``,
        ``linear.bias``), checked to chain from the pooled ``width``."""
        layers = []
        for d in dirs:
            cfg = json.loads((d / "config.json").read_text())
            act = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
            if act not in ACTIVATIONS:
                raise ModelLoadError(f"{d}: Dense activation {act!r} is not computed (only {', '.join(ACTIVATIONS)})")
            w = _dense_weights(d)
            weight, bias = w.get("linear.weight"), w.get("linear.bias")
            if weight is None or weight.dim() != 2 or weight.shape[1] != width:
                raise ModelLoadError(f"{d}: its Dense weight (linear.weight) is missing or does not take the "
                                     f"{width} values before it: a broken sentence-transformers pipeline")
            layers.append((weight.double(), None if bias is None else bias.double(), act))
            width = int(weight.shape[0])
        return cls(tuple(layers))


def _dense_weights(d: Path) -> dict[str, torch.Tensor]:
    if (d / "model.safetensors").exists():
        from safetensors.torch import load_file
        return load_file(str(d / "model.safetensors"))
    if (d / "pytorch_model.bin").exists():
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{d}: a Dense module without its weights (model.safetensors or pytorch_model.bin)")


@dataclass(frozen=True)
class SentencePipeline:
    """What a sentence-transformers directory does with the model's states: its pooling mode
    (None: it says none; "": no one mode, so ``--pooling`` must), its Dense steps' directories
    after pooling, and why ``embed`` must refuse it ("" where nothing stands in the way)."""

    pooling: str | None = None
    dense: tuple[Path, ...] = ()
    refusal: str = ""


def sentence_pipeline(path: Path) -> SentencePipeline:
    """The sentence-transformers pipeline of a model directory (an empty one where it has no
    ``modules.json``)."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return SentencePipeline()
    if not isinstance(modules, list):
        return SentencePipeline()
    modules = [m for m in modules if isinstance(m, dict)]
    types = [str(m.get("type", "")) for m in modules]
    dense = tuple(path / str(m.get("path", "")) for m in modules if str(m.get("type", "")).endswith(".Dense"))
    pooled, refusal = _pooling(path, modules, types)
    order = [t.rsplit(".", 1)[-1] for t in types if t.endswith((".Dense", ".Normalize"))]
    if "Normalize" in order and "Dense" in order[order.index("Normalize"):] and not refusal:
        refusal = "its sentence-transformers pipeline normalizes before a Dense step; here the Dense steps come first"
    return SentencePipeline(pooled, dense, refusal)


def _pooling(path: Path, modules: list[dict[str, Any]], types: list[str]) -> tuple[str | None, str]:
    extra = [t.rsplit(".", 1)[-1] for t in types if t not in ST_KEPT]
    refusal = (f"its sentence-transformers pipeline has a {', '.join(extra)} step, which is not computed here: "
               "its vectors would differ from the model's") if extra else ""
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None, refusal
    try:
        cfg: dict[str, Any] = json.loads((path / str(pooling.get("path", "")) / "config.json").read_text())
    except (OSError, ValueError):
        return None, refusal
    modes = [m for k, m in ST_MODES.items() if cfg.get(k)]
    if len(modes) != 1:
        log.warning("%s: its sentence-transformers Pooling module sets %d modes (%s), one is computed here: embed() "
                    "needs --pooling", path.name, len(modes), ", ".join(modes) or "none")
        return "", refusal
    if cfg.get("include_prompt") is False:
        log.info("%s: its Pooling module leaves out a prompt's tokens (include_prompt false); here every token of "
                 "each input is pooled, its instruction included", path.name)
    return modes[0], refusal


def gguf_pooling(value: Any) -> str | None:
    """A GGUF file's ``{arch}.pooling_type`` as a mode (None: none given, or none that embeds)."""
    return GGUF_POOLING.get(int(value)) if isinstance(value, int) else None
