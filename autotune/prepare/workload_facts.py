"""The facts about one workload's model that the levers ask for (``autotune.levers.base.ModelFacts``), each read
once, when first asked, and handed to every lever: :class:`WorkloadFacts`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from autotune.config.workload import CLASSIFIER_TASKS
from autotune.errors import WorkloadError
from autotune.levers.lora import LoraTargets, lora_targets
from autotune.models.sources import load_hf_config, meta_model, model_type, parse_model_source, resolve_task
from autotune.prepare.model_facts import factory_facts, hf_model_class, linear_layers_but_heads, missing_checkpointing

if TYPE_CHECKING:
    import torch

    from autotune.config.workload import Workload

__all__ = ["WorkloadFacts", "default_lora_refusal", "lora_targets_for"]


class WorkloadFacts:
    """The facts about a workload's model that levers ask for (``autotune.levers.base.ModelFacts``), each read
    once, when first asked: the task resolves the model's config, the class imports transformers. ``built``: the
    model as built for a trial or a job, whose layers are then read instead of a copy's on the meta device."""

    def __init__(self, workload: Workload, *, task: str | None = None, built: torch.nn.Module | None = None) -> None:
        self.workload = workload
        self._task = task
        self._built = built

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

    @functools.cached_property
    def model_type(self) -> str | None:
        return model_type(self.workload)

    @functools.cached_property
    def hf_config(self) -> Any:
        source = parse_model_source(self.workload.model)
        return load_hf_config(source, trust_remote_code=self.workload.trust_remote_code)

    @property
    def new_head(self) -> bool:
        return self.task in CLASSIFIER_TASKS

    @functools.cached_property
    def linear_layers(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        if self._built is not None:
            return linear_layers_but_heads(self._built, task=self.task)
        if self.is_factory:  # built on the meta device in a process of its own: its code may hang or crash
            facts = factory_facts(self.workload, self.task)
            return None if facts is None else (tuple(facts["lora_targets"]), tuple(facts["heads"]))
        return linear_layers_but_heads(meta_model(self.workload, self.task), task=self.task)


def lora_targets_for(
    workload: Workload,
    targets: tuple[str, ...] | None,
    *,
    task: str | None = None,
    model: torch.nn.Module | None = None,
) -> LoraTargets:
    """The layers LoRA adapts (``autotune.levers.lora.lora_targets``) for the workload's model, or for ``model``,
    the workload's as built."""
    return lora_targets(WorkloadFacts(workload, task=task, built=model), targets)


@functools.lru_cache(maxsize=16)  # a tuner asks its space's choices before every trial, and each trial's refusal
def default_lora_refusal(workload: Workload, task: str) -> str | None:
    """Why LoRA on its default targets cannot adapt the workload's model, or None. A factory's model is built on
    the meta device in a process of its own; a Hugging Face model whose targets PEFT does not name, here."""
    try:
        lora_targets_for(workload, None, task=task)
    except WorkloadError as exc:
        return str(exc)
    return None
