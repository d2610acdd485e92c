"""ModelSpec: the shape and conventions of one decoder-only model.

Everything the math, the loader, the planner and the engine need to know about a model is
here; nothing here knows where tensors live.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .rope_scaling import ROPE_TYPES, RopeScaling
from .spec_checks import FAMILIES, LAYER_TYPES, ROUTER_SCORINGS, SpecChecks

__all__ = ["FAMILIES", "LAYER_TYPES", "ROPE_TYPES", "ROUTER_SCORINGS", "ModelSpec", "RopeScaling", "alternating",
           "every_nth"]


def every_nth(num_layers: int, every: int) -> tuple[bool, ...]:
    """True on every ``every``-th layer (the every-th, the 2·every-th, ...), False elsewhere."""
    return tuple((i + 1) % every == 0 for i in range(num_layers))


def alternating(num_layers: int, every: int) -> tuple[str, ...]:
    """``layer_types`` with every ``every``-th layer global and the others sliding (the default
    of Gemma 2/3, OLMo 3, EXAONE 4, Command R7B)."""
    return tuple("full_attention" if g else "sliding_attention" for g in every_nth(num_layers, every))


@dataclass(frozen=True)
class ModelSpec(SpecChecks):
    """Shape of a decoder-only transformer of the OPT, LLaMA, Gemma or Cohere family.

    ``ffn_size`` is the MLP's inner width (OPT ``ffn_dim``, LLaMA ``intermediate_size``).
    ``num_kv_heads`` < ``num_heads`` means grouped-query attention (LLaMA and Gemma families).
    """

    name: str
    family: str
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    vocab_size: int
    max_positions: int
    num_kv_heads: int = 0  # 0: same as num_heads
    head_dim_override: int = 0  # 0: hidden_size // num_heads
    rotary_dim: int = 0  # the leading dims of each head RoPE turns (Phi-4-mini: 3/4); 0: all of them
    # per layer, True where the layer has no position encoding at all (SmolLM3's NoPE layers,
    # every fourth); empty: every layer turns q and k
    nope_layers: tuple[bool, ...] = ()
    norm_eps: float = 1e-5
    # OPT conventions
    pre_layer_norm: bool = True  # False for opt-350m (post-LN, no final norm)
    word_embed_proj_dim: int = 0  # 0: hidden_size (no project_in/out)
    # LLaMA conventions
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # the sliding layers' own RoPE (Gemma 3: base 10000 locally, 1e6 and scaled globally);
    # 0: they rotate as the global layers do
    local_rope_theta: float = 0.0
    local_rope_scaling: RopeScaling | None = None
    sliding_window: int = 0  # > 0: a sliding layer attends to the last this many positions only
    # per layer, "sliding_attention" or "full_attention" (Gemma's alternation, Qwen2's
    # max_window_layers); empty: every layer slides when sliding_window > 0 (Mistral, Phi-3)
    layer_types: tuple[str, ...] = ()
    attn_scale: float = 0.0  # the softmax scale of q.k; 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float = 0.0  # > 0: scores become cap * tanh(scores / cap) before the mask (Gemma 2)
    final_softcap: float = 0.0  # > 0: the same on the final logits (Gemma 2)
    # Granite's multipliers: the embedding times embed_multiplier, each sublayer's output times
    # residual_multiplier before its residual add, the logits divided by logits_divisor
    embed_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    logit_scale: float = 1.0  # Cohere: the logits times this
    # Ministral 3 (Llama 4's attention temperature): q at position p times
    # 1 + attn_temp_beta * ln(1 + floor(p / attn_temp_len)), after RoPE; 0: none. Llama 4's own
    # (attn_temp_nope): on the layers without RoPE only, p counted from 1
    attn_temp_beta: float = 0.0
    attn_temp_len: int = 0
    attn_temp_nope: bool = False
    qk_l2_norm: bool = False  # Llama 4: q and k of each head RMS-normalised without a weight, after RoPE, where it turns
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # biases on q, k, v and o
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # ... over all of q's and all of k's heads together instead (OLMo 2/3)
    qk_norm_after_rope: bool = False  # ... per head after the rotation, not before it (HunYuan)
    # where a layer's norms sit: "pre" (before attention and the MLP: Llama, Gemma 1), "post"
    # (on each one's output, before its residual add: OLMo 2/3, EXAONE 4) or "sandwich" (both:
    # Gemma 2/3, GLM-4); "": the family's own (llama pre, gemma sandwich; OPT and Cohere
    # have layouts of their own)
    norm_layout: str = ""
    norm_weight_fp32: bool = False  # OLMo: an RMSNorm's weight multiplies in float32, before the cast
    # the checkpoint fuses q|k|v and gate|up into one matrix each (Phi-3); the neox family: a phi2 GGUF
    # whose q|k|v is one attn_qkv (neox.gguf_names)
    fused_proj: bool = False
    fused_mlp: bool = False  # ... gate|up only (GLM-4)
    rope_interleaved: bool = False  # RoPE turns pairs (2i, 2i+1), not (i, i + d/2) (GLM-4; the cohere family always)
    rope_fp32: bool = False  # ... in float32 from float32 tables, then cast back (ERNIE 4.5)
    mlp_bias: bool = False
    # a dense layer's MLP: "swiglu" (down(silu(gate) * up)), or ungated down(act(up)) with act
    # "relu2" (relu squared: Arcee AFM) or "xielu" (Apertus: two learned scalars a layer)
    mlp_activation: str = "swiglu"
    # Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): a sparse layer's MLP is a router
    # (hidden -> num_experts logits, softmax in float32, the top experts_per_tok kept) and
    # num_experts SwiGLU experts of width expert_ffn_size, each token's output the weighted sum
    # of its experts'; 0 experts: every layer dense
    num_experts: int = 0
    experts_per_tok: int = 0
    expert_ffn_size: int = 0
    norm_topk_prob: bool = True  # the kept routing weights renormalised to sum to 1
    router_weights_fp32: bool = False  # Mixtral: the routing weights stay float32 (Qwen: the model dtype)
    shared_expert_ffn_size: int = 0  # Qwen2-MoE: one shared SwiGLU expert on every token, gated by a sigmoid
    shared_expert_gated: bool = True  # False: the shared expert's output added as is (GLM-4.5)
    # GLM-4.5 and MiniMax-M2 (DeepSeek-V3's routing): router_scoring "sigmoid" scores each expert
    # with a sigmoid of its logit in float32; the choice adds a per-expert bias (router.choice_b) to the scores, keeps
    # the expert_groups_used best of expert_groups groups (a group's worth: its two best), then
    # the top experts_per_tok of those; the weights are the chosen scores (without the bias),
    # renormalised where norm_topk_prob, times routed_scaling
    router_scoring: str = "softmax"
    router_fp32: bool = False  # the router's product in float32 from float32 copies (GLM-4.5; MiniMax-M2: its dtype)
    # ERNIE 4.5: softmax scores with a choice bias (router.choice_b, as sigmoid routing has), the
    # kept weights divided by their sum clamped below at router_norm_min
    router_choice_bias: bool = False
    router_norm_min: float = 0.0
    # DeepSeek-V2: softmax scores with groups (a group's worth: its best score), the weights
    # not renormalised, times routed_scaling
    expert_groups: int = 1
    expert_groups_used: int = 1
    routed_scaling: float = 1.0
    # gpt-oss: router_scoring "topk_softmax" (the top experts_per_tok logits, then a softmax over
    # them), a bias on the router (router.b) and on each expert's matrices (experts.{e}.*.b), and
    # the clamped gate of swiglu_alpha > 0: gate = min(gate, limit), up = clamp(up, +-limit),
    # (up + 1) * gate * sigmoid(alpha * gate)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    attn_sinks: bool = False  # gpt-oss: a learned logit per head (sinks) joins each softmax's denominator
    # DeepSeek-V3's multi-head latent attention (kv_lora_rank > 0): q from x (through a rank-
    # q_lora_rank bottleneck where > 0), heads of qk_nope_dim + qk_rope_dim for q.k and v_head_dim
    # for v, k and v made from one latent of kv_lora_rank per token plus a shared turned key of
    # qk_rope_dim; the engine caches the latent and the key as one kv head of head_dim =
    # kv_lora_rank + qk_rope_dim (num_kv_heads 1), q absorbing each head's key projection
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # per layer, whether its MLP is sparse (Qwen's mlp_only_layers, decoder_sparse_step); empty:
    # every layer is, where there are experts
    moe_layers: tuple[bool, ...] = ()
    # Qwen3-Next / Qwen3.5: the "linear_attention" layers of layer_types mix tokens with a gated
    # delta rule instead of attention: q, k (lin_k_heads heads of lin_k_dim), v and the output
    # gate z (lin_v_heads of lin_v_dim) through a causal depthwise convolution of lin_conv_kernel
    # taps, a state of (lin_v_heads, lin_k_dim, lin_v_dim) per sequence carried token to token
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    lin_conv_kernel: int = 0
    # the v heads' order: grouped by the key head they read (HF: v head h reads key head
    # h // (v heads / k heads)), or tiled (llama.cpp's qwen35 files: h reads h % k heads)
    lin_v_tiled: bool = False
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also gives a gate; attention's output times sigmoid(gate)
    norm_unit_offset: bool = False  # Qwen3-Next: every RMSNorm multiplies by (1 + w), in float32
    layer_norm: bool = False  # Phi-3.5-MoE: every norm a LayerNorm with a weight and a bias, not an RMSNorm
    lm_head_bias: bool = False  # Phi-3.5-MoE, Phi-2: the LM head has a bias
    # GPT-NeoX: attention and the MLP side by side, each on its own norm of the layer's input
    parallel_residual: bool = False
    # Phi-3.5-MoE's sparsemixer routing (router_scoring "sparsemixer"): an expert's weight is a
    # softmax over the logits within 2 * router_jitter (relative) of the best remaining one
    router_jitter: float = 0.0
    # LoRA adapters served per request (``--lora-modules``): per adapted matrix of a layer, its
    # canonical key, how many adapters, their (largest) rank, its input and output widths; each
    # layer then also holds ``KEY.lora_a`` (n, r, in) and ``KEY.lora_b`` (n, out, r)
    # (``models/lora_stack.py``)
    lora_stacks: tuple[tuple[str, int, int, int, int], ...] = ()
    # a sequence classifier (``*ForSequenceClassification``: reward models, classifiers): its
    # head is ``score`` (num_labels, hidden) at the last token, not the vocabulary; labels' names
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    # a one-label classifier scoring a text pair (a cross-encoder, ``pairs.py``) reads it as the
    # tokenizer's pair encoding; False (the config's ``use_sep_token``): the two texts joined
    pair_sep: bool = True
    # how embeddings pool the last hidden states (``models/pooling.py``: "last", "mean", "cls",
    # "max", "mean_sqrt_len", "weighted_mean"), and why ``embed`` refuses this model ("" : it
    # does not; e.g. a sentence-transformers Dense projection that is not computed)
    pooling: str = "last"
    embed_refusal: str = ""
    # token ids
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        self._check_shape()
        self._check_layers()
        self._check_features()
        self._check_experts()
        if isinstance(self.eos_token_ids, int):
            object.__setattr__(self, "eos_token_ids", (self.eos_token_ids,))
        else:
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    # derived shape ---------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_heads

    @property
    def rope_dim(self) -> int:
        """How many leading dims of each q/k head RoPE turns (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_gated(self) -> bool:
        """Whether a dense layer's MLP has a gate projection (SwiGLU) or only up and down."""
        return self.mlp_activation == "swiglu" and self.family != "neox"

    @property
    def cache_tensors(self) -> int:
        """What the cache stores per kv head: K and V (2), or one latent that attention reads
        as both (1: DeepSeek-V3's latent attention, its values are its keys)."""
        return 1 if self.kv_lora_rank else 2

    @property
    def softmax_scale(self) -> float:
        """The scale of q.k before the softmax."""
        return self.attn_scale or self.head_dim ** -0.5

    def rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` turns q and k with RoPE (SmolLM3's NoPE layers do not)."""
        return not (self.nope_layers and self.nope_layers[layer])

    def rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of layer ``layer``'s rotary embedding."""
        if self.local_rope_theta and self.window(layer):
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    def window(self, layer: int) -> int:
        """How many positions (the query's own included) layer ``layer`` attends to at most
        (a chunked layer: its chunk); 0: all."""
        if not self.sliding_window:
            return 0
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return 0
        return self.sliding_window

    def chunked(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within its chunk only (Llama 4: positions p // window
        alike, counted from each sequence's first token)."""
        return bool(self.layer_types) and self.layer_types[layer] == "chunked_attention"

    def linear(self, layer: int) -> bool:
        """Whether layer ``layer`` is a linear-attention layer (a gated delta rule, no KV cache)."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def lin_conv_dim(self) -> int:
        """Channels of a linear layer's convolution: q, k and v side by side."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def recurrent_numel(self) -> tuple[int, int]:
        """Per sequence, per linear layer: the convolution's state (its last lin_conv_kernel - 1
        inputs, in the model's dtype) and the delta rule's (float32) elements."""
        if not self.lin_v_heads:
            return 0, 0
        return (self.lin_conv_dim * (self.lin_conv_kernel - 1),
                self.lin_v_heads * self.lin_k_dim * self.lin_v_dim)

    def recurrent_bytes(self, dtype_bytes: int) -> int:
        """Bytes of one sequence's states of one linear layer: ``recurrent_numel``'s convolution
        in the model's dtype (``dtype_bytes``), the delta rule's in float32."""
        conv, ssm = self.recurrent_numel()
        return conv * dtype_bytes + 4 * ssm

    def lin_numel(self) -> int:
        """Elements of a linear layer's mixer: qkv, z, b, a, the convolution, dt_bias, A_log,
        the gated norm, out_proj."""
        h, vd = self.hidden_size, self.lin_v_heads * self.lin_v_dim
        conv = self.lin_conv_dim
        return h * (conv + vd + 2 * self.lin_v_heads) + conv * self.lin_conv_kernel + 2 * self.lin_v_heads \
            + self.lin_v_dim + vd * h

    def is_moe(self, layer: int | None) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts (None: any layer of a model
        whose layers all are)."""
        if not self.num_experts:
            return False
        if not self.moe_layers:
            return True
        return all(self.moe_layers) if layer is None else self.moe_layers[layer]

    def mla_numel(self) -> int:
        """Elements of a latent-attention layer's projections and their norms (q, kv_a, kv_b, o)."""
        h, nh, r, dr = self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_rope_dim
        qk = nh * (self.qk_nope_dim + dr)
        q = self.q_lora_rank * (h + 1 + qk) if self.q_lora_rank else h * qk
        return q + h * (r + dr) + r + r * nh * (self.qk_nope_dim + self.v_head_dim) + nh * self.v_head_dim * h

    @property
    def has_choice_bias(self) -> bool:
        """Whether a sparse layer has ``router.choice_b``: sigmoid routing always, ERNIE's softmax."""
        return self.router_scoring == "sigmoid" or self.router_choice_bias

    def expert_numel(self) -> int:
        """Elements of one routed expert (gate, up and down, and their biases where it has them)."""
        h, f = self.hidden_size, self.expert_ffn_size
        return 3 * h * f + (2 * f + h) * self.expert_bias

    def experts_touched(self, tokens: float) -> float:
        """Expected routed experts a sparse layer uses for ``tokens`` tokens, each choosing
        experts_per_tok of num_experts uniformly: E (1 - (1 - k/E)^T)."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** max(tokens, 0.0))

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (OPT's word_embed_proj_dim)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def pooled_dim(self) -> int:
        """Values the head gives per sequence at its last token when pooling (``head.embed``):
        a classifier's labels, else the embedding's width."""
        return self.num_labels or self.embed_dim

    @property
    def has_projection(self) -> bool:
        return self.family == "opt" and self.embed_dim != self.hidden_size

    @property
    def norm(self) -> str:
        return "layernorm" if self.family in ("opt", "neox") or self.layer_norm else "rmsnorm"

    @property
    def activation(self) -> str:
        return {"opt": "relu", "gemma": "gelu_tanh", "neox": "gelu"}.get(self.family, "silu")

    @property
    def positions(self) -> str:
        return "learned" if self.family == "opt" else "rope"

    # sizes (element counts; multiply by the dtype's bytes) -------------------------
    def layer_numel(self, layer: int | None = None) -> float:
        """Elements of one decoder layer's weights (attention + MLP + norms + biases, and the
        stacked LoRA adapters served per request); with ``layer`` None, the mean over the
        layers (they differ where only some are sparse)."""
        return self._layer_numel(layer) + self.lora_numel()

    def lora_numel(self) -> int:
        """Elements of one layer's stacked LoRA adapters (``lora_stacks``)."""
        return sum(n * r * (i + o) for _, n, r, i, o in self.lora_stacks)

    def _layer_numel(self, layer: int | None = None) -> float:
        if layer is None:
            if self.num_experts and self.moe_layers and len(set(self.moe_layers)) > 1 or self.lin_v_heads:
                return sum(self._layer_numel(j) for j in range(self.num_layers)) / self.num_layers
            layer = 0
        h, f = self.hidden_size, self.ffn_size
        attn = self.mla_numel() if self.kv_lora_rank else \
            h * self.q_dim * (1 + self.attn_output_gate) + 2 * h * self.kv_dim + self.q_dim * h
        if self.linear(layer):
            attn = self.lin_numel()
        if self.family == "opt":
            mlp = 2 * h * f
            biases = self.q_dim + 2 * self.kv_dim + h + f + h
            norms = 4 * h
            return attn + mlp + biases + norms
        if self.family == "neox":  # LayerNorms (one or two), biased MLP, ungated
            norms = (2 if self.norm_layout == "shared" else 4) * h
            biases = (self.q_dim + 2 * self.kv_dim + h) * self.attention_bias + (f + h) * self.mlp_bias
            return attn + 2 * h * f + biases + norms
        mlp = self.mlp_numel(layer)
        biases = ((self.q_dim + 2 * self.kv_dim) * (self.attention_bias or self.qkv_bias) + h * self.attention_bias
                  + ((1 + self.mlp_gated) * f + h) * self.mlp_bias * (not self.is_moe(layer))
                  + self.num_heads * self.attn_sinks)
        # Gemma: a norm before and after each block; Cohere: one for both, side by side
        norms = (1 if self.family == "cohere" else 4 if self.norm_layout == "sandwich" else 2) * h * (1 + self.layer_norm)
        whole = self.qk_norm_whole or self.family == "cohere"  # Cohere: a weight per head and dim
        qk = (self.q_dim + self.kv_dim if whole else 2 * self.head_dim) * self.qk_norm * (not self.linear(layer))
        if self.linear(layer):
            biases -= (self.q_dim + 2 * self.kv_dim) * (self.attention_bias or self.qkv_bias) + h * self.attention_bias
        return attn + mlp + biases + norms + qk

    def mlp_numel(self, layer: int | None = None, experts: float | None = None) -> float:
        """Elements of layer ``layer``'s MLP: a dense SwiGLU, or the router, the shared expert
        and ``experts`` routed experts (default: all of them)."""
        h = self.hidden_size
        if not self.is_moe(layer):
            return (3 if self.mlp_gated else 2) * h * self.ffn_size + 2 * (self.mlp_activation == "xielu")
        n = self.num_experts if experts is None else experts
        shared = (3 * h * self.shared_expert_ffn_size + h * self.shared_expert_gated
                  if self.shared_expert_ffn_size else 0)
        router = self.num_experts * (h + self.has_choice_bias + self.router_bias)  # + its biases
        return router + shared + n * self.expert_numel()

    def active_layer_numel(self, layer: int | None = None) -> float:
        """Elements of one layer one token computes with: every weight of a dense layer; a
        sparse layer's without the routed experts it does not choose."""
        if not self.is_moe(layer):
            return self.layer_numel(layer)
        return self.layer_numel(layer) - self.mlp_numel(layer) + self.mlp_numel(layer, self.experts_per_tok)

    def layer_weights(self) -> list[float] | None:
        """What each layer weighs for splitting the layers into stages (its bytes and the
        compute of a token through it, each as a share of the model's), where the layers
        differ (some dense, some sparse); None where they are all alike."""
        if not (self.num_experts and self.moe_layers and len(set(self.moe_layers)) > 1 or self.lin_v_heads):
            return None
        size = [self.layer_numel(j) for j in range(self.num_layers)]
        work = [self.active_layer_numel(j) for j in range(self.num_layers)]
        return [a / sum(size) + b / sum(work) for a, b in zip(size, work)]

    def embed_numel(self) -> int:
        n = self.vocab_size * self.embed_dim
        if self.family == "opt":
            n += (self.max_positions + 2) * self.hidden_size
            if self.has_projection:
                n += 2 * self.embed_dim * self.hidden_size
        return n

    def head_numel(self) -> int:
        """Final norm + LM head (0 extra for a tied head)."""
        n = 2 * self.hidden_size if self.norm == "layernorm" else self.hidden_size
        if self.num_labels:  # a sequence classifier: its score rows
            return n + self.num_labels * self.hidden_size
        if self.family != "opt" and not self.tie_word_embeddings:
            n += self.vocab_size * (self.hidden_size + self.lm_head_bias)
        return n

    def total_numel(self) -> int:
        return int(self.embed_numel() + sum(self.layer_numel(j) for j in range(self.num_layers)) + self.head_numel())

    def kv_numel_per_token(self) -> int:
        """Cache elements per token per layer: K and V, or the latent alone."""
        return self.cache_tensors * self.kv_dim
