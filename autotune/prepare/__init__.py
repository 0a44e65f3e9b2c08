"""What a config does to a model: LoRA adapters, activation checkpointing, the chunked loss, where
weights are held per precision (next, attention and compile), the optimizer and activation offload's
saved-tensor hooks, applied the same way in trials and in users' jobs, and the facts about a model
that say which of them it can take, found before any trial.

This folder is also the public function: ``autotune.prepare(model, config)`` (:mod:`.apply`).
May import ``config`` and ``models``; trials and the estimator use it.
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
    ``task``: the workload's, resolved here only when a knob needs it."""
    if task is None and (config.loss_chunks is not None or config.attention != "auto"):
        from autotune.models.sources import (
            resolve_task,  # reads the model's config: only when asked
        )

        task = resolve_task(workload)
    if config.loss_chunks is not None:
        from autotune.prepare.loss import chunked_loss_refusal

        assert task is not None  # resolved above
        refusal = chunked_loss_refusal(workload, task)
        if refusal is not None:
            return refusal
    if config.attention != "auto":
        from autotune.prepare.attention import attention_refusal

        assert task is not None  # resolved above
        refusal = attention_refusal(workload, config.attention, task)
        if refusal is not None:
            return refusal
    if config.tp > 1:
        from autotune.prepare.tensor_parallel import tensor_parallel_refusal

        refusal = tensor_parallel_refusal(workload, config)
        if refusal is not None:
            return refusal
    if config.pp > 1:
        from autotune.prepare.pipeline import pipeline_refusal

        refusal = pipeline_refusal(workload, config)
        if refusal is not None:
            return refusal
    if config.checkpoint_every > 1:
        from autotune.prepare.checkpointing import every_n_refusal

        return every_n_refusal(workload)
    if config.checkpointing:
        from autotune.models.sources import parse_model_source
        from autotune.prepare.checkpointing import missing_checkpointing

        # A Hugging Face model's class says so from its config; a factory's model is asked by its trial.
        missing = None if parse_model_source(workload.model).kind == "factory" else missing_checkpointing(workload)
        if missing is not None:
            return f"--checkpointing on: {missing}; use --checkpointing off"
    return None
