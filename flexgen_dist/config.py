"""Run configuration: ``RunConfig``, from defaults < YAML file (--config) < command-line flags
(``flags.py`` reads the last two).

The policy of each stage is built from --policy FILE (a mapping, or ``stages:`` a list of
mappings, one per stage) and then overridden by the policy flags given on the command line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from .engine.policy import PERCENT_FIELDS, STATE_FIELDS, Policy
from .engine.beams import BeamConfig
from .engine.sampling import MAX_LOGPROBS, SamplingConfig
from .engine.structure import structure_option
from .choices import MAX_CHOICES
from .models.pooling import POOLINGS


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


def lora_module_pairs(items: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """``NAME=DIR`` items -> (name, dir) pairs, refused in one line where malformed or repeated."""
    out: list[tuple[str, str]] = []
    for item in items:
        name, eq, path = str(item).partition("=")
        name, path = name.strip(), path.strip()
        if not eq or not name or not path:
            raise ConfigError(f"--lora-modules {item!r}: give NAME=DIR (the name requests use as their model, "
                             "the directory PEFT's save_pretrained wrote)")
        if any(name == n for n, _ in out):
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice: give each adapter its own name")
        out.append((name, path))
    return out


@dataclass(frozen=True)
class RunConfig:
    model: str | None = None
    lora: str | None = None  # a PEFT LoRA adapter directory, merged into the weights as they are read
    # PEFT LoRA adapters served per request, "NAME=DIR" each: a request names its adapter as its model
    lora_modules: tuple[str, ...] = ()
    # a language model read as a one-label classifier (an LLM reranker): one token (its logit) or
    # two (the second's logit minus the first's), vLLM's classifier_from_token
    classifier_from_token: tuple[str, ...] = ()
    # a cross-encoder's pair as one prompt: a Jinja template (a file, or its text) over the
    # messages [{"role": "query"}, {"role": "document"}] (vLLM's score template); None: the
    # tokenizer's pair encoding (or the texts joined)
    score_template: str | None = None
    # how embeddings pool the last hidden states: "auto" (as the model's files say: the last
    # token where they say nothing) or one of ``models.pooling.POOLINGS``
    pooling: str = "auto"
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
    # vLLM's controls (``SamplingConfig``): no EOS or stop id before this many new tokens; ids
    # that end a completion as EOS does; words never generated
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    logprobs: int | None = None  # per generated token: its log-probability and this many alternatives
    embed: bool = False  # the run writes each prompt's embedding instead of a completion (``LLM.embed``)
    embed_dimensions: int | None = None  # with embed: each vector's first that many values
    # beam search (``LLM.beam_search``; 0: off): beams per prompt, the length penalty, early
    # stopping (false, true, never) and how many of the best each output line keeps (0: all)
    beam_width: int = 0
    length_penalty: float = 1.0
    early_stopping: str = "false"
    num_return_sequences: int = 0
    # completions per prompt (``choices.py``): n choices, the best n of best_of sampled
    # candidates by mean log-probability per token (None: n)
    n: int = 1
    best_of: int | None = None
    classify: bool = False  # a sequence classifier's run: each prompt's labels' logits (``LLM.classify``)
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
    gguf_native: bool = True  # compress_weight keeps GGUF blocks, GPTQ/AWQ/compressed-tensors codes, FP8 codes
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
    # a block's common leading tokens computed once (engine/blocks.py), and a GPU batch's
    # repeated prompts (engine/twins.py)
    share_prefix: bool = True
    # a longer prompt is cut to its last that many tokens (-1: as many as fit with its
    # generation); None: a prompt longer than the model allows is an error (vLLM's option)
    truncate_prompt_tokens: int | None = None
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
        lora_module_pairs(self.lora_modules)  # its own checks
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                              or self.truncate_prompt_tokens >= 1):
            raise ConfigError(f"--truncate-prompt-tokens {self.truncate_prompt_tokens}: give an integer >= 1 (keep "
                              "each prompt's last that many tokens) or -1 (as many as the model has room for)")
        if self.pooling not in ("auto", *POOLINGS):
            raise ConfigError(f"--pooling {self.pooling!r}: give auto or one of {', '.join(POOLINGS)}")
        if len(self.classifier_from_token) > 2 or not all(self.classifier_from_token):
            raise ConfigError("--classifier-from-token takes one token (its logit is the score) or two (e.g. no yes: "
                              "the second's logit minus the first's)")
        if self.embed and self.classify:
            raise ConfigError("--embed and --classify: give one (a classifier's results are its labels' logits)")
        if self.embed_dimensions is not None and not self.embed:
            raise ConfigError("--embed-dimensions cuts embeddings: give it with --embed")
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
        _ = self.score_template_text
        self._check_beams()
        try:
            _ = self.sampling  # its own checks, as config errors
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from None

    def _check_beams(self) -> None:
        """The beam search options: settings only with --beam-width, which generates."""
        if not self.beam_width and (self.length_penalty != 1.0 or str(self.early_stopping).lower() != "false"
                                    or self.num_return_sequences):
            raise ConfigError("--length-penalty, --early-stopping and --num-return-sequences are beam search "
                              "settings: give --beam-width K")
        if self.n != 1 or self.best_of is not None:
            if self.beam_width or self.embed or self.classify:
                raise ConfigError("--n and --best-of sample several completions per prompt: drop --beam-width "
                                  "(--num-return-sequences gives several beams), --embed or --classify")
            best = self.n if self.best_of is None else self.best_of
            if not 1 <= self.n <= best <= MAX_CHOICES:
                raise ConfigError(f"--n {self.n} --best-of {best}: give 1 <= N <= M <= {MAX_CHOICES}")
        if self.beam_width:
            if self.embed or self.classify:
                raise ConfigError("--beam-width generates: drop --embed / --classify")
            try:
                _ = self.beams
            except ValueError as e:
                raise ConfigError(str(e)) from None

    @property
    def beams(self) -> BeamConfig | None:
        """The run's beam search (None: --beam-width not given)."""
        if not self.beam_width:
            return None
        early = {"false": False, "true": True, "never": "never"}.get(str(self.early_stopping).lower(),
                                                                      self.early_stopping)
        return BeamConfig(self.beam_width, self.length_penalty, early, self.num_return_sequences)

    @cached_property
    def sampling(self) -> SamplingConfig:
        """The run's sampling (built once: a schema or grammar file is read once)."""
        return SamplingConfig(self.temperature, self.top_p, self.seed, self.ignore_eos,
                              self.frequency_penalty, self.presence_penalty, top_k=self.top_k, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids), bad_words=tuple(self.bad_words),
                              structure=structure_option(self.json_schema, self.regex, self.choice, self.grammar))

    def model_options(self) -> dict[str, Any]:
        """The options set away from their defaults that change what the model reads or
        computes (adapters, a token judge, truncation, pooling, templates): part of a job's
        fingerprint (``run.py``, ``batch.py``)."""
        return {**({"lora": self.lora} if self.lora else {}),
                **({"lora_modules": list(self.lora_modules)} if self.lora_modules else {}),
                **({"classifier_from_token": list(self.classifier_from_token)} if self.classifier_from_token else {}),
                **({"truncate_prompt_tokens": self.truncate_prompt_tokens} if self.truncate_prompt_tokens else {}),
                **({"pooling": self.pooling} if self.pooling != "auto" else {}),
                **({"score_template": self.score_template_text} if self.score_template else {}),
                **({"chat_template_kwargs": self.template_kwargs} if self.template_kwargs else {}),
                **({"reasoning_parser": self.reasoning_parser} if self.reasoning_parser != "auto" else {})}

    @cached_property
    def score_template_text(self) -> str | None:
        """``--score-template``'s Jinja text: the file's, or the option itself where it is a
        template (it holds ``{{`` or ``{%``)."""
        t = self.score_template
        if t is None or "{{" in t or "{%" in t:
            return t
        try:
            return Path(t).expanduser().read_text()
        except OSError as e:
            raise ConfigError(f"--score-template {t}: cannot read it ({e.strerror}): give a Jinja file or the "
                              "template itself") from None

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
    data = read_yaml(path)
    if isinstance(data, dict) and "stages" in data:
        data = data["stages"]
    if isinstance(data, dict):
        return [data]
    if isinstance(data, list) and all(isinstance(d, dict) for d in data):
        return data
    raise ConfigError(f"{path}: a policy file is a mapping of policy fields, or 'stages:' a list of them")


def read_yaml(path: str) -> Any:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None


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
    for k in ("percent", "state_percent", "stage_layers", "stop_token_ids"):
        if opts.get(k) is not None:
            opts[k] = tuple(opts[k])
    if isinstance(opts.get("bad_words"), (list, str)):
        opts["bad_words"] = (opts["bad_words"],) if isinstance(opts["bad_words"], str) else tuple(opts["bad_words"])
    if isinstance(opts.get("classifier_from_token"), (list, str)):
        v = opts["classifier_from_token"]
        opts["classifier_from_token"] = (v,) if isinstance(v, str) else tuple(v)
    if isinstance(opts.get("lora_modules"), dict):  # {name: directory}
        opts["lora_modules"] = tuple(f"{k}={v}" for k, v in opts["lora_modules"].items())
    elif isinstance(opts.get("lora_modules"), (list, str)):
        opts["lora_modules"] = (opts["lora_modules"],) if isinstance(opts["lora_modules"], str) \
            else tuple(opts["lora_modules"])
    if isinstance(opts.get("chat_template_kwargs"), dict):  # the template's variables as a dict
        opts["chat_template_kwargs"] = json.dumps(opts["chat_template_kwargs"])
    known = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ConfigError(f"unknown option {unknown[0]!r}; options are the CLI's flags with underscores: "
                          f"{', '.join(sorted(known))}")
    return replace(config or RunConfig(), **opts)
