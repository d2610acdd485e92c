"""A call's arguments as a ``Workload``: the prompts (text, token ids or conversations)
tokenized and checked against the model's positions, with the per-request limits, samplings
and stop strings; for scoring, each sequence split into its prefill and decode parts with
its targets. Rank 0 builds it (it has the tokenizer); the other ranks get its header."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence, cast

from .config import ConfigError, RunConfig
from .engine.prefix_shape import PrefixShape
from .engine.held import holds_prefix
from .engine.bans import bad_word_ids
from .engine.beams import BeamConfig
from .engine.prefix import longest_sharing, shares_prefix
from .engine.sampling import SamplingConfig
from .engine.structure import check_structure
from .models.spec import ModelSpec
from .plan import Workload
from .prompts import Messages, Prompt, check_prompt_lengths, make_prompt, truncated
from .reasoning import Reasoning
from .scoring import score_split, score_targets

PromptLike = str | Sequence[int] | Messages | Prompt  # a Prompt keeps its id and text (the CLI passes them)
LoraChoice = str | Sequence[str | None] | None  # a served LoRA adapter's name for every prompt, or one per prompt
log = logging.getLogger("flexgen_dist")


def build_workload(prompts: Sequence[PromptLike] | None, gen_len: int | None,
                   sampling: SamplingConfig | Sequence[SamplingConfig] | None, cfg: RunConfig, spec: ModelSpec,
                   tokenizer: Any | None, *, keys: Sequence[int] | None = None,
                   max_new_tokens: Sequence[int] | None = None, stop: Sequence[Sequence[str]] | None = None,
                   scoring: bool = False, logprobs: int | None = None, reasoning: Reasoning | None = None,
                   lora: LoraChoice = None, served: Sequence[str] = (), call: str | None = None,
                   beams: BeamConfig | None = None, truncate: int | None = None) -> Workload:
    """The workload of one call; ``gen_len`` and ``sampling`` default to the config's. A chat
    prompt of a reasoning model (``reasoning``) gets its structure after the thinking.
    ``lora``: the adapter of every prompt or of each, by name among ``served`` (the model's).
    ``beams``: a beam search (``LLM.beam_search``): every prompt is there ``beams.width`` times
    in a row, its beams. ``truncate``: the call's ``truncate_prompt_tokens`` (None: the run's);
    a prompt's sampling's own wins."""
    name = call or ("score" if scoring else "generate")
    if spec.num_labels and name != "classify":  # no vocabulary head: its head gives its labels' logits
        raise ConfigError(f"{name}() needs a language model: this is a sequence classifier ({spec.num_labels} "
                          "labels, no vocabulary head): use classify()")
    if name == "classify" and not spec.num_labels:
        raise ConfigError("classify() needs a sequence classifier (a *ForSequenceClassification checkpoint): "
                          "this is a language model; use generate(), score() or embed()")
    what = f"{name}() takes a non-empty list of " + ("sequences" if name == "score" else "prompts")
    if prompts is None or isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ConfigError(f"{what} (strings or token-id lists)")
    gen_len = cfg.gen_len if gen_len is None else int(gen_len)
    if gen_len < 1:
        raise ConfigError(f"gen_len {gen_len}: must be >= 1")
    ps: list[Prompt] = [p if isinstance(p, Prompt) else prompt_of(n, p, tokenizer, spec.vocab_size, cfg.template_kwargs)
                        for n, p in enumerate(prompts)]
    keeps = cut_to(len(ps), sampling, cfg.truncate_prompt_tokens if truncate is None else truncate)
    if any(k is not None for k in keeps) and name != "score":  # scoring counts positions: never cut
        # the prompts made here (a ``Prompt`` given is final: a batch request's cut as it asked)
        gens = [0] * len(ps) if scoring else list(max_new_tokens or [gen_len] * len(ps))
        ps = [p if isinstance(q, Prompt) else truncated(p, k, spec.max_positions - g)
              for p, q, g, k in zip(ps, prompts, gens, keeps)]
    # a scored sequence generates nothing: it may fill every position
    check_prompt_lengths(ps, 0 if scoring else gen_len, spec.max_positions)
    each = None if sampling is None or isinstance(sampling, SamplingConfig) else tuple(sampling)
    if each is not None:
        each = tuple(with_word_ids(c, tokenizer, spec.vocab_size) for c in each)
    samp = with_word_ids((each[0] if each else sampling) or cfg.sampling, tokenizer, spec.vocab_size)
    if not scoring:
        check_structures(each or [samp], spec, tokenizer)  # type: ignore[list-item]
        if reasoning is not None:
            each = after_thinking(ps, each, samp, reasoning)  # type: ignore[arg-type]
    if stop is not None and (isinstance(stop, str) or any(isinstance(s, str) for s in stop)):
        raise ConfigError("stop takes one list of stop strings per prompt, e.g. [['\\n'], []]")
    if beams is not None:
        check_beams(each or (samp,), stop, logprobs if logprobs is not None else cfg.logprobs, max_new_tokens)
    if not scoring:
        warn_longrope_crossing(spec, [len(p.ids) for p in ps], max_new_tokens or [gen_len] * len(ps))
    repeats = [c.repeats for c in each] if each else [samp.repeats] * len(ps)  # type: ignore[union-attr]
    seen = tuple(tuple(sorted(set(p.ids))) if r else () for p, r in zip(ps, repeats)) \
        if any(repeats) and not scoring else None
    adapters = adapter_indices(lora, len(ps), served)
    mixed = adapters is not None and len(set(adapters)) > 1  # no keys shared across adapters: one opening each
    prefix = PrefixShape.of_prompts([[-1 - a, *p.ids] if mixed else p.ids for p, a in
                                     zip(ps, adapters or [0] * len(ps))], longest_sharing(spec),
                                    holds_prefix(spec, 1.0 if cfg.attn_sparsity is None else cfg.attn_sparsity,
                                                 max(len(p.ids) for p in ps) + gen_len)) \
        if cfg.share_prefix and not scoring and shares_prefix(spec) else None
    try:
        return Workload(tuple(len(p.ids) for p in ps), gen_len, samp,  # type: ignore[arg-type]
                        keys=None if keys is None else tuple(int(k) for k in keys),
                        max_new_tokens=None if max_new_tokens is None else tuple(int(m) for m in max_new_tokens),
                        samplings=each, stops=None if stop is None else tuple(tuple(s) for s in stop),
                        logprobs=None if scoring else cfg.logprobs if logprobs is None else int(logprobs),
                        seen=seen, adapters=adapters, prefix=prefix, prompts=tuple(ps), beams=beams)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def cut_to(n: int, sampling: SamplingConfig | Sequence[SamplingConfig] | None, default: int | None
           ) -> list[int | None]:
    """Each of ``n`` prompts' ``truncate_prompt_tokens``: its sampling's own, else ``default``."""
    cfgs = [sampling] * n if sampling is None or isinstance(sampling, SamplingConfig) else list(sampling)
    if len(cfgs) != n:  # the workload refuses it, naming the counts
        cfgs = [None] * n
    return [c.truncate_prompt_tokens if c is not None and c.truncate_prompt_tokens is not None else default
            for c in cfgs]


def check_beams(cfgs: Sequence[SamplingConfig], stop: Any, logprobs: int | None, max_new_tokens: Any) -> None:
    """Refuse, in one line, what a beam search does not compute: sampling, penalties, a
    structure, stop strings, logprobs, per-prompt limits."""
    for c in cfgs:
        if not c.greedy:
            raise ConfigError("beam search keeps the most likely beams: give temperature 0 (beam sampling is not "
                              "supported)")
        if c.adjusts or c.structure is not None:
            raise ConfigError("beam search takes no penalties, logit biases or structured output (min_tokens, "
                              "stop_token_ids, bad_words, allowed_token_ids and ignore_eos apply)")
    if stop is not None and any(stop):
        raise ConfigError("beam search takes no stop strings: give stop_token_ids")
    if logprobs is not None:
        raise ConfigError("beam search reports each sequence's score, not per-token logprobs: drop logprobs")
    if max_new_tokens is not None:
        raise ConfigError("a beam search has one max_tokens for every prompt")


def with_word_ids(c: SamplingConfig, tokenizer: Any | None, vocab_size: int) -> SamplingConfig:
    """``c`` checked against the vocabulary (its logit biases, stop, allowed and bad ids), its
    ``bad_words`` made ids by the tokenizer as vLLM makes them (``bans.bad_word_ids``)."""
    if c.bad_words:
        if tokenizer is None:
            raise ConfigError("bad_words need the model's tokenizer (this model has none): give bad_words_ids")
        c = dataclasses.replace(c, bad_words=(), bad_words_ids=tuple(dict.fromkeys(
            (*c.bad_words_ids, *bad_word_ids(c.bad_words, tokenizer)))))
    for name, ids in (("logit_bias token id", [i for i, _ in c.logit_bias]), ("stop_token_ids", c.stop_token_ids),
                      ("allowed_token_ids", c.allowed_token_ids),
                      ("bad_words_ids", [i for w in c.bad_words_ids for i in w])):
        bad = [i for i in ids if i >= vocab_size]
        if bad:
            raise ConfigError(f"{name} {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return c


def adapter_indices(lora: LoraChoice, n: int, served: Sequence[str]) -> tuple[int, ...] | None:
    """Each of ``n`` requests' adapter index (``Workload.adapters``: 0 the base model, a the
    a-th of ``served``) from ``lora`` (one name for all, or one per request, None or "" for
    the base model); None where every request runs the base model. An unknown name, or a
    count that is not one per request, is refused in one line."""
    if lora is None:
        return None
    names = [lora] * n if isinstance(lora, str) else list(lora)
    if len(names) != n:
        raise ConfigError(f"lora has {len(names)} names for {n} prompts: give one adapter name for all, or one per "
                          "prompt (None: the base model)")
    index = {name: a + 1 for a, name in enumerate(served)}
    for name in names:
        if name and name not in index:
            raise ConfigError(f"unknown LoRA adapter {name!r}: " + (
                f"this LLM serves {', '.join(served)} (lora_modules)" if served else
                "this LLM serves none; load them with --lora-modules NAME=DIR (LLM(lora_modules={NAME: DIR}))"))
    out = tuple(index[name] if name else 0 for name in names)
    return out if any(out) else None


def after_thinking(ps: Sequence[Prompt], each: tuple[SamplingConfig, ...] | None, samp: SamplingConfig,
                   reasoning: Reasoning) -> tuple[SamplingConfig, ...] | None:
    """The per-prompt samplings (``each``, or ``samp`` for all) with each chat prompt's
    structure after the thinking (its completion thinks first, ``reasoning.py``); ``each``
    where no structure changes."""
    cfgs = each or (samp,) * len(ps)
    if len(cfgs) != len(ps):  # the workload refuses it, naming the counts
        return each
    out = tuple(dataclasses.replace(c, structure=dataclasses.replace(c.structure, after=reasoning.after(p.ids)))
                if c.structure is not None and p.messages is not None and not c.structure.after else c
                for p, c in zip(ps, cfgs))
    return out if any(a is not b for a, b in zip(out, cfgs)) else each


def check_structures(cfgs: Sequence[SamplingConfig], spec: ModelSpec, tokenizer: Any | None) -> None:
    """Refuse, in one line, a structure this model cannot follow (an invalid schema, regex or
    grammar; no tokenizer) or a request that would not end a structured completion at EOS."""
    structures = {c.structure for c in cfgs if c.structure is not None}
    if not structures:
        return
    why = next((w for w in (c.structure_conflict() for c in cfgs) if w), None)
    if why:
        raise ConfigError(why)
    for st in structures:
        try:
            check_structure(st, tokenizer, spec.vocab_size, spec.eos_token_ids)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def warn_longrope_crossing(spec: ModelSpec, lens: Sequence[int], limits: Sequence[int]) -> int:
    """Warn, once per call, of requests whose sequence grows past a LongRoPE model's original
    context while decoding; returns how many. Their tokens up to that point are transformers';
    after it, the new positions turn with the long frequencies over a cache turned with the
    short ones (transformers' generate recomputes the whole cache there instead; vLLM turns
    every position with the long ones whenever its context exceeds the original)."""
    sc = spec.rope_scaling
    if sc is None or sc.rope_type != "longrope":
        return 0
    old = sc.original_max_position_embeddings
    n = sum(1 for length, limit in zip(lens, limits) if length <= old < length + limit - 1)
    if n:
        log.warning("%d request(s) grow past the original context of %d positions while decoding: after it, "
                    "their new tokens use LongRoPE's long frequencies over a cache built with the short ones "
                    "(transformers recomputes the cache there); keep prompt + max_tokens within %d, or send "
                    "prompts longer than %d, for transformers' tokens exactly", n, old, old + 1, old)
    return n


def prompt_of(n: int, p: PromptLike, tokenizer: Any | None, vocab_size: int,
              template_kwargs: dict[str, Any] | None = None) -> Prompt:
    """Prompt ``n`` of a call: text, token ids, or a conversation (a list of messages, rendered
    with the chat template's variables ``template_kwargs``)."""
    if isinstance(p, str):
        return make_prompt(n, p, None, tokenizer, vocab_size)
    items = list(p)
    if items and all(isinstance(m, dict) for m in items):
        return make_prompt(n, None, None, tokenizer, vocab_size, cast(Messages, items), template_kwargs=template_kwargs)
    return make_prompt(n, None, cast(list[int], items), tokenizer, vocab_size)


def scored_workload(sequences: Sequence[PromptLike] | None, first_scored: Sequence[int] | None,
                    decode_tokens: int, cfg: RunConfig, spec: ModelSpec, tokenizer: Any | None,
                    logprobs: int | None = None, lora: LoraChoice = None, served: Sequence[str] = ()) -> Workload:
    """Scoring's workload: each sequence's prefill part, the decode steps, the targets, and
    (``logprobs``) how many alternatives each scored token reports; ``lora`` as ``build_workload``'s."""
    work = build_workload(sequences, 1, None, cfg, spec, tokenizer, scoring=True, lora=lora, served=served)
    targets = score_targets([p.ids for p in work.prompts], first_scored)
    lens, steps = score_split(list(work.lens), decode_tokens)
    try:
        return dataclasses.replace(work, lens=tuple(lens), gen_len=steps, targets=tuple(tuple(t) for t in targets),
                                   logprobs=None if logprobs is None else int(logprobs))
    except ValueError as e:
        raise ConfigError(str(e)) from None
