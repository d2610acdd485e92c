"""A GPU batch's repeated prompts kept once in its cache through decode.

Batch jobs repeat prompts: a request's ``n`` choices, a beam search's beams, the same question
asked twice (``twins.py`` computes each once at the prefill). Without more, every row's cache
then holds its own copy of its prompt's keys and values, and every decode step reads each copy.
Where a block's rows repeat their prompts enough (``prompt_groups``), its cache keeps each
distinct prompt of a GPU batch once instead, in a cache of its own over the prompt's positions
(``BlockCache.prompts``: as many rows as the batch has prompts, split over the tiers by the same
fractions, compressed alike), and each row's cache only the positions it generates (``held`` =
the prompt's length). A decode step attends in two parts, merged by their log-sum-exps (cascade
attention, as ``held.py`` does for a block's shared prefix): each row over its generated
positions, and each prompt's rows together over the prompt (``PromptGroups.gather``: the queries
of a prompt's rows become the queries of that prompt's one row, so the native kernel, SDPA or a
GPU read each prompt's keys once a step), handed back row by row (``scatter``).

The cache of a batch whose rows ask u prompts shrinks from b to u rows of prompt positions, on
whichever tier it lives, and so do the reads of every decode step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.spec import ModelSpec
from .attention import mask_to_rows
from .blocks import BlockMeta
from .cache_layout import split_rows
from .held import holds_prefix
from .policy import Policy


def prompt_groups(meta: BlockMeta, held: int = 0) -> list[list[int]] | None:
    """Per GPU batch, each row's prompt (its index among the batch's distinct prompts, in the
    order of their first rows, as ``Twins`` computes them), where keeping each prompt once stores
    at most half of what the rows' caches would otherwise keep of the prompt's positions (each
    row less ``held``: a block's shared prefix held once instead). None: the rows' own caches keep
    their prompts (no repeats, scoring, embeddings)."""
    if meta.twins is None or meta.embed or meta.targets is not None:
        return None
    groups, prompts = [], 0
    for k, lens in enumerate(meta.prompt_lens):
        rows = meta.twins[k] or list(range(len(lens)))
        at = {r: n for n, r in enumerate(sorted(set(rows)))}
        groups.append([at[r] for r in rows])
        prompts += len(at)
    s = meta.prompt_len
    return groups if 2 * prompts * s <= sum(meta.batch_sizes) * (s - held) else None


# Whether a CPU device keeps repeated prompts once where its whole cache is in memory (see
# ``kept_positions``): off, measured slower there; the tests turn it on to run the in-memory
# paths a GPU device takes.
IN_CPU_MEMORY = False


def kept_positions(meta: BlockMeta, gbs: int, kv_heads: int, fractions: tuple[float, float, float],
                   held: int = 0, cuda: bool = True) -> int | None:
    """Whether a block keeps its GPU batches' prompts once (``prompt_groups`` with ``held``, the
    block's shared prefix held once otherwise), and so the positions a row leaves out as the
    footprint counts them: against a full GPU batch of ``gbs`` rows of the block's length, tier by
    tier as ``split_rows`` splits rows (the rows' caches, of what they generate, and the
    prompts' cache, u rows of the prompt's length), the least over the block's batches and the
    tiers. None (every row keeps its prompt) where some tier would hold more than a full batch
    of whole rows is counted there: the prompts' rows round otherwise than the rows'; and on a
    CPU device (not ``cuda``) with no part of the cache on disk, where a decode step's attention
    is bound by its arithmetic, the same for a prompt's one row as for each of its rows, not by
    reading the cache, and the merge would only add time (docs/benchmarks.md)."""
    groups = _groups(meta, held, fractions, cuda)
    return None if groups is None else _kept(meta, groups, gbs, kv_heads, fractions)


def _groups(meta: BlockMeta, held: int, fractions: tuple[float, float, float], cuda: bool) -> list[list[int]] | None:
    """``prompt_groups``, on a CPU device only with part of the cache on disk (``kept_positions``)."""
    return prompt_groups(meta, held) if cuda or fractions[2] or IN_CPU_MEMORY else None


def _kept(meta: BlockMeta, groups: list[list[int]], gbs: int, kv_heads: int,
          fractions: tuple[float, float, float]) -> int | None:
    """``kept_positions`` for a block whose batches' rows ask ``groups`` (``prompt_groups``)."""
    s, n = meta.prompt_len, meta.gen_len
    full = {t: r1 - r0 for t, r0, r1 in split_rows(gbs * kv_heads, fractions)}
    most = s + n
    for rows in groups:
        u = max(rows) + 1
        need = {t: (r1 - r0) * n for t, r0, r1 in split_rows(len(rows) * kv_heads, fractions)}
        for t, r0, r1 in split_rows(u * kv_heads, fractions):
            need[t] = need.get(t, 0) + (r1 - r0) * s
        for t, x in need.items():
            if x and not full.get(t):
                return None
            if x:
                most = min(most, s + n - -(-x // full[t]))
    return most if most >= 0 else None


def cache_layout(spec: ModelSpec, policy: Policy, meta: BlockMeta, device: torch.device,
                 ) -> tuple[int, PromptGroups | None]:
    """What a block's cache leaves out of each row on a stage: (positions, the GPU batches'
    prompts kept once or None). Each batch's repeated prompts kept once (``kept_positions``): the
    block's padded prompt; else its shared prefix held once (``held.py``), where the model and
    policy hold one; else nothing."""
    if not holds_prefix(spec, policy.attn_sparsity, meta.prompt_len + meta.gen_len):
        return 0, None
    fractions = policy.fractions("cache")
    groups = _groups(meta, meta.shared, fractions, device.type == "cuda")
    if groups is None or _kept(meta, groups, policy.gpu_batch_size, spec.num_kv_heads, fractions) is None:
        return meta.shared, None
    return meta.prompt_len, PromptGroups.of(groups, meta.prompt_lens, meta.prompt_len, spec.num_kv_heads, device)


@dataclass
class _Batch:
    reps: torch.Tensor  # (u,) each prompt's first row
    index: torch.Tensor  # (u, most rows a prompt has) rows of each prompt, b where it has fewer
    back: torch.Tensor  # (b,) each row's place in ``index`` flattened
    mask: torch.Tensor  # (u * kv_heads, 1, 1, s) the prompt positions each prompt's row holds
    ragged: bool  # whether some prompt has fewer rows than another (``index`` padded)
    identity: bool  # every row its own prompt


@dataclass
class PromptGroups:
    """Each GPU batch's prompts: which rows ask which, and the positions each prompt holds."""

    batches: list[_Batch] = field(default_factory=list)
    length: int = 0  # the block's padded prompt length: the positions the prompts' cache holds
    starts: list[int] = field(default_factory=lambda: [0])  # each batch's first row (b * kv_heads each), and the end

    @classmethod
    def of(cls, groups: list[list[int]], prompt_lens: list[list[int]], prompt_len: int, kv_heads: int,
           device: torch.device) -> PromptGroups:
        out = cls(length=prompt_len)
        pos = torch.arange(prompt_len, device=device)
        for rows, lens in zip(groups, prompt_lens):
            u, b = max(rows) + 1, len(rows)
            members: list[list[int]] = [[] for _ in range(u)]
            for r, g in enumerate(rows):
                members[g].append(r)
            most = max(len(m) for m in members)
            index = torch.tensor([m + [b] * (most - len(m)) for m in members], device=device)
            back = torch.empty(b, dtype=torch.long)
            for g, m in enumerate(members):
                for n, r in enumerate(m):
                    back[r] = g * most + n
            glens = torch.tensor([lens[m[0]] for m in members], device=device)
            held = pos[None] >= (prompt_len - glens)[:, None]
            out.starts.append(out.starts[-1] + b * kv_heads)
            out.batches.append(_Batch(torch.tensor([m[0] for m in members], device=device), index,
                                      back.to(device), mask_to_rows(held[:, None], kv_heads),
                                      any(len(m) < most for m in members), u == b))
        return out

    @property
    def sizes(self) -> list[int]:
        """The prompts of each GPU batch: the rows of the prompts' cache."""
        return [x.reps.shape[0] for x in self.batches]

    def mask(self, kb: int) -> torch.Tensor:
        return self.batches[kb].mask

    def firsts(self, x: torch.Tensor, kb: int) -> torch.Tensor:
        """Each prompt's rows of batch kb's (b, ...) keys or values: its first row's."""
        bt = self.batches[kb]
        return x if bt.identity else x.index_select(0, bt.reps.to(x.device))

    def gather(self, q: torch.Tensor, kb: int) -> torch.Tensor:
        """Batch kb's decode queries (b * kvh, G, 1, d), row r on kv head r % kvh, as the queries
        of each prompt's row: (u * kvh, m * G, 1, d), m the most rows a prompt has (a prompt with
        fewer asks zeros in their place, which ``scatter`` drops)."""
        bt = self.batches[kb]
        b = bt.back.shape[0]
        _, g, _, d = q.shape
        x = q.view(b, -1, g, d)
        kvh = x.shape[1]
        if bt.ragged:
            x = torch.cat([x, x.new_zeros((1, kvh, g, d))])
        u, m = bt.index.shape
        x = x.index_select(0, bt.index.reshape(-1).to(x.device)).view(u, m, kvh, g, d)
        return x.transpose(1, 2).reshape(u * kvh, m * g, 1, d)

    def scatter(self, o: torch.Tensor, lse: torch.Tensor, kb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather``'s inverse for an attention's output (u * kvh, m * G, 1, d) and log-sum-exps
        (u * kvh, m * G, 1): each row's, (b * kvh, G, 1, d) and (b * kvh, G, 1)."""
        bt = self.batches[kb]
        u, m = bt.index.shape
        d = o.shape[-1]
        kvh = o.shape[0] // u
        g = o.shape[1] // m
        back = bt.back.to(o.device)
        o = o.view(u, kvh, m, g, d).transpose(1, 2).reshape(u * m, kvh, g, d).index_select(0, back)
        lse = lse.view(u, kvh, m, g).transpose(1, 2).reshape(u * m, kvh, g).index_select(0, back)
        return o.reshape(-1, g, 1, d), lse.reshape(-1, g, 1)
