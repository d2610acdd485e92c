"""Embeddings (``LLM.embed``, a batch file's ``/v1/embeddings`` requests): each input's last
hidden state after the model's final norm, last-token pooled, as decoder embedding models
(Qwen3-Embedding, e5-mistral, gte-Qwen2, SFR-Embedding) define theirs; optionally cut to its
first ``dimensions`` (Matryoshka-trained models, OpenAI's ``dimensions``), then L2-normalized.

The run is a prefill with no token generated: the last stage's head gives each sequence's
vector (``engine.head.embed``) in the place scoring's rows take, and stage 0 gets them at the
block's end (``distributed.scores.BlockScores``), so every placement, pipeline and launcher
serves embeddings as it serves generation."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from .config import ConfigError
from .models.pooling import POOLINGS
from .models.spec import ModelSpec
from .plan import Workload


@dataclass
class Embedding:
    """One input's embedding."""

    index: int  # position of the input in the embed call
    embedding: list[float]
    prompt_tokens: int  # the input's tokens


@dataclass
class Classification:
    """A sequence classifier's result for one input (``LLM.classify``)."""

    index: int  # position of the input in the classify call
    logits: list[float]  # per label, at the last token (a reward model: its one reward)
    probs: list[float]  # their softmax
    label: str  # the most likely label's name (``id2label``)
    prompt_tokens: int

    @classmethod
    def of(cls, e: Embedding, labels: Sequence[str]) -> Classification:
        logits = torch.tensor(e.embedding, dtype=torch.float64)
        best = int(logits.argmax())
        return cls(e.index, e.embedding, logits.softmax(-1).float().tolist(),
                   labels[best] if best < len(labels) else f"LABEL_{best}", e.prompt_tokens)


def finish(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> list[float]:
    """A sequence's vector (float32) cut to its first ``dimensions`` (None: all), then divided
    by its L2 norm where ``normalize`` (a zero vector stays zero)."""
    v = vector.double()
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = v / v.norm().clamp_min(1e-12)
    return v.float().tolist()


def check_embed(dimensions: int | None, spec: ModelSpec, width: int | None = None) -> None:
    """What keeps ``embed`` from giving this model's vectors (``width`` values: default the
    spec's ``embed_dim``) cut to ``dimensions``: a sentence-transformers step it does not
    compute, no one pooling mode, too many dimensions."""
    width = spec.embed_dim if width is None else width
    if spec.embed_refusal and not spec.num_labels:
        raise ConfigError(f"embed(): {spec.name}: {spec.embed_refusal}")
    if not spec.pooling and not spec.num_labels:
        raise ConfigError(f"embed(): {spec.name}'s Pooling module sets no one pooling mode: choose one with "
                          f"--pooling ({', '.join(POOLINGS)})")
    if dimensions is not None and spec.num_labels:
        raise ConfigError("dimensions: a sequence classifier's results are its labels' logits, not an embedding")
    if dimensions is not None and not 1 <= int(dimensions) <= width:
        raise ConfigError(f"dimensions {dimensions}: this model's embeddings have {width}; give 1 to "
                          f"{width} (or none for all)")


def embed_workload(scored: Workload) -> Workload:
    """The workload of an embed call from ``workloads.build_workload(..., scoring=True)``'s:
    one prefill step, no sampling, the head's vectors for results."""
    return dataclasses.replace(scored, gen_len=1, embed=True, logprobs=None)
