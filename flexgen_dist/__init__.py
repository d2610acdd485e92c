"""flexgen_dist: high-throughput generation with offloading, on one device or a pipeline of ranks.

    from flexgen_dist import LLM

    with LLM() as llm:                                   # the bundled SmolLM2-135M-Instruct
        for c in llm.generate(["The capital of France is"], gen_len=16):
            print(c.text)

See ``flexgen_dist.api`` for the options and the SPMD rule under torchrun, mpirun and Slurm.
"""
from . import hugepages as _hugepages

_hugepages.request()  # before torch is imported: huge pages for large host tensors (see there)

from .api import LLM, Completion  # noqa: E402
from .scoring import Score  # noqa: E402
from .embeddings import Classification, Embedding  # noqa: E402
from .pairs import Ranked  # noqa: E402
from .beam_calls import BeamOutput  # noqa: E402
from .config import ConfigError, RunConfig  # noqa: E402
from .engine.policy import Policy  # noqa: E402
from .engine.sampling import SamplingConfig, TokenLogprobs  # noqa: E402
from .engine.structure import Structure  # noqa: E402

__all__ = ["LLM", "Completion", "Score", "Embedding", "Classification", "Ranked", "BeamOutput", "ConfigError", "Policy", "RunConfig", "SamplingConfig", "Structure",
           "TokenLogprobs"]
