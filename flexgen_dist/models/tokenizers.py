"""A model's tokenizer: a Hugging Face directory's, or the one a GGUF file carries (converted
by transformers once per file and version, then read from a cache)."""
from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any

from ..kernels import cache_root

log = logging.getLogger("flexgen_dist")


# transformers reads these architectures' GGUF tokenizers from 5.18 on: 5.17 has none for the
# Gemma files and builds Phi-3's with other ids for the same text.
GGUF_TOKENIZER_SINCE = {"phi3": (5, 18), "gemma": (5, 18), "gemma2": (5, 18), "gemma3": (5, 18)}


def transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = (re.findall(r"\d+", transformers.__version__) + ["0", "0"])[:2]
    return int(major), int(minor)


def load_tokenizer(path: Path, gguf_file: str | None = None, arch: str | None = None) -> Any | None:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        if gguf_file:
            return gguf_tokenizer(path / gguf_file, arch)
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                   "vocab.json", "tokenizer.model")):
            return None
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - a model without a usable tokenizer still runs on ids
        if gguf_file:  # a GGUF file carries its tokenizer: say why it is not used
            why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
            log.warning("%s: its tokenizer cannot be built (%s); prompts must be token ids", gguf_file, why)
        return None


def gguf_tokenizer(gguf: Path, arch: str | None = None) -> Any:
    """Tokenizer of a GGUF file; converted once per transformers version, then read from a
    cache (seconds -> ms). Refused where the installed transformers reads ``arch``'s wrongly."""
    import transformers
    from transformers import AutoTokenizer

    need = GGUF_TOKENIZER_SINCE.get(arch or "")
    if need and transformers_version() < need:
        raise ValueError(f"transformers {transformers.__version__} reads a {arch} GGUF tokenizer wrongly or not "
                         f"at all: pip install 'transformers>={need[0]}.{need[1]}'")
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode()
                         ).hexdigest()[:16]
    cache = cache_root() / "tokenizers" / key
    if (cache / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception:  # noqa: BLE001 - a broken cache entry is rebuilt below
            pass
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ValueError as e:
        if "architecture" not in str(e):
            raise
        # transformers rebuilds a model config from the file first, and knows fewer GGUF
        # architectures than tokenizers: build the tokenizer alone from the file's tokenizer.*
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    try:
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cache) if not cache.exists() else None
    except OSError:
        pass  # an unwritable cache only costs time
    return tok
