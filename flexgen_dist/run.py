"""Entry point: ``python -m flexgen_dist.run`` (bare, or under torchrun, mpirun or srun).

A thin shell over the API: parse, build an ``LLM``, generate, write outputs and metrics,
always clean up. User errors end with one line on stderr and exit code 1 (2 for bad flags);
outputs already produced stay on disk, durable block by block, and ``--resume`` finishes an
interrupted job (output.py). Nothing in the package imports this module.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Iterator

from .api import LLM
from .beam_calls import BeamOutput
from .config import ConfigError, RunConfig
from .embeddings import Classification, Embedding
from .flags import parse_config
from .errors import exit_code_of
from .memory.tiers import MemoryBudgetError
from .metrics import summary
from .output import OutputWriter, check_writable
from .prompts import Prompt, read_prompts, truncated


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="flexgen_dist: %(message)s", stream=sys.stderr)
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return exit_code_of(lambda: run(cfg))


def run(cfg: RunConfig) -> int:
    """Generate for the run's prompts; rank 0 writes outputs as blocks finish, then the report."""
    for flag, path in (("--output", cfg.output), ("--metrics", cfg.metrics)):
        check_writable(flag, path)  # before the model loads, not after the generation
    with LLM(config=cfg) as llm:
        prompts: list[Prompt] | None = None
        writer: OutputWriter | None = None

        def prepare() -> int:
            """Rank 0: read the prompts, check the output against them; the number left."""
            nonlocal prompts, writer
            prompts = _read(cfg, llm)
            writer = OutputWriter(cfg.output, llm.tokenizer, resume=cfg.resume, overwrite=cfg.overwrite)
            done = writer.start(prompts, fingerprint(cfg, llm))
            if done:
                print(f"resuming: {done} of {len(prompts)} prompts already in {cfg.output}", file=sys.stderr)
            return len(prompts) - done

        if cfg.explain:  # the plan only: no output is touched, nothing is placed
            return _explain(llm, _read(cfg, llm) if llm.is_driver else None)
        left = llm.on_driver(prepare)  # every rank learns what rank 0 found
        done = writer.done if writer is not None else 0
        records: list[dict[str, Any]] = []
        try:
            if left:
                todo = prompts[done:] if prompts is not None else None
                if cfg.beam_width and llm.is_driver:  # the plan's GPU batch holds whole prompts' beams
                    llm.gpu_batch_unit = cfg.beam_width
                if cfg.warmup:
                    llm.warmup(todo)
                lora = [p.lora for p in todo] if todo is not None and any(p.lora for p in todo) else None
                for part in _results(cfg, llm, todo, done, len(prompts) if prompts is not None else 0, lora):
                    if writer is not None:
                        recs = [_record(writer, todo[rs[0].index], *rs)  # type: ignore[index]
                                for rs in (part[a:a + cfg.n] for a in range(0, len(part), cfg.n))]
                        writer.write(recs)
                        records.extend(recs)
        finally:
            if writer is not None:
                writer.close()
        if not left:
            if llm.is_driver:
                print(f"nothing to do: all {done} prompts are already in {cfg.output}")
            return 0
        if cfg.metrics and llm.world_size > 1:
            _write_json(_rank_path(cfg.metrics, llm.rank), llm.stage_metrics)
        if llm.is_driver:
            assert prompts is not None
            _report(cfg, records, {**llm.metrics, "job_prompts": len(prompts), "resumed_prompts": done})
    return 0


def _read(cfg: RunConfig, llm: LLM) -> list[Prompt]:
    """Rank 0: the job's prompts, each cut as ``--truncate-prompt-tokens`` says."""
    prompts = read_prompts(cfg.prompts, cfg.num_prompts, cfg.prompt_len, llm.tokenizer, llm.model.spec.vocab_size,
                           cfg.seed, cfg.template_kwargs)
    room = llm.model.spec.max_positions - (0 if cfg.embed or cfg.classify else cfg.gen_len)
    return [truncated(p, cfg.truncate_prompt_tokens, room) for p in prompts]


def _results(cfg: RunConfig, llm: LLM, todo: list[Prompt] | None, done: int, total: int,
             lora: list[str | None] | None) -> Iterator[list[Any]]:
    """The job's results a window at a time: embeddings (``--embed``), a classifier's logits
    (``--classify``) or completions (each prompt's sampling key its index in the job: a resumed
    job draws the same)."""
    if cfg.embed:
        return llm.stream_embed(todo, dimensions=cfg.embed_dimensions, lora=lora)
    if cfg.classify:
        return llm.stream_classify(todo, lora=lora)
    if cfg.beams is not None:
        b = cfg.beams
        return llm.stream_beam_search(todo, b.width, cfg.gen_len, length_penalty=b.length_penalty,
                                      early_stopping=b.early_stopping, num_return_sequences=b.num_return or None,
                                      lora=lora)
    return llm.stream(todo, keys=None if todo is None else range(done, total), lora=lora, n=cfg.n,
                      best_of=cfg.best_of)


def _record(writer: OutputWriter, p: Prompt, r: Any, *more: Any) -> dict[str, Any]:
    """A result's output line: an embedding, a classifier's logits, or a completion (``more``:
    the prompt's other choices, all of them then under "choices", the first also the line's)."""
    if more:
        rec = _record(writer, p, r)
        rec["choices"] = [{k: v for k, v in writer.record(p, c.token_ids, c.text, c.logprobs, c.reasoning).items()
                           if k not in ("id", "messages", "prompt")} for c in (r, *more)]
        return rec
    if isinstance(r, Embedding):
        return {"id": p.id, "embedding": r.embedding, "prompt_tokens": r.prompt_tokens}
    if isinstance(r, Classification):
        return {"id": p.id, "logits": r.logits, "probs": r.probs, "label": r.label, "prompt_tokens": r.prompt_tokens}
    if isinstance(r, BeamOutput):  # the best hypothesis as the line, every one returned under "beams"
        best = r.sequences[0]
        rec = {**writer.record(p, best.token_ids, best.text, None, best.reasoning), "score": best.score}
        if len(r.sequences) > 1:
            rec["beams"] = [{k: v for k, v in (("text", c.text), ("tokens", c.token_ids), ("score", c.score))
                             if v is not None} for c in r.sequences]
        return rec
    return writer.record(p, r.token_ids, r.text, r.logprobs, r.reasoning)


def _explain(llm: LLM, prompts: list[Prompt] | None) -> int:
    """--explain: rank 0 prints the plan and each stage's budget verdict; nothing is placed."""
    if not llm.is_driver or not prompts:
        return 0
    plan = llm.explain(prompts)
    assert plan is not None
    print(plan.explain())
    try:
        llm.check_plan(plan, prompts)
    except MemoryBudgetError as e:
        print(f"does not fit: {e}")
        return 1
    print("fits the memory budgets")
    return 0


def fingerprint(cfg: RunConfig, llm: LLM) -> dict[str, Any]:
    """What determines the output lines (not the policy or the ranks, which may change)."""
    model = cfg.model or "(bundled)"
    if Path(model).expanduser().exists():
        model = os.path.realpath(Path(model).expanduser())
    return {"model": model, "model_name": llm.model.spec.name, "dummy_weights": cfg.dummy_weights, "dtype": str(llm.dtype),
            "gen_len": cfg.gen_len, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
            "ignore_eos": cfg.ignore_eos, **({"dummy_fill": cfg.dummy_fill} if cfg.dummy_fill != "random" else {}),
            **({"logprobs": cfg.logprobs} if cfg.logprobs is not None else {}),
            **{k: getattr(cfg, k) for k in ("frequency_penalty", "presence_penalty", "top_k", "min_p") if getattr(cfg, k)},
            **{k: list(getattr(cfg, k)) for k in ("stop_token_ids", "bad_words") if getattr(cfg, k)},
            **({"min_tokens": cfg.min_tokens} if cfg.min_tokens else {}),
            **({"repetition_penalty": cfg.repetition_penalty} if cfg.repetition_penalty != 1.0 else {}),
            **({"embed": True, "embed_dimensions": cfg.embed_dimensions} if cfg.embed else {}),
            **({"classify": True} if cfg.classify else {}),
            **({"beams": dataclasses.asdict(cfg.beams)} if cfg.beams is not None else {}),
            **({"n": cfg.n, "best_of": cfg.best_of or cfg.n} if cfg.n != 1 or cfg.best_of is not None else {}),
            **cfg.model_options(), **_structure_print(cfg)}


def _structure_print(cfg: RunConfig) -> dict[str, Any]:
    """The structure every completion follows, as the job's fingerprint records it (its text,
    not a file's path: an edited schema file is another job)."""
    st = cfg.sampling.structure
    return {} if st is None else {"structure": {"kind": st.kind, "value": st.value}}


def _rank_path(path: str, rank: int) -> Path:
    p = Path(path).expanduser()
    return p.with_name(p.stem + f".rank{rank}.json")


def _write_json(path: str | Path, data: dict[str, Any]) -> None:
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=str) + "\n")


def _report(cfg: RunConfig, records: list[dict[str, Any]], metrics: dict[str, Any]) -> None:
    for r in records[: cfg.print_outputs]:
        head = r["messages"][-1]["content"] if r.get("messages") else r.get("prompt")
        body = (f"{len(r['embedding'])} values {r['embedding'][:3]}..." if "embedding" in r else
                f"{r['label']} (logits {[round(x, 4) for x in r['logits']]})" if "label" in r else
                r.get("text") if "text" in r else str(r["tokens"]))
        print(f"[{r['id']}] {head!r} -> {body!r}" if head is not None else f"[{r['id']}] -> {body}")
    if len(records) > cfg.print_outputs:
        more = f" (all in {cfg.output})" if cfg.output else " (use --output FILE for all)"
        print(f"... {len(records) - cfg.print_outputs} more{more}")
    print(summary(metrics))
    if cfg.metrics:
        _write_json(cfg.metrics, metrics)


if __name__ == "__main__":
    sys.exit(main())
