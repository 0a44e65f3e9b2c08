"""autotune: the fastest training configuration of a PyTorch model that fits on this hardware.

The public API is re-exported here and imported lazily, so ``import autotune`` stays cheap
(torch, transformers, DeepSpeed and PEFT load only in the commands and trials that use them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autotune.version import __version__ as __version__  # re-exported

_EXPORTS = {
    "AutotuneError": "autotune.errors",
    "ConfigError": "autotune.errors",
    "WorkloadError": "autotune.errors",
    "StorageError": "autotune.errors",
    "Workload": "autotune.config.workload",
    "TrialConfig": "autotune.config.knobs",
    "TrialResult": "autotune.trial.result",
    "TrialStatus": "autotune.trial.result",
    "PhaseTimings": "autotune.trial.result",
    "run_trial": "autotune.trial.runner",
    "run_script_trial": "autotune.scripts.runner",
    "current_config": "autotune.scripts.current",
    "parse_size": "autotune.sizes",
    "deepspeed_config": "autotune.config.deepspeed_config",
    "find": "autotune.search.tuner",
    "tune": "autotune.search.tuner",
    "load_summary": "autotune.study.records",
    "SearchSpace": "autotune.search.space",
    "load_space": "autotune.search.presets",
    "StudySummary": "autotune.study.summary",
    "TrialRecord": "autotune.study.summary",
    "export_config": "autotune.output.exporters",
    "write_report": "autotune.output.report",
}

__all__ = sorted([*_EXPORTS, "prepare"])

if TYPE_CHECKING:
    from autotune.config.deepspeed_config import deepspeed_config
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.errors import AutotuneError, ConfigError, StorageError, WorkloadError
    from autotune.output.exporters import export_config
    from autotune.output.report import write_report
    from autotune.prepare.apply import prepare
    from autotune.scripts.current import current_config
    from autotune.scripts.runner import run_script_trial
    from autotune.search.presets import load_space
    from autotune.search.space import SearchSpace
    from autotune.search.tuner import find, tune
    from autotune.sizes import parse_size
    from autotune.study.records import load_summary
    from autotune.study.summary import StudySummary, TrialRecord
    from autotune.trial.result import PhaseTimings, TrialResult, TrialStatus
    from autotune.trial.runner import run_trial


def __getattr__(name: str) -> Any:
    if name == "prepare":  # the folder autotune/prepare, which is callable: autotune.prepare(model, config)
        return importlib.import_module("autotune.prepare")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
