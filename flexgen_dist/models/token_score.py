"""A language model read as a one-label classifier from its logits of one or two tokens
(``--classifier-from-token``, vLLM's ``classifier_from_token``): how LLM rerankers such as
Qwen3-Reranker ("no", "yes"), bge-reranker-v2-gemma ("Yes") and mxbai-rerank-v2 ship, as
causal LMs whose answer token is the judgement.

With two tokens (A, B) the score head is the difference of their head rows, so the one logit
is ``logit(B) - logit(A)`` and its sigmoid is B's probability against A alone
(``softmax([logit(A), logit(B)])[1]``, the models' own formula); with one token it is that
token's logit. The head's linear scale (Cohere's ``logit_scale``, Granite's divisor) is folded
in, so the difference is of the logits the LM computes; a final soft-cap (Gemma 2/3) or a
head bias would make it no longer a difference of rows, and is refused. The rest of the
model is read unchanged; the spec becomes a one-label classifier's, so ``classify``,
``score_pairs``, ``rerank`` and ``/v1/score`` / ``/v1/rerank`` serve it, and pairs are
joined as one text (an LLM reranker reads one prompt, ``ModelSpec.pair_sep`` off)."""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from .lora import WrappedSource
from .packed import PackedWeight
from .source import ModelLoadError, WeightSource

if TYPE_CHECKING:
    from .loader import LoadedModel

log = logging.getLogger("flexgen_dist")


def token_ids(tokenizer: Any | None, tokens: Sequence[str]) -> tuple[int, ...]:
    """Each token's id: a vocabulary entry of that spelling, else a text the tokenizer reads
    as exactly one token; anything else is a one-line error."""
    if tokenizer is None:
        raise ModelLoadError("--classifier-from-token needs the model's tokenizer to find the tokens: this model "
                             "has none")
    out = []
    for t in tokens:
        i = tokenizer.convert_tokens_to_ids(t)
        if i is None or i == tokenizer.unk_token_id:
            ids = tokenizer(t, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ModelLoadError(f"--classifier-from-token {t!r}: not one token of this tokenizer (it reads "
                                     f"as {len(ids)}): give the token as the vocabulary spells it")
            i = ids[0]
        out.append(int(i))
    return tuple(out)


class TokenScoreSource(WrappedSource):
    """The base source with its head part replaced by the final norm and a one-row score head
    (module doc); every other part is the base's."""

    def __init__(self, base: WeightSource, ids: tuple[int, ...], label: str) -> None:
        spec = base.spec
        super().__init__(base, dataclasses.replace(spec, num_labels=1, labels=(label,), pair_sep=False,
                                                   tie_word_embeddings=False))
        self.ids = ids
        self.scale = spec.logit_scale / spec.logits_divisor

    def get(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor]:
        if part != "head":
            return self.base.get(part, layer)
        w = self.base.get("head")
        rows = w["lm_head.w" if "lm_head.w" in w else "tok.w"][list(self.ids)].double()
        row = rows[1] - rows[0] if len(self.ids) == 2 else rows[0]
        return self._checked(part, layer, {"norm.w": w["norm.w"], "score.w": (row * self.scale)[None]})

    def get_packed(self, part: str, layer: int | None = None) -> dict[str, torch.Tensor | PackedWeight]:
        return dict(self.get(part, layer)) if part == "head" else self.base.get_packed(part, layer)

    def packed_formats(self, part: str, layer: int | None = None) -> dict[str, tuple[Any, ...]]:
        return {} if part == "head" else self.base.packed_formats(part, layer)


def with_token_classifier(model: LoadedModel, tokens: Sequence[str],
                          find_ids: Callable[[], tuple[int, ...]]) -> LoadedModel:
    """``model`` read as a one-label classifier of ``tokens`` (their ids from ``find_ids``:
    one, or two whose difference is the logit), refused in one line where its head is not
    linear in the rows."""
    spec = model.spec
    name = f"--classifier-from-token {' '.join(tokens)}"
    if spec.num_labels:
        raise ModelLoadError(f"{name}: {spec.name} is already a sequence classifier ({spec.num_labels} labels)")
    if len(tokens) not in (1, 2):
        raise ModelLoadError(f"{name}: give one token (its logit) or two (the second's logit minus the first's)")
    if spec.family not in ("llama", "gemma", "cohere"):
        raise ModelLoadError(f"{name}: read for the Llama, Gemma and Cohere families' architectures (Qwen, Llama, "
                             f"Gemma, Mistral, ...), not {spec.family}")
    if spec.final_softcap > 0:
        raise ModelLoadError(f"{name}: {spec.name} soft-caps its logits, so a difference of head rows is not its "
                             "logits' difference")
    if spec.lm_head_bias:
        raise ModelLoadError(f"{name}: {spec.name}'s head has a bias: a difference of head rows is not its "
                             "logits' difference")
    ids = find_ids()
    bad = [i for i in ids if not 0 <= i < spec.vocab_size]
    if bad:
        raise ModelLoadError(f"{name}: token id {bad[0]} is outside the vocabulary (0..{spec.vocab_size - 1})")
    label = tokens[-1]
    source = TokenScoreSource(model.source, ids, label)
    log.info("%s read as a one-label classifier: %s", spec.name,
             f"logit({tokens[1]!r}) - logit({tokens[0]!r})" if len(ids) == 2 else f"logit({tokens[0]!r})")
    return dataclasses.replace(model, spec=source.spec, source=source,
                               origin=f"{model.origin} (scored by {' vs '.join(repr(t) for t in tokens)})")
