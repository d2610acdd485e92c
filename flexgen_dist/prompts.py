"""Reading prompts (.jsonl, .txt, synthetic); writing outputs is ``output.py``."""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from jinja2 import TemplateError

from .config import ConfigError

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "The three primary colors are",
    "To make a cup of tea, first",
]
# the default job's questions where the model has a chat template (an instruct model)
DEFAULT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "What are the three primary colors?",
    "How do I make a cup of tea?",
]
Messages = list[dict[str, str]]
Raw = tuple[Any, "str | None", "list[int] | None", "Messages | None", "str | None"]  # id, text, ids, messages, lora


@dataclass
class Prompt:
    """One request: its id, its text (for a chat, the rendered template) and token ids, and
    the conversation it was rendered from, if any."""

    id: Any
    text: str | None
    ids: list[int]
    messages: Messages | None = None
    lora: str | None = None  # the LoRA adapter it runs with, by name (a served one; None: the base model)


def read_prompts(path: str | None, num_prompts: int | None, prompt_len: int, tokenizer: Any | None,
                 vocab_size: int, seed: int = 0, template_kwargs: dict[str, Any] | None = None) -> list[Prompt]:
    """Prompts from a file, synthetic ids, or (neither given) a few built-in examples; chats
    rendered with the template's variables ``template_kwargs``."""
    if path is None and num_prompts is not None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(low=min(10, vocab_size - 1), high=vocab_size, size=(num_prompts, prompt_len),
                            generator=g)
        return [Prompt(i, None, row) for i, row in enumerate(ids.tolist())]
    if path is None and has_chat_template(tokenizer):
        raw: list[Raw] = [(i, None, None, [{"role": "user", "content": q}], None)
                          for i, q in enumerate(DEFAULT_QUESTIONS)]
    elif path is None:
        raw = [(i, t, None, None, None) for i, t in enumerate(DEFAULT_PROMPTS)]
    else:
        raw = _read_file(path)
    if not raw:
        raise ConfigError(f"{path}: no prompts in the file")
    if num_prompts is not None:
        raw = raw[:num_prompts]
    return [dataclasses.replace(make_prompt(pid, text, ids, tokenizer, vocab_size, messages,
                                            template_kwargs=template_kwargs), lora=lora)
            for pid, text, ids, messages, lora in raw]


def has_chat_template(tokenizer: Any | None) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_chat(pid: Any, messages: Any, tokenizer: Any | None, tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None, continue_final: bool | None = None,
                generation_prompt: bool = True, special: bool = False) -> tuple[str, list[int]]:
    """The conversation through the model's own chat template, as transformers renders it
    (with the assistant's turn opened, ``tools``' definitions where given, and the template's
    own variables ``template_kwargs``, e.g. ``enable_thinking``), and its token ids (the
    template writes the special tokens itself, so none are added unless ``special``).

    A conversation whose last message is the assistant's is continued, not answered
    (``continue_final``; None: as transformers' text-generation pipeline decides, by the last
    message's role): its text is a prefill the completion goes on from (an opening ``{``, an
    "Answer:"). ``generation_prompt`` False (vLLM's ``add_generation_prompt``) leaves the
    assistant's turn unopened."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ConfigError(f"prompt {pid!r}: 'messages' must be a non-empty list of "
                          "{\"role\": ..., \"content\": ...} objects with string values")
    if not has_chat_template(tokenizer):
        raise ConfigError(f"prompt {pid!r} is a chat but this model has no chat template: give "
                          "'prompt' text or 'input_ids' instead")
    last = messages[-1]["role"] == "assistant"
    cont = last if continue_final is None else continue_final
    if cont and not last:
        raise ConfigError(f"prompt {pid!r}: continue_final_message needs the conversation to end with the "
                          "assistant's message (the text to go on from)")
    extra = {**(template_kwargs or {}), "add_generation_prompt": generation_prompt and not cont,
             **({"continue_final_message": True} if cont else {})}
    if SYSTEM_TOOLS in tokenizer.chat_template:
        messages, tools = system_tools(messages, tools), None
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **extra)
    except TemplateError as e:  # the template's own refusal (raise_exception) or a bad variable
        raise ConfigError(f"prompt {pid!r}: the model's chat template refused it ({e})") from None
    except ValueError as e:  # transformers: the final message cannot be found in the rendered text
        raise ConfigError(f"prompt {pid!r}: the assistant's final message cannot be continued under this chat "
                          f"template ({e})") from None
    template = tokenizer.chat_template
    if tools and template not in _RENDERS_TOOLS:  # asked once per template, warned once
        _RENDERS_TOOLS[template] = text != tokenizer.apply_chat_template(messages, tokenize=False, **extra)
        if not _RENDERS_TOOLS[template]:
            logging.getLogger("flexgen_dist").warning(
                "this model's chat template does not render tools: the model is not shown the functions' "
                "definitions (a named or required call is still held to their parameters)")
    return text, list(tokenizer(text, add_special_tokens=special)["input_ids"])


_RENDERS_TOOLS: dict[str, bool] = {}  # chat template -> whether it writes the tools it is given
# Phi-4-mini's template writes the tools a system message carries (its own ``tools`` key, a JSON
# list of the functions), not the ``tools`` it is given
SYSTEM_TOOLS = "'<|tool|>' + message['tools']"


def system_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation as a template that reads its tools from the system message wants it
    (Phi-4-mini's): ``tools`` there, a JSON list of the functions' definitions (an empty
    system message opens a conversation that has none), and an assistant's earlier calls
    written as the model writes them, ``functools[{"name", "arguments"}, ...]`` after its text
    (that template renders only a message's content)."""
    def written(m: dict[str, Any]) -> dict[str, Any]:
        calls = m.get("tool_calls")
        if m["role"] != "assistant" or not isinstance(calls, list) or not calls:
            return m
        listed = []
        for c in calls:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass  # kept as the text it was given
            listed.append({"name": fn.get("name"), "arguments": args})
        said = m["content"].strip()
        return {k: v for k, v in m.items() if k != "tool_calls"} | {
            "content": (said + " " if said else "") + "functools" + json.dumps(listed, ensure_ascii=False)}

    messages = [written(m) for m in messages]
    if not tools:
        return messages
    listed = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False)
    first = messages[0] if messages[0]["role"] == "system" else {"role": "system", "content": ""}
    return [{**first, "tools": listed}, *messages[1 if first is messages[0] else 0:]]


def make_prompt(pid: Any, text: str | None, ids: list[int] | None, tokenizer: Any | None,
                vocab_size: int, messages: Messages | None = None,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                continue_final: bool | None = None, generation_prompt: bool = True,
                special: bool | None = None) -> Prompt:
    """A checked prompt: a chat is rendered by the model's template (with ``tools``' and the
    template's variables where given; a final assistant message continued as ``render_chat``
    says), text is tokenized; ids must be non-empty and inside the vocabulary. ``special``
    (vLLM's ``add_special_tokens``): whether the tokenizer adds its special tokens (a BOS) to
    the text; None: as transformers does for text, not for a rendered chat (its template
    writes them)."""
    if messages is not None:
        text, ids = render_chat(pid, messages, tokenizer, tools, template_kwargs, continue_final, generation_prompt,
                                bool(special))
    if ids is None:
        if tokenizer is None:
            raise ConfigError(f"prompt {pid!r} is text but this model has no tokenizer: give "
                              "'input_ids' in a .jsonl file, or --num-prompts N --prompt-len S for synthetic prompts")
        ids = list(tokenizer(text, add_special_tokens=special is not False)["input_ids"])
    if not ids:
        raise ConfigError(f"prompt {pid!r} is empty: remove it or give it some text")
    bad = [t for t in ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ConfigError(f"prompt {pid!r}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return Prompt(pid, text, [int(t) for t in ids], messages)


def truncated(p: Prompt, keep: int | None, room: int) -> Prompt:
    """``p`` cut to its last ``keep`` tokens (vLLM's ``truncate_prompt_tokens``: left
    truncation; -1: the ``room`` the model leaves it; None: uncut); a cut prompt keeps no text
    (its ids are the prompt now)."""
    n = room if keep == -1 else keep
    if n is None or n < 1 or len(p.ids) <= n:
        return p
    return dataclasses.replace(p, text=None, ids=p.ids[-n:])


def check_truncation(keep: Any, name: str = "truncate_prompt_tokens") -> int | None:
    """A ``truncate_prompt_tokens`` value: None, -1 or an integer >= 1; else a one-line error."""
    if keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and (keep == -1 or keep >= 1)):
        return keep
    raise ConfigError(f"{name} {keep!r}: give an integer >= 1 (keep a prompt's last that many tokens) or -1 "
                      "(as many as the model has room for)")


def check_prompt_lengths(prompts: list[Prompt], gen_len: int, max_positions: int) -> None:
    """Refuse a prompt that, with ``gen_len`` new tokens, needs more positions than the model has."""
    for p in prompts:
        if len(p.ids) + gen_len > max_positions:
            raise ConfigError(f"prompt {p.id!r} has {len(p.ids)} tokens; with --gen-len {gen_len} that "
                              f"exceeds the model's {max_positions} positions: shorten it, lower --gen-len or give "
                              "--truncate-prompt-tokens")


def jsonl_records(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(0-based line number, object) of each non-blank line; a line that is not a JSON object
    is a one-line error naming the file and line."""
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n + 1}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path}:{n + 1}: each line must be a JSON object")
        yield n, rec


def _read_file(path: str) -> list[Raw]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    lines = p.read_text(encoding="utf-8").splitlines()
    if p.suffix == ".jsonl" or p.suffix == ".json":
        out = []
        for n, rec in jsonl_records(p, "\n".join(lines)):
            if "prompt" not in rec and "input_ids" not in rec and "messages" not in rec:
                raise ConfigError(f"{path}:{n + 1}: each line needs a 'prompt', 'messages' or 'input_ids' field")
            pid, lora = rec.get("id", n), rec.get("lora")
            if lora is not None and not isinstance(lora, str):
                raise ConfigError(f"{path}:{n + 1}: 'lora' must be the name of a LoRA adapter (--lora-modules NAME=DIR)")
            if "input_ids" in rec:
                ids = rec["input_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ConfigError(f"{path}:{n + 1}: 'input_ids' must be a list of integers")
                out.append((pid, rec.get("prompt"), ids, None, lora))
            elif "messages" in rec:
                out.append((pid, None, None, rec["messages"], lora))
            else:
                out.append((pid, str(rec["prompt"]), None, None, lora))
        return out
    return [(n, line, None, None, None) for n, line in enumerate(lines) if line.strip()]


class StopStrings:
    """Each request's stop strings, checked on its newest ids as they come (stage 0 of the loop)
    and cut from its text at the end (``cut``): the completion ends before the first of them.
    ``floors``: per request, its ``min_tokens`` (vLLM's): a stop string counts only where it
    ends after that many new tokens' text.

    A stop string of c characters is spread over at most 4c byte-level tokens, so decoding
    that many of the newest ids finds it the step it completes."""

    def __init__(self, stops: tuple[tuple[str, ...], ...], tokenizer: Any | None,
                 floors: Sequence[int] | None = None) -> None:
        if tokenizer is None and any(stops):
            raise ConfigError("stop strings need the model's tokenizer (this model has none): drop 'stop'")
        self.stops, self.tokenizer = stops, tokenizer
        self.floors = list(floors) if floors is not None else [0] * len(stops)
        self._tail = [4 * max((len(s) for s in st), default=0) + 2 for st in stops]

    def has(self, n: int) -> bool:
        return bool(self.stops[n])

    def hit(self, n: int, ids: list[int]) -> bool:
        """Whether request n's completion so far (``ids``) holds one of its stop strings (past
        its floor)."""
        floor = self.floors[n]
        if len(ids) <= floor:
            return False
        start = max(0, len(ids) - self._tail[n])
        text = self.tokenizer.decode(ids[start:], skip_special_tokens=True)
        before = len(self.tokenizer.decode(ids[start:floor], skip_special_tokens=True)) if floor > start else 0
        return first_stop(text, self.stops[n], before) is not None

    def cut(self, n: int, text: str, floor: int = 0, include: bool = False) -> tuple[str, str | None]:
        """Request n's text up to its first stop string ending past character ``floor`` (through
        it where ``include``), and that string (None: none found)."""
        found = first_stop(text, self.stops[n], floor)
        if found is None:
            return text, None
        at, s = found
        return text[:at + len(s) if include else at], s


def first_stop(text: str, stops: Sequence[str], floor: int = 0) -> tuple[int, str] | None:
    """Where the first of ``stops`` that ends past character ``floor`` starts in ``text``, and
    which (None: none does)."""
    hits = [(i, s) for s in stops for i in [text.find(s, max(0, floor - len(s) + 1))] if i >= 0]
    return min(hits, key=lambda h: h[0]) if hits else None
