"""The fields of an OpenAI Batch request's body, checked one at a time (``openai_requests.py``
reads a line with them): sampling values and their ranges, logit biases, logprobs, stop
strings, vLLM's sampling controls (``min_tokens``, ``stop_token_ids``, ``bad_words``, ...),
structured output, a chat's messages, its template's variables, a continued final
message and a classifier's activation; each bad value is a ``RequestError`` with OpenAI's error code and a one-line
message."""
from __future__ import annotations

from typing import Any

from .config import ConfigError, check_template_kwargs
from .engine.bans import bad_word_ids
from .engine.beams import BeamConfig
from .engine.sampling import MAX_BIAS, MAX_LOGPROBS, MAX_REPETITION
from .engine.structure import Structure, check_structure
from .openai_tools import ToolChoice
from .prompts import Messages

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# vLLM's older spelling of its structured outputs, field -> ``Structure`` kind
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
EFFORTS = ("none", "minimal", "low", "medium", "high")  # reasoning_effort, as the template reads it


class RequestError(ValueError):
    """What is wrong with one request: an OpenAI-style error code and a one-line message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def structure(body: dict[str, Any], tokenizer: Any | None, vocab_size: int,
              eos_ids: tuple[int, ...], tools: ToolChoice | None = None) -> Structure | None:
    """What the completion must match: ``response_format`` (OpenAI's ``json_object`` or
    ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``) or its older ``guided_*`` fields, or a named or required
    tool call (``openai_tools.py``); at most one of them."""
    asks: list[tuple[str, Any]] = []
    call = tools.structure() if tools is not None else None
    if call is not None:
        asks.append(("json", call.value))
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            asks.append(("json_object", None))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                raise RequestError("invalid_value", "response_format json_schema needs 'json_schema': {'name', "
                                                    "'schema': {...}}")
            asks.append(("json", js.get("schema", {})))
        else:
            raise RequestError("invalid_value", f"response_format {rf!r}: use type text, json_object or json_schema")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("invalid_value", "structured_outputs must be an object, e.g. {'regex': '...'}")
        for k, v in so.items():
            if k not in ("json", "regex", "choice", "grammar", "json_object"):
                raise RequestError("unsupported_field", f"structured_outputs field {k!r} is not supported (use json, "
                                                        "regex, choice, grammar or json_object)")
            if k != "json_object" or v:
                asks.append((k, v))
    asks += [(GUIDED[k], body[k]) for k in GUIDED if body.get(k) is not None]
    if not asks:
        return None
    if len(asks) > 1:
        raise RequestError("invalid_value", "a request follows one structure: give one of response_format, "
                                            "structured_outputs, the guided_* fields and a tool_choice that calls, "
                                            "with one field")
    kind, v = asks[0]
    try:
        if kind == "json":
            st = Structure.json_schema(v)
        elif kind == "choice":
            st = Structure.choice(v if isinstance(v, list) else [])
        elif kind == "json_object":
            st = Structure.json_object()
        else:
            st = Structure(kind, v if isinstance(v, str) else "")
        check_structure(st, tokenizer, vocab_size, eos_ids)
    except ValueError as e:
        raise RequestError("invalid_value", f"{kind}: {e}") from None
    return st


def repetition(v: Any) -> float:
    if v is None:
        return 1.0
    p = number(v, "repetition_penalty", 0.0, MAX_REPETITION)
    if p <= 0:
        raise RequestError("invalid_value", f"repetition_penalty must be in (0, {MAX_REPETITION:g}]")
    return p


def echo(url: str, v: Any) -> bool:
    if v in (None, False):
        return False
    if v is not True:
        raise RequestError("invalid_value", f"echo {v!r}: true or false")
    if url != COMPLETIONS:
        raise RequestError("unsupported_field", "echo is a completions field: a chat request has no echo")
    return True


def logit_bias(v: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: ``{"token id": bias in [-100, 100]}`` (ids as strings, as JSON keys are)."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise RequestError("invalid_value", "logit_bias must be an object of token ids to biases")
    out = []
    for k, b in v.items():
        try:
            i = int(k)
        except (TypeError, ValueError):
            raise RequestError("invalid_value", f"logit_bias key {k!r} is not a token id") from None
        if not 0 <= i < vocab_size:
            raise RequestError("invalid_value", f"logit_bias token id {i} is outside the vocabulary [0, {vocab_size})")
        out.append((i, number(b, f"logit_bias[{k!r}]", -MAX_BIAS, MAX_BIAS)))
    return tuple(out)


def logprobs(url: str, body: dict[str, Any]) -> int | None:
    """The alternatives per token a request's logprobs ask for (None: no logprobs). Chat:
    ``logprobs`` true, with ``top_logprobs`` 0-20; completions: ``logprobs`` an integer 0-20."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if url == CHAT:
        if lp not in (None, False, True):
            raise RequestError("invalid_value", f"logprobs {lp!r}: a chat request takes true or false "
                                                "(top_logprobs sets the alternatives)")
        k = 0 if top is None else alternatives(top, "top_logprobs")
        if k and not lp:
            raise RequestError("invalid_value", "top_logprobs needs logprobs: true")
        return k if lp else None
    if top is not None:
        raise RequestError("unsupported_field", "top_logprobs is a chat field: a completions request sets "
                                                "logprobs to the number of alternatives")
    return None if lp is None else alternatives(lp, "logprobs")


def alternatives(v: Any, name: str) -> int:
    k = integer(v, name, 0)
    if k > MAX_LOGPROBS:
        raise RequestError("invalid_value", f"{name} {k}: at most {MAX_LOGPROBS}")
    return k


def continuation(body: dict[str, Any]) -> tuple[bool, bool]:
    """vLLM's ``continue_final_message`` (the final assistant message goes on: a prefill) and
    ``add_generation_prompt`` (the assistant's turn opened; default true), checked together."""
    cont, opened = body.get("continue_final_message", False), body.get("add_generation_prompt")
    for k, v in (("continue_final_message", cont), ("add_generation_prompt", opened)):
        if v is not None and not isinstance(v, bool):
            raise RequestError("invalid_value", f"{k} {v!r}: true or false")
    if cont and opened:
        raise RequestError("invalid_value", "continue_final_message and add_generation_prompt are both true: a "
                                            "continued message opens no new turn (set add_generation_prompt false)")
    return bool(cont), opened is not False


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """A chat request's own template variables: vLLM's ``chat_template_kwargs`` (e.g.
    ``{"enable_thinking": false}``) and OpenAI's ``reasoning_effort`` (gpt-oss' template reads it)."""
    try:
        kw = check_template_kwargs(body.get("chat_template_kwargs"))
    except ConfigError as e:
        raise RequestError("invalid_value", str(e)) from None
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise RequestError("invalid_value", f"reasoning_effort {effort!r}: use one of {', '.join(EFFORTS)}")
        kw["reasoning_effort"] = effort
    return kw


def chat_messages(msgs: list[Any]) -> Messages:
    out: Messages = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError("invalid_request", "each message needs a role of system, user, assistant or tool "
                                                  "and a content")
        c = m.get("content")
        if m["role"] == "assistant" and c is None and isinstance(m.get("tool_calls"), list):
            out.append({"role": "assistant", "content": "", "tool_calls": m["tool_calls"]})  # type: ignore[dict-item]
            continue
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in c):
                raise RequestError("unsupported_field", "message content parts other than text are not supported")
            c = "".join(str(part.get("text", "")) for part in c)
        if not isinstance(c, str):
            raise RequestError("invalid_request", "a message's content must be a string or text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        extra = {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if k in m}  # a call and its result
        out.append({"role": role, "content": c, **extra})
    return out


def integer(v: Any, name: str, low: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise RequestError("invalid_value", f"{name} {v!r}: must be an integer >= {low}")
    return v


def number(v: Any, name: str, low: float, high: float) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
        raise RequestError("invalid_value", f"{name} {v!r}: must be a number in [{low:g}, {high:g}]")
    return float(v)


def stops(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("invalid_value", "stop must be a non-empty string or a list of them")
    return tuple(stops)


def activation(body: dict[str, Any]) -> bool:
    """vLLM's switch of a classifier's activation (softmax, a one-label model's sigmoid), under
    its three names; off: the logits themselves."""
    on = True
    for k in ("use_activation", "activation", "softmax"):
        v = body.get(k)
        if v is not None and not isinstance(v, bool):
            raise RequestError("invalid_value", f"{k} {v!r}: true or false")
        on = on and v is not False
    return on


# vLLM's sampling controls a request may set (``SamplingConfig``'s fields of those names)
CONTROLS = ("min_tokens", "stop_token_ids", "ignore_eos", "bad_words", "allowed_token_ids",
            "include_stop_str_in_output", "skip_special_tokens")


def controls(body: dict[str, Any], vocab_size: int, tokenizer: Any | None) -> dict[str, Any]:
    """vLLM's sampling controls of ``body`` as ``SamplingConfig`` keywords: ``min_tokens``,
    ``stop_token_ids``, ``ignore_eos``, ``bad_words`` (made ids here, as vLLM makes them),
    ``allowed_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``."""
    out: dict[str, Any] = {}
    for k in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        v = body.get(k)
        if v is not None and not isinstance(v, bool):
            raise RequestError("invalid_value", f"{k} {v!r}: true or false")
        if v is not None:
            out[k] = v
    if body.get("min_tokens") is not None:
        out["min_tokens"] = integer(body["min_tokens"], "min_tokens", 0)
    for k in ("stop_token_ids", "allowed_token_ids"):
        v = body.get(k)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v) or \
                not all(0 <= t < vocab_size for t in v):
            raise RequestError("invalid_value", f"{k} must be a list of token ids in [0, {vocab_size})")
        if k == "allowed_token_ids" and not v:
            raise RequestError("invalid_value", "allowed_token_ids must not be empty (leave it out to allow every "
                                                "token)")
        out[k] = tuple(v)
    words = body.get("bad_words")
    if words is not None:
        if isinstance(words, str):
            words = [words]
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise RequestError("invalid_value", "bad_words must be a list of non-empty strings")
        if words and tokenizer is None:
            raise RequestError("invalid_request", "bad_words need the model's tokenizer (this model has none)")
        ids = bad_word_ids(words, tokenizer) if words else ()
        if any(i >= vocab_size for w in ids for i in w):
            raise RequestError("invalid_value", "bad_words encode to ids outside the model's vocabulary")
        out["bad_words_ids"] = ids
    return out


def beams(body: dict[str, Any], n: int) -> BeamConfig | None:
    """vLLM's ``use_beam_search``: ``n`` beams (its best_of, the best of which are its choices), ``length_penalty``
    and ``early_stopping`` (read only with it, as vLLM reads them); None without it."""
    on = body.get("use_beam_search")
    if on is not None and not isinstance(on, bool):
        raise RequestError("invalid_value", f"use_beam_search {on!r}: true or false")
    lp = body.get("length_penalty", 1.0)
    if not isinstance(lp, (int, float)) or isinstance(lp, bool):
        raise RequestError("invalid_value", f"length_penalty {lp!r}: a number")
    early = body.get("early_stopping", False)
    if early not in (False, True, "never") or not isinstance(early, (bool, str)):
        raise RequestError("invalid_value", f"early_stopping {early!r}: true, false or \"never\"")
    return BeamConfig(n, float(lp), early) if on else None
