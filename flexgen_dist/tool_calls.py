"""Reading a model's own function calls back from its completion (``tool_choice`` auto), in the
syntax its chat template teaches: ``READERS`` maps what a template writes to the reader of
that syntax, ``reads_auto`` picks it for a tokenizer. ``<tool_call>{...}</tool_call>`` blocks
(Qwen 2.5/3, Hermes), GLM-4.5's ``<tool_call>`` with ``<arg_key>``/``<arg_value>`` pairs,
Qwen3-Coder's ``<function=NAME>`` with ``<parameter=KEY>`` tags, ``[TOOL_CALLS]`` (Mistral),
DeepSeek-V3's ``<｜tool▁calls▁begin｜>``, Llama 3.1-3.3's bare ``{"name", "parameters"}`` JSON,
gpt-oss' harmony ``commentary`` messages to ``functions.NAME``, Kimi K2's
``<|tool_calls_section_begin|>``, MiniMax-M2's ``<minimax:tool_call>`` with ``<invoke name=...>``
and ``<parameter name=...>`` tags, Granite 3.x's ``<|tool_call|>`` and a JSON list, the pythonic
``[name(key=value), ...]`` list (Llama 4), Phi-4-mini's ``functools[...]`` JSON list (its template
takes the tools on the system message: ``prompts.render_chat``). Each reader returns the text
before the calls as the message's content (None where blank) and the calls as (name,
arguments as JSON text), only where they are whole calls of the request's functions; else no
calls, and the text whole is the content. An argument written as a tag's text (GLM-4.5,
Qwen3-Coder, MiniMax-M2) is that text where its parameter's schema says ``string``, else the
JSON value the text is (the text where it is none).
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from .prompts import SYSTEM_TOOLS
from .reasoning import harmony_answer, harmony_messages

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_JSON = json.JSONDecoder()
_SPECIALS = re.compile(r"(\s*<[^<>\s]+>)*\s*")  # nothing but special tokens' text (the end of turn)
Calls = list[tuple[str, str]]  # (function name, arguments as JSON text)
Tools = dict[str, dict[str, Any]]  # the request's functions: name -> its parameters' properties (schemas)


def _call(obj: Any, names: Tools) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a ``{"name", "arguments" | "parameters"}`` object
    calling one of ``names``, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args)


def _json_call(name: str, body: str, names: Tools) -> tuple[str, str] | None:
    """The call of ``name`` whose arguments are the JSON value ``body`` begins with (text
    after it ignored), where ``name`` is one of ``names``; else None."""
    try:
        return _call({"name": name, "arguments": _JSON.raw_decode(body.strip())[0]}, names)
    except json.JSONDecodeError:
        return None


def _head(raw: str, marker: str, calls: Calls) -> tuple[str | None, Calls]:
    """The content before the first ``marker`` (None where blank) and ``calls``; no calls: the
    whole text is the content."""
    if not calls:
        return raw, []
    return raw.split(marker, 1)[0].strip() or None, calls


def hermes_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """(the content before the first block, or None where it is blank; each ``<tool_call>``
    block's (name, arguments as JSON)) of a completion's text with its special tokens (Qwen
    2.5/3, Hermes); no calls where a block is not a call of one of ``names`` (then the text is
    the content, whole)."""
    calls = []
    for m in _BLOCK.finditer(raw):
        try:
            c = _call(json.loads(m.group(1).strip()), names)
        except json.JSONDecodeError:
            c = None
        if c is None:
            return raw, []
        calls.append(c)
    return _head(raw, "<tool_call>", calls)


def mistral_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """Mistral's calls after ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` (its v3
    tokenizers' templates), or ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]``
    (the newer ones'); anything else is content."""
    parts = raw.split("[TOOL_CALLS]")[1:]
    calls: Calls = []
    try:
        for part in parts:
            part = part.strip()
            if part.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
                found = [_call(o, names) for o in _JSON.raw_decode(part)[0]]
            else:  # name[ARGS]{...}
                name, _, rest = part.partition("[ARGS]")
                found = [_call({"name": name.strip(), "arguments": _JSON.raw_decode(rest.strip())[0]}, names)]
            if not found or None in found:
                return raw, []
            calls += found  # type: ignore[arg-type]
    except (json.JSONDecodeError, TypeError):
        return raw, []
    return _head(raw, "[TOOL_CALLS]", calls)


def llama3_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """Llama 3.1-3.3's JSON calls: the message is ``{"name", "parameters"}`` objects (after an
    optional ``<|python_tag|>``, several joined by ``;``), nothing else; anything else is content."""
    text = raw.replace("<|python_tag|>", "").strip()
    calls: Calls = []
    while text:
        try:
            obj, end = _JSON.raw_decode(text)
        except json.JSONDecodeError:
            break
        c = _call(obj, names)
        if c is None:
            return raw, []
        calls.append(c)
        text = text[end:].strip().lstrip(";").strip()
    if not calls or not _SPECIALS.fullmatch(text):  # words after the calls: not a call message
        return raw, []
    return None, calls


_GRANITE = "<|tool_call|>"


def granite_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """IBM Granite 3.x's calls: ``<|tool_call|>`` then a JSON list of ``{"name", "arguments"}``
    (or the list alone, the whole message), nothing but end-of-turn tokens after it."""
    head, marker, body = raw.partition(_GRANITE)
    if not marker:
        head, body = "", raw
    return _listed(raw, head, body, names)


def _listed(raw: str, head: str, body: str, names: Tools) -> tuple[str | None, Calls]:
    """The calls of the JSON list of ``{"name", "arguments"}`` that ``body`` opens with, nothing
    but end-of-turn tokens after it, and ``head`` as the content (None where blank); no calls
    (``raw`` whole is the content) where it is not a list of calls of ``names``."""
    try:
        objs, end = _JSON.raw_decode(body.strip())
    except json.JSONDecodeError:
        return raw, []
    found = [_call(o, names) for o in objs] if isinstance(objs, list) and objs else [None]
    if None in found or not _SPECIALS.fullmatch(body.strip()[end:]):
        return raw, []
    return head.strip() or None, found  # type: ignore[return-value]


_PHI4 = re.compile(r"functools\s*\[")  # the marker, the list's bracket after it (prose may say "functools.")


def phi4_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """Phi-4-mini's calls: ``functools`` then a JSON list of ``{"name", "arguments"}`` (or
    ``"parameters"``), nothing but end-of-turn tokens after it; the text before is the content.
    The list is read as JSON, whole (an argument may hold lists of its own)."""
    m = _PHI4.search(raw)
    return (raw, []) if m is None else _listed(raw, raw[:m.start()], raw[m.end() - 1:], names)


def pythonic_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """Calls as a Python list, the whole message (Llama 4's template and the pythonic ones of
    Llama 3.2 and Gemma 3 guides): ``[name(key=value, ...), ...]``, each value a literal (strings,
    numbers, booleans, None, lists, dicts), read by ``ast`` (nothing is evaluated); Llama 4's
    ``<|python_start|>``/``<|python_end|>`` around it and end-of-turn tokens after it allowed."""
    text = raw.replace("<|python_start|>", "").replace("<|python_end|>", "")
    m = re.match(r"\s*(\[.*\])", text, re.DOTALL)
    if m is None or not _SPECIALS.fullmatch(text[m.end():]):
        return raw, []
    try:
        tree = ast.parse(m.group(1).strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return raw, []
        calls: Calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
                return raw, []
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(args) != len(node.keywords):
                return raw, []
            c = _call({"name": node.func.id, "arguments": args}, names)
            if c is None:
                return raw, []
            calls.append(c)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return raw, []
    return None, calls


_GLM_BLOCK = re.compile(r"<tool_call>\s*([^<\s]+)\s*(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_XML_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_ARG = re.compile(r"<parameter=([^>]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _value(text: str, schema: Any) -> Any:
    """A tag's text as an argument: the text where the parameter's schema says ``string``, else
    the JSON value it is (the text where it is none)."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _tagged_call(name: str, body: str, arg: re.Pattern[str], names: Tools) -> tuple[str, str] | None:
    """The call of ``name`` whose arguments are ``body``'s ``arg`` matches, (key, value) pairs,
    each value read by ``_value``; None where ``name`` is not one of ``names``."""
    name = name.strip()
    props = names.get(name, {}) if isinstance(names, dict) else {}
    args = {k.strip(): _value(v, props.get(k.strip())) for k, v in arg.findall(body)}
    return _call({"name": name, "arguments": args}, names)


def _tagged_calls(raw: str, names: Tools, block: re.Pattern[str], arg: re.Pattern[str]) -> tuple[str | None, Calls]:
    """Calls written as tags: each ``block`` match's name and body (``_tagged_call``)."""
    calls: Calls = []
    for m in block.finditer(raw):
        c = _tagged_call(m.group(1), m.group(2), arg, names)
        if c is None:
            return raw, []
        calls.append(c)
    return _head(raw, "<tool_call>", calls)


def glm_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """GLM-4.5's calls: ``<tool_call>NAME`` then ``<arg_key>k</arg_key><arg_value>v</arg_value>``
    pairs, then ``</tool_call>``."""
    return _tagged_calls(raw, names, _GLM_BLOCK, _GLM_ARG)


def xml_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """Qwen3-Coder's calls: ``<tool_call>`` ``<function=NAME>`` then ``<parameter=KEY>`` value
    ``</parameter>`` per argument, ``</function>`` ``</tool_call>``."""
    return _tagged_calls(raw, names, _XML_BLOCK, _XML_ARG)


_MM_BLOCK = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
_MM_INVOKE = re.compile(r"<invoke name=[\"']?([^\"'>]+)[\"']?>(.*?)</invoke>", re.DOTALL)
_MM_ARG = re.compile(r"<parameter name=[\"']?([^\"'>]+)[\"']?>\s*(.*?)\s*</parameter>", re.DOTALL)


def minimax_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """MiniMax-M2's calls: ``<minimax:tool_call>`` blocks, each holding ``<invoke name="NAME">``
    elements with a ``<parameter name="KEY">`` value ``</parameter>`` per argument."""
    calls: Calls = []
    for blk in _MM_BLOCK.finditer(raw):
        for m in _MM_INVOKE.finditer(blk.group(1)):
            c = _tagged_call(m.group(1), m.group(2), _MM_ARG, names)
            if c is None:
                return raw, []
            calls.append(c)
    return _head(raw, "<minimax:tool_call>", calls)


_DS_BEGIN, _DS_CALL = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
_DS_SEP, _DS_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def deepseek_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """DeepSeek-V3's calls after ``<｜tool▁calls▁begin｜>``, each ``<｜tool▁call▁begin｜>`` ...
    ``<｜tool▁call▁end｜>``: V3's ``function<｜tool▁sep｜>NAME`` and a fenced JSON block, or
    V3.1's ``NAME<｜tool▁sep｜>{...}``."""
    if _DS_BEGIN not in raw:
        return raw, []
    calls: Calls = []
    for part in raw.split(_DS_BEGIN, 1)[1].split(_DS_CALL)[1:]:
        head, _, body = part.split(_DS_END, 1)[0].partition(_DS_SEP)
        if head.strip() == "function":  # V3: the name on the first line, then ```json ... ```
            name, _, body = body.partition("\n")
            body = body.strip().removeprefix("```json").removesuffix("```")
        else:
            name = head
        c = _json_call(name.strip(), body, names)
        if c is None:
            return raw, []
        calls.append(c)
    return _head(raw, _DS_BEGIN, calls)


_KIMI_BEGIN, _KIMI_CALL = "<|tool_calls_section_begin|>", "<|tool_call_begin|>"
_KIMI_ARGS, _KIMI_END = "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kimi_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """Kimi K2's calls after ``<|tool_calls_section_begin|>``, each ``<|tool_call_begin|>``
    ``functions.NAME:INDEX`` ``<|tool_call_argument_begin|>`` ``{...}`` ``<|tool_call_end|>``."""
    if _KIMI_BEGIN not in raw:
        return raw, []
    calls: Calls = []
    for part in raw.split(_KIMI_BEGIN, 1)[1].split(_KIMI_CALL)[1:]:
        head, _, body = part.split(_KIMI_END, 1)[0].partition(_KIMI_ARGS)
        name = head.strip().removeprefix("functions.").rsplit(":", 1)[0]
        c = _json_call(name, body, names)
        if c is None:
            return raw, []
        calls.append(c)
    return _head(raw, _KIMI_BEGIN, calls)


def harmony_calls(raw: str, names: Tools) -> tuple[str | None, Calls]:
    """gpt-oss' calls: harmony ``commentary`` messages to ``functions.NAME`` whose text is the
    arguments' JSON (``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
    <|call|>``); the content is its final (and recipient-less commentary) messages' text, the
    analysis being the reasoning."""
    calls: Calls = []
    msgs = harmony_messages(raw)
    for m in msgs:
        if not m.recipient:
            continue
        c = _json_call(m.recipient.removeprefix("functions."), m.text, names) \
            if m.recipient.startswith("functions.") else None
        if c is None:
            return raw, []
        calls.append(c)
    return (harmony_answer(msgs) or None, calls) if calls else (raw, [])


# what a chat template teaches about calls -> the reader of its model's syntax (``tool_choice`` auto),
# in the order they are looked for (GLM-4.5's and Qwen3-Coder's templates also write <tool_call>)
READERS = {"harmony": ("<|channel|>", harmony_calls), "kimi": (_KIMI_BEGIN, kimi_calls),
           "minimax": ("<minimax:tool_call>", minimax_calls),
           "granite": ("<|tool_call|> followed by a JSON list", granite_calls),
           "xml": ("<parameter=", xml_calls), "glm": ("<arg_key>", glm_calls), "hermes": ("<tool_call>", hermes_calls),
           "mistral": ("[TOOL_CALLS]", mistral_calls), "deepseek": (_DS_BEGIN, deepseek_calls),
           "llama3": ('"parameters": dictionary of argument name and its value', llama3_calls),
           "pythonic": ("[func_name1(params_name1=params_value1", pythonic_calls),
           "phi4": (SYSTEM_TOOLS, phi4_calls)}


def reads_auto(tokenizer: Any | None) -> str:
    """The name of the reader (``READERS``) for the calls the model's chat template teaches,
    found by what the template writes; "" where none is known."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not isinstance(template, str):
        return ""
    return next((name for name, (marker, _) in READERS.items() if marker in template), "")
