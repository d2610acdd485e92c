"""OpenAI's Responses API in batch files (``"url": "/v1/responses"``): a request is read as the
chat completion it amounts to (``chat_body``) and answered in the Responses format
(``response_body``), so one engine path serves both.

What a Responses body carries maps onto a chat body: ``instructions`` is a system message
before the ``input`` (a string, or items: messages with text content, ``function_call`` and
``function_call_output`` items of earlier turns; ``reasoning`` items of earlier turns are left
out, as chat templates leave out earlier thinking); ``max_output_tokens``, ``temperature``,
``top_p``; function ``tools`` and ``tool_choice`` in the Responses shape (no ``function``
wrapper); ``text.format`` (``json_schema``, ``json_object``, ``text``) as ``response_format``;
``reasoning.effort`` as the template's ``reasoning_effort``; logprobs with ``include``
``message.output_text.logprobs`` and ``top_logprobs``; ``truncation: "auto"`` lets the
request drop the conversation's first turns to fit (``openai_requests.first_turn_dropped``).
What needs state this runtime does not
keep (``previous_response_id``, ``conversation``, stored prompts) or input it does not read
(images, files) is a request error naming it.

The response's ``output`` holds a ``reasoning`` item (a reasoning model's thinking), the
``function_call`` items of a completion that called tools, or a ``message`` with its
``output_text``; ``status`` is ``incomplete`` (``max_output_tokens``) where the completion
reached its limit; ``usage`` counts input, output and reasoning tokens."""
from __future__ import annotations

import hashlib
from typing import Any

RESPONSES = "/v1/responses"
# body fields that cannot change the output (beside the ones read below)
INERT = {"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
         "prompt_cache_key", "prompt_cache_retention"}
# accepted at the value that means "off" only
OFF: dict[str, tuple[Any, ...]] = {"stream": (False, None), "background": (False, None),
                                   "truncation": ("disabled", "auto", None), "max_tool_calls": (None,)}
# vLLM's sampling extensions, passed to the chat body as they are
EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "seed", "frequency_penalty", "presence_penalty",
              "logit_bias", "stop", "truncate_prompt_tokens")
READ = {"input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "text",
        "reasoning", "include", "top_logprobs", *EXTENSIONS}
STATEFUL = ("previous_response_id", "conversation", "prompt")  # what a stored conversation or prompt gives
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_INERT = ("reasoning.encrypted_content",)  # nothing is encrypted here: asking for it changes nothing


class ResponsesError(ValueError):
    """What keeps a Responses body from being read: an OpenAI error code and a one-line message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def unsupported_field(body: dict[str, Any], known: set[str], off: dict[str, tuple[Any, ...]], where: str = ""
                      ) -> str | None:
    """Why the first field of ``body`` that is neither ``known`` nor at its ``off`` value
    cannot be served (None: every field can)."""
    for k, v in body.items():
        if k in known or (k in off and v in off[k]):
            continue
        if k in off:
            return f"body field {k!r}={v!r} would change the output and is not supported (leave it out)"
        return f"body field {k!r} is not supported{where} (leave it out)"
    return None


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body amounts to (module doc)."""
    for k in STATEFUL:
        if body.get(k) is not None:
            raise ResponsesError("unsupported_field", f"body field {k!r} needs state a batch job does not keep: give "
                                                      "the whole conversation as 'input'")
    bad = unsupported_field(body, READ | INERT | set(STATEFUL), OFF, f" on {RESPONSES}")
    if bad:
        raise ResponsesError("unsupported_field", bad)
    out: dict[str, Any] = {"messages": _messages(body.get("input"), body.get("instructions"))}
    for k in ("temperature", "top_p", *EXTENSIONS):
        if body.get(k) is not None:
            out[k] = body[k]
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        out["tools"] = [_tool(t) for t in body["tools"]] if isinstance(body["tools"], list) else body["tools"]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    effort = _effort(body.get("reasoning"))
    if effort is not None:
        out["reasoning_effort"] = effort
    include = body.get("include") or []
    if not isinstance(include, list) or any(i not in (INCLUDE_LOGPROBS, *INCLUDE_INERT) for i in include):
        raise ResponsesError("unsupported_field", f"include {include!r}: only {INCLUDE_LOGPROBS!r} (and "
                                                  f"{INCLUDE_INERT[0]!r}, which changes nothing) are served")
    top = body.get("top_logprobs")
    if INCLUDE_LOGPROBS in include or top:
        out["logprobs"] = True
        if top is not None:
            out["top_logprobs"] = top
    return out


def _messages(items: Any, instructions: Any) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``."""
    msgs: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ResponsesError("invalid_value", "instructions must be a string")
        msgs.append({"role": "system", "content": instructions})
    if isinstance(items, str) and items:
        return msgs + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ResponsesError("invalid_request", "a responses request needs 'input': a non-empty string or list of "
                                                "input items")
    for item in items:
        if not isinstance(item, dict):
            raise ResponsesError("invalid_request", "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", item.get("id", ""))), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") and not msgs[-1]["content"]:
                msgs[-1]["tool_calls"].append(call)  # one turn's calls: one assistant message
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": out if isinstance(out, str) else _text(out)})
        elif kind == "reasoning":  # an earlier turn's thinking: templates leave it out
            continue
        else:
            raise ResponsesError("unsupported_field", f"input item type {kind!r} is not supported (messages, "
                                                      "function_call and function_call_output are)")
    if not any(m["role"] != "system" for m in msgs):
        raise ResponsesError("invalid_request", "'input' holds no message to answer")
    return msgs


def _text(content: Any) -> str:
    """A message's content: a string, or text parts (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        bad = [p.get("type") for p in content if p.get("type") not in ("input_text", "output_text", "text")]
        if bad:
            raise ResponsesError("unsupported_field", f"content part {bad[0]!r} is not supported (text parts are)")
        return "".join(str(p.get("text", "")) for p in content)
    raise ResponsesError("invalid_request", "a message's content must be a string or a list of text parts")


def _tool(t: Any) -> Any:
    """A Responses function tool as a chat tool (``{"type", "function": {...}}``)."""
    if isinstance(t, dict) and t.get("type") == "function" and "function" not in t:
        return {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
    if isinstance(t, dict) and t.get("type") not in (None, "function"):
        raise ResponsesError("unsupported_field", f"tool type {t.get('type')!r} is not served (function tools are)")
    return t


def _tool_choice(c: Any) -> Any:
    if isinstance(c, dict) and c.get("type") == "function" and "function" not in c:
        return {"type": "function", "function": {"name": c.get("name")}}
    return c


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise ResponsesError("invalid_value", "text must be {'format': {...}}")
    if text.get("verbosity") not in (None, "medium"):
        raise ResponsesError("unsupported_field", "text.verbosity would change the output and is not supported "
                                                  "(leave it out)")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise ResponsesError("invalid_value", f"text.format {fmt!r}: use type text, json_object or json_schema")


def _effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise ResponsesError("invalid_value", "reasoning must be {'effort': ...}")
    return reasoning.get("effort")


def response_body(rid: str, created: int, model: str, choice: Any, message: dict[str, Any],
                  logprobs: dict[str, Any] | None, prompt_tokens: int) -> dict[str, Any]:
    """A Responses body from the one choice of a request read by ``chat_body``: its chat
    ``message`` (content or tool calls), its chat-format ``logprobs`` (None: not asked for)."""
    done = choice.finish_reason != "length"
    status = "completed" if done else "incomplete"
    output: list[dict[str, Any]] = []
    if getattr(choice, "reasoning", None) is not None:
        output.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": choice.reasoning}]})
    for n, call in enumerate(message.get("tool_calls") or ()):
        output.append({"type": "function_call", "id": f"fc_{_short(rid, n)}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": status})
    if message.get("content") is not None or not message.get("tool_calls"):
        part: dict[str, Any] = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs["content"]
        output.append({"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
                       "content": [part]})
    used = len(choice.token_ids)
    thought = getattr(choice, "answer_from", 0) if getattr(choice, "reasoning", None) is not None else 0
    return {"id": f"resp_{rid}", "object": "response", "created_at": created, "status": status,
            "incomplete_details": None if done else {"reason": "max_output_tokens"}, "error": None,
            "model": model, "output": output,
            "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": used, "output_tokens_details": {"reasoning_tokens": thought},
                      "total_tokens": prompt_tokens + used}}


def _short(rid: str, n: int) -> str:
    return hashlib.sha256(f"{rid}|{n}".encode()).hexdigest()[:24]
