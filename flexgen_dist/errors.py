"""The exceptions an entry point reports as one ``error:`` line (exit 1) instead of a traceback:
a user can fix each by changing an input, a flag or the machine's state."""
from __future__ import annotations

import sys
from typing import Callable

from .config import ConfigError
from .memory.disk import DiskStoreError
from .memory.tiers import MemoryBudgetError
from .models.loader import ModelLoadError

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ModelLoadError, DiskStoreError, MemoryBudgetError,
                                                ValueError, FileNotFoundError, PermissionError)


def exit_code_of(body: Callable[[], int]) -> int:
    """Run an entry point's body: a user error is one ``error:`` line and exit 1, Ctrl-C 130
    (what was written so far stays on disk)."""
    try:
        return body()
    except KeyboardInterrupt:
        print("error: interrupted; outputs written so far are kept", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
