"""Reasoning models: a chat completion's thinking apart from its answer.

A reasoning model thinks before it answers, in a syntax its chat template teaches:
``<think> ... </think>`` then the answer (Qwen3, QwQ, DeepSeek-R1, GLM-4.5, SmolLM3, Kimi,
MiniMax-M2, ...; Magistral's ``[THINK] ... [/THINK]``, Seed-OSS' ``<seed:think> ...
</seed:think>``; where the template has opened the thinking in the prompt already, the
completion starts inside it), or gpt-oss' harmony messages (``<|channel|>analysis<|message|>...<|end|>`` then
``<|start|>assistant<|channel|>final<|message|>...``, with calls as ``commentary`` messages to
``functions.NAME``). ``--reasoning-parser`` (``auto``, the default: found by what the template
writes and the tokenizer holding its marker tokens; ``think``; ``harmony``; ``none``) picks it.
With one, a chat completion's ``text`` is its answer and ``reasoning`` its thinking (OpenAI
Batch: ``message.reasoning``, vLLM's field), and a structure holds the answer only, after the
thinking (``Structure.after``). Completions of text prompts are never split.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from .config import REASONING_PARSERS as PARSERS
from .config import ConfigError

# a thinking between two marker tokens: the pairs, in the order a template is searched for them
THINKS = (("<seed:think>", "</seed:think>"), ("[THINK]", "[/THINK]"), ("<think>", "</think>"))
_HARMONY = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")
# the thinking's own rules beside ``start`` (``Reasoning.after``)
_THINKING = "\nthinking: /(?s:.*)/\nWS: /[ \\t\\r\\n]+/\n"
_HARMONY_ENDS = re.compile(r"<\|(?:end|call|return)\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass(frozen=True)
class Split:
    """A completion as a reasoning model's: its thinking (None: it did not think), its answer,
    and where the answer starts among its token ids (what a reader of tool calls reads)."""

    reasoning: str | None
    content: str
    answer_from: int = 0


@dataclass(frozen=True)
class Message:
    """One harmony message of a completion: its channel, its recipient ("" for the user) and
    its text."""

    channel: str
    recipient: str
    text: str


@dataclass(frozen=True)
class Reasoning:
    """How a model thinks: ``syntax`` ``think`` (``marks``: the ids of its opening and
    closing markers, ``<think>`` and ``</think>`` or another pair of ``THINKS``) or
    ``harmony`` (``marks``: its four markers' ids)."""

    syntax: str
    marks: tuple[int, ...]

    def opened(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves the thinking open (its last marker is ``<think>``): the
        completion starts inside it."""
        if self.syntax != "think":
            return False
        start, end = self.marks
        return next((t == start for t in reversed(prompt_ids) if t in (start, end)), False)

    def after(self, prompt_ids: Sequence[int]) -> str:
        """What a structure of this prompt's completion follows (``Structure.after``): Lark
        rules of the thinking before ``@answer``, its markers as special tokens by id (so no
        text inside the thinking matches them, and the thinking's regex cannot take them)."""
        t = [f"<[{i}]>" for i in self.marks]
        if self.syntax == "harmony":  # an analysis message, then the final one
            return f'start: ({t[0]} "analysis" {t[1]} thinking {t[2]} {t[3]} "assistant")? ' \
                   f'{t[0]} "final" {t[1]} @answer' + _THINKING
        if self.opened(prompt_ids):  # the prompt opened it: the completion is inside the thinking
            return f"start: thinking {t[1]} WS? @answer" + _THINKING
        return f"start: ({t[0]} thinking {t[1]} WS?)? @answer" + _THINKING

    def split(self, ids: Sequence[int], prompt_ids: Sequence[int], tokenizer: Any) -> Split:
        """The thinking and the answer of a completion's ``ids`` (the EOS included or not)."""
        if self.syntax == "harmony":
            msgs = harmony_messages(tokenizer.decode(list(ids), skip_special_tokens=False), tokenizer)
            if not msgs:
                return Split(None, tokenizer.decode(list(ids), skip_special_tokens=True))
            thought = [m.text for m in msgs if m.channel == "analysis"]
            return Split("\n\n".join(thought) if thought else None, harmony_answer(msgs))
        start, end = self.marks
        ids = list(ids)
        begin = 0
        if not self.opened(prompt_ids):
            first = next((n for n, t in enumerate(ids) if tokenizer.decode([t]).strip()), None)
            if first is None or ids[first] != start:
                return Split(None, tokenizer.decode(ids, skip_special_tokens=True))
            begin = first + 1
        close = next((n for n in range(begin, len(ids)) if ids[n] == end), len(ids))
        thought = tokenizer.decode(ids[begin:close], skip_special_tokens=True).strip()
        answer = tokenizer.decode(ids[close + 1:], skip_special_tokens=True).lstrip()
        return Split(thought, answer, min(close + 1, len(ids)))


def harmony_messages(raw: str, tokenizer: Any | None = None) -> list[Message]:
    """The harmony messages of a completion's text with its special tokens: each
    ``<|channel|>C [to=R] ... <|message|>TEXT`` up to ``<|end|>``, ``<|call|>``, ``<|return|>``
    or the end (a completion cut at its limit); other special tokens' text dropped."""
    specials = [s for s in getattr(tokenizer, "all_special_tokens", []) if s] if tokenizer is not None else []
    out = []
    for part in _HARMONY_ENDS.split(raw):
        if "<|message|>" not in part:
            continue
        head, text = part.split("<|message|>", 1)
        channel, to = _CHANNEL.search(head), _RECIPIENT.search(head)
        for s in specials:
            text = text.replace(s, "")
        out.append(Message(channel.group(1) if channel else "", to.group(1) if to else "", text.strip()))
    return out


def harmony_answer(msgs: list[Message]) -> str:
    """What harmony messages say to the user: the final (and recipient-less commentary)
    messages' text; the analysis is the reasoning, a message to a recipient a call."""
    return "\n\n".join(m.text for m in msgs if m.channel != "analysis" and not m.recipient)


def reasoning_of(tokenizer: Any | None, parser: str = "auto") -> Reasoning | None:
    """How the model's chat completions think (None: not split): ``parser`` ``auto`` finds it
    by what the chat template writes and the tokenizer holding the markers as single tokens;
    ``think`` or ``harmony`` names it (refused in one line where the tokenizer lacks them)."""
    if parser not in PARSERS:
        raise ConfigError(f"--reasoning-parser {parser!r}: use {', '.join(PARSERS)}")
    if parser == "none" or tokenizer is None:
        return None
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    # what the template writes: harmony's channels, or the first pair of thinking markers
    found = _HARMONY if _HARMONY[0] in template else next((m for m in THINKS if m[0] in template), None)
    if parser == "auto":
        ids = None if found is None else _single_ids(tokenizer, found)
        return None if ids is None else Reasoning("harmony" if found is _HARMONY else "think", ids)
    marks = _HARMONY if parser == "harmony" else found if found not in (None, _HARMONY) else THINKS[-1]
    ids = _single_ids(tokenizer, marks)  # type: ignore[arg-type]
    if ids is None:
        raise ConfigError(f"--reasoning-parser {parser}: this model's tokenizer has no single tokens "
                          f"{' '.join(marks)}; use --reasoning-parser none (or auto)")  # type: ignore[arg-type]
    return Reasoning(parser, ids)


def _single_ids(tokenizer: Any, marks: Sequence[str]) -> tuple[int, ...] | None:
    ids = []
    for m in marks:
        enc = tokenizer.encode(m, add_special_tokens=False)
        if len(enc) != 1:
            return None
        ids.append(int(enc[0]))
    return tuple(ids)
