"""autotune: the fastest training configuration of a PyTorch model that fits on this hardware.

The public API is re-exported here and imported lazily, so ``import autotune`` stays cheap
(torch, transformers, DeepSpeed and PEFT load only in the commands and trials that use them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AutotuneError": "autotune.errors",
    "ConfigError": "autotune.errors",
    "WorkloadError": "autotune.errors",
    "StorageError": "autotune.errors",
    "Workload": "autotune.workload",
    "TrialConfig": "autotune.knobs",
    "TrialResult": "autotune.result",
    "TrialStatus": "autotune.result",
    "PhaseTimings": "autotune.result",
    "run_trial": "autotune.runner",
    "parse_size": "autotune.sizes",
    "deepspeed_config": "autotune.deepspeed_config",
    "find": "autotune.tuner",
    "tune": "autotune.tuner",
    "load_summary": "autotune.study",
    "SearchSpace": "autotune.space",
    "load_space": "autotune.space",
    "StudySummary": "autotune.summary",
    "TrialRecord": "autotune.summary",
    "export_config": "autotune.exporters",
    "write_report": "autotune.report",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from autotune.deepspeed_config import deepspeed_config
    from autotune.errors import AutotuneError, ConfigError, StorageError, WorkloadError
    from autotune.knobs import TrialConfig
    from autotune.result import PhaseTimings, TrialResult, TrialStatus
    from autotune.runner import run_trial
    from autotune.sizes import parse_size
    from autotune.exporters import export_config
    from autotune.report import write_report
    from autotune.space import SearchSpace, load_space
    from autotune.study import load_summary
    from autotune.summary import StudySummary, TrialRecord
    from autotune.tuner import find, tune
    from autotune.workload import Workload


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
