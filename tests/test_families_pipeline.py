"""Every supported family over a 2-rank pipeline (torchrun, gloo on loopback): half the weights
on disk, the cache in RAM, greedy tokens identical to transformers' in float32. Prompts run
past the sliding windows, so the ring caches are crossed too."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import PROMPTS, TinyModel, read_jsonl, reference_generate, write_jsonl
from test_gemma import _gemma2, _gemma3
from test_pipeline import torchrun

pytestmark = [pytest.mark.multinode, pytest.mark.slow]
GEN = 6
LONG = [p * 3 for p in PROMPTS]
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=None)  # no EOS: the reference never suppresses one


def _llama31() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    return LlamaForCausalLM(LlamaConfig(**SMALL, rope_scaling=rope, tie_word_embeddings=False))


def _mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=8))


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8, max_window_layers=2))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
    return m


def _qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return m


def _phi3() -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi-4-mini's shape of RoPE: LongRoPE (the short factors here: every sequence is within the
    # original context, and its attention factor from 512 / 128) over 3/4 of each head
    rope = {"rope_type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(6)],
            "short_factor": [1.0 + 0.1 * i for i in range(6)]}
    cfg = dict(SMALL, max_position_embeddings=512)
    return Phi3ForCausalLM(Phi3Config(**cfg, original_max_position_embeddings=128, sliding_window=8,
                                      rope_scaling=rope, partial_rotary_factor=0.75))


def _granite() -> torch.nn.Module:
    from transformers import GraniteConfig, GraniteForCausalLM

    return GraniteForCausalLM(GraniteConfig(**SMALL, embedding_multiplier=12.0, attention_multiplier=0.5,
                                            residual_multiplier=0.22, logits_scaling=8.0))


def _smollm3() -> torch.nn.Module:
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    return SmolLM3ForCausalLM(SmolLM3Config(**SMALL, use_sliding_window=True, sliding_window=8))


def _olmo3() -> torch.nn.Module:
    from transformers import Olmo3Config, Olmo3ForCausalLM

    return Olmo3ForCausalLM(Olmo3Config(**SMALL, sliding_window=8))


def _cohere2() -> torch.nn.Module:
    from transformers import Cohere2Config, Cohere2ForCausalLM

    return Cohere2ForCausalLM(Cohere2Config(**SMALL, sliding_window=8, logit_scale=0.25))


def _glm4() -> torch.nn.Module:
    from transformers import Glm4Config, Glm4ForCausalLM

    return Glm4ForCausalLM(Glm4Config(**SMALL, head_dim=16))


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama3.1": _llama31, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "phi3": _phi3,
    "granite": _granite, "smollm3": _smollm3, "olmo3": _olmo3, "cohere2": _cohere2, "glm4": _glm4, "gemma2": _gemma2, "gemma3": _gemma3,
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_over_two_ranks_matches_transformers(name: str, tmp_path: Path) -> None:
    torch.manual_seed(31)
    m = FAMILIES[name]().eval()
    m.save_pretrained(tmp_path / "m")
    tm = TinyModel(name, tmp_path / "m", m, 0)
    ref = reference_generate(tm, LONG, GEN)
    out = tmp_path / "o.jsonl"
    r = torchrun(2, ["--model", str(tm.path), "--prompts", str(write_jsonl(tmp_path / "p.jsonl", LONG)),
                     "--gen-len", str(GEN), "--ignore-eos", "--gpu-batch-size", "2", "--num-gpu-batches", "2",
                     "--percent", "0", "50", "0", "100", "100", "0", "--offload-dir", str(tmp_path / "off"),
                     "--output", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["tokens"] for x in read_jsonl(out)] == ref
