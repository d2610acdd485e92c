"""What a llama.cpp file of the NeoX family (``gptneox``: GPT-NeoX / Pythia, ``phi2``: Phi-1/1.5/2,
``starcoder2``) gives its ``ModelSpec`` beyond the shared keys (``neox_fields``, called by
``gguf.spec_from_gguf``), as llama.cpp's converter writes the file and its loader and graph
read it (docs/architecture.md, "Sources of weights")."""
from __future__ import annotations

import logging
from typing import Any

from .gguf_arch import Key
from .gguf_file import decimal32
from .source import ModelLoadError

log = logging.getLogger("flexgen_dist")


# the GELU each file computes with: a file does not say, so these are the released models' configs'
# (Phi-1/1.5/2: gelu_new; Pythia: gelu, the exact one; GPT-NeoX-20B's says gelu_fast; StarCoder2:
# gelu_pytorch_tanh). llama.cpp computes ggml_gelu (the tanh form) for the three architectures.
NEOX_ACTIVATION = {"phi2": "gelu_new", "gptneox": "gelu", "starcoder2": "gelu_pytorch_tanh"}


def neox_fields(arch: str, key: Key, tensors: set[str], heads: int, rotary: int) -> dict[str, Any]:
    """A gptneox / phi2 / starcoder2 file's ``ModelSpec`` fields beyond the shared ones, as
    llama.cpp's loader reads it: the LayerNorm's epsilon and gptneox.use_parallel_residual (both
    required there), the kv heads (the heads' count where the file has none: the gptneox converter
    writes none), biases on q, k, v and o and on the MLP (all required there: a starcoder2 file
    without them, converted from a ``use_bias`` false checkpoint, is refused), phi2's bias on the
    head and its one norm for both sublayers; an output.weight of its own for gptneox and phi2,
    starcoder2's head the embedding where the file has none; ``rotary``: the dims RoPE turns (0: all).

    StarCoder2 slides a window on every layer in transformers, but llama.cpp's converter writes
    no window and its graph attends over the whole context: the spec has no window, as llama.cpp
    computes (transformers' tokens up to the window, every released StarCoder2's 4096 positions;
    past it, llama.cpp's). A starcoder2.attention.sliding_window key is refused as not computed."""
    if arch == "starcoder2" and not {"blk.0.attn_q.bias", "blk.0.ffn_up.bias"} & tensors:
        raise ValueError("a starcoder2 file without biases (use_bias false) is not supported: llama.cpp's loader "
                         "requires them on q, k, v, o and the MLP; load the model's Hugging Face directory")
    if arch == "starcoder2":
        log.info("a starcoder2 GGUF attends over the whole context, as llama.cpp does (the file holds no sliding "
                 "window; transformers' StarCoder2 slides its config's, 4096 positions in the released ones, and "
                 "differs past it)")
    return dict(norm_eps=decimal32(key("attention.layer_norm_epsilon")), rotary_dim=rotary,
                num_kv_heads=int(key("attention.head_count_kv", heads)), attention_bias=True, mlp_bias=True,
                tie_word_embeddings=arch == "starcoder2" and "output.weight" not in tensors,
                lm_head_bias=arch == "phi2", norm_layout="shared" if arch == "phi2" else "pre",
                mlp_activation=NEOX_ACTIVATION[arch],
                parallel_residual=arch == "gptneox" and bool(key("use_parallel_residual")),
                fused_proj=arch == "phi2" and "blk.0.attn_qkv.weight" in tensors)


def check_mlp_width(spec: Any, arch: str, tensors: dict[str, Any], name: str) -> None:
    """A file's MLP is as wide as its key says, refused at load (from the header) where not: a
    phi2 file of a checkpoint not 4 x hidden wide, since Phi2Model writes 4 x hidden whatever the
    width (llama.cpp does not load it either)."""
    up = tensors.get("blk.0.ffn_up.weight")
    if up is not None and int(up.shape[1]) != spec.ffn_size:  # GGUF shapes run innermost first
        raise ModelLoadError(f"{name}: {arch}.feed_forward_length is {spec.ffn_size} but blk.0.ffn_up.weight has "
                             f"{int(up.shape[1])} rows: the file's key and tensors disagree (llama.cpp does not load "
                             "it either; its phi2 converter writes 4 x hidden whatever the checkpoint's width)")
