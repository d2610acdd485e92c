"""A prompt's result as the API returns it: ``Completion``, built from the last stage's tokens
(``completion``): decoded, cut at a stop string, a reasoning model's thinking apart."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection

from .engine.sampling import TokenLogprobs
from .prompts import Prompt, StopStrings
from .reasoning import Reasoning


@dataclass
class Completion:
    """One prompt's result, in input order."""

    index: int  # position of the prompt in the generate call's input
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, up to and including the first EOS (or a stop string's)
    text: str | None  # the decoded completion, cut before a stop string (None: no tokenizer)
    prompt: str | None = None  # the prompt's text, when it was given as text
    # "stop": at EOS or a stop string; "length": at the request's limit of new tokens
    finish_reason: str = "length"
    # with ``logprobs=k``: each token of ``token_ids``'s log-probability, and its k alternatives
    logprobs: TokenLogprobs | None = None
    # a reasoning model's chat completion (``reasoning.py``): its thinking (``text`` is then the
    # answer alone) and where the answer starts in ``token_ids``
    reasoning: str | None = None
    answer_from: int = 0


def completion(index: int, p: Prompt, res: Any, tokenizer: Any, reasoning: Reasoning | None,
               eos_ids: Collection[int], stops: StopStrings | None = None, ignore_eos: bool = False) -> Completion:
    """Request ``index``'s ``Completion`` from its result ``res`` (token ids, or ids and their
    log-probabilities): a reasoning model's chat split into thinking and answer, the text cut
    before a stop string (in the thinking where the answer is empty), ``finish_reason`` "stop"
    at an EOS (unless ignored) or a stop string."""
    toks, lps = res if isinstance(res, tuple) else (res, None)
    split = reasoning.split(toks, p.ids, tokenizer) if reasoning is not None and p.messages is not None else None
    if split is not None:  # a reasoning model's chat: its answer and its thinking
        text, thought = split.content, split.reasoning
    else:
        text = tokenizer.decode(toks, skip_special_tokens=True) if tokenizer is not None else None
        thought = None
    stopped = bool(toks) and toks[-1] in eos_ids and not ignore_eos
    if stops is not None and text is not None and stops.has(index):
        if thought is not None and not text:  # the stop string ended the thinking
            thought, hit = stops.cut(index, thought)
        else:
            text, hit = stops.cut(index, text)
        stopped = stopped or hit
    return Completion(index, p.ids, toks, text, p.text, "stop" if stopped else "length", lps, thought,
                      split.answer_from if split is not None else 0)
