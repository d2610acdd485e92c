"""Structured output: completions held to a JSON schema, any JSON object, a regular
expression, one of given strings, or a Lark grammar (OpenAI's ``response_format``, vLLM's
structured outputs, ``--json-schema``/``--regex``/``--choice``/``--grammar``).

A ``Structure`` is a value (it travels in a request's ``SamplingConfig`` to the last stage).
There, before each choice, ``RowGuides`` sets the logits of every token that cannot continue
a constrained row's structure to -inf, then feeds the chosen token to the row's matcher. The
masks come from ``llguidance`` (a token-trie walk in Rust, ~0.1 ms a row, on the host, all
constrained rows of a GPU batch in one parallel call) as bits, 32 tokens a word; one copy
to the device and a shift unpack them there. Once a structure is complete only the model's
EOS ids are allowed, so a completion ends with its structure (or at its token limit, cut
short, as OpenAI's). Greedy choice is the argmax of the masked logits, as a transformers
loop with the same mask (the tests' reference); sampling draws from the masked distribution;
reported logprobs stay the model's own.

JSON comes compact (no whitespace between tokens: fewer tokens, and no runs of blanks from
a weak model) unless the schema says ``"x-guidance": {"whitespace_flexible": true}``.

A reasoning model's chat completion thinks first (``reasoning.py``): its structure then holds
the answer only, after the thinking (``Structure.after``: Lark rules of the thinking that
refer to the structure as ``@answer``, ``Reasoning.after`` writes them), as vLLM does with a
reasoning parser: ``<think>`` free text ``</think>``, then the structure, or gpt-oss'
harmony messages, an ``analysis`` one then the ``final`` one holding the structure. The
thinking is any text between the model's own marker tokens (referenced by id, as special
tokens, so text inside the thinking cannot close it).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

log = logging.getLogger("flexgen_dist")

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_DEFAULTS = {"whitespace_flexible": False}
# bytes per (row, vocabulary entry) the masking holds beside the logits at its peak: the
# masked copy (float32), the unpacked bits (uint8) and the bool mask
GUIDE_BYTES = 6


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ValueError("structured output needs the llguidance package: pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class Structure:
    """What a completion must match. ``kind``: ``json`` (``value`` a JSON schema as JSON
    text), ``json_object`` (any JSON object), ``regex`` (``value`` the pattern, Rust regex
    syntax, matched whole), ``choice`` (``value`` a JSON list of the allowed strings) or
    ``grammar`` (``value`` a Lark grammar, or llama.cpp's GBNF). ``after``: the thinking
    that comes first, as Lark rules whose ``start`` ends with ``@answer`` (the structure)
    ("": none, the completion is the structure; ``reasoning.Reasoning.after``)."""

    kind: str
    value: str = ""
    after: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structure {self.kind!r}: use one of {', '.join(KINDS)}")
        if self.after and "@answer" not in self.after:
            raise ValueError("a structure's 'after' rules must refer to the structure as @answer")
        if self.kind == "json":
            try:
                schema = json.loads(self.value)
            except (TypeError, json.JSONDecodeError) as e:
                raise ValueError(f"the JSON schema is not valid JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object (or true)")
        elif self.kind == "choice":
            opts = json.loads(self.value) if self.value else None
            if not isinstance(opts, list) or not opts or not all(isinstance(o, str) and o for o in opts):
                raise ValueError("choice takes a non-empty list of non-empty strings")
        elif self.kind != "json_object" and not (isinstance(self.value, str) and self.value):
            raise ValueError(f"a {self.kind} structure needs its text")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> Structure:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Structure:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Structure:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Structure:
        if isinstance(options, str):
            raise ValueError("choice takes a list of strings, not one string")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> Structure:
        return cls("grammar", text)

    def grammar_text(self) -> str:
        """The structure as llguidance's grammar (what a matcher is built from): after the
        thinking (``after``), a grammar of two, the thinking's rules referring to the answer's."""
        answer = self._answer_text()
        if not self.after:
            return answer
        try:
            grammars = json.loads(answer)["grammars"]
        except (json.JSONDecodeError, TypeError, KeyError):  # Lark text (a choice's, a grammar's)
            grammars = [{"lark_grammar": answer}]
        return json.dumps({"grammars": [{"name": "reasoned", "lark_grammar": self.after},
                                        {**grammars[0], "name": "answer"}, *grammars[1:]]})

    def _answer_text(self) -> str:
        llg = _llguidance()
        if self.kind in ("json", "json_object"):
            schema = self.value if self.kind == "json" else '{"type": "object"}'
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.value)
        try:
            return llg.grammar_from("choice" if self.kind == "choice" else "grammar", self.value)
        except ValueError as e:
            raise ValueError(f"the grammar is not valid ({e})") from None

    def describe(self) -> str:
        what = {"json": "a JSON schema", "json_object": "a JSON object", "regex": f"the regex {self.value!r}",
                "choice": f"one of {self.value}", "grammar": "a grammar"}[self.kind]
        return what + (" after the thinking" if self.after else "")


def structure_option(json_schema: str | None = None, regex: str | None = None,
                     choice: Sequence[str] | None = None, grammar: str | None = None) -> Structure | None:
    """The run's structure from its options (at most one): ``json_schema`` and ``grammar`` are
    a file's path or the text itself."""
    given = [(k, v) for k, v in (("json-schema", json_schema), ("regex", regex), ("choice", choice),
                                 ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"--{given[0][0]} and --{given[1][0]} exclude each other: a completion follows one "
                         "structure")
    if not given:
        return None
    name, v = given[0]
    try:
        if name == "regex":
            return Structure.regex(str(v))
        if name == "choice":
            return Structure.choice(list(v))  # type: ignore[arg-type]
        text = _text_or_file(str(v))
        return Structure.json_schema(text) if name == "json-schema" else Structure.grammar(text)
    except ValueError as e:
        raise ValueError(f"--{name}: {e}") from None


def _text_or_file(v: str) -> str:
    p = Path(v).expanduser()
    if v.lstrip()[:1] not in ("{", "[") and "\n" not in v and len(v) < 4096:
        try:
            if p.is_file():
                return p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"{v}: cannot be read ({e.strerror or e})") from None
        if p.suffix in (".json", ".lark", ".gbnf", ".txt"):
            raise ValueError(f"{v}: no such file")
    return v


# --- the tokenizer's side -----------------------------------------------------------------
_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}


def guide_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of ``tokenizer`` over the model's ``vocab_size`` logits, ending at
    ``eos_ids`` (built once per tokenizer: ~0.3 s for 49k tokens)."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer (this model has none): drop the "
                         "structure, or use a model directory or GGUF file with its tokenizer")
    key = (id(tokenizer), int(vocab_size), tuple(int(e) for e in eos_ids))
    got = _TOKENIZERS.get(key)
    if got is not None and got[0] is tokenizer:
        return got[1]
    _llguidance()
    import llguidance.hf

    eos = list(key[2]) or tokenizer.eos_token_id
    if eos is None:
        raise ValueError("structured output ends a completion at EOS, and this model and its tokenizer have no "
                         "EOS token")
    n_vocab = max(int(vocab_size), len(tokenizer))
    try:
        try:
            tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
        except TypeError:  # an llguidance before 1.9 takes one EOS id: the structure ends at the first
            tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,
                                               eos_token=eos[0] if isinstance(eos, list) else eos)
    except (ValueError, TypeError) as e:
        raise ValueError(f"structured output cannot use this tokenizer ({type(tokenizer).__name__}: {e}); it "
                         "needs a fast (tokenizer.json) tokenizer") from None
    _TOKENIZERS[key] = (tokenizer, tok)
    return tok


_COMPILED: dict[tuple[int, Structure], Any] = {}


def matcher(tok: Any, structure: Structure) -> Any:
    """A fresh matcher of ``structure`` (a copy of one compiled per tokenizer and structure)."""
    key = (id(tok), structure)
    base = _COMPILED.get(key)
    if base is None:
        llg = _llguidance()
        base = llg.LLMatcher(tok, structure.grammar_text(), log_level=0)
        if base.is_error():
            raise ValueError(f"{structure.describe()}: {_one_line(base.get_error())}")
        if len(_COMPILED) > 256:
            _COMPILED.clear()
        _COMPILED[key] = base
    return base.deep_copy()


def check_structure(structure: Structure, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
    """Raise ``ValueError`` (one line) where ``structure`` cannot constrain this model."""
    matcher(guide_tokenizer(tokenizer, vocab_size, eos_ids), structure)


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())[:300]


_EXECUTOR: list[Any] = []


def _executor() -> Any:
    if not _EXECUTOR:
        _EXECUTOR.append(_llguidance().LLExecutor())
    return _EXECUTOR[0]


class RowGuides:
    """The structures of a GPU batch's constrained rows, on the last stage: ``mask`` the
    logits before a choice, ``advance`` with the chosen ids after it."""

    def __init__(self, structures: Sequence[Structure | None], tok: Any, eos_ids: Sequence[int],
                 device: torch.device) -> None:
        self.rows = [r for r, s in enumerate(structures) if s is not None]
        self.matchers = [matcher(tok, structures[r]) for r in self.rows]  # type: ignore[arg-type]
        self.eos = set(int(e) for e in eos_ids)
        self.live = list(range(len(self.rows)))  # constrained rows still generating
        self.device = device
        # one row of bits per row of the batch (an unconstrained row's all ones): one
        # ``torch.where`` over the batch, no gather and scatter of its constrained rows (5x)
        self.bits = torch.full((len(structures), (tok.vocab_size + 31) // 32), -1, dtype=torch.int32,
                               pin_memory=device.type == "cuda")
        self.pow2 = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8).to(device)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` (b, vocab) with each constrained row's disallowed ids at -inf."""
        self.bits.fill_(-1)  # a finished row allows every id (its token is padding now)
        if self.live:  # every live row's mask in one parallel call, into its row of the bits
            _executor().unsafe_compute_mask_ptr([(self.matchers[n], self.rows[n]) for n in self.live],
                                                self.bits.data_ptr(), self.bits.shape[1] * 4, self.bits.shape[0])
        # (a GPU's copy from the pinned bits is done before the next fill: ``advance`` waits
        # for the ids chosen after it). Bit k of byte j (little-endian words) is id 8j + k.
        bits = self.bits.to(self.device, non_blocking=True).view(torch.uint8)
        allowed = (bits.unsqueeze(-1) & self.pow2).view(bits.shape[0], -1)[:, :logits.shape[-1]].bool()
        return torch.where(allowed, logits, float("-inf"))

    def advance(self, ids: torch.Tensor) -> None:
        """The rows chose ``ids`` (b,): each live constrained row's matcher takes its token."""
        if not self.live:
            return
        chosen = ids.tolist()  # one host copy a step, only for batches with structures
        still = []
        for n in self.live:
            t = int(chosen[self.rows[n]])
            if t in self.eos:
                continue  # the structure is complete and the row has ended
            if not self.matchers[n].consume_token(t):
                log.warning("a structured completion could not continue its structure (%s); the rest of it is "
                            "not constrained", _one_line(self.matchers[n].get_error()))
                continue
            still.append(n)
        self.live = still

