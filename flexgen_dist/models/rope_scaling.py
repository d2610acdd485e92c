"""RopeScaling: a rotary embedding's frequency scaling, as a checkpoint's config gives it (a
``ModelSpec`` field; ``common.rope_inv_freq`` computes its frequencies)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """A rotary embedding's frequency scaling, as a checkpoint's ``rope_scaling`` (or
    ``rope_parameters``) gives it: ``linear`` divides every frequency by ``factor``; ``llama3``
    (Llama 3.1 and later) divides the low frequencies by ``factor``, keeps the high ones and
    interpolates between, by the wavelength against ``original_max_position_embeddings``;
    ``yarn`` blends interpolated and original frequencies over a ramp between the dimensions
    that turn ``beta_fast`` and ``beta_slow`` times in the original context, and multiplies cos
    and sin by ``attention_factor``; ``dynamic`` (NTK) raises the base only for positions past
    the model's ``max_position_embeddings``, which the engine never runs, so within them it is
    plain RoPE, as in the reference; ``longrope`` (Phi-3 128k, Phi-3.5, Phi-4-mini) divides
    each frequency by its own factor, ``short_factor`` while a sequence is within
    ``original_max_position_embeddings`` and ``long_factor`` once it reaches past it, and
    multiplies cos and sin by ``attention_factor``."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole dimensions
    long_factor: tuple[float, ...] = ()  # longrope: one divisor per frequency, past the original context
    short_factor: tuple[float, ...] = ()  # longrope: ... within it

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope scaling type {self.rope_type!r}: supported are {', '.join(ROPE_TYPES)}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor {self.factor}: must be > 0")
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        if self.rope_type == "longrope":
            if not self.long_factor or len(self.long_factor) != len(self.short_factor):
                raise ValueError(f"longrope needs long_factor and short_factor of one length (got "
                                 f"{len(self.long_factor)} and {len(self.short_factor)})")
            if min(self.long_factor + self.short_factor) <= 0:
                raise ValueError("longrope factors must be > 0")
        # equal factors (Llama 4 Scout's): no band between, the low frequencies divided, the rest kept
        if self.rope_type == "llama3" and self.high_freq_factor < self.low_freq_factor:
            raise ValueError(f"rope scaling high_freq_factor {self.high_freq_factor} must be at least "
                             f"low_freq_factor {self.low_freq_factor}")


ROPE_TYPES = ("linear", "llama3", "dynamic", "yarn", "longrope")


def mla_softmax_scale(qk_dim: int, factor: float, log_mul: float) -> float:
    """Latent attention's softmax scale (DeepSeek): qk_dim ** -0.5, times the square of YaRN's
    m = log_mul · ln(factor) + 1 where the RoPE is stretched (log_mul: 0.1 · mscale_all_dim,
    as a GGUF file's ``yarn_log_multiplier`` holds it; 0: none), in the reference's order."""
    scale = qk_dim ** -0.5
    if not log_mul or factor <= 1:
        return scale
    m = log_mul * math.log(factor) + 1.0
    return scale * m * m
