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
calls reuse the placed weights (and, with "auto", the plan of the first call) and check the
budgets for their own workload.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from . import hugepages
from .config import ConfigError, RunConfig
from .distributed.comm import FailureMonitor, PeerFailure, StageComm
from .distributed.pipeline import Pipeline
from .distributed.topology import DistContext, Topology, cuda_device_for, detect_topology, setup_rank_logging
from .engine.blocks import plan_blocks
from .engine.budget import check_budgets, needs_disk
from .engine.policy import Policy
from .engine.sampling import SamplingConfig
from .engine.stage import StageEngine
from .kernels import gemm
from .memory.disk import DiskStore
from .memory.owners import reclaim_stale_dirs
from .metrics import merge_metrics, progress_bar, summary
from .models.loader import LoadedModel, describe, load_model
from .prompts import Prompt, check_prompt_lengths, make_prompt
from .run_plan import RunPlanner
from .scoring import Score, score_split, score_targets

log = logging.getLogger("flexgen_dist")
PromptLike = str | Sequence[int] | Prompt  # a Prompt keeps its id and text (the CLI passes them)


@dataclass
class Completion:
    """One prompt's result, in input order."""

    index: int  # position of the prompt in the generate call's input
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids, up to and including the first EOS
    text: str | None  # the decoded completion (None for a model without a tokenizer)
    prompt: str | None = None  # the prompt's text, when it was given as text


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is visible: use --device cpu")
        return cuda_device_for(local_rank)
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def build_config(model: str | None, config: RunConfig | None, options: dict[str, Any]) -> RunConfig:
    """``config`` (or the defaults) with ``options`` on top; a ``Policy`` (or a list, one per
    stage) may stand for ``policy=``."""
    opts = dict(options)
    if model is not None:
        opts["model"] = model
    pol = opts.get("policy")
    if isinstance(pol, (Policy, dict)) or (isinstance(pol, (list, tuple)) and pol):
        pols = [pol] if isinstance(pol, (Policy, dict)) else list(pol)
        opts["stages"] = tuple(p.to_dict() if isinstance(p, Policy) else dict(p) for p in pols)
        opts["policy"] = None
    for k in ("percent", "stage_layers"):
        if opts.get(k) is not None:
            opts[k] = tuple(opts[k])
    known = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; options are the CLI's flags with underscores: "
                          f"{', '.join(sorted(known))}")
    return dataclasses.replace(config or RunConfig(), **opts)


class LLM:
    """A model placed over GPU, CPU and disk (one stage per rank), ready to generate."""

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
        self.engine: StageEngine | None = None
        self.metrics: dict[str, Any] = {}  # rank 0: the merged report of the last generate call
        self.stage_metrics: dict[str, Any] = {}  # every rank: its own stage's record
        self._disk: DiskStore | None = None
        self._plan: dict[str, Any] | None = None
        self._monitor: FailureMonitor | None = None
        self._comm: StageComm | None = None
        self._closed = False
        self._ctx = DistContext.init(self.topology, self.device.type, cfg.backend, cfg.dist_timeout)
        with self._guard(close=True):
            if self.world_size > 1:
                # reports an exception to the other ranks, and makes this one exit on theirs
                self._monitor = FailureMonitor(self._ctx).start()
                self._comm = StageComm(self._ctx)
            self.model: LoadedModel = load_model(cfg.model, dummy_weights=cfg.dummy_weights, dtype=self.dtype,
                                                 seed=cfg.seed, load_tokenizer=self.is_driver)
            self.model.source.keep_packed = cfg.gguf_native
            self._planner = RunPlanner(cfg, self.model, self.world_size, self.device, self.dtype)
            # every run reclaims what killed runs left under its offload dir, disk tier or not
            reclaim_stale_dirs(Path(cfg.offload_dir).expanduser())

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
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def on_driver(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and return its result on every rank: how an SPMD script's ranks
        agree on what to do next (e.g. what is left of a job). A failure of ``fn`` is reported
        to the other ranks, which exit naming rank 0, as a failed call's is."""
        self._check_open()
        with self._guard():
            obj = fn() if self.is_driver else None
            if self.world_size == 1:
                return obj
            if self.is_driver:
                for r in range(1, self.world_size):
                    self._comm.send_obj(obj, r)  # type: ignore[union-attr]
                return obj
            return self._comm.recv_obj(0)  # type: ignore[union-attr]

    # --- generation ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
                 sampling: SamplingConfig | None = None, *, keys: Sequence[int] | None = None) -> list[Completion]:
        """Completions of ``prompts`` (strings or token-id lists), in input order.

        ``gen_len`` and ``sampling`` default to the options the LLM was built with. A sampled
        completion depends on the seed and on its prompt's key alone (default: the prompt's
        index in this call): a job split over several calls passes ``keys`` (e.g. the
        prompts' indices in the whole job) to draw what one call would. On ranks other than
        0 the arguments are ignored and the result is empty."""
        return [c for block in self.stream(prompts, gen_len, sampling, keys=keys) for c in block]

    def stream(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
               sampling: SamplingConfig | None = None, *, keys: Sequence[int] | None = None) -> Iterator[list[Completion]]:
        """Like ``generate``, yielding each block's completions as soon as the block finishes.
        Exhaust it (a stream abandoned midway on several ranks fails the other ranks)."""
        self._check_open()
        with self._guard():
            work = self._start(prompts, gen_len, sampling, keys=keys)
            for first, outs in self._run(work):
                yield [self._completion(first + n, work["prompts"][first + n], toks) for n, toks in enumerate(outs)]

    def warmup(self, prompts: Sequence[PromptLike] | None = None, gen_len: int | None = None,
               sampling: SamplingConfig | None = None) -> None:
        """Place the weights for the workload of ``prompts`` (as the first ``generate`` call
        would: the plan and the budget check see this workload), then run one untimed pass:
        the first GPU batch of prompts, cut to 32 tokens, for one token. One-time costs (the
        CUDA context, kernel loading, the allocator's first growth, the native CPU kernels)
        then stay out of the next call's clock, as benchmarks want. Every rank makes the same
        call; ``metrics`` is still the next call's."""
        self._check_open()
        with self._guard():
            work = self._start(prompts, gen_len, sampling)
        short: list[list[int]] | None = None
        if self.is_driver:
            gbs = Policy.from_dict(self._plan["policies"][0]).gpu_batch_size  # type: ignore[index]
            short = [p.ids[:32] for p in work["prompts"][:gbs]]
        self.generate(short, gen_len=1, sampling=SamplingConfig(ignore_eos=True))
        self.metrics, self.stage_metrics = {}, {}

    def score(self, sequences: Sequence[PromptLike] | None = None,
              first_scored: Sequence[int] | None = None, decode_tokens: int = 0) -> list[Score]:
        """Teacher-forced scores of ``sequences`` (strings or token-id lists), in input order.
        Token j of sequence n counts from ``first_scored[n]`` on (default 1: every token that
        has a prefix). The last ``decode_tokens`` tokens of each sequence are predicted by
        decode steps (one token fed per step, attending to the KV cache as generation does:
        this is where ``compress_cache`` and ``attn_sparsity`` act); the others by one
        prefill with the head on every position. On ranks other than 0 the arguments are
        ignored and the result is empty."""
        self._check_open()
        with self._guard():
            work = self._start(sequences, 1, None, scoring=True, first_scored=first_scored,
                               decode_tokens=decode_tokens)
            out: list[Score] = []
            for first, rows in self._run(work):
                out += [Score(first + n, float(r[0]), int(r[1]), int(r[2])) for n, r in enumerate(rows)]
            return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed: build a new one")

    def _start(self, prompts: Sequence[PromptLike] | None, gen_len: int | None,
               sampling: SamplingConfig | None, *, scoring: bool = False,
               first_scored: Sequence[int] | None = None, decode_tokens: int = 0,
               keys: Sequence[int] | None = None) -> dict[str, Any]:
        """Rank 0 checks the workload, plans the stages on the first call, and tells the
        others; every rank then builds (or re-checks) its engine."""
        if self.is_driver:
            work = self._workload(prompts, gen_len, sampling, scoring)
            if keys is not None:
                keys = [int(k) for k in keys]
                if len(keys) != len(work["lens"]):
                    raise ConfigError(f"keys has {len(keys)} entries for {len(work['lens'])} prompts")
                work["keys"] = keys
            if scoring:
                seqs = [p.ids for p in work["prompts"]]
                work["targets"] = score_targets(seqs, first_scored)
                work["lens"], work["gen_len"] = score_split(work["lens"], decode_tokens)
            if self._plan is None:
                work["plan"] = self._planner.plan(work)
            header = {k: v for k, v in work.items() if k != "prompts"}
            for r in range(1, self.world_size):
                self._comm.send_obj(header, r)  # type: ignore[union-attr]
        else:
            work = self._comm.recv_obj(0)  # type: ignore[union-attr]
        if self._plan is None:
            self._plan = work["plan"]
        self._prepare_engine(work)
        return work

    def _workload(self, prompts: Sequence[PromptLike] | None, gen_len: int | None,
                  sampling: SamplingConfig | None, scoring: bool = False) -> dict[str, Any]:
        cfg, spec = self.config, self.model.spec
        what = "score() takes a non-empty list of sequences" if scoring else "generate() takes a non-empty list of prompts"
        if prompts is None or isinstance(prompts, (str, bytes)) or len(prompts) == 0:
            raise ConfigError(f"{what} (strings or token-id lists)")
        gen_len = cfg.gen_len if gen_len is None else int(gen_len)
        if gen_len < 1:
            raise ConfigError(f"gen_len {gen_len}: must be >= 1")
        sampling = sampling or cfg.sampling
        ps: list[Prompt] = [p if isinstance(p, Prompt) else
                            make_prompt(n, p if isinstance(p, str) else None,
                                        None if isinstance(p, str) else list(p), self.tokenizer, spec.vocab_size)
                            for n, p in enumerate(prompts)]
        # a scored sequence generates nothing: it may fill every position
        check_prompt_lengths(ps, 0 if scoring else gen_len, spec.max_positions)
        return {"prompts": ps, "lens": [len(p.ids) for p in ps], "gen_len": gen_len,
                "sampling": dataclasses.asdict(sampling)}

    def _prepare_engine(self, work: dict[str, Any]) -> None:
        """Check this stage's predicted peaks for the workload; build the engine once."""
        plan, rank, spec = self._plan, self.rank, self.model.spec
        assert plan is not None
        policy = Policy.from_dict(plan["policies"][rank])
        lo, hi = plan["ranges"][rank]
        peak = self._planner.peaks(policy, (lo, hi), rank, max(work["lens"]), work["gen_len"], plan["G"],
                                   plan.get("schedule", "sequential"))
        check_budgets(peak, self.config.budgets, stage=rank)
        work["peak"] = peak
        if self.engine is not None:
            return
        try:
            if needs_disk([policy]):
                self._disk = DiskStore(Path(self.config.offload_dir).expanduser(), rank=rank,
                                       direct_io=self.config.direct_io)
                if self._monitor is not None:
                    self._monitor.add_cleanup(self._disk.close)
                self._disk.check_space(peak["disk"])
            self.engine = StageEngine(spec, self.model.source, (lo, hi), has_embed=self.topology.is_first,
                                      has_head=self.topology.is_last, policy=policy, device=self.device,
                                      dtype=self.dtype, disk=self._disk)
        except BaseException:
            if self._disk is not None:  # no half-built stage keeps files
                self._disk.close()
                self._disk = None
            raise
        log.info("stage %d: layers [%d, %d) weights %s", rank, lo, hi, self.engine.describe())
        if self.is_driver:
            self._say_plan()

    def _say_plan(self) -> None:
        plan = self._plan
        assert plan is not None
        where = f"; {self.world_size} stages {[tuple(r) for r in plan['ranges']]}; G={plan['G']}; " \
            f"prefill items per {plan['prefill']}" \
            if self.world_size > 1 else ""
        where += f"; schedule {plan.get('schedule', 'sequential')}"
        print(f"model: {describe(self.model)}{where}", file=sys.stderr)
        for s, d in enumerate(plan["policies"]):
            p = Policy.from_dict(d)
            who = f"stage {s} " if self.world_size > 1 else ""
            print(f"{who}policy: gbs={p.gpu_batch_size} num_gb={p.num_gpu_batches} percent="
                  f"{' '.join(f'{x:g}' for x in p.percent())} cpu_attention={p.cpu_attention} "
                  f"overlap={p.overlap}", file=sys.stderr)

    def _run(self, work: dict[str, Any]) -> Iterator[tuple[int, list[Any]]]:
        """The one loop over this call's blocks: rank 0 gets (first index, per-sequence results)
        of each block; at the end every rank records its stage and rank 0 merges them."""
        engine, plan = self.engine, self._plan
        assert engine is not None and plan is not None
        gen_len, sampling = work["gen_len"], SamplingConfig(**work["sampling"])
        blocks = plan_blocks(work["lens"], engine.policy.block_size)
        pipe = Pipeline(engine, blocks, gen_len=gen_len, sampling=sampling, num_groups=plan["G"], ctx=self._ctx,
                        targets=work.get("targets"), keys=work.get("keys"), prefill=plan.get("prefill", "block"),
                        ride=plan.get("schedule") == "overlapped")
        times0 = engine.times.as_dict()
        read0 = self._disk.bytes_read if self._disk is not None else 0
        prompts: list[Prompt] | None = work.get("prompts")
        bar = progress_bar(len(blocks) * gen_len, self.config.progress and self.is_driver)
        try:
            yield from pipe.run([p.ids for p in prompts] if prompts else None,
                                bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        times = {k: v - times0[k] for k, v in engine.times.as_dict().items()}
        lo, hi = plan["ranges"][self.rank]
        self.stage_metrics = {
            "stage": self.rank, "layers": [lo, hi], "policy": engine.policy.to_dict(),
            "peak_bytes": engine.peak_bytes(), "predicted_peak_bytes": work["peak"], **times,
            "comm_wait_s": pipe.comm_wait_s, "token_steps": pipe.timings.token_steps,
            "prefill_s": pipe.timings.prefill_s, "decode_s": pipe.timings.decode_s,
            **{f"prefill_{k}": v for k, v in pipe.prefill_split.items()},
            "disk_bytes_read": (self._disk.bytes_read - read0) if self._disk is not None else 0,
            "direct_io": None if self._disk is None else self._disk.direct,
            "kernel_policy": gemm.summary(),  # which GEMM forms ran: equal digests, same sums
            "huge_pages": hugepages.status(),  # large host tensors on huge pages (hugepages.py)
        }
        if not self.is_driver:
            self._comm.send_obj(self.stage_metrics, 0)  # type: ignore[union-attr]
            return
        stages = [self.stage_metrics] + [self._comm.recv_obj(r) for r in range(1, self.world_size)]  # type: ignore[union-attr]
        run = {"model": describe(self.model), "device": str(self.device),
               "dtype": str(self.dtype).replace("torch.", ""), "num_prompts": len(work["lens"]),
               "prompt_len": max(work["lens"]), "gen_len": gen_len, "num_micro_batches": plan["G"],
               "prefill_items": plan["prefill"], "schedule": plan.get("schedule", "sequential")}
        self.metrics = merge_metrics(run, pipe.timings, stages, plan["predicted"])

    def _completion(self, index: int, p: Prompt, toks: list[int]) -> Completion:
        text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else None
        return Completion(index, p.ids, toks, text, p.text)

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
                cause = self._monitor.earlier_failure() if self._monitor is not None and \
                    isinstance(e, PeerFailure) else None
                if isinstance(e, GeneratorExit):
                    e = RuntimeError("a stream was abandoned before its end")
                if self._monitor is not None and not (isinstance(e, SystemExit) and e.code in (0, None)):
                    self._monitor.report(e, quiet=True)
                self.close()
                if cause is not None:  # name the rank that failed first, not its echo here
                    raise PeerFailure(cause[1], cause[0]) from None
            elif close:
                self.close()
            raise

    def close(self) -> None:
        """Free the engine, remove this rank's offload files, leave the process group."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._monitor is not None:
                self._monitor.stop()  # rank 0 waits here until its peers are done
        finally:
            for thing in (self.engine, self._disk):
                if thing is not None:
                    thing.close()
            self._ctx.close()

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
