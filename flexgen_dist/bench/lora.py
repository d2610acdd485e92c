"""What LoRA adapters cost: merged for a whole call (``--lora``) against served per request
(``--lora-modules``), side by side in one run.

    python -m flexgen_dist.bench.lora --json bench_results/lora.json

The bundled SmolLM2-135M (or ``--model``, ``--dummy-weights`` for a registry shape) gets ``--adapters`` random adapters of rank ``--rank`` on every linear
layer of attention and the MLP (PEFT's saved format), then the same greedy job (``--prompts`` x
``--prompt-len``, ``--gen-len`` new, bfloat16, weights on the compute device) runs: on the base
model; with one adapter merged; with that adapter named by every request; and with the
requests spread over all the adapters (every GPU batch mixes them). Each mode also runs under
``--compress-weight`` (4-bit base; the stacks stay in the run's dtype). Reports prefill,
decode and total throughput and the weights' bytes, and (the bundled model) ``eval ppl`` of
the base model, the adapter merged and served, in float32 and bfloat16; never asserts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .single import machine, write_json

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def random_adapter(path: Path, spec: Any, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of a Llama-family ``spec`` at ``path``: rank ``rank`` on every linear
    layer of attention and the MLP, A and B random (B small, as a trained one's update is)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, f, q, kv = spec.hidden_size, spec.ffn_size, spec.q_dim, spec.kv_dim
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    out = {}
    for j in range(spec.num_layers):
        for m in MODULES:
            o, i = shapes[m]
            name = f"base_model.model.model.layers.{j}.{m}"
            out[f"{name}.lora_A.weight"] = torch.randn(rank, i, generator=g) / i ** 0.5
            out[f"{name}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": sorted({m.split(".")[1] for m in MODULES})}))


def timed(model: str | None, opts: dict[str, Any], lora: Any, ids: list[list[int]], gen_len: int,
          gbs: int) -> dict[str, Any]:
    from .. import LLM

    with LLM(model, dtype="bfloat16", percent=(100, 0, 100, 0, 100, 0), gpu_batch_size=gbs,
             num_gpu_batches=max(1, len(ids) // gbs), ignore_eos=True, progress=False, **opts) as llm:
        llm.generate(ids[:2], gen_len=2, lora=None if isinstance(lora, list) or lora is None else lora)  # warm-up
        llm.generate(ids, gen_len=gen_len, lora=lora)
        m, stored = llm.metrics, llm.engine.weights.bytes_per_tier()
    keys = ("prefill_throughput", "decode_throughput", "total_throughput")
    return {**{k: m.get(k) for k in keys}, "weight_bytes": sum(stored.values())}


def perplexities(model: str | None, merged: Path, served: dict[str, Any]) -> list[dict[str, Any]]:
    """``eval ppl`` (the bundled English sample, 4 windows of 512) in bfloat16 and float32: the
    base model, adapter a0 merged, and a0 served per request (the same function, rounded
    differently: merged rounds W + B A once; served adds the two products' rounded outputs)."""
    from .. import LLM
    from ..eval import evaluate

    out = []
    for dtype in ("float32", "bfloat16"):
        for name, opts, lora in (("base model", {}, None), ("a0 merged (--lora)", {"lora": str(merged)}, None),
                                 ("a0 per request (--lora-modules)", served, "a0")):
            with LLM(model, dtype=dtype, progress=False, **opts) as llm:
                res = evaluate(llm, window=512, max_windows=4, lora=lora)
            assert res is not None
            out.append({"mode": name, "dtype": dtype, "ppl": res["ppl"], "accuracy": res["accuracy"]})
            print(f"eval ppl {dtype:<9} {name:<35} {res['ppl']:.4f}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a Llama-family model (default: the bundled SmolLM2-135M)")
    ap.add_argument("--dummy-weights", action="store_true", help="random weights for a registry shape")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--gpu-batch-size", type=int, default=16)
    ap.add_argument("--json", default="bench_results/lora.json")
    args = ap.parse_args(argv)
    from ..models.loader import load_model

    spec = load_model(args.model, dummy_weights=args.dummy_weights, load_tokenizer=False).spec
    torch.manual_seed(0)
    ids = torch.randint(min(100, spec.vocab_size // 4), spec.vocab_size, (args.prompts, args.prompt_len)).tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / f"a{n}" for n in range(args.adapters)]
        for n, d in enumerate(dirs):
            random_adapter(d, spec, args.rank, seed=n)
        served = {"lora_modules": {f"a{n}": str(d) for n, d in enumerate(dirs)}}
        spread = [f"a{n % args.adapters}" for n in range(args.prompts)]
        for compress in (False, True):
            extra = {"compress_weight": True} if compress else {}
            modes = [("base model", {}, None), ("one adapter merged (--lora)", {"lora": str(dirs[0])}, None),
                     ("one adapter per request, every request a0", served, "a0"),
                     (f"{args.adapters} adapters per request, spread over each batch", served, spread)]
            for name, opts, lora in modes:
                r = timed(args.model, {**opts, **extra, "dummy_weights": args.dummy_weights}, lora, ids, args.gen_len,
                          args.gpu_batch_size)
                rows.append({"mode": name, "compress_weight": compress, **r})
                print(f"{name:<55} {'4-bit' if compress else 'bf16 '} prefill {r['prefill_throughput']:8.1f} "
                      f"decode {r['decode_throughput']:7.1f} total {r['total_throughput']:7.1f} tok/s, "
                      f"weights {r['weight_bytes'] / 1e6:.1f} MB", file=sys.stderr)
        ppl = perplexities(args.model, dirs[0], served) if args.model is None else []
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows, "ppl": ppl})
    return 0


if __name__ == "__main__":
    sys.exit(main())
