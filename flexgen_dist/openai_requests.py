"""OpenAI Batch request lines (``openai_batch.py`` runs them): each line parsed into a
``Request``, what it asks for (prompt, limits, sampling, stops, ``n``, logprobs, echo; an
embeddings or classify request's inputs, dimensions and encoding; a score or rerank
request's pairs) or the one-line error that keeps it from running (bad JSON, an unknown url, a body field that
would change the output and is not computed, a prompt longer than the model's context). Each
field's own check is ``openai_fields.py``'s; a Responses body is read as its chat body
(``openai_responses.py``)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from . import openai_fields as fields
from .choices import MAX_CHOICES, Choices
from .config import ConfigError
from .engine.beams import BeamConfig
from .engine.sampling import MAX_PENALTY, SamplingConfig, TokenLogprobs
from .models.spec import ModelSpec
from .openai_fields import CHAT, COMPLETIONS, GUIDED, RequestError
from .openai_responses import RESPONSES, ResponsesError, chat_body, unsupported_field
from .openai_tools import ToolChoice, ToolError, parse_tools
from .tool_calls import reads_auto
from .pairs import Pairs, cross_encoder
from .prompts import Prompt, check_truncation, make_prompt, truncated

EMBEDDINGS = "/v1/embeddings"
SCORE, RERANK = "/v1/score", "/v1/rerank"  # text pairs (``pairs.py``): vLLM's routes
CLASSIFY = "/v1/classify"  # a sequence classifier's labels (vLLM's route)
ROUTES = {CHAT: CHAT, COMPLETIONS: COMPLETIONS, EMBEDDINGS: EMBEDDINGS, SCORE: SCORE, "/score": SCORE,
          RERANK: RERANK, "/rerank": RERANK, "/v2/rerank": RERANK, RESPONSES: RESPONSES,
          CLASSIFY: CLASSIFY, "/classify": CLASSIFY}  # url -> endpoint
# a score body's pair of sides, under any of vLLM's names for them
SCORE_SIDES = (("text_1", "text_2"), ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"))
# fields of a score or rerank body besides its texts (vLLM's), and a rerank body's own (Jina's, Cohere's)
PAIR_FIELDS = {"model", "user", "priority", "truncate_prompt_tokens", "use_activation", "activation", "softmax"}
RERANK_FIELDS = {"top_n", "return_documents"}
MAX_N = MAX_CHOICES  # choices per request
MAX_INPUTS = 2048  # inputs per embeddings request (OpenAI's limit)
EMBED_FIELDS = {"input", "model", "encoding_format", "dimensions", "user",
                "truncate_prompt_tokens"}  # an embeddings body's fields (the last: vLLM's)
CLASSIFY_FIELDS = {"input", "model", "user", "truncate_prompt_tokens", "priority", "use_activation", "activation",
                   "softmax"}  # a classify body's (vLLM's)
# body fields that cannot change the output
INERT = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls",
         "priority", "request_id", "cache_salt"}  # the last three: vLLM's scheduling and cache keys
# fields accepted at the value that means "off" only: any other value would change the output
OFF: dict[str, tuple[Any, ...]] = {
    "stream": (False, None),
    "functions": (None, []), "function_call": (None, "none", "auto"), "suffix": (None, ""),
    "spaces_between_special_tokens": (None, True),  # vLLM's: only a slow tokenizer's decode reads it
}
USED = {"messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
        "best_of",
        "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias",
        "top_k", "min_p", "repetition_penalty", "prompt_logprobs",  # these four: vLLM's extensions
        "response_format", "structured_outputs", *GUIDED,  # the last two: vLLM's structured outputs
        "tools", "tool_choice",  # chat only: function calling, named or required (openai_tools.py)
        "chat_template_kwargs", "reasoning_effort",  # chat only: the template's variables (vLLM's; OpenAI's)
        "continue_final_message", "add_generation_prompt",  # chat only (vLLM's): an assistant prefill continued
        *fields.CONTROLS,  # vLLM's: min_tokens, stop_token_ids, ignore_eos, bad_words, ...
        "echo",  # completions only
        "truncate_prompt_tokens",  # vLLM's: a longer prompt cut to its last K tokens
        "add_special_tokens", "return_tokens_as_token_ids",  # vLLM's: a BOS for the text; logprobs' tokens as ids
        "use_beam_search", "length_penalty", "early_stopping"}  # vLLM's: best_of beams (then its beam settings)



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
    # candidates generated, of which the n with the highest mean log-probability per token are
    # returned (``best_of``; a beam search's width; 0: n, as for every request that asks for none)
    best_of: int = 0
    generated: int | None = None  # tokens of every candidate (``best_choices``; None: of the choices)
    seeded: bool = False  # its own seed: its draws depend on nothing else (not its line)
    logprobs: int | None = None  # alternatives per token in its logprobs (None: no logprobs)
    echo: bool = False  # completions: the prompt comes back before the completion (and its logprobs)
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's tokens' logprobs, K alternatives
    # the prompt's tokens 1.. scored (echo with logprobs, or prompt_logprobs): logprobs and ranks
    scored: tuple[TokenLogprobs, list[int]] | None = None
    tools: ToolChoice | None = None  # chat: its tools, and the call its completion must be
    model: str | None = None  # the body's model: where it names a LoRA adapter the run serves, its adapter
    adapter: str | None = None  # that adapter's name (``run_batch`` sets it; None: the base model)
    inputs: list[Prompt] | None = None  # embeddings: its inputs (``prompt`` is None)
    dimensions: int | None = None  # embeddings: each vector's first that many (None: all)
    encoding_format: str = "float"  # embeddings: "float" (a list) or "base64" (float32 little-endian bytes)
    pairs: Pairs | None = None  # score, rerank: its texts (``inputs`` are what the model runs for them)
    activation: bool = True  # score, rerank, classify: the logits through a sigmoid / softmax (False: as they are)
    cross: bool = False  # score, rerank: the model reads each pair as one sequence (else embeds each text)
    top_n: int = 0  # rerank: the best that many documents (0: all)
    return_documents: bool = True  # rerank: each result carries its document's text
    truncate: int | None = None  # vLLM's truncate_prompt_tokens: the request's own, else the run's
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs spell tokens "token_id:{id}"
    beams: BeamConfig | None = None  # vLLM's use_beam_search: its n choices are its n best beams
    error: RequestError | None = None
    choices: list[Any] = field(default_factory=list)  # filled by the run (Completions)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def candidates(self) -> int:
        """Results it runs for before its line is written: its ``best_of``, else its ``n``."""
        return self.best_of or self.n

    @property
    def prompt_alternatives(self) -> int | None:
        """How many alternatives its prompt's scored tokens need (None: its prompt is not
        scored): echo with logprobs, or vLLM's prompt_logprobs, the more of the two."""
        asks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asks) if asks and self.ok else None


def parse_requests(lines: list[str], tokenizer: Any | None, vocab_size: int, max_positions: int,
                   default_max_tokens: int, seed: int = 0, eos_ids: tuple[int, ...] = (),
                   template_kwargs: dict[str, Any] | None = None, truncate: int | None = None,
                   ignore_eos: bool = False) -> list[Request]:
    """One ``Request`` per non-blank line, in order; a duplicate ``custom_id`` is refused
    before anything runs (``ConfigError``), a bad request gets its ``error``. ``seed`` and
    ``ignore_eos`` (the run's) are a request's unless it gives its own. Chats render with
    the template's variables ``template_kwargs`` (the run's), a request's own on top; prompts
    are cut as ``truncate`` says (the run's ``truncate_prompt_tokens``) unless a request says
    otherwise."""
    out: list[Request] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines):
        if not raw.strip():
            continue
        req = parse_request(n, raw, tokenizer, vocab_size, max_positions, default_max_tokens, seed, eos_ids,
                            template_kwargs, truncate, ignore_eos)
        if req.custom_id in seen:
            raise ConfigError(f"line {n + 1}: custom_id {req.custom_id!r} is also on line {seen[req.custom_id] + 1}; "
                              "each request needs its own custom_id")
        seen[req.custom_id] = n
        out.append(req)
    if not out:
        raise ConfigError("the batch file has no requests")
    return out


def parse_request(n: int, raw: str, tokenizer: Any | None, vocab_size: int, max_positions: int,
                  default_max_tokens: int, seed: int = 0, eos_ids: tuple[int, ...] = (),
                  template_kwargs: dict[str, Any] | None = None, truncate: int | None = None,
                  ignore_eos: bool = False) -> Request:
    """Request of line ``n`` (0-based); a request that cannot run carries its error."""
    req = Request(n, f"line-{n + 1}", truncate=truncate)
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
        _fill(req, rec, tokenizer, vocab_size, max_positions, default_max_tokens, seed, eos_ids, template_kwargs,
              ignore_eos)
    except RequestError as e:
        req.error = e
    except ConfigError as e:  # what make_prompt refuses (ids outside the vocabulary, no template)
        req.error = RequestError("invalid_request", str(e))
    return req


def _fill(req: Request, rec: dict[str, Any], tokenizer: Any | None, vocab_size: int, max_positions: int,
          default_max_tokens: int, seed: int, eos_ids: tuple[int, ...] = (),
          template_kwargs: dict[str, Any] | None = None, ignore_eos: bool = False) -> None:
    method = rec.get("method", "POST")
    if method != "POST":
        raise RequestError("invalid_request", f"method {method!r}: batch requests are POST")
    url = str(rec.get("url", ""))
    if url not in ROUTES:
        raise RequestError("invalid_url", f"url {url!r} is not served: use one of "
                                          f"{', '.join(dict.fromkeys(ROUTES.values()))}")
    req.url = ROUTES[url]
    body = rec.get("body")
    if not isinstance(body, dict):
        raise RequestError("invalid_request", "the request has no 'body' object")
    if body.get("truncate_prompt_tokens") is not None:
        try:
            req.truncate = check_truncation(body["truncate_prompt_tokens"])
        except ConfigError as e:
            raise RequestError("invalid_value", str(e)) from None
    if req.url in (EMBEDDINGS, CLASSIFY):
        _fill_inputs(req, body, tokenizer, vocab_size, max_positions)
        return
    if req.url in (SCORE, RERANK):
        _fill_pairs(req, body)
        return
    kind, auto = req.url, False
    if req.url == RESPONSES:  # read as the chat completion it amounts to, answered in its own format
        auto = body.get("truncation") == "auto"  # the conversation's first turns may go to fit
        try:
            body, kind = {**chat_body(body), **({"model": body["model"]} if "model" in body else {})}, CHAT
        except ResponsesError as e:
            raise RequestError(e.code, str(e)) from None
    bad = unsupported_field(body, USED | INERT, OFF)
    if bad:
        raise RequestError("unsupported_field", bad)
    req.echo = fields.echo(kind, body.get("echo"))
    req.model = body["model"] if isinstance(body.get("model"), str) else None
    try:
        req.tools = parse_tools(body, kind == CHAT, reads_auto(tokenizer))
    except ToolError as e:
        raise RequestError(e.code, str(e)) from None
    _fill_prompt(req, kind, body, auto, tokenizer, vocab_size, max_positions, default_max_tokens, template_kwargs)
    _fill_sampling(req, kind, body, tokenizer, vocab_size, seed, eos_ids, ignore_eos)


def _fill_prompt(req: Request, kind: str, body: dict[str, Any], auto: bool, tokenizer: Any | None, vocab_size: int,
                 max_positions: int, default_max_tokens: int, template_kwargs: dict[str, Any] | None) -> None:
    """A completion or chat request's prompt and ``max_tokens``, cut as it asks (a Responses
    body's ``truncation: "auto"``: its first turns dropped), or its context error."""
    req.prompt = _prompt(req, kind, body, tokenizer, vocab_size, template_kwargs)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    # echo and max_tokens 0: the prompt's own logprobs, nothing generated (a loglikelihood)
    req.max_tokens = default_max_tokens if mt is None else fields.integer(mt, "max_tokens", 0 if req.echo else 1)
    while auto and len(req.prompt.ids) + req.max_tokens > max_positions:
        shorter = first_turn_dropped(body["messages"])
        if shorter is None:
            break
        body = {**body, "messages": shorter}
        req.prompt = _prompt(req, kind, body, tokenizer, vocab_size, template_kwargs)
    req.prompt = truncated(req.prompt, req.truncate, max_positions - req.max_tokens)
    if len(req.prompt.ids) + req.max_tokens > max_positions:
        raise RequestError("context_length_exceeded",
                           f"the prompt has {len(req.prompt.ids)} tokens; with max_tokens {req.max_tokens} that "
                           f"exceeds the model's {max_positions} positions: shorten it, lower max_tokens or give "
                           "truncate_prompt_tokens")


def _fill_sampling(req: Request, kind: str, body: dict[str, Any], tokenizer: Any | None, vocab_size: int, seed: int,
                   eos_ids: tuple[int, ...], ignore_eos: bool) -> None:
    """A completion or chat request's sampling (vLLM's controls and structured output
    included), stops, ``n``, logprobs and beam search."""
    hot = any(k in body for k in ("top_p", "top_k", "min_p"))  # a sampling setting without a temperature
    temp = fields.number(body.get("temperature", 1.0 if hot else 0.0), "temperature", 0.0, 2.0)
    top_p = fields.number(body.get("top_p", 1.0), "top_p", 0.0, 1.0)
    if top_p <= 0:
        raise RequestError("invalid_value", "top_p must be in (0, 1]")
    s = body.get("seed")
    penalties = [fields.number(body.get(k) or 0.0, k, -MAX_PENALTY, MAX_PENALTY)
                 for k in ("frequency_penalty", "presence_penalty")]
    top_k = body.get("top_k")
    top_k = 0 if top_k in (None, -1) else fields.integer(top_k, "top_k", 0)  # -1 (vLLM's off) or 0: every token
    ctl = fields.controls(body, vocab_size, tokenizer)
    st = fields.structure(body, tokenizer, vocab_size, eos_ids, req.tools)
    ctl.setdefault("ignore_eos", ignore_eos and st is None)  # the run's --ignore-eos, where it can hold
    req.sampling = SamplingConfig(temp, top_p, seed if s is None else fields.integer(s, "seed", 0),
                                  frequency_penalty=penalties[0], presence_penalty=penalties[1],
                                  logit_bias=fields.logit_bias(body.get("logit_bias"), vocab_size), top_k=top_k,
                                  min_p=fields.number(body.get("min_p", 0.0), "min_p", 0.0, 1.0),
                                  repetition_penalty=fields.repetition(body.get("repetition_penalty")),
                                  structure=st, **ctl)
    why = req.sampling.structure_conflict()
    if why:
        raise RequestError("invalid_value", why)
    req.seeded = s is not None
    req.stop = fields.stops(body.get("stop"))
    req.n = fields.integer(body.get("n", 1), "n", 1)
    if req.n > MAX_N:
        raise RequestError("invalid_value", f"n {req.n}: at most {MAX_N} choices per request")
    best_of = body.get("best_of")
    best_of = None if best_of is None else fields.integer(best_of, "best_of", 1)
    try:  # with greedy sampling every candidate is the greedy one: none beyond n
        choices = Choices.of(req.n, best_of, req.sampling, req.sampling)
    except ValueError as e:
        raise RequestError("invalid_value", f"{e}: best_of candidates are generated and the n best returned") \
            from None
    req.logprobs = fields.logprobs(kind, body)
    as_ids = body.get("return_tokens_as_token_ids")
    if as_ids is not None and not isinstance(as_ids, bool):
        raise RequestError("invalid_value", f"return_tokens_as_token_ids {as_ids!r}: true or false")
    req.as_ids = bool(as_ids)
    pl = body.get("prompt_logprobs")
    req.prompt_logprobs = None if pl is None else fields.alternatives(pl, "prompt_logprobs")
    req.beams = fields.beams(body, best_of or req.n)  # vLLM's: best_of beams, the n best returned
    req.best_of = req.n if req.max_tokens == 0 else req.beams.width if req.beams is not None else choices.best_of
    if req.beams is not None:
        asks = [k for k, on in (("stop", bool(req.stop)), ("logprobs", req.logprobs is not None),
                                ("prompt_logprobs", req.prompt_logprobs is not None), ("echo", req.echo),
                                ("a sampling temperature", not req.sampling.greedy),
                                ("penalties or logit_bias", req.sampling.adjusts),
                                ("structured output", req.sampling.structure is not None)) if on]
        if asks:
            raise RequestError("invalid_request", f"use_beam_search does not take {asks[0]}"
                                                  + (": give stop_token_ids" if asks[0] == "stop" else ""))


def first_turn_dropped(msgs: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The Responses API's ``truncation: "auto"``: the conversation without its first turn (its
    first message after the instructions, up to the next user message: a turn's calls and their
    outputs go together), or None where only the last turn is left."""
    lead = next((i for i, m in enumerate(msgs) if m.get("role") not in ("system", "developer")), len(msgs))
    nxt = next((i for i in range(lead + 1, len(msgs)) if msgs[i].get("role") == "user"), None)
    return None if nxt is None else msgs[:lead] + msgs[nxt:]


def _fill_inputs(req: Request, body: dict[str, Any], tokenizer: Any | None, vocab_size: int,
                 max_positions: int) -> None:
    """An embeddings or classify request: its inputs (a string, token ids, or a list of
    either); an embeddings request's ``dimensions`` and ``encoding_format``, a classify
    request's ``use_activation``."""
    bad = unsupported_field(body, EMBED_FIELDS if req.url == EMBEDDINGS else CLASSIFY_FIELDS, {}, f" on {req.url}")
    if bad:
        raise RequestError("unsupported_field", bad)
    req.model = body["model"] if isinstance(body.get("model"), str) else None
    x = body.get("input")
    ids = isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    items = [x] if isinstance(x, str) or ids else x
    if not isinstance(items, list) or not items:
        raise RequestError("invalid_request", f"a {req.url} request needs 'input': a string, a list of token ids, "
                                              "or a non-empty list of either")
    if len(items) > MAX_INPUTS:
        raise RequestError("invalid_value", f"{len(items)} inputs: at most {MAX_INPUTS} per request")
    req.inputs = []
    for j, item in enumerate(items):
        if isinstance(item, str) and item:
            p = make_prompt(f"{req.custom_id}[{j}]", item, None, tokenizer, vocab_size)
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            p = make_prompt(f"{req.custom_id}[{j}]", None, item, tokenizer, vocab_size)
        else:
            raise RequestError("invalid_request", f"input {j} is not a non-empty string or list of token ids")
        p = truncated(p, req.truncate, max_positions)
        if len(p.ids) > max_positions:
            raise RequestError("context_length_exceeded", f"input {j} has {len(p.ids)} tokens, more than the model's "
                                                          f"{max_positions} positions: shorten it (or give "
                                                          "truncate_prompt_tokens)")
        req.inputs.append(p)
    req.n = len(req.inputs)  # one vector per input: the line is ready with all of them
    if req.url == CLASSIFY:
        req.activation = fields.activation(body)
        return
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise RequestError("invalid_value", f"encoding_format {fmt!r}: give 'float' or 'base64'")
    req.encoding_format = fmt
    d = body.get("dimensions")
    req.dimensions = None if d is None else fields.integer(d, "dimensions", 1)


def _fill_pairs(req: Request, body: dict[str, Any]) -> None:
    """A score request (two sides of texts, under any of vLLM's names) or a rerank request
    (``query``, ``documents``, ``top_n``); the model's inputs for it come with the model
    (``pair_inputs``)."""
    rerank = req.url == RERANK
    sides = [("query", "documents")] if rerank else [s for s in SCORE_SIDES if s[0] in body and s[1] in body]
    if len(sides) != 1:
        raise RequestError("invalid_request", f"a {req.url} request needs " + (
            "'query' and 'documents'" if rerank else "its two sides: 'text_1' and 'text_2' (or 'queries' and "
                                                     "'documents' or 'items', or 'data_1' and 'data_2'), one pair"))
    names = sides[0]
    bad = unsupported_field(body, PAIR_FIELDS | set(names) | (RERANK_FIELDS if rerank else set()),
                            {"mm_processor_kwargs": (None,)}, f" on {req.url}")
    if bad:
        raise RequestError("unsupported_field", bad)
    req.model = body["model"] if isinstance(body.get("model"), str) else None
    try:
        req.pairs = Pairs.of(body.get(names[0]), body.get(names[1]), names, one_first=rerank)
    except ConfigError as e:
        raise RequestError("invalid_request", str(e)) from None
    if len(req.pairs.first) + len(req.pairs.second) > MAX_INPUTS:
        raise RequestError("invalid_value", f"{len(req.pairs.first) + len(req.pairs.second)} texts: at most "
                                            f"{MAX_INPUTS} per request")
    req.activation = fields.activation(body)
    if rerank:
        top = body.get("top_n")
        req.top_n = 0 if top is None or (isinstance(top, int) and not isinstance(top, bool) and top < 0) \
            else fields.integer(top, "top_n", 0)  # 0 or negative: every document (vLLM's)
        rd = body.get("return_documents", True)
        if not isinstance(rd, bool):
            raise RequestError("invalid_value", f"return_documents {rd!r}: true or false")
        req.return_documents = rd


def pair_inputs(req: Request, spec: ModelSpec, tokenizer: Any | None, template: str | None = None,
                template_kwargs: dict[str, Any] | None = None) -> None:
    """A score or rerank request's ``inputs`` for this model (``Pairs.prompts``), or its error;
    one result per input makes its line ready (``n``)."""
    assert req.pairs is not None
    try:
        req.cross = cross_encoder(spec)
        req.inputs = req.pairs.prompts(spec, tokenizer, req.custom_id, req.truncate, template, template_kwargs)
    except ConfigError as e:
        code = "context_length_exceeded" if "positions" in str(e) else "invalid_request"
        raise RequestError(code, str(e)) from None
    req.n = len(req.inputs)


def _prompt(req: Request, kind: str, body: dict[str, Any], tokenizer: Any | None, vocab_size: int,
            template_kwargs: dict[str, Any] | None = None) -> Prompt:
    special = body.get("add_special_tokens")  # vLLM's: default true for a completion, false for a chat
    if special is not None and not isinstance(special, bool):
        raise RequestError("invalid_value", f"add_special_tokens {special!r}: true or false")
    if kind == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("invalid_request", "a chat request needs 'messages', a non-empty list")
        cont, opened = fields.continuation(body)
        return make_prompt(req.custom_id, None, None, tokenizer, vocab_size, fields.chat_messages(msgs),
                           tools=list(req.tools.tools) if req.tools is not None else None,
                           template_kwargs={**(template_kwargs or {}), **fields.template_kwargs(body)},
                           continue_final=cont, generation_prompt=opened, special=special)
    for k in ("chat_template_kwargs", "reasoning_effort", "continue_final_message", "add_generation_prompt"):
        if body.get(k) is not None:
            raise RequestError("unsupported_field", f"{k} is a chat field: a completions request has no chat template")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt given as a list of one
    if isinstance(p, str) and p:
        return make_prompt(req.custom_id, p, None, tokenizer, vocab_size, special=special)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return make_prompt(req.custom_id, None, p, tokenizer, vocab_size)
    raise RequestError("invalid_request", "a completions request needs 'prompt': a non-empty string or a list of "
                                          "token ids (one prompt per request)")


def sampling_key(req: Request, choice: int) -> int:
    """The key of choice ``choice`` of ``req`` for its random draws: the choice alone for a
    request with its own seed (the same request samples the same in any job), else its line
    and choice (every request of a job draws apart, and a resumed job draws the same)."""
    return choice if req.seeded else req.line * MAX_N + choice
