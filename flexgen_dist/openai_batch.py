"""Batch jobs in the OpenAI Batch format: request lines in, response lines out.

An input line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions" | "/v1/responses" | "/v1/embeddings" | "/v1/classify" | "/v1/score" |
"/v1/rerank", "body": {...}}`` (a Responses request runs as the chat completion it amounts to,
``openai_responses.py``; score and rerank requests as ``pairs.py`` reads them); an output
line is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``,
with the body shaped as the endpoint's response (``choices``, ``usage``), so the readers of
hosted batch APIs parse it. A request the
engine cannot serve as asked (bad JSON, an unknown url, a body field that would change the
output and is not computed, a prompt longer than the model's context) gets an error line of
its own; the others run. Each request keeps its own ``max_tokens``, sampling (penalties,
biases, top-k and min-p included) and stop strings (``Workload``), and ``n`` choices become n
rows of the job. Log-probabilities are computed for the whole call at the most any request
asks for, and each request's line carries its own number of alternatives. A completions
request with ``echo`` gets its prompt back before its completion, and with ``logprobs`` its
prompt's tokens' too, from one teacher-forced scoring call (``LLM.score``) over every echoed
prompt before the generation; with ``max_tokens`` 0 it generates nothing. A request whose
``model`` names a LoRA adapter the run serves (``--lora-modules``) runs with it. Embeddings
requests (``/v1/embeddings``) get each input's vector from one ``LLM.embed`` call over every
input of the file, before the completions run, each cut to its ``dimensions`` and normalized.

``openai_requests.py`` turns lines into requests and ``openai_lines.py`` results into lines;
this module runs a batch of them (``LLM.batch``; ``python -m flexgen_dist.batch`` is the
command).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from .choices import by_mean_logprob
from .config import ConfigError, RunConfig
from .embeddings import Classification, check_embed, finish
from .engine.beams import beams_refusal
from .engine.sampling import SamplingConfig, TokenLogprobs
from .openai_lines import output_line
from .models.loader import LoadedModel
from .openai_requests import CLASSIFY, EMBEDDINGS, RERANK, SCORE, Request, RequestError, pair_inputs, parse_requests, sampling_key



@dataclass
class _Nothing:
    """The choice of an echo request with max_tokens 0: nothing generated."""

    logprobs: TokenLogprobs | None
    token_ids: list[int] = field(default_factory=list)
    text: str | None = ""
    finish_reason: str = "length"
    reasoning: str | None = None
    answer_from: int = 0
    stop_reason: int | str | None = None


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
        spec = llm.model.spec
        reqs = parse_requests(lines, llm.tokenizer, spec.vocab_size, spec.max_positions, default, llm.config.seed,
                              spec.eos_token_ids, llm.config.template_kwargs, llm.config.truncate_prompt_tokens,
                              llm.config.ignore_eos)[skip:]
        for r in reqs:  # a model naming a served LoRA adapter runs with it; any other, the base model
            r.adapter = r.model if r.model in llm.model.adapters else None
            try:
                _for_model(r, llm.model, llm.tokenizer, llm.config)
            except RequestError as e:
                r.error = e
        return any(r.ok for r in reqs)

    def plan() -> tuple[bool, str, bool, int]:  # scored (echo, prompt_logprobs)? pooled how, generated? beam calls
        if not parse():
            return False, "", False, 0
        assert reqs is not None
        pooled = any(r.ok and r.inputs is not None for r in reqs)
        widths = {r.beams.width for r in reqs if r.ok and r.beams is not None}
        if widths:  # a GPU batch holds whole prompts' beams: the plan's is a multiple of every width
            llm.gpu_batch_unit = math.lcm(*widths)
        return (any(r.prompt_alternatives is not None for r in reqs),
                ("classify" if llm.model.spec.num_labels else "embed") if pooled else "",
                any(r.ok and r.max_tokens > 0 and r.beams is None for r in reqs), len(beam_groups(reqs)))

    scores, pooled, runs, searches = llm.on_driver(plan)
    if not llm.is_driver:  # the same calls as rank 0, in the same order
        if (scores or pooled) and runs:
            llm.prepare()
        if scores:
            llm.score()
        if pooled == "classify":
            llm.classify()
        elif pooled:
            llm.embed()
        if runs:
            for _ in llm.stream():
                pass
        for _ in range(searches):
            if llm.on_driver(lambda: None):
                for _ in llm.stream_beam_search():
                    pass
        return
    assert reqs is not None
    yield from _drive(llm, reqs)


class _InOrder:
    """Rank 0's requests written in input order: each line once its request has all its choices
    (an error line at once)."""

    def __init__(self, llm: Any, reqs: list[Request]) -> None:
        self.llm, self.reqs, self.out = llm, reqs, 0  # out: the next request to write

    def lines(self) -> list[dict[str, Any]]:
        reqs, llm, lines = self.reqs, self.llm, []
        while self.out < len(reqs) and (not reqs[self.out].ok or len(reqs[self.out].choices) == reqs[self.out].candidates):
            r = reqs[self.out]
            best_choices(r)
            lines.append(output_line(r, r.adapter or llm.model.spec.name, tokenizer=llm.tokenizer))
            self.out += 1
        return lines


def _drive(llm: Any, reqs: list[Request]) -> Iterator[list[dict[str, Any]]]:
    """Rank 0's calls, in the order the other ranks make them (``run_batch``): the plan, the
    prompts' scores, the embeddings, the completions; lines yielded as they are ready."""
    rows: list[tuple[Request, int]] = [(r, j) for r in reqs if r.ok and r.max_tokens > 0 and r.beams is None
                                       for j in range(r.candidates)]
    # one call: the most any asks (best_of's ranking needs the chosen tokens' own)
    asked = [r.logprobs or 0 for r, _ in rows if r.logprobs is not None or r.candidates > r.n]
    scored = [r for r in reqs if r.prompt_alternatives is not None]
    embedded = [(r, p) for r in reqs if r.ok and r.inputs is not None for p in r.inputs]
    if rows and (scored or embedded):  # the plan is the generation's, with the scored and embedded prompts among its rows
        extra = [r.prompt for r in scored] + [p for _, p in embedded]
        llm.prepare([r.prompt for r, _ in rows] + extra,
                    max(r.max_tokens for r, _ in rows), [r.sampling for r, _ in rows] + [SamplingConfig()] * len(extra),
                    max_new_tokens=[r.max_tokens for r, _ in rows] + [1] * len(extra),
                    logprobs=max(asked) if asked else None,
                    lora=[r.adapter for r, _ in rows] + [r.adapter for r in scored] + [r.adapter for r, _ in embedded])
    if scored:  # the prompts' logprobs: one scoring call, every token with a prefix
        k = max(r.prompt_alternatives for r in scored)  # type: ignore[type-var]
        for r, sc in zip(scored, llm.score([r.prompt for r in scored], logprobs=k, lora=[r.adapter for r in scored])):
            r.scored = (sc.logprobs, sc.ranks)  # type: ignore[assignment]
    for r in reqs:
        if r.ok and r.max_tokens == 0 and r.inputs is None:
            r.choices = [_Nothing(None if r.logprobs is None else TokenLogprobs([], []),
                                  text="" if llm.tokenizer is not None else None) for _ in range(r.n)]
    ready = _InOrder(llm, reqs)
    if embedded:  # one call over every input of every request (embedded, or a cross-encoder's pairs classified)
        classify = bool(llm.model.spec.num_labels)
        prompts, lora = [p for _, p in embedded], [r.adapter for r, _ in embedded]
        windows = llm.stream_classify(prompts, lora=lora) if classify else \
            llm.stream_embed(prompts, normalize=False, lora=lora)
        for window in windows:
            for e in window:  # windows come in input order: a request's results in its inputs' order
                r = embedded[e.index][0]
                r.choices.append(e if r.url == CLASSIFY else e.logits if isinstance(e, Classification)
                                 else e.embedding if r.pairs is not None
                                 else finish(torch.tensor(e.embedding), r.dimensions, normalize=True))
            yield from _nonempty(ready.lines())
    if rows:
        for window in llm.stream([r.prompt for r, _ in rows],  # type: ignore[misc]
                                  max(r.max_tokens for r, _ in rows), [r.sampling for r, _ in rows],
                                  keys=[sampling_key(r, j) for r, j in rows],
                                  max_new_tokens=[r.max_tokens for r, _ in rows],
                                  stop=[r.stop for r, _ in rows], logprobs=max(asked) if asked else None,
                                  lora=[r.adapter for r, _ in rows]):
            for c in window:
                rows[c.index][0].choices.append(c)
            yield from _nonempty(ready.lines())
    for group in beam_groups(reqs):  # vLLM's use_beam_search: one call per beam setting and max_tokens
        r0 = group[0]
        why = None if llm.plan is None else next(
            (w for w in (beams_refusal(s.policy, r0.beams.width) for s in llm.plan.stages) if w), None)
        if llm.on_driver(lambda: why is None):
            for window in llm.stream_beam_search([r.prompt for r in group], r0.beams.width, r0.max_tokens,
                                                 length_penalty=r0.beams.length_penalty,
                                                 early_stopping=r0.beams.early_stopping,
                                                 sampling=[r.sampling for r in group],
                                                 lora=[r.adapter for r in group]):
                for o in window:
                    group[o.index].choices = list(o.sequences)
                yield from _nonempty(ready.lines())
        else:
            for r in group:
                r.error = RequestError("invalid_request", str(why))
        yield from _nonempty(ready.lines())
    yield from _nonempty(ready.lines())


def best_choices(r: Request) -> None:
    """A request's ``best_of`` candidates cut to its ``n`` best, best first: by the mean
    log-probability of their tokens (OpenAI's rule: the model's own distribution, as
    ``logprobs`` reports it; ties in candidate order), or as its beam search ranked them.
    Its usage then counts every candidate's tokens (``Request.generated``), as generated."""
    if not r.ok or r.candidates == r.n or len(r.choices) <= r.n:
        return
    r.generated = sum(len(c.token_ids) for c in r.choices)
    if r.beams is None:
        r.choices = by_mean_logprob(r.choices)
    r.choices = r.choices[:r.n]


def beam_groups(reqs: list[Request]) -> list[list[Request]]:
    """The beam search requests that can run, by beam setting and max_tokens, in input order."""
    out: dict[tuple[Any, int], list[Request]] = {}
    for r in reqs:
        if r.ok and r.beams is not None and r.max_tokens > 0:
            out.setdefault((r.beams, r.max_tokens), []).append(r)
    return list(out.values())


def _for_model(r: Request, model: LoadedModel, tokenizer: Any | None, cfg: RunConfig) -> None:
    """What a parsed request needs of this model: a language model for completions and
    embeddings, room for its ``dimensions``, the pair inputs of a score or rerank request."""
    if not r.ok:
        return
    spec = model.spec
    if r.url == CLASSIFY:
        if not spec.num_labels:
            raise RequestError("invalid_request", f"{CLASSIFY} needs a sequence classifier (a "
                                                  "*ForSequenceClassification checkpoint): this is a language model")
        return
    if spec.num_labels and r.pairs is None:
        raise RequestError("invalid_request", f"this model is a sequence classifier ({spec.num_labels} labels, no "
                                              f"vocabulary head): {r.url} needs a language model; it serves "
                                              + (f"{CLASSIFY}, {SCORE} and {RERANK}" if spec.num_labels == 1 else CLASSIFY))
    if r.url == EMBEDDINGS or (r.pairs is not None and not spec.num_labels):  # vectors of this model
        try:
            check_embed(r.dimensions, spec, model.embed_dim)
        except ConfigError as e:
            raise RequestError("invalid_value" if r.dimensions is not None and "dimensions" in str(e)
                               else "invalid_request", str(e)) from None
    if r.pairs is not None:
        pair_inputs(r, spec, tokenizer, cfg.score_template_text, cfg.template_kwargs)


def _nonempty(lines: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    return [lines] if lines else []
