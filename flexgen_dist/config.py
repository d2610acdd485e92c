"""Run configuration: defaults < YAML file (--config) < command-line flags.

Every flag has a YAML key of the same name with dashes as underscores. The policy of each
stage is built from --policy FILE (a mapping, or ``stages:`` a list of mappings, one per
stage) and then overridden by the policy flags given on the command line.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import yaml

from .engine.policy import PERCENT_FIELDS, STATE_FIELDS, Policy
from .engine.sampling import MAX_LOGPROBS, SamplingConfig
from .engine.structure import structure_option


class ConfigError(ValueError):
    """Bad configuration; the message names the key and what to change."""


DEFAULT_SORT_WINDOW = 32
DUMMY_FILLS = ("random", "ones")
POLICY_FLAGS = ("gpu_batch_size", "num_gpu_batches", "percent", "state_percent", "cpu_attention", "overlap",
                "compress_weight", "compress_cache", "attn_sparsity", "comp_group_size", "comp_bits")
REASONING_PARSERS = ("auto", "none", "think", "harmony")  # reasoning.py
# what the chat template's call sets itself: not a template variable a caller may give
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "add_generation_prompt",
                            "continue_final_message", "tokenize", "chat_template", "return_dict", "return_tensors",
                            "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs")


def check_template_kwargs(kwargs: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """``kwargs`` as the chat template's extra variables (e.g. ``{"enable_thinking": false}``):
    an object of names to values, none of the names the call sets itself."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(f"{where} must be an object of template variables, e.g. {{\"enable_thinking\": false}}")
    bad = [k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS]
    if bad:
        raise ConfigError(f"{where}: {bad[0]!r} is set by the chat call itself, not a template variable: leave it out")
    return dict(kwargs)


@dataclass(frozen=True)
class RunConfig:
    model: str | None = None
    dummy_weights: bool = False
    dummy_fill: str = "random"
    prompts: str | None = None
    num_prompts: int | None = None
    prompt_len: int = 128
    gen_len: int = 32
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # per generated token: its log-probability and this many alternatives
    # what every completion must match (at most one; engine/structure.py): a JSON schema (a
    # file or the JSON itself), a regex, one of some strings, a Lark/GBNF grammar (file or text)
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # a chat template's own variables (JSON object text, e.g. '{"enable_thinking": false}')
    chat_template_kwargs: str | None = None
    reasoning_parser: str = "auto"  # how chat completions' thinking is told from the answer (reasoning.py)
    output: str | None = None
    resume: bool = False
    overwrite: bool = False
    metrics: str | None = None
    policy: str | None = None
    percent: tuple[float, ...] | None = None
    state_percent: tuple[float, ...] | None = None
    gpu_batch_size: int | None = None
    num_gpu_batches: int | None = None
    cpu_attention: bool | None = None
    overlap: bool | None = None
    compress_weight: bool | None = None
    compress_cache: bool | None = None
    attn_sparsity: float | None = None
    comp_group_size: int | None = None
    comp_bits: int | None = None
    gguf_native: bool = True  # compress_weight keeps GGUF blocks, GPTQ/AWQ/compressed-tensors codes
    offload_dir: str = "~/.cache/flexgen_dist/offload"
    direct_io: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    gpu_mem: str | None = None
    cpu_mem: str | None = None
    disk_mem: str | None = None
    hardware: str | None = None
    num_micro_batches: int | None = None
    stage_layers: tuple[int, ...] | None = None
    partition: str = "equal"
    prefill_items: str = "auto"
    schedule: str = "auto"
    backend: str | None = None
    dist_timeout: float = 120.0
    master_addr: str | None = None
    master_port: int | None = None
    log_dir: str | None = None
    threads: int | None = None  # compute threads per rank (None: from the CPUs this rank may use)
    print_outputs: int = 8
    sort_window: int = DEFAULT_SORT_WINDOW  # blocks' worth of requests grouped by length at a time (0: input order)
    share_prefix: bool = True  # a block's common leading tokens computed once (engine/blocks.py)
    progress: bool = True
    warmup: bool = False
    explain: bool = False
    stages: tuple[dict[str, Any], ...] = field(default_factory=tuple)  # per-stage policy dicts

    def __post_init__(self) -> None:
        # one spelling of the offload dir for every reader (budgets, profiler, disk tier): "~" expanded
        object.__setattr__(self, "offload_dir", str(Path(self.offload_dir).expanduser()))
        if self.gen_len < 1:
            raise ConfigError(f"--gen-len {self.gen_len}: must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError(f"--num-prompts {self.num_prompts}: must be >= 1")
        if self.prompt_len < 1:
            raise ConfigError(f"--prompt-len {self.prompt_len}: must be >= 1")
        if self.percent is not None and len(self.percent) != 6:
            raise ConfigError(f"--percent takes six numbers WG WC CG CC HG HC, got {len(self.percent)}")
        if self.state_percent is not None and len(self.state_percent) != 2:
            raise ConfigError(f"--state-percent takes two numbers SG SC, got {len(self.state_percent)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: use cpu, cuda or auto")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ConfigError(f"--dtype {self.dtype!r}: use float32, float16, bfloat16 or auto")
        if self.dummy_fill not in DUMMY_FILLS:
            raise ConfigError(f"--dummy-fill {self.dummy_fill!r}: use {' or '.join(DUMMY_FILLS)}")
        if self.dummy_fill != "random" and not self.dummy_weights:
            raise ConfigError(f"--dummy-fill {self.dummy_fill} sets the values of dummy weights: add --dummy-weights")
        if self.direct_io not in ("auto", "on", "off"):
            raise ConfigError(f"--direct-io {self.direct_io!r}: use auto, on or off")
        if self.partition not in ("equal", "balanced"):
            raise ConfigError(f"--partition {self.partition!r}: use equal or balanced")
        if self.partition == "balanced" and not self.auto_policy:
            raise ConfigError("--partition balanced moves layers by the planner's stage times: it needs "
                              "--policy auto (or give the split yourself with --stage-layers)")
        if self.prefill_items not in ("auto", "block", "batch"):
            raise ConfigError(f"--prefill-items {self.prefill_items!r}: use auto, block or batch")
        if self.schedule not in ("auto", "sequential", "overlapped"):
            raise ConfigError(f"--schedule {self.schedule!r}: use auto, sequential or overlapped")
        if self.dist_timeout <= 0:
            raise ConfigError(f"--dist-timeout {self.dist_timeout}: must be > 0 seconds")
        if self.sort_window < 0:
            raise ConfigError(f"--sort-window {self.sort_window}: must be >= 0 (0 keeps the input order)")
        if self.print_outputs < 0:
            raise ConfigError(f"--print-outputs {self.print_outputs}: must be >= 0")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other: resume finishes a job, overwrite "
                              "starts it over")
        if (self.resume or self.overwrite) and not self.output:
            raise ConfigError(f"--{'resume' if self.resume else 'overwrite'} needs --output FILE (the job's output)")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads {self.threads}: must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"--logprobs {self.logprobs}: give 0 (each token's own log-probability) to "
                              f"{MAX_LOGPROBS} (and that many most likely alternatives)")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ConfigError(f"--num-micro-batches {self.num_micro_batches}: must be >= 1")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser!r}: use {', '.join(REASONING_PARSERS)}")
        _ = self.template_kwargs  # its own checks
        try:
            _ = self.sampling  # its own checks, as config errors
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None

    @cached_property
    def sampling(self) -> SamplingConfig:
        """The run's sampling (built once: a schema or grammar file is read once)."""
        return SamplingConfig(self.temperature, self.top_p, self.seed, self.ignore_eos,
                              self.frequency_penalty, self.presence_penalty, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty,
                              structure=structure_option(self.json_schema, self.regex, self.choice, self.grammar))

    @cached_property
    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables (``--chat-template-kwargs``)."""
        if self.chat_template_kwargs is None:
            return {}
        try:
            kw = json.loads(self.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--chat-template-kwargs is not valid JSON ({e.msg}): give an object, e.g. "
                              "'{\"enable_thinking\": false}'") from None
        return check_template_kwargs(kw, "--chat-template-kwargs")

    @property
    def auto_policy(self) -> bool:
        return self.policy == "auto"

    def policy_overrides(self) -> dict[str, Any]:
        """Policy fields given as flags (or top-level YAML keys)."""
        out: dict[str, Any] = {}
        for f in POLICY_FLAGS:
            v = getattr(self, f)
            if v is None:
                continue
            if f == "percent":
                out.update(zip(PERCENT_FIELDS, (float(x) for x in v)))
            elif f == "state_percent":
                out.update(zip(STATE_FIELDS, (float(x) for x in v)))
            else:
                out[f] = v
        return out

    def stage_policies(self, num_stages: int) -> list[Policy]:
        """One Policy per stage: policy file (or per-stage list), then flag overrides."""
        try:
            return [Policy.from_dict(d) for d in self._policy_dicts(num_stages)]
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None

    def block_given(self, num_stages: int) -> bool:
        """Whether a flag, the policy file or a stage's mapping sets the block's shape
        (``gpu_batch_size`` or ``num_gpu_batches``); where none does, the run planner sizes
        the block to the workload (``run_plan.default_block``)."""
        return any(k in d for d in self._policy_dicts(num_stages) for k in ("gpu_batch_size", "num_gpu_batches"))

    def _policy_dicts(self, num_stages: int) -> list[dict[str, Any]]:
        """Each stage's policy mapping as given: the policy file (or per-stage list), then the flags."""
        base: list[dict[str, Any]] = [dict(s) for s in self.stages]
        if self.policy and not self.auto_policy:
            base = load_policy_file(self.policy)
        if not base:
            base = [{}]
        if len(base) == 1:
            base = base * num_stages
        if len(base) != num_stages:
            raise ConfigError(f"{len(base)} stage policies given for {num_stages} stages: give one, "
                              f"or one per stage")
        over = self.policy_overrides()
        return [{**b, **over} for b in base]


def load_policy_file(path: str) -> list[dict[str, Any]]:
    data = _read_yaml(path)
    if isinstance(data, dict) and "stages" in data:
        data = data["stages"]
    if isinstance(data, dict):
        return [data]
    if isinstance(data, list) and all(isinstance(d, dict) for d in data):
        return data
    raise ConfigError(f"{path}: a policy file is a mapping of policy fields, or 'stages:' a list of them")


def _read_yaml(path: str) -> Any:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None


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
    g.add_argument("--dummy-weights", action="store_true", help="random weights for a registry shape")
    g.add_argument("--dummy-fill", choices=DUMMY_FILLS, help="values of --dummy-weights: random (the default) "
                   "or ones (every weight 1, as FlexGen's dummy weights: for side-by-side timings with it, "
                   "since a GPU multiplies constant data faster than random data)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--threads", type=int, help="compute threads per rank (default: the CPUs this rank may use: "
                   "its affinity, cgroup quota and share of the node, less the CPUs other processes keep busy "
                   "at start, at most OMP_NUM_THREADS); the metrics say what was chosen and why")


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
    g.add_argument("--sort-window", type=int, help="group requests of similar length into blocks, this "
                   "many blocks' worth at a time; outputs still go out in input order, a window at a "
                   "time (default 32; 0: blocks in input order)")
    g.add_argument("--no-share-prefix", dest="share_prefix", action="store_false", help="compute the leading "
                   "tokens the prompts of a block share for every prompt (default: once per block, where "
                   "they share at least 16)")
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
                   help="under --compress-weight, re-quantize a GGUF file's Q4/Q8 weights (and a GPTQ, AWQ "
                        "or compressed-tensors checkpoint's) from their dequantized values instead of keeping "
                        "the file's own codes (for comparisons)")
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
        data = _read_yaml(ns.pop("config"))
        if not isinstance(data, dict):
            raise ConfigError("--config file must be a YAML mapping of option: value")
        known = {f.name for f in fields(RunConfig)}
        for k, v in data.items():
            key = str(k).replace("-", "_")
            if key not in known:
                raise ConfigError(f"unknown key {k!r} in --config file; known keys: {', '.join(sorted(known))}")
            values[key] = v if key == "stages" else _yaml_value(key, v)
    values.update(ns)
    for k in ("percent", "state_percent", "stage_layers", "choice"):
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
