"""How an embedding model pools its last hidden states into one vector (``ModelSpec.pooling``),
as its own files say: a sentence-transformers directory's ``modules.json`` and its Pooling
module's ``config.json`` (the format Qwen3-Embedding, gte-Qwen2, stella and KaLM ship in), or a
GGUF file's ``{arch}.pooling_type``; the last token where neither says (decoder embedding
models such as e5-mistral). ``--pooling`` overrides it.

What a sentence-transformers pipeline does after pooling beyond normalizing (a ``Dense``
projection, several pooling modes concatenated) is not computed: ``ModelSpec.embed_refusal``
then says so, and ``embed`` refuses the model in one line rather than give other vectors."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("flexgen_dist")

# pooling modes (``ModelSpec.pooling``): the last token; the mean, the square-root-of-length
# scaled sum, the position-weighted mean (weights 1, 2, ...) or the maximum over the input's
# tokens; its first token
POOLINGS = ("last", "mean", "cls", "max", "mean_sqrt_len", "weighted_mean")
# sentence-transformers' Pooling config fields -> mode
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
            "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
            "pooling_mode_weightedmean_tokens": "weighted_mean"}
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_* (0: none)
ST_KEPT = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
           "sentence_transformers.models.Normalize"}  # the modules whose effect ``embed`` gives


def sentence_pooling(path: Path) -> tuple[str | None, str]:
    """A sentence-transformers directory's pooling mode (None: no such pipeline here; "": its
    Pooling module sets no one mode, so ``--pooling`` must) and why ``embed`` must refuse it
    ("" where nothing stands in the way)."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return None, ""
    if not isinstance(modules, list):
        return None, ""
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    extra = [t.rsplit(".", 1)[-1] for t in types if t not in ST_KEPT]
    refusal = (f"its sentence-transformers pipeline ends with {', '.join(extra)} after pooling, which is not "
               "computed here: its vectors would differ from the model's") if extra else ""
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None, refusal
    try:
        cfg: dict[str, Any] = json.loads((path / str(pooling.get("path", "")) / "config.json").read_text())
    except (OSError, ValueError):
        return None, refusal
    modes = [m for k, m in ST_MODES.items() if cfg.get(k)]
    if len(modes) != 1:
        log.warning("%s: its sentence-transformers Pooling module sets %d modes (%s), one is computed here: embed() "
                    "needs --pooling", path.name, len(modes), ", ".join(modes) or "none")
        return "", refusal
    if cfg.get("include_prompt") is False:
        log.info("%s: its Pooling module leaves out a prompt's tokens (include_prompt false); here every token of "
                 "each input is pooled, its instruction included", path.name)
    return modes[0], refusal


def gguf_pooling(value: Any) -> str | None:
    """A GGUF file's ``{arch}.pooling_type`` as a mode (None: none given, or none that embeds)."""
    return GGUF_POOLING.get(int(value)) if isinstance(value, int) else None
