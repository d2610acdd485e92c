"""flexgen_dist: high-throughput generation with offloading, on one device or a pipeline of ranks.

    from flexgen_dist import LLM

    with LLM() as llm:                                   # the bundled SmolLM2-135M-Instruct
        for c in llm.generate(["The capital of France is"], gen_len=16):
            print(c.text)

See ``flexgen_dist.api`` for the options and the SPMD rule under torchrun, mpirun and Slurm.
"""
from .api import LLM, Completion
from .scoring import Score
from .config import ConfigError, RunConfig
from .engine.policy import Policy
from .engine.sampling import SamplingConfig

__all__ = ["LLM", "Completion", "Score", "ConfigError", "Policy", "RunConfig", "SamplingConfig"]
