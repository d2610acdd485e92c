"""Side-by-side benchmark: this engine vs transformers' generate() on one workload.

    python -m flexgen_dist.bench.single --num-prompts 32 --prompt-len 128 --gen-len 32 --json out.json

Both run the same synthetic prompts at the same batch size and dtype (``--dtype``, float32 by
default; bfloat16 runs every GEMM on AMX where the CPU has it), greedy. Each is warmed
up on the full workload shape (every prompt, 2 new tokens), so neither pays the first touch of
its large buffers inside the timing; then the two are timed alternately ``--repeats`` times and
the medians compared. The JSON has every timing, both median throughputs, their ratio, and
whether the tokens agree.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..distributed.local import generate
from ..engine.policy import Policy
from ..engine.sampling import SamplingConfig
from ..engine.stage import StageEngine
from ..models.loader import bundled_model_path, load_model


def machine() -> dict[str, Any]:
    return {"cpu": platform.processor() or platform.machine(), "cores": torch.get_num_threads(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def hf_model(model: str | None, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    if model is None or model.endswith(".gguf"):
        p = bundled_model_path() if model is None else Path(model)
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()


def write_json(path: str | Path, data: Any) -> None:
    """A benchmark's results to ``path`` (its folder made)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def run_hf(model: Any, ids: torch.Tensor, gen_len: int, batch: int, pad: int) -> tuple[float, list[list[int]]]:
    """transformers' greedy ``generate`` over ``ids`` in batches of ``batch``: (seconds, tokens)."""
    outs = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for a in range(0, ids.shape[0], batch):
            x = ids[a:a + batch]
            o = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=gen_len,
                               min_new_tokens=gen_len, do_sample=False, pad_token_id=pad)
            outs += o[:, x.shape[1]:].tolist()
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: bundled SmolLM2-135M)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="of weights and compute, for both sides")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each, alternating")
    ap.add_argument("--json", default="bench_results/single.json")
    args = ap.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    lm = load_model(args.model, load_tokenizer=False, dtype=dtype)
    spec = lm.spec
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, spec.vocab_size, (args.num_prompts, args.prompt_len), generator=g)
    prompts = ids.tolist()
    pad = spec.pad_token_id if spec.pad_token_id is not None else 0

    eng = StageEngine(spec, lm.source, (0, spec.num_layers), has_embed=True, has_head=True,
                      policy=Policy(gpu_batch_size=args.batch_size), device=torch.device("cpu"),
                      dtype=dtype)
    model = hf_model(args.model, dtype)
    sc = SamplingConfig(ignore_eos=True)
    generate(eng, prompts, 2, sc)  # warm-up on the full shape
    run_hf(model, ids, 2, args.batch_size, pad)

    t_ours: list[float] = []
    t_hf: list[float] = []
    metrics: list[dict[str, Any]] = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        ours, tm = generate(eng, prompts, args.gen_len, sc)
        t_ours.append(time.perf_counter() - t0)
        metrics.append(tm.metrics())
        t, ref = run_hf(model, ids, args.gen_len, args.batch_size, pad)
        t_hf.append(t)
        print(f"repeat {r + 1}/{args.repeats}: flexgen_dist {t_ours[-1]:.2f} s, transformers {t:.2f} s",
              flush=True)
    eng.close()
    med_ours, med_hf = statistics.median(t_ours), statistics.median(t_hf)

    gen_tokens = args.num_prompts * args.gen_len
    res = {
        "benchmark": "single", "machine": machine(), "model": spec.name,
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                     "gen_len": args.gen_len, "batch_size": args.batch_size, "dtype": args.dtype,
                     "repeats": args.repeats},
        "flexgen_dist": {"total_throughput": gen_tokens / med_ours, "wall_s": t_ours,
                         "per_repeat": metrics},
        "transformers": {"total_throughput": gen_tokens / med_hf, "wall_s": t_hf},
        "ratio": med_hf / med_ours,
        "tokens_match": ours == ref,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(f"flexgen_dist {res['flexgen_dist']['total_throughput']:.1f} tok/s | transformers "
          f"{res['transformers']['total_throughput']:.1f} tok/s | ratio {res['ratio']:.2f}x | "
          f"tokens match: {res['tokens_match']}  -> {args.json}")
    return res


if __name__ == "__main__":
    main()
