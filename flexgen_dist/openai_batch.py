"""Batch jobs in the OpenAI Batch format: request lines in, response lines out.

An input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``; an output line is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``, with the body shaped as the endpoint's
response (``choices``, ``usage``), so the readers of hosted batch APIs parse it. A request the
engine cannot serve as asked (bad JSON, an unknown url, a body field that would change the
output and is not computed, a prompt longer than the model's context) gets an error line of
its own; the others run. Each request keeps its own ``max_tokens``, sampling (penalties,
biases, top-k and min-p included) and stop strings (``Workload``), and ``n`` choices become n
rows of the job. Log-probabilities are computed for the whole call at the most any request
asks for, and each request's line carries its own number of alternatives. A completions
request with ``echo`` gets its prompt back before its completion, and with ``logprobs`` its
prompt's tokens' too, from one teacher-forced scoring call (``LLM.score``) over every echoed
prompt before the generation; with ``max_tokens`` 0 it generates nothing.

This module turns lines into requests and results into lines; ``LLM.batch`` runs them and
``python -m flexgen_dist.batch`` is the command.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from .config import ConfigError
from .engine.sampling import MAX_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION, SamplingConfig, TokenLogprobs
from .prompts import Messages, Prompt, make_prompt

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_N = 128  # choices per request
# body fields that cannot change the output
INERT = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# fields accepted at the value that means "off" only: any other value would change the output
OFF: dict[str, tuple[Any, ...]] = {
    "stream": (False, None),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "best_of": (None, 1), "suffix": (None, ""),
}
USED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
        "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias",
        "top_k", "min_p", "repetition_penalty",  # these three: vLLM's extensions
        "echo"}  # completions only


class RequestError(ValueError):
    """What is wrong with one request: an OpenAI-style error code and a one-line message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Request:
    """One input line: its place, id, endpoint and what to generate, or why it cannot run."""

    line: int  # 0-based line of the input file
    custom_id: str
    url: str = CHAT
    prompt: Prompt | None = None
    max_tokens: int = 0
    sampling: SamplingConfig = SamplingConfig()
    stop: tuple[str, ...] = ()
    n: int = 1
    seeded: bool = False  # its own seed: its draws depend on nothing else (not its line)
    logprobs: int | None = None  # alternatives per token in its logprobs (None: no logprobs)
    echo: bool = False  # completions: the prompt comes back before the completion (and its logprobs)
    prompt_logprobs: TokenLogprobs | None = None  # echo with logprobs: the prompt's tokens 1.. (scored)
    error: RequestError | None = None
    choices: list[Any] = field(default_factory=list)  # filled by the run (Completions)

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_requests(lines: list[str], tokenizer: Any | None, vocab_size: int, max_positions: int,
                   default_max_tokens: int, seed: int = 0) -> list[Request]:
    """One ``Request`` per non-blank line, in order; a duplicate ``custom_id`` is refused
    before anything runs (``ConfigError``), a bad request gets its ``error``."""
    out: list[Request] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines):
        if not raw.strip():
            continue
        req = parse_request(n, raw, tokenizer, vocab_size, max_positions, default_max_tokens, seed)
        if req.custom_id in seen:
            raise ConfigError(f"line {n + 1}: custom_id {req.custom_id!r} is also on line {seen[req.custom_id] + 1}; "
                              "each request needs its own custom_id")
        seen[req.custom_id] = n
        out.append(req)
    if not out:
        raise ConfigError("the batch file has no requests")
    return out


def parse_request(n: int, raw: str, tokenizer: Any | None, vocab_size: int, max_positions: int,
                  default_max_tokens: int, seed: int = 0) -> Request:
    """Request of line ``n`` (0-based); a request that cannot run carries its error."""
    req = Request(n, f"line-{n + 1}")
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as e:
        req.error = RequestError("invalid_json", f"line {n + 1} is not valid JSON ({e.msg})")
        return req
    if not isinstance(rec, dict):
        req.error = RequestError("invalid_request", f"line {n + 1} is not a JSON object")
        return req
    if rec.get("custom_id") is not None:
        req.custom_id = str(rec["custom_id"])
    try:
        _fill(req, rec, tokenizer, vocab_size, max_positions, default_max_tokens, seed)
    except RequestError as e:
        req.error = e
    except ConfigError as e:  # what make_prompt refuses (ids outside the vocabulary, no template)
        req.error = RequestError("invalid_request", str(e))
    return req


def _fill(req: Request, rec: dict[str, Any], tokenizer: Any | None, vocab_size: int, max_positions: int,
          default_max_tokens: int, seed: int) -> None:
    method = rec.get("method", "POST")
    if method != "POST":
        raise RequestError("invalid_request", f"method {method!r}: batch requests are POST")
    req.url = str(rec.get("url", ""))
    if req.url not in (CHAT, COMPLETIONS):
        raise RequestError("invalid_url", f"url {req.url!r} is not served: use {CHAT} or {COMPLETIONS}")
    body = rec.get("body")
    if not isinstance(body, dict):
        raise RequestError("invalid_request", "the request has no 'body' object")
    for k, v in body.items():
        if k in USED or k in INERT:
            continue
        if k in OFF:
            if v not in OFF[k]:
                raise RequestError("unsupported_field", f"body field {k!r}={v!r} would change the output and is "
                                                        "not supported (leave it out)")
            continue
        raise RequestError("unsupported_field", f"body field {k!r} is not supported (leave it out)")
    req.echo = _echo(req.url, body.get("echo"))
    req.prompt = _prompt(req, body, tokenizer, vocab_size)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    # echo and max_tokens 0: the prompt's own logprobs, nothing generated (a loglikelihood)
    req.max_tokens = default_max_tokens if mt is None else _int(mt, "max_tokens", 0 if req.echo else 1)
    total = len(req.prompt.ids) + req.max_tokens
    if total > max_positions:
        raise RequestError("context_length_exceeded",
                           f"the prompt has {len(req.prompt.ids)} tokens; with max_tokens {req.max_tokens} that "
                           f"exceeds the model's {max_positions} positions: shorten it or lower max_tokens")
    hot = any(k in body for k in ("top_p", "top_k", "min_p"))  # a sampling setting without a temperature
    temp = _number(body.get("temperature", 1.0 if hot else 0.0), "temperature", 0.0, 2.0)
    top_p = _number(body.get("top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p <= 0:
        raise RequestError("invalid_value", "top_p must be in (0, 1]")
    s = body.get("seed")
    penalties = [_number(body.get(k) or 0.0, k, -MAX_PENALTY, MAX_PENALTY)
                 for k in ("frequency_penalty", "presence_penalty")]
    top_k = body.get("top_k")
    top_k = 0 if top_k in (None, -1) else _int(top_k, "top_k", 0)  # -1 (vLLM's off) or 0: every token
    req.sampling = SamplingConfig(temp, top_p, seed if s is None else _int(s, "seed", 0), False, *penalties,
                                  _logit_bias(body.get("logit_bias"), vocab_size), top_k=top_k,
                                  min_p=_number(body.get("min_p", 0.0), "min_p", 0.0, 1.0),
                                  repetition_penalty=_repetition(body.get("repetition_penalty")))
    req.seeded = s is not None
    req.stop = _stops(body.get("stop"))
    req.n = _int(body.get("n", 1), "n", 1)
    if req.n > MAX_N:
        raise RequestError("invalid_value", f"n {req.n}: at most {MAX_N} choices per request")
    req.logprobs = _logprobs(req.url, body)


def _repetition(v: Any) -> float:
    if v is None:
        return 1.0
    p = _number(v, "repetition_penalty", 0.0, MAX_REPETITION)
    if p <= 0:
        raise RequestError("invalid_value", f"repetition_penalty must be in (0, {MAX_REPETITION:g}]")
    return p


def _echo(url: str, v: Any) -> bool:
    if v in (None, False):
        return False
    if v is not True:
        raise RequestError("invalid_value", f"echo {v!r}: true or false")
    if url != COMPLETIONS:
        raise RequestError("unsupported_field", "echo is a completions field: a chat request has no echo")
    return True


def _logit_bias(v: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
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
        out.append((i, _number(b, f"logit_bias[{k!r}]", -MAX_BIAS, MAX_BIAS)))
    return tuple(out)


def _logprobs(url: str, body: dict[str, Any]) -> int | None:
    """The alternatives per token a request's logprobs ask for (None: no logprobs). Chat:
    ``logprobs`` true, with ``top_logprobs`` 0-20; completions: ``logprobs`` an integer 0-20."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if url == CHAT:
        if lp not in (None, False, True):
            raise RequestError("invalid_value", f"logprobs {lp!r}: a chat request takes true or false "
                                                "(top_logprobs sets the alternatives)")
        k = 0 if top is None else _alternatives(top, "top_logprobs")
        if k and not lp:
            raise RequestError("invalid_value", "top_logprobs needs logprobs: true")
        return k if lp else None
    if top is not None:
        raise RequestError("unsupported_field", "top_logprobs is a chat field: a completions request sets "
                                                "logprobs to the number of alternatives")
    return None if lp is None else _alternatives(lp, "logprobs")


def _alternatives(v: Any, name: str) -> int:
    k = _int(v, name, 0)
    if k > MAX_LOGPROBS:
        raise RequestError("invalid_value", f"{name} {k}: at most {MAX_LOGPROBS}")
    return k


def _prompt(req: Request, body: dict[str, Any], tokenizer: Any | None, vocab_size: int) -> Prompt:
    if req.url == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("invalid_request", "a chat request needs 'messages', a non-empty list")
        return make_prompt(req.custom_id, None, None, tokenizer, vocab_size, _messages(msgs))
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt given as a list of one
    if isinstance(p, str) and p:
        return make_prompt(req.custom_id, p, None, tokenizer, vocab_size)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return make_prompt(req.custom_id, None, p, tokenizer, vocab_size)
    raise RequestError("invalid_request", "a completions request needs 'prompt': a non-empty string or a list of "
                                          "token ids (one prompt per request)")


def _messages(msgs: list[Any]) -> Messages:
    out: Messages = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise RequestError("invalid_request", "each message needs a role of system, user or assistant "
                                                  "and a content")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in c):
                raise RequestError("unsupported_field", "message content parts other than text are not supported")
            c = "".join(str(part.get("text", "")) for part in c)
        if not isinstance(c, str):
            raise RequestError("invalid_request", "a message's content must be a string or text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": c})
    return out


def _int(v: Any, name: str, low: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise RequestError("invalid_value", f"{name} {v!r}: must be an integer >= {low}")
    return v


def _number(v: Any, name: str, low: float, high: float) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
        raise RequestError("invalid_value", f"{name} {v!r}: must be a number in [{low:g}, {high:g}]")
    return float(v)


def _stops(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("invalid_value", "stop must be a non-empty string or a list of them")
    return tuple(stops)


def sampling_key(req: Request, choice: int) -> int:
    """The key of choice ``choice`` of ``req`` for its random draws: the choice alone for a
    request with its own seed (the same request samples the same in any job), else its line
    and choice (every request of a job draws apart, and a resumed job draws the same)."""
    return choice if req.seeded else req.line * MAX_N + choice


# --- output lines -----------------------------------------------------------------------
def request_id(req: Request) -> str:
    """A stable id of the request (its line and custom_id): a resumed job writes the same."""
    return hashlib.sha256(f"{req.line}|{req.custom_id}".encode()).hexdigest()[:24]


def output_line(req: Request, model: str, created: int | None = None, tokenizer: Any | None = None
                ) -> dict[str, Any]:
    """The output line of ``req``: its response (with ``req.choices``) or its error; the
    tokenizer spells the tokens of its logprobs."""
    rid = request_id(req)
    if req.error is not None:
        err = {"code": req.error.code, "message": str(req.error)}
        return {"id": f"batch_req_{rid}", "custom_id": req.custom_id,
                "response": {"status_code": 400, "request_id": rid,
                             "body": {"error": {**err, "type": "invalid_request_error"}}},
                "error": err}
    assert req.prompt is not None
    created = int(time.time()) if created is None else created
    chat = req.url == CHAT
    echoed = req.prompt.text if req.prompt.text is not None else \
        tokenizer.decode(req.prompt.ids) if tokenizer is not None else None
    choices = []
    for j, c in enumerate(req.choices):
        choice: dict[str, Any] = {"index": j}
        text = c.text if c.text is not None else ""
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (echoed or "") + text if req.echo else text
        if c.text is None:  # a model without a tokenizer: the ids are the answer
            choice["token_ids"] = (req.prompt.ids if req.echo else []) + c.token_ids
        choice["logprobs"] = None
        if req.logprobs is not None and c.logprobs is not None:
            choice["logprobs"] = _logprobs_object(chat, c.token_ids, c.logprobs.trimmed(req.logprobs), tokenizer)
            if req.echo and req.prompt_logprobs is not None:
                choice["logprobs"] = _echoed(req.prompt.ids, req.prompt_logprobs.trimmed(req.logprobs), tokenizer,
                                             choice["logprobs"])
        choice["finish_reason"] = c.finish_reason
        choices.append(choice)
    used = sum(len(c.token_ids) for c in req.choices)
    prompt_tokens = len(req.prompt.ids)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used, "total_tokens": prompt_tokens + used}}
    return {"id": f"batch_req_{rid}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


def _logprobs_object(chat: bool, ids: list[int], lps: TokenLogprobs, tokenizer: Any | None) -> dict[str, Any]:
    """A choice's ``logprobs`` in the endpoint's format: chat, ``{"content": [{token, logprob,
    bytes, top_logprobs}]}``; completions, ``{tokens, token_logprobs, top_logprobs,
    text_offset}`` (offsets into the completion's text). A token is spelled as the tokenizer
    decodes it alone (without one: its id as text)."""
    def spell(i: int) -> str:
        return tokenizer.decode([i]) if tokenizer is not None else str(i)

    toks = [spell(i) for i in ids]
    tops = [[(spell(i), lp) for i, lp in alts] for alts in lps.top]
    if chat:
        def entry(t: str, lp: float) -> dict[str, Any]:
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]}
                            for t, lp, alts in zip(toks, lps.token_logprobs, tops)], "refusal": None}
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t)
    return {"tokens": toks, "token_logprobs": lps.token_logprobs,
            "top_logprobs": [dict(alts) for alts in tops], "text_offset": offsets}


def _echoed(prompt_ids: list[int], lps: TokenLogprobs, tokenizer: Any | None, completion: dict[str, Any]
            ) -> dict[str, Any]:
    """A completions ``logprobs`` object with the prompt's tokens before the completion's, as
    ``echo`` returns them: the first token has no prefix (its logprob and alternatives are
    null), the offsets run over the echoed prompt and the completion."""
    head = _logprobs_object(False, prompt_ids[1:], lps, tokenizer)
    first = tokenizer.decode(prompt_ids[:1]) if tokenizer is not None else str(prompt_ids[0])
    toks = [first, *head["tokens"], *completion["tokens"]]
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t)
    return {"tokens": toks, "token_logprobs": [None, *head["token_logprobs"], *completion["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"], *completion["top_logprobs"]], "text_offset": offsets}


@dataclass
class _Nothing:
    """The choice of an echo request with max_tokens 0: nothing generated."""

    logprobs: TokenLogprobs | None
    token_ids: list[int] = field(default_factory=list)
    text: str | None = ""
    finish_reason: str = "length"


# --- running a batch ----------------------------------------------------------------------
def run_batch(llm: Any, requests: Sequence[dict[str, Any] | str] | None, default_max_tokens: int,
              skip: int = 0) -> Iterator[list[dict[str, Any]]]:
    """``LLM.stream_batch``: on every rank (SPMD), rank 0 parses the requests and writes their
    output lines in input order, as the windows of ``llm.stream`` complete their rows (a
    request's n choices are n rows); the other ranks serve their stages."""
    default = default_max_tokens
    reqs: list[Request] | None = None

    def parse() -> bool:  # rank 0: the requests; every rank: whether any will run
        nonlocal reqs
        if requests is None or isinstance(requests, (str, bytes)):
            raise ConfigError("batch() takes a list of requests (dicts or JSON lines)")
        lines = [r if isinstance(r, str) else json.dumps(r) for r in requests]
        reqs = parse_requests(lines, llm.tokenizer, llm.model.spec.vocab_size, llm.model.spec.max_positions,
                              default, llm.config.seed)[skip:]
        return any(r.ok for r in reqs)

    def plan() -> tuple[bool, bool]:  # whether anything is scored (echo with logprobs), generated
        if not parse():
            return False, False
        assert reqs is not None
        return any(r.ok and r.echo and r.logprobs is not None for r in reqs), \
            any(r.ok and r.max_tokens > 0 for r in reqs)

    scores, runs = llm.on_driver(plan)
    if not llm.is_driver:
        if scores and runs:
            llm.prepare()
        if scores:
            llm.score()
        if runs:
            for _ in llm.stream():
                pass
        return
    assert reqs is not None
    rows: list[tuple[Request, int]] = [(r, j) for r in reqs if r.ok and r.max_tokens > 0 for j in range(r.n)]
    asked = [r.logprobs for r, _ in rows if r.logprobs is not None]  # one call: the most any asks
    if scores:  # the echoed prompts' logprobs: one scoring call, every token with a prefix
        scored = [r for r in reqs if r.ok and r.echo and r.logprobs is not None]
        if rows:  # the plan is the generation's, with the scored prompts among its rows
            llm.prepare([r.prompt for r, _ in rows] + [r.prompt for r in scored],
                        max(r.max_tokens for r, _ in rows), [r.sampling for r, _ in rows] + [SamplingConfig()] * len(scored),
                        max_new_tokens=[r.max_tokens for r, _ in rows] + [1] * len(scored),
                        logprobs=max(asked) if asked else None)
        k = max(r.logprobs for r in scored)  # type: ignore[type-var]
        for r, sc in zip(scored, llm.score([r.prompt for r in scored], logprobs=k)):
            r.prompt_logprobs = sc.logprobs
    for r in reqs:
        if r.ok and r.max_tokens == 0:
            r.choices = [_Nothing(None if r.logprobs is None else TokenLogprobs([], []),
                                  text="" if llm.tokenizer is not None else None) for _ in range(r.n)]
    out = 0  # the next request to write

    def ready() -> list[dict[str, Any]]:
        nonlocal out
        lines = []
        while out < len(reqs) and (not reqs[out].ok or len(reqs[out].choices) == reqs[out].n):
            lines.append(output_line(reqs[out], llm.model.spec.name, tokenizer=llm.tokenizer))
            out += 1
        return lines

    if rows:
        for window in llm.stream([r.prompt for r, _ in rows],  # type: ignore[misc]
                                  max(r.max_tokens for r, _ in rows), [r.sampling for r, _ in rows],
                                  keys=[sampling_key(r, j) for r, j in rows],
                                  max_new_tokens=[r.max_tokens for r, _ in rows],
                                  stop=[r.stop for r, _ in rows], logprobs=max(asked) if asked else None):
            for c in window:
                rows[c.index][0].choices.append(c)
            lines = ready()
            if lines:
                yield lines
    lines = ready()
    if lines:
        yield lines
