"""What a ``deepseek2`` GGUF file (DeepSeek-V3 / R1 / V3.1, Kimi K2, DeepSeek-V2 / V2-Lite) says
beyond the shared keys: its latent attention (``mla_fields``), DeepSeek-V2's softmax routing
(``deepseek_v2_fields``), and its kv_b, which newer converters split in two, joined back
(``join_kv_b``). ``gguf_arch`` and ``gguf`` call these for that architecture alone."""
from __future__ import annotations

from typing import Any

import numpy as np

from .gguf_file import decimal32
from .rope_scaling import mla_softmax_scale
from .source import ModelLoadError


def deepseek_v2_fields(key: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2 / V2-Lite from a ``deepseek2`` file (gating function 1, or none: softmax):
    a float32 router's softmax, the top experts' weights renormalised where
    ``expert_weights_norm`` says (never, in its files) and times ``expert_weights_scale``; shared
    experts ungated (the dense first layers: where the file has no router). Its group-limited
    choice (DeepSeek-V2 / V2.5's ``n_group``) is refused: a file that names groups would be
    routed as llama.cpp ranks them, which the reference's does not check."""
    if int(key("expert_group_count", 1) or 1) > 1:
        raise ValueError(f"deepseek2 file with softmax routing in {key('expert_group_count')} expert groups "
                         "(DeepSeek-V2 / V2.5): not supported; use the Hugging Face directory")
    return dict(router_fp32=True, router_weights_fp32=True, norm_topk_prob=bool(key("expert_weights_norm", False)),
                routed_scaling=decimal32(float(key("expert_weights_scale", 1.0))),
                shared_expert_ffn_size=int(key("expert_shared_count", 0)) * fields["expert_ffn_size"],
                shared_expert_gated=False)


def mla_fields(key: Any) -> dict[str, Any]:
    """DeepSeek-V3's latent attention from a ``deepseek2`` file, as the Hugging Face config it
    was converted from gives it (``hf_config._mla_spec``). Newer converters describe the cache
    llama.cpp keeps (key_length = kv_lora_rank + rope dims, value_length = kv_lora_rank, one
    kv head) and the heads in ``*_length_mla``; older ones the heads in key/value_length.
    The softmax scale is the q.k head size ** -0.5 times YaRN's mscale_all_dim factor squared,
    that factor from ``yarn_log_multiplier`` (0.1 mscale_all_dim, as the converter writes it)."""
    r, dr = int(key("attention.kv_lora_rank")), int(key("rope.dimension_count"))
    if key("attention.key_length_mla", None) is not None:
        if (int(key("attention.key_length")), int(key("attention.value_length"))) != (r + dr, r):
            raise ValueError(f"deepseek2 key/value_length {key('attention.key_length')}/"
                             f"{key('attention.value_length')} with kv_lora_rank {r} and {dr} rope dims: expected "
                             f"{r + dr}/{r}; corrupt file?")
        qk, dv = int(key("attention.key_length_mla")), int(key("attention.value_length_mla"))
    else:
        qk, dv = int(key("attention.key_length")), int(key("attention.value_length"))
    yarn = key("rope.scaling.type", "none") == "yarn"
    scale = mla_softmax_scale(qk, float(key("rope.scaling.factor", 1.0)),
                              decimal32(float(key("rope.scaling.yarn_log_multiplier", 0.0))) if yarn else 0.0)
    return dict(head_dim_override=r + dr, num_kv_heads=1, kv_lora_rank=r, q_lora_rank=int(key("attention.q_lora_rank", 0)),
                qk_nope_dim=qk - dr, qk_rope_dim=dr, v_head_dim=dv, attn_scale=scale, rope_interleaved=True)


class JoinedKVB:
    """A ``deepseek2`` layer's kv_b as the Hugging Face checkpoint holds it, (heads x (nope +
    v), kv_lora_rank), from the two tensors newer converters split it into: attn_k_b (each
    head's key rows, transposed: heads x rank x nope) and attn_v_b (heads x v x rank).
    Quacks as the reader's tensor (name, shape innermost first, type, data), read when asked."""

    def __init__(self, name: str, k_b: Any, v_b: Any) -> None:
        from gguf import GGMLQuantizationType

        self.name, self._k, self._v = name, k_b, v_b
        heads, r, nope = (int(n) for n in k_b.shape[::-1])
        vh, dv, vr = (int(n) for n in v_b.shape[::-1])
        if (vh, vr) != (heads, r):
            raise ModelLoadError(f"GGUF {k_b.name} {(heads, r, nope)} and {v_b.name} {(vh, dv, vr)} do not pair: "
                                 "corrupt file?")
        self.shape = np.array([r, heads * (nope + dv)])
        self.tensor_type = GGMLQuantizationType.F32

    @property
    def data(self) -> np.ndarray:
        from gguf import dequantize

        k = np.asarray(dequantize(self._k.data, self._k.tensor_type), dtype=np.float32)
        v = np.asarray(dequantize(self._v.data, self._v.tensor_type), dtype=np.float32)
        heads, r = k.shape[0], k.shape[1]
        k = k.reshape(heads, r, -1).transpose(0, 2, 1)
        return np.ascontiguousarray(np.concatenate([k, v.reshape(heads, -1, r)], axis=1).reshape(-1, r))


def join_kv_b(tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` with each layer's attn_k_b and attn_v_b replaced by one attn_kv_b (a
    ``JoinedKVB``, or the file's own where it keeps both forms)."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".attn_k_b.weight")]:
        at = name[: -len("attn_k_b.weight")]
        v_b = out.pop(at + "attn_v_b.weight", None)
        if v_b is None:
            raise ModelLoadError(f"GGUF tensor {name} without {at}attn_v_b.weight: the file is incomplete; "
                                 "convert the model again")
        k_b = out.pop(name)
        out.setdefault(at + "attn_kv_b.weight", JoinedKVB(at + "attn_kv_b.weight", k_b, v_b))
    return out
