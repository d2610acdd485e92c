"""The other systems the GPU suite (``bench.gpu_suite``) measures this engine against, and
the ``Case`` all of them run: the FlexGen package (its command line, its benchmark log, the
tokenizer it asks the model hub for) and Hugging Face accelerate (run here, one case per
process: ``python -m flexgen_dist.bench.gpu_baselines accelerate CASE_JSON METRICS``)."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    """One comparison: a model and one policy, run by both systems."""

    name: str
    model: str  # registry shape; FlexGen's name is facebook/<model>
    percent: tuple[int, int, int, int, int, int]
    gpu_batch_size: int
    num_gpu_batches: int
    cpu_attention: bool = False  # FlexGen's --cpu-cache-compute
    compress_weight: bool = False
    compress_cache: bool = False
    prompt_len: int = 512
    gen_len: int = 32
    pin_weight: bool = True  # FlexGen's --pin-weight (its 175B policies turn it off)
    note: str = ""
    budgets: dict[str, str] = field(default_factory=dict)  # --gpu-mem/--cpu-mem for --policy auto

    @property
    def num_prompts(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches


# --- FlexGen ---------------------------------------------------------------------------------
def flexgen_command(case: Case, offload: Path, log: Path) -> list[str]:
    cmd = [sys.executable, "-m", "flexgen.flex_opt", "--model", f"facebook/{case.model}", "--path", "_DUMMY_",
           "--offload-dir", str(offload), "--prompt-len", str(case.prompt_len), "--gen-len", str(case.gen_len),
           "--gpu-batch-size", str(case.gpu_batch_size), "--num-gpu-batches", str(case.num_gpu_batches),
           "--percent", *map(str, case.percent), "--pin-weight", str(case.pin_weight),
           "--log-file", str(log)]
    if case.cpu_attention:
        cmd.append("--cpu-cache-compute")
    if case.compress_weight:
        cmd.append("--compress-weight")
    if case.compress_cache:
        cmd.append("--compress-cache")
    return cmd


FLEXGEN_KEYS = {"prefill throughput": "prefill_throughput", "decode throughput": "decode_throughput",
                "total throughput": "total_throughput", "prefill latency": "prefill_time_s",
                "decode latency": "decode_time_s", "peak gpu mem": "peak_gpu_gb"}


def parse_flexgen_log(text: str) -> dict[str, float]:
    """The figures of FlexGen's benchmark log (``write_benchmark_log``); the last run's."""
    out: dict[str, float] = {}
    for key, name in FLEXGEN_KEYS.items():
        found = re.findall(rf"{key}: ([0-9.eE+-]+)", text)
        if found:
            out[name] = float(found[-1])
    if "projected: True" in text:
        out["projected"] = 1.0
    return out


# --- the tokenizer FlexGen asks the hub for -------------------------------------------------
def opt_tokenizer_standin(hf_home: Path, repo: str = "facebook/opt-30b") -> Path:
    """An OPT-compatible tokenizer in an offline Hugging Face cache under ``hf_home``, so that
    ``AutoTokenizer.from_pretrained(repo)`` works with ``HF_HOME=hf_home HF_HUB_OFFLINE=1``:
    byte-level BPE over the 256 byte symbols, OPT's special tokens at OPT's ids (<s> 0,
    <pad> 1, </s> 2, <unk> 3), </s> as BOS as OPT has it. Returns the snapshot directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    commit = "0" * 40
    base = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(snap))
    (snap / "config.json").write_text(json.dumps({"model_type": "opt", "vocab_size": 50272}) + "\n")
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(commit)
    return snap


# --- accelerate ------------------------------------------------------------------------------
def accelerate_command(case: Case, metrics: Path, device: str = "cuda", dtype: str = "float16") -> list[str]:
    """One accelerate run in a process of its own (its memory is the process's)."""
    return [sys.executable, "-m", "flexgen_dist.bench.gpu_baselines", "accelerate", json.dumps(asdict(case)),
            str(metrics), "--device", device, "--dtype", dtype]


class _FirstToken:
    """A ``generate`` streamer that notes when the first new token arrives: the prompt comes
    first (``put``), then each generated token, so prefill and decode are timed in one call
    (two calls timed apart left noise that could exceed a short decode)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.puts, self.first = cuda, 0, None

    def put(self, value: Any) -> None:
        import torch

        self.puts += 1
        if self.puts == 2:  # the first generated token
            if self.cuda:
                torch.cuda.synchronize()
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def accelerate_baseline(case: Case, device: str, dtype_name: str) -> dict[str, Any]:
    """Hugging Face accelerate at the case's budget: the case's share of the weight bytes on
    the device (``percent[0]``), the rest in RAM behind accelerate's offload hooks (moved to
    the device for each forward), ``generate`` over the prompts in batches of the case's GPU
    batch size. Every weight 1, as FlexGen's dummy weights and this engine's ``--dummy-fill
    ones`` (a GPU multiplies constant data faster than random data, so all three get the same
    values). Each batch's one ``generate`` is split where its first new token arrives (a
    streamer notes the time): prefill before, decode after. Cases with weights on disk are not
    run."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import OPTConfig, OPTForCausalLM

    from ..models.registry import get_spec

    if case.percent[0] + case.percent[1] < 100:
        raise SystemExit(f"{case.name}: weights on disk; the accelerate baseline runs GPU/CPU placements only")
    spec = get_spec(case.model)
    dtype = getattr(torch, dtype_name)
    cfg = OPTConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, ffn_dim=spec.ffn_size,
                    num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                    max_position_embeddings=spec.max_positions, do_layer_norm_before=spec.pre_layer_norm,
                    word_embed_proj_dim=spec.embed_dim, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    with init_empty_weights():
        model = OPTForCausalLM(cfg)
    model = model.to(dtype).to_empty(device="cpu").eval()
    model.tie_weights()  # to_empty gives the tied head a tensor of its own
    for p in model.parameters():
        p.data.fill_(1.0)
    total = compute_module_sizes(model, dtype=dtype)[""]
    if device == "cuda" and case.percent[0] > 0:
        gpu = int(total * case.percent[0] / 100) + 2**30  # the share plus room for the largest module
        dmap = infer_auto_device_map(model, max_memory={0: gpu, "cpu": 2 * total},
                                     no_split_module_classes=["OPTDecoderLayer"], dtype=dtype)
    else:
        dmap = {"": "cpu"}
    main = 0 if device == "cuda" else "cpu"
    model = dispatch_model(model, device_map=dmap, main_device=main)
    on_gpu = sum(v == 0 for v in dmap.values())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, spec.vocab_size, (case.num_prompts, case.prompt_len), generator=g)
    dev = torch.device("cuda" if device == "cuda" else "cpu")

    def gen(x: torch.Tensor, n: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one greedy ``generate`` of n new tokens."""
        if dev.type == "cuda":
            torch.cuda.synchronize()
        clock = _FirstToken(dev.type == "cuda")
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=1, streamer=clock)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        first = clock.first if clock.first is not None else t1
        return first - t0, t1 - first

    b = case.gpu_batch_size
    gen(ids[:b, :32].to(dev), 1)  # warm-up
    prefill = decode = 0.0
    for a in range(0, case.num_prompts, b):
        p, d = gen(ids[a:a + b].to(dev), case.gen_len)
        prefill += p
        decode += d
    n = case.num_prompts
    return {"prefill_throughput": n * case.prompt_len / prefill,
            "decode_throughput": n * (case.gen_len - 1) / decode if decode > 0 else 0.0,
            "total_throughput": n * case.gen_len / (prefill + decode), "prefill_time_s": prefill,
            "decode_time_s": decode, "modules_on_gpu": on_gpu, "modules": len(dmap), "weight_bytes": total}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="system", required=True)
    a = sub.add_parser("accelerate", help="one accelerate run of a case (the compare phase starts it)")
    a.add_argument("case", help="the case as JSON (dataclasses.asdict of a Case)")
    a.add_argument("metrics", help="JSON file for the throughputs")
    a.add_argument("--device", default="cuda")
    a.add_argument("--dtype", default="float16")
    args = ap.parse_args(argv)
    spec = json.loads(args.case)
    m = accelerate_baseline(Case(**{**spec, "percent": tuple(spec["percent"])}), args.device, args.dtype)
    Path(args.metrics).write_text(json.dumps(m, indent=2) + "\n")
    return m


if __name__ == "__main__":
    main()
