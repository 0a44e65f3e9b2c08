"""One exception hierarchy for everything autotune refuses or cannot do.

Messages name the flag (or file, or key) that is wrong and say how to fix it, so the CLI can
print them as one line and exit with status 2.
"""

from __future__ import annotations

__all__ = ["AutotuneError", "ConfigError", "WorkloadError", "StorageError"]


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose."""


class ConfigError(AutotuneError):
    """A knob value, or a combination of knobs, that cannot be run."""


class WorkloadError(AutotuneError):
    """A workload (model source, task, batch, device) that cannot be built."""


class StorageError(AutotuneError):
    """A study storage that cannot be opened or written."""
