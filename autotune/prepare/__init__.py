"""What a config does to a model: the levers (``autotune.levers``) applied in their order, with LoRA on a base
quantized or not, tensor parallel, FSDP and pipeline stages (whose applying is still here) where they go among
them, the same way in trials and in users' jobs; and the facts about a model that say which of them it can take,
found before any trial.

This folder is also the public function: ``autotune.prepare(model, config)`` (:mod:`.apply`).
May import ``levers``, ``config`` and ``models``; trials and the estimator use it.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload


class _CallableFolder(types.ModuleType):
    """``autotune.prepare`` is both this folder and, called, :func:`autotune.prepare.apply.prepare`:
    importing a submodule sets the package's attribute to the folder, so the folder must be the callable."""

    def __call__(self, model: torch.nn.Module, config: Any = None, **kwargs: Any) -> torch.nn.Module:
        from autotune.prepare.apply import prepare

        return prepare(model, config, **kwargs)


sys.modules[__name__].__class__ = _CallableFolder


def __getattr__(name: str) -> Any:
    if name == "prepare":  # from autotune.prepare import prepare
        from autotune.prepare.apply import prepare

        return prepare
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def refusal_before_trial(workload: Workload, config: TrialConfig, task: str | None = None) -> str | None:
    """Why this config cannot be prepared for this workload's model, said before any trial; or None.
    ``task``: the workload's, resolved here only when a lever asks for it. The model's facts are read once,
    when a lever first asks, and handed to every lever's refusal."""
    from autotune.levers import MODEL_REFUSAL_ORDER
    from autotune.prepare.workload_facts import WorkloadFacts

    facts = WorkloadFacts(workload, task=task)
    for lever in MODEL_REFUSAL_ORDER:
        refusal = lever.model_refusal(config, facts) if lever.needs_model_facts(config) else None
        if refusal is not None:
            return refusal
    return None
