"""What the ``LLM`` facade's call mixins (``pooled_calls.py``, ``beam_calls.py``,
``score_calls.py``) use of it: its model, config and tokenizer, whether this rank is the driver, and the steps every call
takes (``_check_open``, ``_guard``, ``_start``, ``_run``, ``_windows``). ``api.LLM`` defines
them; the mixins only declare them, once, here."""
from __future__ import annotations

from typing import Any, Callable


class Facade:
    """The attributes of ``api.LLM`` its call mixins read (module doc)."""

    model: Any
    config: Any
    tokenizer: Any
    reasoning: Any
    is_driver: bool
    _check_open: Callable[[], None]
    _guard: Callable[..., Any]
    _start: Callable[..., Any]
    _run: Callable[..., Any]
    _windows: Callable[..., Any]
    _workload: Callable[..., Any]
    on_driver: Callable[..., Any]
