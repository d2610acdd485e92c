"""Dummy weights: deterministic random-looking values of a model's shapes, for benchmarks of
big shapes without a checkpoint (``--dummy-weights``)."""
from __future__ import annotations

import functools
import hashlib

import torch

from .source import WeightSource
from .spec import ModelSpec

# Dummy weights are cut from one pool of normal(0, 0.02) values per seed and dtype, each tensor
# starting at an offset of its own and wrapping around: a copy per tensor instead of drawing
# every value (drawing ran at ~200 M values/s, 150 s for OPT-30B's weights; copying runs at
# memory speed). The pool's odd length keeps the wrap from lining up with rows.
DUMMY_POOL = 16_777_259


@functools.lru_cache(maxsize=2)
def _dummy_pool(seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(DUMMY_POOL, dtype=dtype).normal_(0.0, 0.02, generator=g)


def _from_pool(pool: torch.Tensor, shape: torch.Size | tuple[int, ...], offset: int) -> torch.Tensor:
    out = torch.empty(shape, dtype=pool.dtype)
    flat, n, pos = out.view(-1), out.numel(), 0
    offset %= pool.numel()
    while pos < n:
        take = min(n - pos, pool.numel() - offset)
        flat[pos:pos + take].copy_(pool[offset:offset + take])
        pos, offset = pos + take, 0
    return out


class DummySource(WeightSource):
    """Deterministic random-looking weights, made per part so nothing big is ever whole: norms
    1, biases 0, every other tensor a slice of the seed's pool (``DUMMY_POOL``) at an offset
    hashed from its name.

    ``fill="ones"``: every tensor 1, as FlexGen's dummy weights are. Only for timing against
    it: a GPU's matrix products draw less power, and so keep higher clocks, on constant data
    than on random data, so two systems timed on different values are not comparable. The
    activations of such a model overflow in a half type; the time does not depend on that.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, seed: int = 0, fill: str = "random") -> None:
        super().__init__(spec, dtype)
        if fill not in ("random", "ones"):
            raise ValueError(f"dummy fill {fill!r}: use random or ones")
        self.seed, self.fill = seed, fill

    def _read(self, part: str, layer: int | None) -> dict[str, torch.Tensor]:
        out = {}
        for k, shape in self.shapes(part, layer).items():
            # a tied head ("tok.w" in the head) takes the embedding's values, as a checkpoint
            # of a tied model holds one matrix for both
            key = (f"{self.seed}/embed/None/{k}" if k == "tok.w" else f"{self.seed}/{part}/{layer}/{k}").encode()
            # made in the source's dtype: ``get``'s conversion is then no second pass
            if self.fill == "ones" or k.endswith("norm.w"):
                out[k] = torch.ones(shape, dtype=self.dtype)
            elif k.endswith(".b"):
                out[k] = torch.zeros(shape, dtype=self.dtype)
            else:
                offset = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
                out[k] = _from_pool(_dummy_pool(self.seed, self.dtype), shape, offset)
        return out
