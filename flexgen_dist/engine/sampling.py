"""Next-token choice: greedy, temperature, top-k, top-p, min-p; frequency and presence
penalties and logit biases; vLLM's bans (``bans.py``); per-sequence randomness (which
sequences are done: ``endings.py``).

A sampled token is drawn by inverting the cumulative distribution at a uniform number that
is a hash of (seed, the sequence's key, the step), computed for every row at once: a
sequence's tokens depend on its prompt (its key: its index in the job) and on nothing else,
not on the block, the batch or the rank that ran it, so a job resumed with other blocks, or
on another number of ranks, draws the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from .bans import TokenBans
from .structure import GUIDE_BYTES, RowGuides, Structure


MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| at most (the OpenAI API's range)
MAX_REPETITION = 10.0  # transformers and vLLM take any positive value; beyond this it is an error
MAX_BIAS = 100.0  # |logit bias| at most (the OpenAI API's range)


@dataclass(frozen=True)
class SamplingConfig:
    """How a sequence's next token is chosen. Before the choice (greedy too) its logits are
    adjusted: first ``repetition_penalty`` as transformers and vLLM define it (the logit of
    every id of the prompt or already generated is divided by it where positive, multiplied
    where negative; 1: off), then as OpenAI's API defines: ``logit_bias`` ((id, bias) pairs)
    is added, and each id already generated c times in this completion loses
    ``frequency_penalty * c`` plus ``presence_penalty`` once (the prompt's ids do not count)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # sampling only, applied as transformers applies them: the k most likely ids (0: all),
    # then the top-p nucleus of what they hold, then the ids at least min_p times as likely
    # as the most likely one (0: all)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # what the completion must match (``structure.py``): a JSON schema, a regex, a choice, a
    # grammar; None: anything
    structure: Structure | None = None
    # vLLM's controls (``bans.py``): no EOS or stop id before ``min_tokens`` new tokens (nor a
    # stop string ending before them); ``stop_token_ids`` end the completion as EOS does (kept
    # in its ids); ``bad_words`` (words, made ids by the tokenizer as vLLM makes them) and
    # ``bad_words_ids`` (id sequences, transformers' form): a word's last token is never chosen
    # where the completion's newest tokens are the rest of it; ``allowed_token_ids``: no other
    # token is chosen (empty: any)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    # what the completion's text keeps (vLLM's): the stop string or stop id's text that ended
    # it; special tokens' text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: a longer prompt cut to its last K tokens (-1: what fits with its generation);
    # None: as the run says (``--truncate-prompt-tokens``)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature {self.temperature}: must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k}: must be >= 0 (0 keeps every token)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"--min-p {self.min_p}: must be in [0, 1] (0 keeps every token)")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION:
            raise ValueError(f"--repetition-penalty {self.repetition_penalty}: must be in (0, {MAX_REPETITION:g}] "
                             "(1 is off, above 1 discourages repeats)")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"--{name.replace('_', '-')} {v}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        if self.structure is not None and not isinstance(self.structure, Structure):
            raise ValueError(f"structure {self.structure!r}: give a Structure (Structure.json_schema(...), "
                             ".regex, .choice, .grammar, .json_object())")
        check_controls(self)
        bias = tuple((int(i), float(b)) for i, b in dict(self.logit_bias).items())  # a dict works too
        object.__setattr__(self, "logit_bias", bias)
        for i, b in bias:
            if i < 0 or not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias {{{i}: {b}}}: ids are >= 0 and biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted before the choice (penalties or biases)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias or self.repeats)

    @property
    def bans(self) -> bool:
        """Whether some tokens may not be chosen (``bans.py``)."""
        return bool(self.min_tokens or self.bad_words_ids or self.allowed_token_ids)

    def ends(self, eos_ids: Sequence[int]) -> tuple[int, ...]:
        """The ids that end this completion: the model's EOS (unless ignored) and its stop ids."""
        return tuple(dict.fromkeys((*(() if self.ignore_eos else eos_ids), *self.stop_token_ids)))

    def structure_conflict(self) -> str | None:
        """Why this sampling cannot hold its structure, which decides where the completion ends
        (None: it can, or it has none)."""
        if self.structure is None:
            return None
        if self.ignore_eos:
            return ("a structured output ends its completion at EOS once the structure is complete: drop --ignore-eos "
                    "(ignore_eos)")
        if self.min_tokens:
            return "a structured output ends where its structure is complete: drop min_tokens (--min-tokens)"
        return None

    @property
    def repeats(self) -> bool:
        """Whether a repetition penalty applies (it needs the prompt's ids where it is chosen)."""
        return self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_controls(cfg: SamplingConfig) -> None:
    """vLLM's controls of ``cfg`` as tuples of ints (lists work too), or a one-line error."""
    def ids(v: Any, name: str) -> tuple[int, ...]:
        if isinstance(v, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in v):
            raise ValueError(f"{name} {v!r}: give a list of token ids (ints >= 0)")
        return tuple(int(t) for t in v)
    if isinstance(cfg.min_tokens, bool) or not isinstance(cfg.min_tokens, int) or cfg.min_tokens < 0:
        raise ValueError(f"min_tokens {cfg.min_tokens!r}: must be an int >= 0")
    keep = cfg.truncate_prompt_tokens
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or not (keep == -1 or keep >= 1)):
        raise ValueError(f"truncate_prompt_tokens {keep!r}: give an integer >= 1 (keep a prompt's last that many "
                         "tokens) or -1 (as many as the model has room for)")
    if isinstance(cfg.bad_words, str) or not all(isinstance(w, str) and w.strip() for w in cfg.bad_words):
        raise ValueError(f"bad_words {cfg.bad_words!r}: give a list of non-empty strings")
    words = tuple(ids(w, "bad_words_ids") for w in cfg.bad_words_ids)
    if any(not w for w in words):
        raise ValueError("bad_words_ids: each word is a non-empty list of token ids")
    for name, v in (("stop_token_ids", ids(cfg.stop_token_ids, "stop_token_ids")),
                    ("allowed_token_ids", ids(cfg.allowed_token_ids, "allowed_token_ids")),
                    ("bad_words", tuple(cfg.bad_words)), ("bad_words_ids", words)):
        object.__setattr__(cfg, name, v)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniforms(seed: int | torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor:
    """(b,) float64 in [0, 1): a counter-based draw for each key at ``step`` (48 random bits).
    ``seed``: one for every row, or (b,) int64, one per row."""
    seeds = seed if isinstance(seed, torch.Tensor) else torch.full_like(keys, seed)
    x = _mix32(seeds & _M32) ^ ((seeds >> 32) & _M32)
    x = _mix32(x ^ (keys & _M32))
    x = _mix32(x ^ (step & _M32))
    hi, lo = _mix32(x ^ 0x68E31DA4), _mix32(x ^ 0xB5297A4D)
    return ((hi << 16) | (lo >> 16)).double() / float(1 << 48)


def sample(logits: torch.Tensor, cfg: SamplingConfig, keys: torch.Tensor | None = None,
           step: int = 0) -> torch.Tensor:
    """Token ids (b,) from last-position logits (b, vocab); ``keys`` (b,) int64 name each row's
    sequence for its random draw at ``step`` (module doc); greedy needs neither."""
    if cfg.greedy:
        # the first maximal index, as argmax, which is 2.5x slower on the CPU (32 x 49152)
        return logits.max(dim=-1).indices
    if keys is None:
        raise ValueError("sampling needs each row's key")
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_k:
        probs = _top_k(probs, torch.full((probs.shape[0],), cfg.top_k, device=probs.device), cfg.top_k)
    order = None
    if cfg.top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        b = probs.shape[0]
        probs = _nucleus(probs, torch.full((b,), cfg.top_p, device=probs.device),
                         torch.full((b,), bool(cfg.top_k), device=probs.device))
    if cfg.min_p:
        probs = _min_p(probs, torch.full((probs.shape[0],), cfg.min_p, device=probs.device))
    cdf = probs.double().cumsum(dim=-1)
    u = uniforms(cfg.seed, keys.to(cdf.device), step).unsqueeze(-1) * cdf[:, -1:]
    # the first token whose cumulative sum passes u: never one of probability 0
    choice = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
    return (choice if order is None else order.gather(-1, choice)).squeeze(-1)


class RowSampling:
    """The sampling settings of each row of a GPU batch (requests may differ), as tensors.

    A row's draw depends on its own settings, key and step only: rows with top-p < 1 are
    sorted apart from the others, so a row samples what it would alone."""

    def __init__(self, cfgs: list[SamplingConfig], device: torch.device, steps: int = 0,
                 prompts: Sequence[Sequence[int]] | None = None, guide: Any = None,
                 eos_ids: Sequence[int] = ()) -> None:
        """``steps``: the most choices this sampler will make (needed by penalties);
        ``prompts``: each row's prompt ids (needed by a repetition penalty); ``guide``:
        llguidance's tokenizer (``structure.guide_tokenizer``) and ``eos_ids`` the model's,
        needed by rows with a structure and by ``min_tokens``."""
        self.adjust = LogitAdjust(cfgs, device, steps, prompts) if any(c.adjusts for c in cfgs) else None
        self.bans = TokenBans(cfgs, device, eos_ids) if any(c.bans for c in cfgs) else None
        self.guides = None
        if any(c.structure is not None for c in cfgs):
            if guide is None:
                raise ValueError("a structured output needs the model's tokenizer on the last stage")
            self.guides = RowGuides([c.structure for c in cfgs], guide, eos_ids, device)
        self.greedy = all(c.greedy for c in cfgs)
        self.hot = torch.tensor([not c.greedy for c in cfgs], device=device)
        self.temperature = torch.tensor([c.temperature if not c.greedy else 1.0 for c in cfgs],
                                        dtype=torch.float32, device=device)
        self.top_p = torch.tensor([c.top_p for c in cfgs], dtype=torch.float32, device=device)
        self.nucleus = [n for n, c in enumerate(cfgs) if c.top_p < 1.0 and not c.greedy]
        self.top_k = torch.tensor([c.top_k for c in cfgs], dtype=torch.long, device=device)
        self.kmax = max((c.top_k for c in cfgs if not c.greedy), default=0)  # 0: no row filters by top-k
        # min-p of the rows outside the nucleus here; a nucleus row's after its top-p, as alone
        self.min_p = torch.tensor([c.min_p if n not in self.nucleus else 0.0 for n, c in enumerate(cfgs)],
                                  dtype=torch.float32, device=device)
        self.nucleus_min_p = torch.tensor([cfgs[n].min_p for n in self.nucleus], dtype=torch.float32,
                                          device=device)
        self.any_min_p = any(c.min_p and not c.greedy for c in cfgs)
        self.seed = torch.tensor([c.seed for c in cfgs], dtype=torch.long, device=device)
        self.uniform = cfgs[0] if all(c == cfgs[0] for c in cfgs) else None

    def sample(self, logits: torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor:
        """Token ids (b,) from last-position logits (b, vocab), each row by its own settings
        (``logits`` is not changed: the adjusted ones are a new tensor)."""
        if self.adjust is None and self.guides is None and self.bans is None:
            return self._choose(logits, keys, step)
        if self.adjust is not None:
            logits = self.adjust(logits)
        if self.bans is not None:
            logits = self.bans(logits, step, fresh=self.adjust is not None)
        if self.guides is not None:  # after the adjustments: a disallowed id stays at -inf
            logits = self.guides.mask(logits)
        ids = self._choose(logits, keys, step)
        if self.adjust is not None:
            self.adjust.count(ids)
        if self.bans is not None:
            self.bans.count(ids)
        if self.guides is not None:
            self.guides.advance(ids)
        return ids

    def _choose(self, logits: torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor:
        if self.uniform is not None:  # one setting for all: the whole-batch path
            return sample(logits, self.uniform, keys, step)
        greedy = logits.max(dim=-1).indices
        if self.greedy:
            return greedy
        probs = torch.softmax(logits.float() / self.temperature[:, None], dim=-1)
        if self.kmax:
            probs = _top_k(probs, self.top_k, self.kmax)
        u = uniforms(self.seed, keys.to(probs.device), step)
        out = _invert(_min_p(probs, self.min_p) if self.any_min_p else probs, u)
        if self.nucleus:
            rows = torch.tensor(self.nucleus, device=probs.device)
            sp, order = probs[rows].sort(dim=-1, descending=True)
            sp = _nucleus(sp, self.top_p[rows], self.top_k[rows] > 0)
            if self.any_min_p:
                sp = _min_p(sp, self.nucleus_min_p)
            out[rows] = order.gather(-1, _invert(sp, u[rows])[:, None]).squeeze(-1)
        return torch.where(self.hot, out, greedy)


def _top_k(probs: torch.Tensor, k: torch.Tensor, kmax: int) -> torch.Tensor:
    """``probs`` with each row's ids below its k-th largest set to 0 (k (b,); 0: none; kmax:
    the largest k, known on the host, so no step waits for the device to say it)."""
    kmax = min(kmax, probs.shape[-1])
    kth = probs.topk(kmax, dim=-1).values.gather(-1, (k.clamp(1, kmax) - 1)[:, None])
    return probs.masked_fill((probs < kth) & (k[:, None] > 0), 0.0)


def _nucleus(sp: torch.Tensor, top_p: torch.Tensor, renorm: torch.Tensor) -> torch.Tensor:
    """Sorted (descending) ``sp`` cut to each row's smallest prefix whose mass reaches top_p
    (b,) of the row's mass: of what top-k left where ``renorm`` (b,) (the mass that softmax
    would renormalise to 1), else of 1. The first token always stays."""
    total = sp.sum(dim=-1, keepdim=True)
    mass = top_p[:, None] * torch.where(renorm[:, None], total, torch.ones_like(total))
    return sp.masked_fill(sp.cumsum(dim=-1) - sp > mass, 0.0)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``probs`` with each row's ids less likely than min_p (b,) times its most likely set to 0."""
    return probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)


class LogitAdjust:
    """The penalties and biases of a GPU batch's rows (``SamplingConfig``) as (id, amount)
    entries per row, (b, biases + steps), scattered onto a copy of the logits in one
    ``scatter_add``: a row's biases, then one entry per token it has generated, of
    ``-(frequency_penalty + presence_penalty if the id is new to the row)``. Memory is
    O(rows x steps), not O(rows x vocab); unused entries add 0 to id 0."""

    def __init__(self, cfgs: list[SamplingConfig], device: torch.device, steps: int,
                 prompts: Sequence[Sequence[int]] | None = None) -> None:
        nb = max(len(c.logit_bias) for c in cfgs)
        # the repetition penalty: per row the ids of its prompt (``prompts``, unique) and then
        # one per step generated, (b, prompt ids + steps); a row without one divides by 1, and
        # its unused entries repeat an id of its own, which changes nothing twice
        self.rep = self.seen = None
        if any(c.repeats for c in cfgs):
            if prompts is None:
                raise ValueError("a repetition penalty needs each row's prompt ids")
            own = [sorted(set(p)) or [0] for p in prompts]
            wide = max(len(o) for o in own)
            seen = torch.tensor([o + [o[0]] * (wide - len(o) + steps) for o in own], dtype=torch.long)
            self.seen, self.seen_used = seen.to(device), wide
            self.rep = torch.tensor([c.repetition_penalty for c in cfgs], dtype=torch.float32, device=device)
        self.penalised = any(c.frequency_penalty or c.presence_penalty for c in cfgs)
        width = nb + (steps if self.penalised else 0)
        self.ids = torch.zeros((len(cfgs), width), dtype=torch.long)
        self.amount = torch.zeros((len(cfgs), width), dtype=torch.float32)
        for r, c in enumerate(cfgs):
            for j, (i, b) in enumerate(c.logit_bias):
                self.ids[r, j], self.amount[r, j] = i, b
        self.ids, self.amount = self.ids.to(device), self.amount.to(device)
        self.freq = torch.tensor([c.frequency_penalty for c in cfgs], dtype=torch.float32, device=device)
        self.pres = torch.tensor([c.presence_penalty for c in cfgs], dtype=torch.float32, device=device)
        self.nb, self.used = nb, nb  # entries in use: the biases, then one per step counted

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if self.rep is not None:  # transformers' RepetitionPenaltyLogitsProcessor, on the ids seen
            seen = self.seen[:, :self.seen_used]
            got = out.gather(1, seen)
            p = self.rep[:, None]
            out.scatter_(1, seen, torch.where(got > 0, got / p, got * p))
        return out.scatter_add_(1, self.ids[:, :self.used], self.amount[:, :self.used])

    def count(self, ids: torch.Tensor) -> None:
        """Each row generated ``ids`` (b,) at this step."""
        if self.rep is not None:
            if self.seen_used == self.seen.shape[1]:
                raise RuntimeError("LogitAdjust was made for fewer steps")
            self.seen[:, self.seen_used] = ids.view(-1)
            self.seen_used += 1
        if not self.penalised:
            return
        if self.used == self.ids.shape[1]:
            raise RuntimeError(f"LogitAdjust was made for {self.ids.shape[1] - self.nb} steps")
        ids = ids.view(-1)
        new = ~(self.ids[:, self.nb:self.used] == ids[:, None]).any(dim=1)
        self.ids[:, self.used] = ids
        self.amount[:, self.used] = -(self.freq + self.pres * new)
        self.used += 1


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index where each row's cumulative distribution passes u (b,) (scaled to its mass)."""
    cdf = probs.double().cumsum(dim=-1)
    choice = torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:], right=True)
    return choice.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


# Bytes per (row, vocabulary entry) that choosing a token holds beside a GPU batch's logits, at
# its peak (engine/footprint.py counts them for one GPU batch at a time, as the choice runs):
# sampling's float32 probabilities, their sorted copy and order (int64) and the float64
# cumulative sums; a penalty's or bias's adjusted copy; log-probabilities' log-softmax; a
# structure's masked copy (``structure.GUIDE_BYTES``).
SAMPLE_BYTES = 32
ADJUST_BYTES = 4
ALLOWED_BYTES = 1  # ``allowed_token_ids``: a row's banned ids as a mask
LOGPROB_BYTES = 4


def choice_bytes(samplings: Iterable[SamplingConfig], logprobs: int | None) -> int:
    """What choosing the next tokens holds per (row, vocabulary entry) beyond the logits (see
    ``SAMPLE_BYTES``): 0 for greedy choice alone, which keeps only each row's maximum."""
    cfgs = list(samplings)
    draw = SAMPLE_BYTES * any(not c.greedy for c in cfgs) + ADJUST_BYTES * any(c.adjusts or c.bans for c in cfgs) + \
        ALLOWED_BYTES * any(c.allowed_token_ids for c in cfgs) + GUIDE_BYTES * any(c.structure is not None for c in cfgs)
    # the log-softmax comes after the draw, whose buffers are gone by then
    return max(draw, LOGPROB_BYTES * (logprobs is not None))


MAX_LOGPROBS = 20  # alternatives per token at most (the OpenAI API's own bound)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """(b, 1 + 2k) float64 per row: the log-probability of the chosen id, then the ids and
    the log-probabilities of the k most likely ones, most likely first. The distribution is
    the model's own (a softmax of the raw logits): temperature and top-p change which token
    is drawn, not the numbers reported for it, as OpenAI's and vLLM's reported logprobs."""
    # one log-softmax pass (on a 2-core CPU, 32 x 49152: 0.55 ms, where logsumexp took 1.25),
    # then the top k of its output, already log-probabilities
    lsm = torch.log_softmax(logits.float(), dim=-1)
    chosen = lsm.gather(-1, ids.view(-1, 1).to(lsm.device)).double()
    if k == 0:
        return chosen
    vals, top = lsm.topk(k, dim=-1)
    return torch.cat([chosen, top.double(), vals.double()], dim=-1)


@dataclass
class TokenLogprobs:
    """One completion's log-probabilities (natural log, the model's distribution): each
    generated token's, and per token its ``k`` most likely alternatives as (id, logprob),
    most likely first (empty lists when none were asked for)."""

    token_logprobs: list[float]
    top: list[list[tuple[int, float]]]

    @classmethod
    def of_rows(cls, rows: torch.Tensor, k: int) -> "TokenLogprobs":
        """From (steps, 1 + 2k) rows of ``token_logprobs`` (one per kept token)."""
        vals = rows.tolist()
        return cls([r[0] for r in vals],
                   [[(int(i), lp) for i, lp in zip(r[1:1 + k], r[1 + k:])] for r in vals])

    def trimmed(self, k: int) -> "TokenLogprobs":
        """The same with at most ``k`` alternatives per token."""
        return TokenLogprobs(list(self.token_logprobs), [t[:k] for t in self.top])
