"""The exceptions an entry point reports as one ``error:`` line (exit 1) instead of a traceback:
a user can fix each by changing an input, a flag or the machine's state."""
from __future__ import annotations

from .config import ConfigError
from .memory.disk import DiskStoreError
from .memory.tiers import MemoryBudgetError
from .models.loader import ModelLoadError

USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ModelLoadError, DiskStoreError, MemoryBudgetError,
                                                ValueError, FileNotFoundError, PermissionError)
