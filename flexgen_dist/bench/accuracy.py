"""Accuracy of each compression and sparsity mode, through the engine that runs it, in one run.

    python -m flexgen_dist.bench.accuracy --json bench_results/accuracy.json

Three tables, printed as markdown and written to the JSON:

1. **Weights** (``eval ppl``, every token scored in prefill): the same windows of the same
   text with the same model (default: the bundled SmolLM2 on the bundled English sample) in
   float32 (the GGUF's dequantized values), with the GGUF's own 4-bit blocks kept compressed,
   and re-quantized by the engine's group-wise quantizer at several group sizes, bit widths
   and grouping dims. The engine groups along dim 1 (the input dim); dim 0 (the layout
   before) is measured by quantizing and dequantizing the weights along dim 0 before an
   uncompressed engine runs them, which yields exactly the values that layout would expand to.
2. **KV cache and attention** (``eval ppl --decode-tokens``): the last ``--decode-tokens``
   tokens of each window are predicted by teacher-forced decode steps over the KV cache, the
   rest of the window being context, so ``--compress-cache`` and ``--attn-sparsity`` (which
   act on decode attention) are measured as generation sees them.
3. **Relative logit error** on random OPT and LLaMA shapes (transformers' own random
   initialisation): ``||logits - logits_fp32|| / ||logits_fp32||`` at the prefill step and
   averaged over forced decode steps, and the decode steps' top-1 agreement with float32.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..api import LLM
from ..engine.blocks import left_pad, pad_token, plan_blocks
from ..engine.policy import Policy
from ..engine.stage import StageEngine
from ..eval import evaluate
from ..memory.quant import dequantize, quantize
from ..models.loader import load_model
from ..models.source import WeightSource
from .single import machine

WEIGHT_MODES: list[tuple[str, dict[str, Any]]] = [
    ("float32 (GGUF values expanded)", {}),
    ("4-bit, the GGUF's own blocks (native, `--compress-weight`)", {"compress_weight": True}),
    ("4-bit re-quantized, dim 1, group 32", {"compress_weight": True, "gguf_native": False, "comp_group_size": 32}),
    ("4-bit re-quantized, dim 1, group 64 (default)", {"compress_weight": True, "gguf_native": False}),
    ("4-bit re-quantized, dim 1, group 128", {"compress_weight": True, "gguf_native": False,
                                              "comp_group_size": 128}),
    ("4-bit re-quantized, dim 0, group 32 (the layout before)", {"fake_quant": (4, 32, 0)}),
    ("4-bit re-quantized, dim 0, group 64 (the layout before)", {"fake_quant": (4, 64, 0)}),
    ("8-bit re-quantized, dim 1, group 64", {"compress_weight": True, "gguf_native": False, "comp_bits": 8}),
]
DECODE_MODES: list[tuple[str, dict[str, Any]]] = [
    ("float32, dense attention", {}),
    ("4-bit KV cache (`--compress-cache`)", {"compress_cache": True}),
    ("4-bit native weights + 4-bit KV cache", {"compress_weight": True, "compress_cache": True}),
    ("`--attn-sparsity 0.5`", {"attn_sparsity": 0.5}),
    ("`--attn-sparsity 0.2`", {"attn_sparsity": 0.2}),
    ("`--attn-sparsity 0.1`", {"attn_sparsity": 0.1}),
]
LOGIT_MODES: list[tuple[str, dict[str, Any]]] = [
    ("4-bit weights, dim 1, group 32", {"compress_weight": True, "comp_group_size": 32}),
    ("4-bit weights, dim 1, group 64 (default)", {"compress_weight": True}),
    ("4-bit weights, dim 1, group 128", {"compress_weight": True, "comp_group_size": 128}),
    ("4-bit weights, dim 0, group 64 (the layout before)", {"fake_quant": (4, 64, 0)}),
    ("4-bit KV cache", {"compress_cache": True}),
    ("4-bit weights + KV cache", {"compress_weight": True, "compress_cache": True}),
    ("attention sparsity 0.5", {"attn_sparsity": 0.5}),
    ("attention sparsity 0.2", {"attn_sparsity": 0.2}),
    ("attention sparsity 0.1", {"attn_sparsity": 0.1}),
]


class FakeQuantSource(WeightSource):
    """Another source's weights, each matrix quantized and dequantized along ``dim``: what an
    engine that stored them that way would compute with."""

    def __init__(self, inner: WeightSource, bits: int, group_size: int, dim: int) -> None:
        super().__init__(inner.spec, inner.dtype)
        self.inner, self.bits, self.group_size, self.dim = inner, bits, group_size, dim

    def _read(self, part: str, layer: int | None) -> dict[str, torch.Tensor]:
        return {k: dequantize(quantize(v, self.bits, self.group_size, self.dim)) if v.dim() == 2 else v
                for k, v in self.inner.get(part, layer).items()}

    def close(self) -> None:
        self.inner.close()


def _llm(model: str | None, dummy: bool, opts: dict[str, Any]) -> LLM:
    opts = dict(opts)
    fake = opts.pop("fake_quant", None)
    llm = LLM(model, dummy_weights=dummy, progress=False, **opts)
    if fake is not None:  # the engine is built at the first call, from this source
        llm.model.source = FakeQuantSource(llm.model.source, *fake)
    return llm


def ppl_rows(model: str | None, dummy: bool, modes: list[tuple[str, dict[str, Any]]],
             ev: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, opts in modes:
        with _llm(model, dummy, opts) as llm:
            res = evaluate(llm, **ev)
        assert res is not None
        rows.append({"mode": name, "options": {k: list(v) if isinstance(v, tuple) else v for k, v in opts.items()},
                     "ppl": res["ppl"], "accuracy": res["accuracy"], "tokens_scored": res["tokens_scored"],
                     "decode_tokens": res["decode_tokens"],
                     "weight_bytes": sum(res["peak_bytes"][0][t] for t in ("gpu", "cpu", "disk"))})
        print(f"{name}: ppl {res['ppl']:.4f}, accuracy {100 * res['accuracy']:.2f} %", flush=True)
    for r in rows:
        r["ppl_change"] = r["ppl"] / rows[0]["ppl"] - 1
    return rows


def random_model(family: str, path: Path, hidden: int = 768) -> Path:
    """A transformers model of a small but real shape (heads of 64) with its library's random
    initialisation."""
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    if family == "opt":
        m = OPTForCausalLM(OPTConfig(vocab_size=2048, hidden_size=hidden, ffn_dim=4 * hidden, num_hidden_layers=4,
                                     num_attention_heads=heads, max_position_embeddings=512, pad_token_id=1,
                                     bos_token_id=2, eos_token_id=2))
    else:
        m = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=8 * hidden // 3,
                                         num_hidden_layers=4, num_attention_heads=heads,
                                         num_key_value_heads=max(1, heads // 3), max_position_embeddings=512,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2))
    m.save_pretrained(path)
    return path


def step_logits(path: Path, opts: dict[str, Any], prompts: list[list[int]], forced: torch.Tensor | None,
                steps: int) -> list[torch.Tensor]:
    """Float32 logits of one block at the prefill and each decode step; the decode inputs are
    ``forced`` (b, steps - 1) when given, else the greedy tokens (the reference run)."""
    opts = dict(opts)
    fake = opts.pop("fake_quant", None)
    lm = load_model(str(path), load_tokenizer=False)
    source = FakeQuantSource(lm.source, *fake) if fake is not None else lm.source
    pol = Policy(len(prompts), 1, 100, 0, 100, 0, 100, 0, **opts)
    eng = StageEngine(lm.spec, source, (0, lm.spec.num_layers), has_embed=True, has_head=True, policy=pol,
                      device=torch.device("cpu"), dtype=torch.float32)
    blk = plan_blocks([len(p) for p in prompts], pol.block_size)[0]
    st = eng.new_block(blk.meta(pol.gpu_batch_size, steps))
    x = left_pad(prompts, blk.prompt_len, pad_token(lm.spec.pad_token_id, lm.spec.eos_token_ids))
    out = []
    try:
        for i in range(steps):
            lg = eng.run_token(st, i, [x])[0].float()
            out.append(lg)
            x = (forced[:, i:i + 1] if forced is not None and i < forced.shape[1] else lg.argmax(-1, keepdim=True))
    finally:
        eng.free_block(st)
        eng.close()
    return out


def logit_rows(workdir: Path, hidden: int = 768, steps: int = 17) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 2048, (4, 128), generator=g).tolist()
    rows = []
    for family in ("opt", "llama"):
        path = random_model(family, workdir / family, hidden)
        ref = step_logits(path, {}, prompts, None, steps)
        forced = torch.stack([lg.argmax(-1) for lg in ref[:-1]], 1)  # the reference run's own tokens
        for name, opts in LOGIT_MODES:
            got = step_logits(path, opts, prompts, forced, steps)
            rel = [float((a - b).norm() / b.norm()) for a, b in zip(got, ref)]
            agree = float(torch.stack([(a.argmax(-1) == b.argmax(-1)).float().mean()
                                       for a, b in zip(got[1:], ref[1:])]).mean())
            rows.append({"family": family, "mode": name, "prefill_rel_error": rel[0],
                         "decode_rel_error": sum(rel[1:]) / len(rel[1:]), "decode_top1_agreement": agree})
            print(f"{family} {name}: prefill {rel[0]:.2e}, decode {rows[-1]['decode_rel_error']:.2e}, "
                  f"top-1 {100 * agree:.1f} %", flush=True)
    return rows


def _ppl_table(rows: list[dict[str, Any]]) -> str:
    out = ["| mode | perplexity | vs float32 | next-token accuracy |", "|---|---|---|---|"]
    out += [f"| {r['mode']} | {r['ppl']:.4f} | {100 * r['ppl_change']:+.2f} % | {100 * r['accuracy']:.2f} % |"
            for r in rows]
    return "\n".join(out)


def _logit_table(rows: list[dict[str, Any]]) -> str:
    out = ["| shape | mode | prefill rel. error | decode rel. error | decode top-1 = fp32 |", "|---|---|---|---|---|"]
    out += [f"| {r['family']} | {r['mode']} | {r['prefill_rel_error']:.2e} | {r['decode_rel_error']:.2e} | "
            f"{100 * r['decode_top1_agreement']:.1f} % |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--text", default=None, help="default: the bundled English sample")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=128, help="of each window, for the KV-cache table")
    ap.add_argument("--skip-logits", action="store_true", help="leave out the random-shape logit table")
    ap.add_argument("--logit-hidden", type=int, default=768, help="hidden size of the random shapes")
    ap.add_argument("--json", default="bench_results/accuracy.json")
    args = ap.parse_args(argv)
    ev = {"text": args.text, "window": args.window, "max_windows": args.max_windows}
    weights = ppl_rows(args.model, args.dummy_weights, WEIGHT_MODES, ev)
    decode = ppl_rows(args.model, args.dummy_weights, DECODE_MODES, {**ev, "decode_tokens": args.decode_tokens})
    logits: list[dict[str, Any]] = []
    if not args.skip_logits:
        with tempfile.TemporaryDirectory(prefix="fg-acc-") as d:
            logits = logit_rows(Path(d), args.logit_hidden)
    out = {"benchmark": "accuracy", "machine": machine(), "model": args.model or "bundled SmolLM2-135M-Instruct",
           "text": args.text or "bundled English sample", "window": args.window,
           "decode_tokens": args.decode_tokens, "weights": weights, "decode": decode, "logits": logits}
    print("\n" + _ppl_table(weights) + "\n\n" + _ppl_table(decode))
    if logits:
        print("\n" + _logit_table(logits))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
