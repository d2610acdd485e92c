"""Embeddings side by side: this engine's ``LLM.embed`` against transformers' forward pass
(``last_hidden_state[:, -1]``, the batch left-padded, no gradient) on the same inputs.

    python -m flexgen_dist.bench.embeddings --json bench_results/embeddings.json

The bundled SmolLM2-135M as a Hugging Face directory (its GGUF's values), ``--inputs`` random
inputs of ``--input-len`` tokens, in float32 and bfloat16: input tokens per second of each
(after one untimed call each), the largest difference between their normalized vectors, and
each one's least cosine similarity to transformers' float32 vectors.
The engine also runs with every weight on disk (what a model larger than memory does).
Reports, never asserts.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from .int_checkpoints import export_hf
from .single import machine, write_json


def left_padded_batches(ids: list[list[int]], batch: int, pad: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask) of each batch of ``ids``, left-padded with ``pad``."""
    for a in range(0, len(ids), batch):
        rows = ids[a:a + batch]
        s = max(map(len, rows))
        yield (torch.tensor([[pad] * (s - len(r)) + r for r in rows]),
               torch.tensor([[0] * (s - len(r)) + [1] * len(r) for r in rows]))


def bundled_hf(tmp: str) -> Path:
    """The bundled SmolLM2-135M written as a Hugging Face directory under ``tmp`` (its GGUF's values)."""
    hf = Path(tmp) / "hf"
    hf.mkdir()
    export_hf(hf)
    return hf


def hf_vectors(model: Any, ids: list[list[int]], batch: int, pad: int) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model.base_model(input_ids=x, attention_mask=mask).last_hidden_state[:, -1].float()
                          for x, mask in left_padded_batches(ids, batch, pad)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32, help="transformers' batch and the engine's GPU batch")
    ap.add_argument("--json", default="bench_results/embeddings.json")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from .. import LLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = bundled_hf(tmp)
        torch.manual_seed(0)
        ids = torch.randint(100, 40000, (args.inputs, args.input_len)).tolist()
        tokens = args.inputs * args.input_len
        exact: torch.Tensor | None = None  # transformers' float32 vectors: what bfloat16 is measured against

        def cos(v: torch.Tensor) -> float:  # the least cosine similarity to the float32 vectors
            assert exact is not None
            return float(torch.nn.functional.cosine_similarity(v, exact, dim=-1).min())

        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).replace("torch.", "")
            model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).eval()
            hf_vectors(model, ids[:args.batch], args.batch, 0)  # warm-up
            t0 = time.perf_counter()
            ref = hf_vectors(model, ids, args.batch, 0)
            hf_s = time.perf_counter() - t0
            del model
            exact = ref if exact is None else exact
            res: dict[str, Any] = {"dtype": name, "transformers_tok_s": tokens / hf_s,
                                   "transformers_min_cosine_to_float32": cos(ref)}
            for where, pct in (("weights on the compute device", (100, 0, 100, 0, 100, 0)),
                               ("every weight on disk", (0, 0, 100, 0, 100, 0))):
                with LLM(str(hf), dtype=name, percent=pct, gpu_batch_size=args.batch, num_gpu_batches=1,
                         offload_dir=str(Path(tmp) / "off"), progress=False) as llm:
                    llm.embed(ids[:args.batch])  # warm-up: the kernels, the read buffers
                    t0 = time.perf_counter()
                    got = llm.embed(ids, normalize=False)
                    s = time.perf_counter() - t0
                vec = torch.tensor([e.embedding for e in got])
                diff = (torch.nn.functional.normalize(vec, dim=-1) - torch.nn.functional.normalize(ref, dim=-1))
                res[where] = {"tok_s": tokens / s, "max_abs_diff_normalized": float(diff.abs().max()),
                              "min_cosine_to_float32": cos(vec)}
                print(f"{name:<9} {where:<32} {tokens / s:9.1f} tok/s (transformers {tokens / hf_s:9.1f}); "
                      f"max |diff| of normalized vectors {float(diff.abs().max()):.2e}; least cosine to float32 "
                      f"{cos(vec):.5f} (transformers {cos(ref):.5f})", file=sys.stderr)
            rows.append(res)
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
