"""Function calling in OpenAI Batch chat requests: ``tools`` and a ``tool_choice`` that names a
function, or ``required``, held to the functions' parameter schemas by structured output.

The tools go to the model's chat template (``apply_chat_template(tools=...)``, as transformers
renders them; Phi-4-mini's on the system message, ``prompts.render_chat``), and the completion
is constrained (``engine/structure.py``): for a named function, to a JSON object matching its
``parameters``; for ``required``, to a non-empty JSON array of ``{"name", "arguments"}`` calls
of the given functions. The response carries them as ``message.tool_calls`` with
``finish_reason`` ``tool_calls``, as OpenAI's API does (and vLLM, which constrains named and
required tool choices the same way). ``tool_choice`` ``auto`` (the default when tools are
given) leaves the choice to the model, so its calls are read back from its own syntax, the one
its chat template teaches (``tool_calls.py``), the text before them the message's content (a
reasoning model's thinking is left out first: ``reasoning.py``). For a template that teaches
none of those syntaxes, ``auto`` is refused in one line naming the choices that work; ``none``
renders the tools and constrains nothing.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .engine.structure import Structure
from .tool_calls import READERS

REQUIRED = "required"
AUTO = "auto"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolError(ValueError):
    """What is wrong with a request's tools (the caller makes it a request error)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's tools (as its body gives them, for the template) and what the
    completion must be: ``call`` a function's name, ``REQUIRED`` (one or more calls of any),
    or None (``tool_choice`` none: nothing constrained)."""

    tools: tuple[dict[str, Any], ...]
    call: str | None
    syntax: str = ""  # ``auto``: the reader of the model's own calls (``tool_calls.READERS``)

    def structure(self) -> Structure | None:
        if self.call is None or self.call == AUTO:
            return None
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.call != REQUIRED:
            return Structure.json_schema(params[self.call])
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in params.items()]
        return Structure.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def parse_tools(body: dict[str, Any], chat: bool, syntax: str = "") -> ToolChoice | None:
    """The request's ``tools`` and ``tool_choice`` (None: no tools); ``syntax``: the reader of
    the calls the model's template teaches (``tool_calls.reads_auto``; "": none known). A ``ToolError``
    says what is wrong in one line."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("invalid_value", f"tool_choice {choice!r} needs 'tools'")
        return None
    if not chat:
        raise ToolError("unsupported_field", "tools is a chat field: a completions request has no tools")
    if not isinstance(tools, list):
        raise ToolError("invalid_value", "tools must be a list of {'type': 'function', 'function': {...}}")
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise ToolError("invalid_value", "each tool must be {'type': 'function', 'function': {'name': ..., "
                                             "'parameters': {...}}}, its name 1-64 letters, digits, _ or -")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ToolError("invalid_value", f"tool {fn['name']!r}: parameters must be a JSON schema object")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise ToolError("invalid_value", "two tools have one name: give each function its own")
    if (choice is None or choice == AUTO) and syntax:
        return ToolChoice(tuple(tools), AUTO, syntax)
    if choice is None or choice == AUTO:
        raise ToolError("unsupported_field", "tool_choice 'auto' (the default with tools) reads the model's own "
                                             "calls, in a syntax this model's chat template does not teach "
                                             "(<tool_call> blocks, [TOOL_CALLS], DeepSeek's, Kimi's, MiniMax's, Granite's, Llama 3's JSON, "
                                             "pythonic lists, harmony, Phi-4-mini's functools): set "
                                             "tool_choice to 'required', to {'type': 'function', 'function': "
                                             "{'name': ...}}, or to 'none'")
    if choice == "none":
        return ToolChoice(tuple(tools), None)
    if choice == REQUIRED:
        return ToolChoice(tuple(tools), REQUIRED)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in names:
        raise ToolError("invalid_value", f"tool_choice {choice!r}: name one of the tools ({', '.join(names)}), or "
                                         "give 'required' or 'none'")
    return ToolChoice(tuple(tools), name)


def tool_message(choice: ToolChoice, text: str, key: str, raw: str | None = None) -> dict[str, Any] | None:
    """The assistant message of a completion under ``choice`` where it holds whole calls
    (``{"role", "content", "tool_calls"}``), else None (its text stays the content: a
    completion cut at its token limit, or an ``auto`` one that called nothing). ``key`` makes
    each call's id (stable in a resumed job); ``raw``: the text with its special tokens, which
    ``auto`` reads (``tool_calls``)."""
    content = None
    if choice.call is None:
        return None
    if choice.call == AUTO:
        read = READERS[choice.syntax][1]
        tools = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
                 for t in choice.tools}
        content, calls = read(raw if raw is not None else text, tools)
        if not calls:
            return None
    elif choice.call == REQUIRED:
        try:
            calls = [(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
        except (json.JSONDecodeError, TypeError, KeyError):
            return None
    else:
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        calls = [(choice.call, text)]
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": "call_" + hashlib.sha256(f"{key}|{n}".encode()).hexdigest()[:24], "type": "function",
                            "function": {"name": name, "arguments": args}} for n, (name, args) in enumerate(calls)]}
