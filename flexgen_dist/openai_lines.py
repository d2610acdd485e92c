"""OpenAI Batch response lines: a request's response body in its endpoint's format (choices,
logprobs, usage) or its error, with an id stable across a resumed job."""
from __future__ import annotations

import base64
import hashlib
import struct
import time
from typing import Any

import torch

from .engine.sampling import TokenLogprobs
from .openai_requests import CHAT, CLASSIFY, EMBEDDINGS, RERANK, SCORE, Request
from .openai_responses import RESPONSES, response_body
from .pairs import ranked
from .openai_tools import tool_message

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
    created = int(time.time()) if created is None else created
    if req.url == EMBEDDINGS:
        return _embeddings_line(req, model, rid)
    if req.url in (SCORE, RERANK):
        return _pairs_line(req, model, rid, created)
    if req.url == CLASSIFY:
        return _classify_line(req, model, rid, created)
    assert req.prompt is not None
    chat = req.url in (CHAT, RESPONSES)
    echoed = req.prompt.text if req.prompt.text is not None else \
        tokenizer.decode(req.prompt.ids) if tokenizer is not None else None
    choices = []
    for j, c in enumerate(req.choices):
        choice: dict[str, Any] = {"index": j}
        text = c.text if c.text is not None else ""
        called = None
        if chat and req.tools is not None:  # whole calls: OpenAI's message of tool calls (after any thinking)
            raw = tokenizer.decode(c.token_ids[c.answer_from:], skip_special_tokens=False) \
                if tokenizer is not None else None
            called = tool_message(req.tools, text, f"{rid}|{j}", raw)
        if called is not None:
            choice["message"] = called
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
        if chat and c.reasoning is not None:  # a reasoning model's thinking (vLLM's field)
            choice["message"]["reasoning"] = c.reasoning
        if not chat:  # a completion's text (a chat choice has its message alone)
            choice["text"] = (echoed or "") + text if req.echo else text
        if c.text is None:  # a model without a tokenizer: the ids are the answer
            choice["token_ids"] = (req.prompt.ids if req.echo else []) + c.token_ids
        choice["logprobs"] = None
        if req.logprobs is not None and c.logprobs is not None:
            speller = _AsIds() if req.as_ids else tokenizer  # vLLM's return_tokens_as_token_ids
            choice["logprobs"] = _logprobs_object(chat, c.token_ids, c.logprobs.trimmed(req.logprobs), speller)
            if req.echo and req.scored is not None:
                choice["logprobs"] = _echoed(req.prompt.ids, req.scored[0].trimmed(req.logprobs), speller,
                                             choice["logprobs"])
        if req.prompt_logprobs is not None and req.scored is not None and not chat:
            choice["prompt_logprobs"] = _prompt_logprobs(req.prompt.ids, req.scored, req.prompt_logprobs, tokenizer)
        choice["finish_reason"] = "tool_calls" if called is not None and c.finish_reason == "stop" else c.finish_reason
        choice["stop_reason"] = c.stop_reason  # vLLM's: the stop id or string (None: EOS, length)
        choices.append(choice)
    used = req.generated if req.generated is not None else sum(len(c.token_ids) for c in req.choices)
    prompt_tokens = len(req.prompt.ids)
    if req.url == RESPONSES:  # one choice, in the Responses format
        body = response_body(rid, created, model, req.choices[0], choices[0]["message"], choices[0]["logprobs"],
                             prompt_tokens)
        return _answered(req, rid, body)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used, "total_tokens": prompt_tokens + used}}
    if chat and req.prompt_logprobs is not None and req.scored is not None:  # vLLM: the response's, once
        body["prompt_logprobs"] = _prompt_logprobs(req.prompt.ids, req.scored, req.prompt_logprobs, tokenizer)
    return _answered(req, rid, body)


def _embeddings_line(req: Request, model: str, rid: str) -> dict[str, Any]:
    """An embeddings request's line: OpenAI's ``{"object": "list", "data": [{"object":
    "embedding", "index", "embedding"}], "model", "usage"}``, each vector a list of floats or
    (``encoding_format`` base64) its float32 little-endian bytes in base64."""
    assert req.inputs is not None
    data = []
    for j, vec in enumerate(req.choices):
        emb: Any = vec if req.encoding_format == "float" else \
            base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
        data.append({"object": "embedding", "index": j, "embedding": emb})
    tokens = sum(len(p.ids) for p in req.inputs)
    body = {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return _answered(req, rid, body)


def _classify_line(req: Request, model: str, rid: str, created: int) -> dict[str, Any]:
    """A classify request's line (vLLM's ``{"id", "object": "list", "created", "model", "data":
    [{"index", "label", "probs", "num_classes"}], "usage"}``): each input's labels' softmax (a
    one-label model's sigmoid; the logits themselves with ``use_activation`` off) and the
    most likely label's name."""
    assert req.inputs is not None
    data = []
    for j, c in enumerate(req.choices):  # each a ``Classification``
        x = torch.tensor(c.logits, dtype=torch.float64)
        probs = (x.sigmoid() if x.numel() == 1 else x.softmax(-1)) if req.activation else x
        data.append({"index": j, "label": c.label, "probs": probs.tolist(), "num_classes": x.numel()})
    tokens = sum(len(p.ids) for p in req.inputs)
    body = {"id": f"classify-{rid}", "object": "list", "created": created, "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    return _answered(req, rid, body)


def _pairs_line(req: Request, model: str, rid: str, created: int) -> dict[str, Any]:
    """A score request's line (vLLM's ``{"id", "object": "list", "created", "model", "data":
    [{"index", "object": "score", "score"}], "usage"}``) or a rerank request's (vLLM's and
    Jina's ``{"id", "model", "usage", "results": [{"index", "document": {"text"},
    "relevance_score"}]}``, best first, its ``top_n``). Usage counts the tokens the model read."""
    assert req.pairs is not None and req.inputs is not None
    scores = req.pairs.scores(req.choices, req.cross, req.activation)
    tokens = sum(len(p.ids) for p in req.inputs)
    if req.url == SCORE:
        body = {"id": f"score-{rid}", "object": "list", "created": created, "model": model,
                "data": [{"index": j, "object": "score", "score": s} for j, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    else:
        results = []
        for r in ranked(req.pairs.second, scores, req.top_n):
            res: dict[str, Any] = {"index": r.index}
            if req.return_documents:
                res["document"] = {"text": r.document}
            results.append({**res, "relevance_score": r.score})
        body = {"id": f"rerank-{rid}", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results}
    return _answered(req, rid, body)


def _answered(req: Request, rid: str, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of a request answered with ``body``."""
    return {"id": f"batch_req_{rid}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}


class _AsIds:
    """Spells each token as vLLM's ``return_tokens_as_token_ids`` does: ``token_id:{id}``."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"token_id:{i}" for i in ids)


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


def _prompt_logprobs(ids: list[int], scored: tuple[TokenLogprobs, list[int]], k: int, tokenizer: Any | None
                     ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first (no prefix), else
    ``{id: {"logprob", "rank", "decoded_token"}}`` for the token itself and its ``k`` most
    likely alternatives (ids as JSON keys are, strings)."""
    lps, ranks = scored

    def entry(i: int, lp: float, rank: int) -> dict[str, Any]:
        return {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([i]) if tokenizer is not None else str(i)}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, lp, rank, alts in zip(ids[1:], lps.token_logprobs, ranks, lps.top):
        d = {str(i): entry(i, alp, n + 1) for n, (i, alp) in enumerate(alts[:k])}
        d[str(t)] = entry(t, lp, rank)
        out.append(d)
    return out


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
