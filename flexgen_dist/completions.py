"""A prompt's result as the API returns it: ``Completion``, built from the last stage's tokens
(``completion``): decoded, cut at a stop string, a reasoning model's thinking apart."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection

from .engine.sampling import SamplingConfig, TokenLogprobs
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
    # vLLM's: what ended it, where not EOS or its length: the stop id, or the stop string
    stop_reason: int | str | None = None
    # a beam search's (``LLM.beam_search``): the sum of its tokens' log-probabilities over its
    # length to the power length_penalty
    score: float | None = None
    # with several choices per prompt (``generate(n=, best_of=)``): its place among its prompt's,
    # best first where best_of ranked them (``choices.py``)
    choice: int = 0


def completion(index: int, p: Prompt, res: Any, tokenizer: Any, reasoning: Reasoning | None,
               eos_ids: Collection[int], stops: StopStrings | None = None,
               cfg: SamplingConfig = SamplingConfig()) -> Completion:
    """Request ``index``'s ``Completion`` from its result ``res`` (token ids, or ids and their
    log-probabilities) under its sampling ``cfg``: a reasoning model's chat split into thinking
    and answer, the text cut before a stop string (in the thinking where the answer is empty),
    ``finish_reason`` "stop" at an id that ends it (EOS unless ignored, a stop id) or a stop
    string, whose text the completion's leaves out unless ``cfg.include_stop_str_in_output``."""
    toks, lps = res if isinstance(res, tuple) else (res, None)
    ends = cfg.ends(tuple(eos_ids))
    ended = bool(toks) and toks[-1] in ends
    shown = toks[:-1] if ended and not cfg.include_stop_str_in_output else toks
    split = reasoning.split(shown, p.ids, tokenizer) if reasoning is not None and p.messages is not None else None
    if split is not None:  # a reasoning model's chat: its answer and its thinking
        text, thought = split.content, split.reasoning
    else:
        text = tokenizer.decode(shown, skip_special_tokens=cfg.skip_special_tokens) if tokenizer is not None else None
        thought = None
    reason: int | str | None = toks[-1] if ended and toks[-1] not in eos_ids else None
    if stops is not None and text is not None and stops.has(index):
        if thought is not None and not text:  # the stop string ended the thinking
            thought, hit = stops.cut(index, thought, _floor(tokenizer, shown, 0, cfg), cfg.include_stop_str_in_output)
        else:
            text, hit = stops.cut(index, text, _floor(tokenizer, shown, split.answer_from if split else 0, cfg),
                                  cfg.include_stop_str_in_output)
        ended, reason = ended or hit is not None, hit if hit is not None else reason
    return Completion(index, p.ids, toks, text, p.text, "stop" if ended else "length", lps, thought,
                      split.answer_from if split is not None else 0, reason)


def _floor(tokenizer: Any, toks: list[int], start: int, cfg: SamplingConfig) -> int:
    """How many characters of the text of ``toks[start:]`` the first ``cfg.min_tokens`` new
    tokens make: a stop string ending within them does not count (vLLM's)."""
    if cfg.min_tokens <= start:
        return 0
    return len(tokenizer.decode(toks[start:cfg.min_tokens], skip_special_tokens=cfg.skip_special_tokens))