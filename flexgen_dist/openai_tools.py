"""Function calling in OpenAI Batch chat requests: ``tools`` and a ``tool_choice`` that names a
function, or ``required``, held to the functions' parameter schemas by structured output.

The tools go to the model's chat template (``apply_chat_template(tools=...)``, as transformers
renders them), and the completion is constrained (``engine/structure.py``): for a named
function, to a JSON object matching its ``parameters``; for ``required``, to a non-empty JSON
array of ``{"name", "arguments"}`` calls of the given functions. The response carries them
as ``message.tool_calls`` with ``finish_reason`` ``tool_calls``, as OpenAI's API does (and
vLLM, which constrains named and required tool choices the same way). ``tool_choice``
``auto`` (the default when tools are given) would need a parser of each model's own tool-call
syntax and is refused in one line; ``none`` renders the tools and constrains nothing.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .engine.structure import Structure

REQUIRED = "required"
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

    def structure(self) -> Structure | None:
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.call is None:
            return None
        if self.call != REQUIRED:
            return Structure.json_schema(params[self.call])
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in params.items()]
        return Structure.json_schema({"type": "array", "minItems": 1, "items": {"anyOf": calls}})


def parse_tools(body: dict[str, Any], chat: bool) -> ToolChoice | None:
    """The request's ``tools`` and ``tool_choice`` (None: no tools); a ``ToolError`` says what
    is wrong in one line."""
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
    if choice is None or choice == "auto":
        raise ToolError("unsupported_field", "tool_choice 'auto' (the default with tools) needs a parser of this "
                                             "model's own tool-call syntax, which is not computed: set tool_choice to "
                                             "'required', to {'type': 'function', 'function': {'name': ...}}, or to "
                                             "'none'")
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


def tool_calls(choice: ToolChoice, text: str, key: str) -> list[dict[str, Any]] | None:
    """The ``tool_calls`` of a completion held to ``choice`` (None where its text is not a
    whole call: cut at its token limit). ``key`` makes each call's id (stable in a resumed job)."""
    if choice.call is None:
        return None
    if choice.call == REQUIRED:
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
    return [{"id": "call_" + hashlib.sha256(f"{key}|{n}".encode()).hexdigest()[:24], "type": "function",
             "function": {"name": name, "arguments": args}} for n, (name, args) in enumerate(calls)]
