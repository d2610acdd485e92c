"""Shared fixtures: tiny random models saved with transformers, and the reference generator."""
from __future__ import annotations

import json
import random
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28], [40, 41],
           [50, 51, 52, 53, 54], [60, 61, 62, 63, 64, 65, 66]]


@dataclass
class TinyModel:
    name: str
    path: Path
    model: torch.nn.Module
    pad_id: int


def _build(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed({"opt-pre": 1, "opt-post-proj": 2, "opt-pre-proj": 3, "llama-gqa": 4,
                       "llama-tied": 5}[kind])
    if kind.startswith("opt"):
        cfg = OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                        num_attention_heads=4, max_position_embeddings=128,
                        do_layer_norm_before=kind.startswith("opt-pre"),
                        word_embed_proj_dim=32 if kind.endswith("proj") else 64,
                        pad_token_id=1, bos_token_id=2, eos_token_id=2)
        return OPTForCausalLM(cfg)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2 if kind == "llama-gqa" else 4,
                      max_position_embeddings=128, rope_theta=5000.0,
                      tie_word_embeddings=kind == "llama-tied", pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    return LlamaForCausalLM(cfg)


MODEL_KINDS = ["opt-pre", "opt-post-proj", "opt-pre-proj", "llama-gqa", "llama-tied"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyModel]:
    out = {}
    for kind in MODEL_KINDS:
        m = _build(kind).eval()
        d = tmp_path_factory.mktemp(kind)
        m.save_pretrained(d)
        out[kind] = TinyModel(kind, d, m, m.config.pad_token_id)
    return out


def reference_generate(tm: TinyModel, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """Greedy tokens from transformers' generate() on a left-padded batch (float32)."""
    s = max(map(len, prompts))
    ids = torch.tensor([[tm.pad_id] * (s - len(p)) + p for p in prompts])
    mask = (torch.arange(s)[None] >= torch.tensor([s - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = tm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len,
                                min_new_tokens=gen_len, do_sample=False, pad_token_id=tm.pad_id)
    return out[:, s:].tolist()


def write_jsonl(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(pair: bool = False) -> int:
    """A free TCP port on loopback (with ``pair``, p and p + 1 both free: the failure monitor
    listens on MASTER_PORT + 1).

    Drawn below the kernel's ephemeral range: a port handed out by ``bind(0)`` lies inside it,
    where any process's next outgoing connection (gloo opens many) may take it, or its
    neighbour, before the test's rank binds it.
    """
    high = min(_ephemeral_low(), 65535) - 2
    for _ in range(200):
        port = random.randint(20000, max(20001, high))
        try:
            for p in (port, port + 1) if pair else (port,):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port below the ephemeral range")
