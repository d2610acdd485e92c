"""The command line and its YAML file: defaults < YAML file (``--config``) < flags.

Every flag has a YAML key of the same name with dashes as underscores; ``parse_config`` checks
each file value against the option's type (``_yaml_value``) and builds the ``RunConfig``. The
entry points (``run``, ``batch``, ``eval``) share ``build_parser``, adding their own options.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any, NoReturn

from .config import DUMMY_FILLS, REASONING_PARSERS, ConfigError, RunConfig, read_yaml
from .models.pooling import POOLINGS


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one ``ConfigError`` line (no usage block) pointing to --help."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise ConfigError(f"{message} (see {self.prog} --help)")


def _yaml_value(key: str, v: Any) -> Any:
    """A --config file's value for ``key``, checked against the option's type (the key named)."""
    ann = str(next(f.type for f in fields(RunConfig) if f.name == key))
    if v is None:
        if "None" in ann:
            return v
        raise ConfigError(f"--config key {key!r}: needs a value")
    base = ann.replace(" | None", "")

    def bad(what: str) -> ConfigError:
        return ConfigError(f"--config key {key!r}: expected {what}, got {v!r}")

    if base == "bool":
        if not isinstance(v, bool):
            raise bad("true or false")
    elif base == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad("an integer")
    elif base == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad("a number")
        return float(v)
    elif key == "lora_modules" and isinstance(v, dict):  # {name: directory}
        return tuple(f"{k}={d}" for k, d in v.items())
    elif key in ("json_schema", "chat_template_kwargs") and isinstance(v, (dict, bool)):
        return json.dumps(v)  # the schema (or the template's variables) written as YAML
    elif base == "str":
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise bad("a string")
        return str(v)
    elif base.startswith("tuple[int"):
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise bad("a list of integers")
    elif base.startswith("tuple[str"):
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            quote = " (quote the words YAML reads as true/false: 'yes', 'no', 'on', 'off')" \
                if isinstance(v, (list, tuple)) and any(isinstance(x, bool) for x in v) else ""
            raise bad("a list of strings" + quote)
        return tuple(v)
    elif base.startswith("tuple[float"):
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                       for x in v):
            raise bad("a list of numbers")
    return v


def build_parser(prog: str = "python -m flexgen_dist.run") -> argparse.ArgumentParser:
    p = ArgParser(prog=prog, argument_default=argparse.SUPPRESS,
                  description="High-throughput generation with offloading, on one device or a pipeline of ranks.")
    p.add_argument("--config", help="YAML file with any of these options (flags override it)")
    _model_args(p.add_argument_group("model"))
    _workload_args(p.add_argument_group("workload"))
    _policy_args(p.add_argument_group("policy"))
    _distributed_args(p.add_argument_group("distributed"))
    return p


def _model_args(g: argparse._ArgumentGroup) -> None:
    """The model options: what runs, where and in what dtype."""
    g.add_argument("--model", help="registry name, Hugging Face model dir, or .gguf file "
                   "(default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--lora", metavar="DIR", help="a LoRA adapter (the directory PEFT's save_pretrained writes) "
                   "merged into the model's weights as they are read")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=DIR", type=str,
                   help="LoRA adapters served per request: a batch request whose model is NAME (a prompt "
                   "file's line whose \"lora\" is NAME) runs with the adapter in DIR, the others with the base "
                   "model; one batch mixes them")
    g.add_argument("--classifier-from-token", nargs="+", metavar="TOKEN",
                   help="read a language model as a one-label classifier from its logits of TOKEN (one: its "
                   "logit; two, e.g. 'no yes': the second's minus the first's): LLM rerankers such as "
                   "Qwen3-Reranker, for score_pairs, rerank and /v1/score, /v1/rerank")
    g.add_argument("--score-template", metavar="FILE|JINJA", help="a cross-encoder's (or --classifier-from-token "
                   "judge's) prompt for a text pair: a Jinja template over the messages [{role: query}, {role: "
                   "document}] (vLLM's score template; configs/score_templates/qwen3_reranker.jinja for "
                   "Qwen3-Reranker); its variables from --chat-template-kwargs")
    g.add_argument("--pooling", choices=["auto", *POOLINGS],
                   help="how embeddings pool the last hidden states (default auto: as the model's "
                   "sentence-transformers or GGUF metadata says, else the last token)")
    g.add_argument("--dummy-weights", action="store_true", help="random weights for a registry shape")
    g.add_argument("--dummy-fill", choices=DUMMY_FILLS, help="values of --dummy-weights: random (the default) "
                   "or ones (every weight 1, as FlexGen's dummy weights: for side-by-side timings with it, "
                   "since a GPU multiplies constant data faster than random data)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--threads", type=int, help="compute threads per rank (default: the CPUs this rank may use: "
                   "its affinity, cgroup quota and share of the node, less the CPUs other processes keep busy "
                   "at start, at most OMP_NUM_THREADS); the metrics say what was chosen and why")


def _completions_args(g: argparse._ArgumentGroup) -> None:
    """How many completions a prompt gets: a beam search's, or n of best_of samples."""
    g.add_argument("--beam-width", type=int, metavar="K", help="beam search with K beams per prompt (as "
                   "transformers' num_beams); each output line is the best hypothesis, with the others under "
                   "'beams' (--num-return-sequences of them)")
    g.add_argument("--length-penalty", type=float, help="with --beam-width: a hypothesis' score is its summed "
                   "log-probabilities over its length to this power (default 1)")
    g.add_argument("--early-stopping", choices=["false", "true", "never"], help="with --beam-width: when a "
                   "prompt's search ends (transformers' early_stopping; default false)")
    g.add_argument("--num-return-sequences", type=int, metavar="N", help="with --beam-width: the best N "
                   "hypotheses per prompt (default: all K)")
    g.add_argument("--n", type=int, metavar="N", help="N sampled completions per prompt (vLLM's and OpenAI's n): "
                   "each output line holds them under 'choices', the first also as the line's own text")
    g.add_argument("--best-of", type=int, metavar="M", help="sample M candidates per prompt and keep the --n "
                   "with the highest mean log-probability per token, best first (OpenAI's best_of; default N)")


def _workload_args(g: argparse._ArgumentGroup) -> None:
    """The workload options: the prompts, the sampling and what is written."""
    g.add_argument("--prompts", help=".jsonl with {id, prompt|input_ids} per line, or .txt one per line")
    g.add_argument("--num-prompts", type=int, help="synthetic prompts (random ids) instead of a file")
    g.add_argument("--prompt-len", type=int, help="length of synthetic prompts (default 128)")
    g.add_argument("--gen-len", type=int, help="tokens to generate per prompt (default 32)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --gen-len tokens")
    g.add_argument("--temperature", type=float, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int, help="sample among the K most likely tokens only (default 0: all)")
    g.add_argument("--min-p", type=float, help="sample among the tokens at least this times as likely as the "
                   "most likely one only (0-1, default 0: all)")
    g.add_argument("--seed", type=int)
    g.add_argument("--frequency-penalty", type=float, help="subtract this times the times a token was "
                   "generated already from its logit (-2 to 2, default 0; greedy too)")
    g.add_argument("--presence-penalty", type=float, help="subtract this from the logit of every token "
                   "generated already (-2 to 2, default 0; greedy too)")
    g.add_argument("--repetition-penalty", type=float, help="divide the logit of every token of the prompt or "
                   "generated already by this where positive, multiply where negative (as transformers; "
                   "default 1: off; greedy too)")
    g.add_argument("--min-tokens", type=int, metavar="N", help="no EOS (or stop token) before N new tokens, and no "
                   "stop string ending before them (vLLM's min_tokens; default 0)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", metavar="ID", help="token ids that end a completion "
                   "as EOS does (kept in its tokens, left out of its text)")
    g.add_argument("--bad-words", nargs="+", metavar="WORD", help="words never generated (vLLM's bad_words: a "
                   "word's last token is banned where the newest tokens are the rest of it)")
    _completions_args(g)
    g.add_argument("--logprobs", type=int, metavar="K", help="write each generated token's log-probability "
                   "under the model, and its K most likely alternatives (0-20), in each output line")
    g.add_argument("--json-schema", metavar="FILE|JSON", help="every completion is JSON matching this schema "
                   "(a file, or the schema itself; '{\"type\": \"object\"}' for any object)")
    g.add_argument("--regex", help="every completion matches this regular expression (whole)")
    g.add_argument("--choice", nargs="+", metavar="TEXT", help="every completion is one of these strings")
    g.add_argument("--grammar", metavar="FILE|TEXT", help="every completion follows this Lark (or GBNF) grammar")
    g.add_argument("--chat-template-kwargs", metavar="JSON", help="the chat template's own variables for chat "
                   "prompts, e.g. '{\"enable_thinking\": false}' (Qwen3) or '{\"reasoning_effort\": \"low\"}' "
                   "(gpt-oss)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, help="how a reasoning model's chat "
                   "completions are split into reasoning and answer: auto (the default: by the chat template), "
                   "think (<think>...</think>), harmony (gpt-oss), none (the text as generated)")
    g.add_argument("--output", help="JSONL of {id, prompt?, text?, tokens}; an existing non-empty one needs "
                   "--resume or --overwrite")
    g.add_argument("--resume", action="store_true", help="finish the job in --output: skip the prompts "
                   "already there, generate the rest (same model, dtype, sampling, prompts)")
    g.add_argument("--overwrite", action="store_true", help="start the job in --output over")
    g.add_argument("--metrics", help="JSON file of throughputs, timings, peaks, policy")
    g.add_argument("--print-outputs", type=int, help="completions to print (default 8)")
    g.add_argument("--embed", action="store_true", help="write each prompt's embedding instead of a completion "
                   "(its last hidden states after the final norm, pooled as --pooling says, L2-normalized): "
                   "{\"id\", \"embedding\", \"prompt_tokens\"} lines")
    g.add_argument("--classify", action="store_true", help="a sequence classifier (reward model) checkpoint: write "
                   "each prompt's labels' logits, their softmax and the top label: {\"id\", \"logits\", \"probs\", "
                   "\"label\", \"prompt_tokens\"} lines")
    g.add_argument("--embed-dimensions", type=int, metavar="N", help="with --embed: each vector's first N values "
                   "(Matryoshka-trained models), then normalized")
    g.add_argument("--truncate-prompt-tokens", type=int, metavar="K", help="cut a longer prompt to its last K "
                   "tokens (-1: as many as fit with its generation) instead of refusing it; a batch request's own "
                   "truncate_prompt_tokens overrides it")
    g.add_argument("--sort-window", type=int, help="group requests of similar length into blocks, this "
                   "many blocks' worth at a time; outputs still go out in input order, a window at a "
                   "time (default 32; 0: blocks in input order)")
    g.add_argument("--no-share-prefix", dest="share_prefix", action="store_false", help="compute the leading "
                   "tokens the prompts of a block share for every prompt (default: once per block, where "
                   "they share at least 16), and a prompt asked more than once for each of its rows "
                   "(default: once per GPU batch)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--warmup", action="store_true", help="before the job, place the weights and run one "
                   "untimed token of one GPU batch, so one-time costs (CUDA context, kernels, allocator) "
                   "stay out of the measured throughput (benchmarks)")
    g.add_argument("--explain", action="store_true", help="print the run's plan (each stage's layers, policy "
                   "and predicted peaks, and why each choice was made) and whether it fits the memory budgets, "
                   "then exit without placing or generating anything")


def _policy_args(g: argparse._ArgumentGroup) -> None:
    """The policy options: placement, compression, memory budgets."""
    g.add_argument("--policy", help="policy YAML file, or 'auto' to plan one")
    g.add_argument("--percent", nargs=6, type=float, metavar=("WG", "WC", "CG", "CC", "HG", "HC"),
                   help="GPU and CPU percent of weights, cache, activations (disk gets the rest)")
    g.add_argument("--state-percent", nargs=2, type=float, metavar=("SG", "SC"),
                   help="GPU and CPU percent of the linear-attention layers' states, by whole layers "
                        "(Qwen3-Next, Qwen3.5; disk gets the rest; default 100 0)")
    g.add_argument("--gpu-batch-size", type=int)
    g.add_argument("--num-gpu-batches", type=int)
    g.add_argument("--cpu-attention", action=argparse.BooleanOptionalAction)
    g.add_argument("--overlap", action=argparse.BooleanOptionalAction)
    g.add_argument("--compress-weight", action=argparse.BooleanOptionalAction)
    g.add_argument("--compress-cache", action=argparse.BooleanOptionalAction)
    g.add_argument("--attn-sparsity", type=float)
    g.add_argument("--comp-group-size", type=int, help="elements per quantization group (default 64)")
    g.add_argument("--comp-bits", type=int, choices=[4, 8], help="bits per compressed value (default 4)")
    g.add_argument("--no-gguf-native", dest="gguf_native", action="store_false",
                   help="under --compress-weight, re-quantize a GGUF file's Q4/Q8 weights (and a GPTQ, AWQ, "
                        "compressed-tensors or FP8 checkpoint's) from their dequantized values instead of "
                        "keeping the file's own codes (for comparisons)")
    g.add_argument("--offload-dir")
    g.add_argument("--direct-io", choices=["auto", "on", "off"])
    g.add_argument("--gpu-mem")
    g.add_argument("--cpu-mem")
    g.add_argument("--disk-mem")
    g.add_argument("--hardware", help="hardware profile YAML for --policy auto")


def _distributed_args(g: argparse._ArgumentGroup) -> None:
    """The distributed options: the pipeline across ranks."""
    g.add_argument("--num-micro-batches", type=int,
                   help="groups of blocks in flight (default: the planner's best with a hardware profile, "
                        "else the number of stages)")
    g.add_argument("--prefill-items", choices=["auto", "block", "batch"],
                   help="how a block's prefill crosses the stages: one item per block (each loaded layer "
                        "serves every GPU batch), or one per GPU batch (the next stage starts sooner; "
                        "off-device weights are read once per batch); auto: the cost model's choice")
    g.add_argument("--schedule", choices=["auto", "sequential", "overlapped"],
                   help="overlapped: the next block's prefill rides on this block's decode steps (each "
                        "loaded layer serves both; needs the memory of two blocks per group); sequential: "
                        "one block's prefill, then its decode; auto: overlapped where predicted faster "
                        "(>= 10 %%; without a hardware profile: on a GPU whose weights stream from host RAM or disk)")
    g.add_argument("--stage-layers", nargs="+", type=int, help="layers per stage, e.g. 5 4 3")
    g.add_argument("--partition", choices=["equal", "balanced"])
    g.add_argument("--backend", choices=["gloo", "nccl"])
    g.add_argument("--dist-timeout", type=float, help="seconds before a silent peer is declared dead")
    g.add_argument("--master-addr")
    g.add_argument("--master-port", type=int)
    g.add_argument("--log-dir", help="write each rank's log (rank{r}.log) here (default: no log files)")

def parse_config(argv: list[str] | None = None) -> RunConfig:
    return parse_config_with(argv, build_parser(), ())[0]


def parse_config_with(argv: list[str] | None, parser: argparse.ArgumentParser,
                      extra: tuple[str, ...]) -> tuple[RunConfig, dict[str, Any]]:
    """``parse_config`` with another entry point's parser (``build_parser()`` plus its own
    options): the run options as a ``RunConfig``, and the ``extra`` options' values."""
    ns = vars(parser.parse_args(argv))
    own = {k: ns.pop(k) for k in extra if k in ns}
    values: dict[str, Any] = {}
    if "config" in ns:
        data = read_yaml(ns.pop("config"))
        if not isinstance(data, dict):
            raise ConfigError("--config file must be a YAML mapping of option: value")
        known = {f.name for f in fields(RunConfig)}
        for k, v in data.items():
            key = str(k).replace("-", "_")
            if key not in known:
                raise ConfigError(f"unknown key {k!r} in --config file; known keys: {', '.join(sorted(known))}")
            values[key] = v if key == "stages" else _yaml_value(key, v)
    values.update(ns)
    for k in ("percent", "state_percent", "stage_layers", "choice", "lora_modules", "classifier_from_token",
              "stop_token_ids", "bad_words"):
        if values.get(k) is not None:
            values[k] = tuple(values[k])
    if "stages" in values:
        st = values["stages"]
        if not isinstance(st, (list, tuple)) or not all(isinstance(s, dict) for s in st):
            raise ConfigError("'stages' in the config file must be a list of policy mappings")
        values["stages"] = tuple(st)
    try:
        return RunConfig(**values), own
    except TypeError as e:
        raise ConfigError(str(e)) from None
