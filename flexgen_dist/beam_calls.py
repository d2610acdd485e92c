"""The LLM's beam search (a mixin of ``api.LLM``): ``beam_search`` runs each prompt as its
beams (``engine/beams.py``), the same generation loop on every stage, and returns per prompt
its best hypotheses as ``Completion`` s, best first, each with its ``score``."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

from .completions import Completion, completion
from .config import ConfigError
from .engine.beams import BeamConfig, Beamed
from .engine.sampling import SamplingConfig
from .facade import Facade
from .workloads import LoraChoice, PromptLike


@dataclass
class BeamOutput:
    """One prompt's beam search result: its best ``sequences`` (``Completion`` s, best first,
    each with its ``score``: the sum of its tokens' log-probabilities over its length to the
    power ``length_penalty``)."""

    index: int
    prompt_ids: list[int]
    prompt: str | None
    sequences: list[Completion] = field(default_factory=list)


class BeamCalls(Facade):
    """``beam_search`` (and its stream) of ``LLM``, on its ``_guard``, ``_start``, ``_run`` and
    ``_windows``."""

    def beam_search(self, prompts: Sequence[PromptLike] | None = None, beam_width: int = 4,
                    max_tokens: int | None = None, *, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, num_return_sequences: int | None = None,
                    sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
                    lora: LoraChoice = None) -> list[BeamOutput]:
        """Each prompt's best ``num_return_sequences`` (default: ``beam_width``) hypotheses by
        beam search, as transformers' ``generate(num_beams=beam_width, length_penalty=...,
        early_stopping=...)`` finds them (README, "Beam search"), in input order.
        ``max_tokens``: new tokens at most (default: the LLM's ``gen_len``). ``sampling`` (one,
        or one per prompt) may give vLLM's controls (``min_tokens``, ``stop_token_ids``,
        ``ignore_eos``, ``bad_words``, ``allowed_token_ids``, ``include_stop_str_in_output``,
        ``skip_special_tokens``); it must be greedy. Every GPU batch holds whole prompts' beams:
        the GPU batch size is a multiple of ``beam_width``. On ranks other than 0 the arguments
        are ignored and the result is empty."""
        return [o for window in self.stream_beam_search(
            prompts, beam_width, max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
            num_return_sequences=num_return_sequences, sampling=sampling, lora=lora) for o in window]

    def stream_beam_search(self, prompts: Sequence[PromptLike] | None = None, beam_width: int = 4,
                           max_tokens: int | None = None, *, length_penalty: float = 1.0,
                           early_stopping: bool | str = False, num_return_sequences: int | None = None,
                           sampling: SamplingConfig | Sequence[SamplingConfig] | None = None,
                           lora: LoraChoice = None) -> Iterator[list[BeamOutput]]:
        """Like ``beam_search``, yielding results as soon as they are final, in input order."""
        self._check_open()
        with self._guard():
            beams = _beams(beam_width, length_penalty, early_stopping, num_return_sequences) \
                if self.is_driver else None
            work, peaks = self._start(lambda: self._beam_workload(prompts, beams, max_tokens, sampling, lora))
            eos = self.model.spec.eos_token_ids
            for window in self._windows(self._run(work, peaks)):  # (rank 0's: the others get none)
                k, out = work.beams.width, []
                for a in range(0, len(window), k):  # a prompt's rows come together, its best first
                    n, _ = window[a]
                    p = work.prompts[n]
                    seqs = [self._sequence(n // k, p, res, work.sampling_of(n), eos)
                            for _, res in window[a:a + work.beams.returns]]
                    out.append(BeamOutput(n // k, p.ids, p.text, seqs))
                yield out

    def _beam_workload(self, prompts: Sequence[PromptLike] | None, beams: BeamConfig | None, max_tokens: int | None,
                       sampling: SamplingConfig | Sequence[SamplingConfig] | None, lora: LoraChoice) -> Any:
        """Rank 0: the call's workload, each prompt (its sampling, its adapter) ``width`` times."""
        assert beams is not None
        if prompts is None or isinstance(prompts, (str, bytes)) or len(prompts) == 0:
            raise ConfigError("beam_search() takes a non-empty list of prompts (strings, token-id lists or "
                              "conversations)")
        k = beams.width
        each = None if sampling is None or isinstance(sampling, SamplingConfig) else list(sampling)
        if each is not None and len(each) != len(prompts):
            raise ConfigError(f"sampling has {len(each)} settings for {len(prompts)} prompts: give one for all or "
                              "one per prompt")
        rows = [p for p in prompts for _ in range(k)]
        samp = None if each is None else [c for c in each for _ in range(k)]
        adapters = lora if lora is None or isinstance(lora, str) else [a for a in lora for _ in range(k)]
        return self._workload(rows, max_tokens, samp if samp is not None else sampling, lora=adapters, beams=beams)

    def _sequence(self, index: int, p: Any, res: Beamed, cfg: SamplingConfig, eos: Sequence[int]) -> Completion:
        return replace(completion(index, p, res.tokens, self.tokenizer, self.reasoning, eos, None, cfg), score=res.score)


def _beams(width: int, length_penalty: float, early_stopping: bool | str, num_return: int | None) -> BeamConfig:
    try:
        return BeamConfig(width, length_penalty, early_stopping, num_return or 0)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
