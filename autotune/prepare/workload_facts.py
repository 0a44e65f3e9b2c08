"""The facts about one workload's model that the levers' refusals ask for (``autotune.levers.base.ModelFacts``),
each read once, when first asked, and handed to every lever: :class:`WorkloadFacts`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from autotune.errors import WorkloadError
from autotune.models.sources import parse_model_source, resolve_task
from autotune.prepare.lora import lora_targets
from autotune.prepare.model_facts import hf_model_class, missing_checkpointing

if TYPE_CHECKING:
    from autotune.config.workload import Workload

__all__ = ["WorkloadFacts", "default_lora_refusal"]


class WorkloadFacts:
    """The facts about a workload's model that levers' refusals ask for (``autotune.levers.base.ModelFacts``),
    each read once, when first asked: the task resolves the model's config, the class imports transformers."""

    def __init__(self, workload: Workload, *, task: str | None = None) -> None:
        self.workload = workload
        self._task = task

    @property
    def model(self) -> str:
        return self.workload.model

    @functools.cached_property
    def is_factory(self) -> bool:
        return parse_model_source(self.workload.model).kind == "factory"

    @property
    def task(self) -> str:
        if self._task is None:
            self._task = resolve_task(self.workload)  # reads the model's config: only when asked
        return self._task

    @functools.cached_property
    def model_class(self) -> type | None:
        return hf_model_class(self.workload, self.task)

    @functools.cached_property
    def missing_checkpointing(self) -> str | None:
        return missing_checkpointing(self.workload)

    @property
    def default_lora_refusal(self) -> str | None:
        return default_lora_refusal(self.workload, self.task)


@functools.lru_cache(maxsize=16)  # a tuner asks its space's choices before every trial, and each trial's refusal
def default_lora_refusal(workload: Workload, task: str) -> str | None:
    """Why LoRA on its default targets cannot adapt the workload's model, or None. A factory's model is built on
    the meta device in a process of its own; a Hugging Face model whose targets PEFT does not name, here."""
    try:
        lora_targets(workload, None, task=task)
    except WorkloadError as exc:
        return str(exc)
    return None
