"""The library API: ``LLM(model, **options).generate(prompts)``, on one process or m ranks.

    from flexgen_dist import LLM

    with LLM("opt-1.3b", dummy_weights=True, percent=(0, 100, 100, 0, 100, 0)) as llm:
        for c in llm.generate(["Hello", [5, 6, 7]], gen_len=16):
            print(c.index, c.token_ids, c.text)

Options are the CLI's (``RunConfig`` fields: ``--gpu-batch-size`` is ``gpu_batch_size=``).
Under torchrun, mpirun or srun every rank runs the same script (SPMD): each builds the
``LLM``, each calls ``generate`` as often as rank 0 does; rank 0 gets the completions, the
other ranks serve their stage and get an empty list. Only rank 0 reads the prompts, the
policy files and the generation settings: it sends the others what they need.

The engine is built at the first ``generate`` call, when the workload (prompt lengths,
gen-len, number of prompts) is known: the budget check and ``policy="auto"`` need it. Later
calls reuse the placed weights and the first call's plan, and check the budgets for their
own workload.
"""
from __future__ import annotations

import dataclasses
import sys
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .budgets import machine_budgets, user_caps
from .choices import Choices
from .completions import Completion, completion
from .config import ConfigError, RunConfig, build_config, lora_module_pairs
from .distributed.group import RankGroup
from .distributed.topology import DistContext, Topology, cuda_device_for, detect_topology, setup_rank_logging
from .engine.sampling import SamplingConfig
from .memory.owners import reclaim_stale_dirs
from .metrics import merge_metrics, summary
from .models.loader import LoadedModel, describe, load_model
from .models.lora import with_lora
from .models.lora_stack import with_lora_modules
from .models.token_score import token_ids, with_token_classifier
from .plan import Peaks, RunPlan, Workload
from .beam_calls import BeamCalls
from .pooled_calls import PooledCalls
from .score_calls import ScoreCalls
from .openai_batch import run_batch
from .prompts import Messages, Prompt, StopStrings
from .reasoning import Reasoning, reasoning_of
from .run_plan import RunPlanner
from .threads import apply as apply_threads, choose_threads
from .worker import StageWorker, with_shared_prefixes, with_twins
from .workloads import LoraChoice, PromptLike, build_workload


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device this rank computes on: ``auto`` (CUDA where visible), ``cuda`` (this rank's GPU) or ``cpu``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu")
        return cuda_device_for(local_rank)
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The run's dtype: ``auto`` is float16 on a GPU, float32 on a CPU."""
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class LLM(PooledCalls, BeamCalls, ScoreCalls):
    """A model placed over GPU, CPU and disk (one stage per rank), ready to generate.

    A thin facade: rank 0 turns a call's arguments into a ``Workload``, ``RunPlanner`` makes
    the ``RunPlan`` once, the ``RankGroup`` (a group of one on a single process) hands both to
    every rank, and this rank's ``StageWorker`` runs its stage."""

    def __init__(self, model: str | None = None, *, config: RunConfig | None = None, **options: Any) -> None:
        self.config = cfg = build_config(model, config, options)
        self.topology: Topology = detect_topology(master_addr=cfg.master_addr, master_port=cfg.master_port)
        self.device = resolve_device(cfg.device, self.topology.local_rank)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if cfg.log_dir:
            try:
                setup_rank_logging(cfg.log_dir, self.topology.rank)
            except OSError as e:
                raise ConfigError(f"--log-dir {cfg.log_dir}: cannot be used ({e.strerror or e}); choose a "
                                  "writable directory") from None
        self.metrics: dict[str, Any] = {}  # rank 0: the merged report of the last generate call
        self.stage_metrics: dict[str, Any] = {}  # every rank: its own stage's record
        self.plan: RunPlan | None = None  # made at the first call (rank 0), the same on every rank
        # compute threads from the CPUs this rank may use, before anything computes (threads.py)
        self.threads = choose_threads(cfg.threads)
        apply_threads(self.threads)
        self._group = RankGroup(DistContext.init(self.topology, self.device.type, cfg.backend, cfg.dist_timeout))
        self._closed = False
        with self._guard(close=True):
            self._group.start_monitor()  # several ranks: a failure anywhere ends every rank
            self.model: LoadedModel = load_model(cfg.model, dummy_weights=cfg.dummy_weights, dtype=self.dtype,
                                                 seed=cfg.seed, load_tokenizer=self._needs_tokenizer,
                                                 dummy_fill=cfg.dummy_fill)
            if cfg.classifier_from_token:  # an LLM reranker: its head is the tokens' logits' difference
                self.model = with_token_classifier(self.model, cfg.classifier_from_token, lambda: self._group.broadcast(
                    token_ids(self.model.tokenizer, cfg.classifier_from_token) if self.is_driver else None))
            if cfg.pooling != "auto":  # embeddings pooled as the run says, not as the model's files do
                self.model = dataclasses.replace(self.model, spec=dataclasses.replace(self.model.spec,
                                                                                      pooling=cfg.pooling))
            if cfg.lora:  # merged as each part is read: every later step sees ordinary weights
                self.model = with_lora(self.model, cfg.lora)
            if cfg.lora_modules:  # served per request: each layer also holds every adapter's A and B
                self.model = with_lora_modules(self.model, lora_module_pairs(cfg.lora_modules))
            self.model.source.keep_packed = cfg.gguf_native
            # measured once, before anything is placed: later calls are checked against the same
            budgets = machine_budgets(user_caps(cfg.gpu_mem, cfg.cpu_mem, cfg.disk_mem), self.device,
                                      cfg.offload_dir)
            self._planner = RunPlanner(cfg, self.model, self.world_size, self.device, self.dtype, budgets)
            self._worker = StageWorker(cfg, self.model, self._group, self.device, self.dtype, self.threads)
            # every run reclaims what killed runs left under its offload dir, disk tier or not
            reclaim_stale_dirs(Path(cfg.offload_dir))

    # --- who am I -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_driver(self) -> bool:
        """Rank 0: reads prompts and settings, gets the completions and the merged metrics."""
        return self.topology.is_first

    @property
    def _needs_tokenizer(self) -> bool:
        """Rank 0 tokenizes and decodes; the last rank masks structured outputs' choices with it."""
        return self.is_driver or self.rank == self.world_size - 1

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @cached_property
    def reasoning(self) -> Reasoning | None:
        """How this model's chat completions think, where they do (``--reasoning-parser``)."""
        return reasoning_of(self.tokenizer, self.config.reasoning_parser)

    @property
    def gpu_batch_unit(self) -> int:
        """The plan's default GPU batch size is a multiple of this (rank 0, before the first
        call: e.g. every beam width a batch job will run)."""
        return self._planner.row_unit

    @gpu_batch_unit.setter
    def gpu_batch_unit(self, n: int) -> None:
        self._planner.row_unit = int(n)

    @property
    def engine(self) -> Any:
        """This rank's stage engine (None before the first call)."""
        return self._worker.engine

    def on_driver(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and return its result on every rank: how an SPMD script's ranks
        agree on what to do next (e.g. what is left of a job). A failure of ``fn`` is reported
        to the other ranks, which exit naming rank 0, as a failed call's is."""
        self._check_open()
        with self._guard():
            return self._group.broadcast(fn() if self.is_driver else None)

    # --- generation ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
                 sampling: SamplingConfig | Sequence[SamplingConfig] | None = None, *,
                 keys: Sequence[int] | None = None, max_new_tokens: Sequence[int] | None = None,
                 stop: Sequence[Sequence[str]] | None = None, logprobs: int | None = None,
                 lora: LoraChoice = None, n: int = 1, best_of: int | None = None) -> list[Completion]:
        """Completions of ``prompts`` (strings or token-id lists), in input order.

        ``gen_len`` and ``sampling`` default to the options the LLM was built with;
        ``sampling`` may also be one ``SamplingConfig`` per prompt (all of it: temperature,
        penalties, ``ignore_eos``, vLLM's ``min_tokens``, ``stop_token_ids``, ``bad_words``, ...). ``max_new_tokens`` (one per prompt, each <=
        gen_len) cuts a completion shorter; ``stop`` (one list of strings per prompt) ends it
        before the first of its stop strings. A finished completion costs no more steps once
        its whole block is done, and blocks group prompts of similar length (``sort_window``).
        A sampled completion depends on its seed and on its prompt's key alone (default: the
        prompt's index in this call): a job split over several calls passes ``keys`` (e.g. the
        prompts' indices in the whole job) to draw what one call would. ``logprobs`` (0 to 20)
        fills each completion's ``logprobs``: every generated token's log-probability under
        the model and that many most likely alternatives (README, "Library API"). ``lora`` names
        the LoRA adapter (one of ``lora_modules``) every prompt runs with, or one per prompt (None:
        the base model); one call mixes them. ``n``: that many completions per prompt (each
        prompt's in a row, ``Completion.choice`` 0..n-1), the best ``n`` of ``best_of`` sampled
        candidates by their mean log-probability per token where ``best_of`` is larger
        (``choices.py``; a prompt's prefill is computed once for all). On ranks other than 0
        the arguments are ignored and the result is empty."""
        return [c for block in self.stream(prompts, gen_len, sampling, keys=keys, max_new_tokens=max_new_tokens,
                                           stop=stop, logprobs=logprobs, lora=lora, n=n, best_of=best_of)
                for c in block]

    def chat(self, conversations: Sequence[Messages] | None = None, gen_len: int | None = None,
             sampling: SamplingConfig | Sequence[SamplingConfig] | None = None, *,
             max_new_tokens: Sequence[int] | None = None,
             logprobs: int | None = None, lora: LoraChoice = None, n: int = 1,
             best_of: int | None = None) -> list[Completion]:
        """Replies to ``conversations`` (each a list of ``{"role": ..., "content": ...}``
        messages), each rendered through the model's own chat template with the assistant's
        turn opened, exactly as transformers renders it; as ``generate`` otherwise."""
        return self.generate(conversations, gen_len, sampling, max_new_tokens=max_new_tokens, logprobs=logprobs,
                             lora=lora, n=n, best_of=best_of)

    def stream(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
               sampling: SamplingConfig | Sequence[SamplingConfig] | None = None, *,
               keys: Sequence[int] | None = None, max_new_tokens: Sequence[int] | None = None,
               stop: Sequence[Sequence[str]] | None = None, logprobs: int | None = None,
               lora: LoraChoice = None, n: int = 1, best_of: int | None = None) -> Iterator[list[Completion]]:
        """Like ``generate``, yielding completions as soon as they are final, in input order: a
        window of consecutive prompts at a time (the prompts one length-grouping window sorted
        into blocks; with ``sort_window=0``, one block). Exhaust it (a stream abandoned midway
        on several ranks fails the other ranks)."""
        try:
            ch = Choices.of(n, best_of, sampling, self.config.sampling)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        call = dict(prompts=prompts, sampling=sampling, keys=keys, max_new_tokens=max_new_tokens, stop=stop,
                    logprobs=logprobs, lora=lora)
        if ch.many and isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
            yield from ch.fold(self._stream(gen_len, **ch.expand(**call)), logprobs)  # each candidate a row
            if self.metrics:  # rank 0's report counts rows: say how many each prompt had
                self.metrics.update(candidates_per_prompt=ch.best_of, choices_per_prompt=ch.n)
            return
        yield from self._stream(gen_len, **call)

    def _stream(self, gen_len: int | None, prompts: Sequence[PromptLike] | None,
                sampling: SamplingConfig | Sequence[SamplingConfig] | None, keys: Sequence[int] | None,
                max_new_tokens: Sequence[int] | None, stop: Sequence[Sequence[str]] | None,
                logprobs: int | None, lora: LoraChoice) -> Iterator[list[Completion]]:
        self._check_open()
        with self._guard():
            work, peaks = self._start(lambda: self._workload(prompts, gen_len, sampling, keys=keys,
                                                             max_new_tokens=max_new_tokens, stop=stop,
                                                             logprobs=logprobs, lora=lora))
            stops = work.stop_strings(self.tokenizer) if self.is_driver else None
            for window in self._windows(self._run(work, peaks)):
                yield [self._completion(n, work.prompts[n], toks, stops, work.sampling_of(n)) for n, toks in window]

    def batch(self, requests: Sequence[dict[str, Any] | str] | None = None,
              max_tokens: int | None = None) -> list[dict[str, Any]]:
        """OpenAI Batch requests (``{"custom_id", "method", "url", "body"}`` dicts or their JSON
        lines) -> their output lines, in input order (``openai_batch.py``). A request without
        ``max_tokens`` gets ``max_tokens`` (default: this LLM's ``gen_len``); a bad request gets
        an error line and the others run; duplicate ``custom_id`` s are refused before anything
        runs. On ranks other than 0 the arguments are ignored and the result is empty."""
        return [line for part in self.stream_batch(requests, max_tokens) for line in part]

    def stream_batch(self, requests: Sequence[dict[str, Any] | str] | None = None,
                     max_tokens: int | None = None, *, skip: int = 0) -> Iterator[list[dict[str, Any]]]:
        """Like ``batch``, yielding output lines as soon as they are final, in input order;
        ``skip``: the first requests are done already (a resumed job) and are not run."""
        self._check_open()
        yield from run_batch(self, requests, self.config.gen_len if max_tokens is None else int(max_tokens), skip)

    def _windows(self, blocks: Iterator[tuple[Any, list[Any]]]) -> Iterator[list[tuple[int, Any]]]:
        """(index, result) of each prompt of the call, a whole window of them at a time, in input
        order, as the blocks of ``_run`` (rank 0: in block order) complete them."""
        pending: dict[int, list[tuple[int, Any]]] = {}
        left: dict[int, int] = {}
        for blk, outs in blocks:
            if not left:  # the call's blocks are planned once its run has started
                for b in self._worker.blocks:
                    left[b.window] = left.get(b.window, 0) + 1
            pending.setdefault(blk.window, []).extend(zip(blk.members, outs))
            left[blk.window] -= 1
            if left[blk.window] == 0:
                yield sorted(pending.pop(blk.window), key=lambda r: r[0])

    def prepare(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
                sampling: SamplingConfig | Sequence[SamplingConfig] | None = None, *,
                max_new_tokens: Sequence[int] | None = None, logprobs: int | None = None,
                lora: LoraChoice = None) -> Workload:
        """Plan and build for a workload like this one without running it (every rank calls
        it; rank 0's arguments count). The plan is made at an LLM's first call and kept, so a
        job that first scores and then generates plans here for the generation (its block
        size, its cache) rather than for the shorter scoring call. Returns the workload (its
        header on ranks other than 0)."""
        self._check_open()
        with self._guard():
            work, _ = self._start(lambda: self._workload(prompts, gen_len, sampling, max_new_tokens=max_new_tokens,
                                                         logprobs=logprobs, lora=lora))
        return work

    def warmup(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
               sampling: SamplingConfig | None = None) -> None:
        """Place the weights for the workload of ``prompts`` (as the first ``generate`` call
        would: the plan and the budget check see this workload), then run one untimed pass:
        the first GPU batch of prompts, cut to 32 tokens, for one token. One-time costs (the
        CUDA context, kernel loading, the allocator's first growth, the native CPU kernels)
        then stay out of the next call's clock, as benchmarks want. Every rank makes the same
        call; ``metrics`` is still the next call's."""
        work = self.prepare(prompts, gen_len, sampling)
        short: list[list[int]] | None = None
        if self.is_driver:
            assert self.plan is not None
            short = [p.ids[:32] for p in work.prompts[:self.plan.stages[0].policy.gpu_batch_size]]
        self.generate(short, gen_len=1, sampling=SamplingConfig(ignore_eos=True))
        self.metrics, self.stage_metrics = {}, {}

    def explain(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
                sampling: SamplingConfig | None = None) -> RunPlan | None:
        """The plan a call with these arguments would follow (this LLM's plan once it has
        one), made without placing or running anything; None on ranks other than 0."""
        self._check_open()
        if not self.is_driver:
            return None
        return self.plan or self._planner.plan(self._twins(self._workload(prompts, gen_len, sampling)))

    def check_plan(self, plan: RunPlan, prompts: Sequence[PromptLike] | None = None,
                   gen_len: int | None = None) -> list[Peaks]:
        """Each stage's peaks under ``plan`` for this workload; a stage over a budget raises
        ``MemoryBudgetError`` naming it (what the first call would refuse)."""
        work = self._workload(prompts, gen_len, None)
        return [self._planner.check(plan, work, s) for s in range(len(plan.stages))]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed: build a new one")

    def _start(self, workload: Callable[[], Workload]) -> tuple[Workload, Peaks]:
        """Rank 0 builds the workload and, at the first call, the plan; every rank receives
        both, checks its stage's peaks for this workload and builds its engine once."""
        work = self._twins(workload()) if self.is_driver else None
        plan = (self.plan or self._planner.plan(work)) if work is not None else None
        if work is not None and plan is not None:
            work = self._shared(work, plan)
        header, plan = self._group.broadcast((work.header() if work is not None else None, plan))
        work = work or header
        self.plan = self.plan or plan
        peaks = self._planner.check(self.plan, work, self.rank)
        if self._worker.build(self.plan, peaks) and self.is_driver:
            self._say_plan()
        cost = self._worker.prepare(self.plan, work)
        if self.is_driver and cost["kernel_build_s"] + cost["gemm_tune_s"] >= 0.5:  # first use on a machine
            print(f"one-time: native kernels ready in {cost['kernel_build_s']:.1f} s, GEMM forms of "
                  f"{cost['gemm_shapes_tuned']} shapes timed in {cost['gemm_tune_s']:.1f} s (kept for later "
                  "runs; not part of the throughputs)", file=sys.stderr)
        return work, peaks

    def _twins(self, work: Workload) -> Workload:
        """Rank 0: ``work`` with its repeated prompts, where sharing is on (``worker.with_twins``),
        before the plan is made: its cost model counts what they save."""
        return with_twins(work) if self.config.share_prefix else work

    def _shared(self, work: Workload, plan: RunPlan) -> Workload:
        """Rank 0: ``work`` with its blocks' shared prefixes, where sharing is on (``worker.with_shared_prefixes``)."""
        if not self.config.share_prefix:
            return work
        stages = plan.stages
        return with_shared_prefixes(work, plan, self.model.spec, lambda w: self._planner.fits(
            [s.policy for s in stages], [s.layers for s in stages], w, plan.num_micro_batches, plan.schedule),
            cuda=self.device.type == "cuda")

    def _workload(self, prompts: Sequence[PromptLike] | None, gen_len: int | None,
                  sampling: SamplingConfig | Sequence[SamplingConfig] | None, **extra: Any) -> Workload:
        return build_workload(prompts, gen_len, sampling, self.config, self.model.spec, self.tokenizer,
                              reasoning=self.reasoning, served=self.model.adapters, **extra)

    def _say_plan(self) -> None:
        plan = self.plan
        assert plan is not None
        where = f"; {self.world_size} stages {[s.layers for s in plan.stages]}; G={plan.num_micro_batches}; " \
            f"prefill items per {plan.prefill_items}" if self.world_size > 1 else ""
        print(f"model: {describe(self.model)}{where}; schedule {plan.schedule}", file=sys.stderr)
        for s in plan.stages:
            p = s.policy
            who = f"stage {s.index} " if self.world_size > 1 else ""
            print(f"{who}policy: gbs={p.gpu_batch_size} num_gb={p.num_gpu_batches} "
                  f"{p.placement()} cpu_attention={p.cpu_attention} "
                  f"overlap={p.overlap}", file=sys.stderr)
        if self.device.type == "cpu":
            print(f"threads: {self.threads.threads} ({self.threads.why})", file=sys.stderr)

    def _run(self, work: Workload, peaks: Peaks) -> Iterator[tuple[int, list[Any]]]:
        """This rank's stage over the call's blocks; at the end rank 0 merges every stage's record."""
        plan = self.plan
        assert plan is not None
        yield from self._worker.run(plan, work, peaks)
        self.stage_metrics = self._worker.record
        stages = self._group.gather(self.stage_metrics)
        if not self.is_driver:
            return
        run = {"model": describe(self.model), "device": str(self.device),
               "dtype": str(self.dtype).replace("torch.", ""), "num_prompts": work.num_prompts,
               "prompt_len": work.prompt_len, "gen_len": work.gen_len, "num_micro_batches": plan.num_micro_batches,
               "prefill_items": plan.prefill_items, "schedule": plan.schedule,
               **({"beam_width": work.beams.width} if work.beams is not None else {})}
        predicted = {} if plan.prediction is None else dataclasses.asdict(plan.prediction)
        self.metrics = {**merge_metrics(run, self._worker.timings, stages, predicted), "plan": plan.to_dict()}

    def _completion(self, index: int, p: Prompt, res: Any, stops: StopStrings | None,
                    cfg: SamplingConfig) -> Completion:
        return completion(index, p, res, self.tokenizer, self.reasoning, self.model.spec.eos_token_ids, stops, cfg)

    def summary(self) -> str:
        """The last call's throughputs in words (rank 0)."""
        return summary(self.metrics) if self.metrics else "no call has finished yet"

    # --- failures and cleanup -----------------------------------------------------------
    @contextmanager
    def _guard(self, close: bool = False) -> Iterator[None]:
        """On several ranks, an exception here is reported to the others (they exit naming
        this rank) and this LLM is closed; on one, it propagates and the LLM stays usable
        (a call with a shorter workload may fit), unless ``close``."""
        try:
            yield
        except BaseException as e:
            if self.world_size > 1:
                err = RuntimeError("a stream was abandoned before its end") if isinstance(e, GeneratorExit) else e
                cause = self._group.report(err)
                self.close()
                if cause is not None:  # name the rank that failed first, not its echo here
                    raise cause from None
            elif close:
                self.close()
            raise

    def close(self) -> None:
        """Free the engine, remove this rank's offload files, leave the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            worker = getattr(self, "_worker", None)
            if worker is not None:
                worker.close()
        finally:
            self._group.close()  # rank 0 waits here until its peers are done

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # One process only: on several ranks close() waits for the peers, which a garbage
        # collector must not do (call close(), or use a with block).
        if not getattr(self, "_closed", True) and self.world_size == 1:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
