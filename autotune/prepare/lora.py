"""LoRA: which layers it adapts (PEFT's default targets where PEFT has them, else every linear layer
but the task head) and applying it to a built model. Trials, the estimator and the peft export all
resolve targets here, so a user's job adapts what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.config.workload import CLASSIFIER_TASKS
from autotune.errors import ConfigError, WorkloadError
from autotune.models.sources import meta_model, model_type, parse_model_source
from autotune.prepare.model_facts import factory_facts, linear_layers_but_heads

if TYPE_CHECKING:
    import torch

    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["LoraTargets", "lora_targets", "lora_targets_note", "apply_lora"]


@dataclass(frozen=True)
class LoraTargets:
    """What ``LoraConfig`` gets for a workload and config, and the same said in words.

    Trials and the peft export both use it, so the user's job adapts what was measured.
    """

    target_modules: str | tuple[str, ...]  # "all-linear" (PEFT's keyword) or module names
    modules_to_save: tuple[str, ...] | None  # heads trained in full (a classifier's), as PEFT saves them
    task_type: str | None  # PEFT's TaskType value; None for a factory's plain module
    note: str  # e.g. "q_proj, v_proj (PEFT's default targets for llama)"

    def peft_kwargs(self) -> dict[str, Any]:
        """``LoraConfig`` keyword arguments: what a trial applies and the peft export writes."""
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        # PEFT's SEQ_CLS adds classifier and score to modules_to_save itself: name only other heads.
        own = ("classifier", "score") if self.task_type == "SEQ_CLS" else ()
        extra = [name for name in self.modules_to_save or () if name not in own]
        return {"target_modules": targets, "modules_to_save": extra or None, "task_type": self.task_type}


# PEFT has no masked-LM type: a masked LM's LoRA is a plain PeftModel.
_PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq-lm": "SEQ_2_SEQ_LM"}


def lora_targets(
    workload: Workload, targets: tuple[str, ...] | None, *, task: str, model: torch.nn.Module | None = None
) -> LoraTargets:
    """Resolve ``--lora-targets`` (None: the default) for the workload's model.

    The default is PEFT's own targets for the architecture where PEFT has them, else every linear
    layer but the task head, and a classifier's head then trains in full (as PEFT's SEQ_CLS does).
    ``model``: the built model, if there is one; else the fallback builds one on the meta device
    (a factory's in a separate process: its code may hang or crash).
    """
    source = parse_model_source(workload.model)
    task_type = None if source.kind == "factory" else _PEFT_TASK_TYPES.get(task)
    note = lora_targets_note(workload, targets, task=task)
    if targets == ("all-linear",):
        return LoraTargets("all-linear", None, task_type, note)
    if targets is not None:
        return LoraTargets(tuple(targets), None, task_type, note)
    defaults = _peft_default_targets(model_type(workload))
    if defaults is not None:  # named here: PEFT's own lookup fails on some (Mixtral under transformers 5)
        # PEFT has no image task type: its recipe names the classifier to train in full.
        return LoraTargets(defaults, ("classifier",) if task == "image-cls" else None, task_type, note)
    if model is not None:
        found, heads = linear_layers_but_heads(model, task=task)
    elif source.kind == "factory":
        facts = factory_facts(workload, task)
        if facts is None:
            raise WorkloadError(
                f"--model {workload.model}: building it on the meta device failed, so its linear "
                "layers are unknown; name the modules to adapt with --lora-targets"
            )
        found, heads = tuple(facts["lora_targets"]), tuple(facts["heads"])
    else:
        found, heads = linear_layers_but_heads(meta_model(workload, task), task=task)
    if not found:
        raise WorkloadError(
            f"--lora-rank: the model from --model {workload.model} has no linear layer besides "
            "its task head to adapt; name the modules with --lora-targets"
        )
    return LoraTargets(found, heads if task in CLASSIFIER_TASKS and heads else None, task_type, note)


def lora_targets_note(workload: Workload, targets: tuple[str, ...] | None, *, task: str) -> str:
    """Which layers LoRA adapts, in words, without building the model."""
    if targets == ("all-linear",):
        return "every linear layer but the output layer or classifier (PEFT's all-linear)"
    if targets is not None:
        return ", ".join(targets)
    name = model_type(workload)
    defaults = _peft_default_targets(name)
    if defaults is not None:
        return f"{', '.join(defaults)} (PEFT's default targets for {name})"
    return f"every linear layer but the task head (PEFT has no default targets for {name or 'a custom model'})"


def apply_lora(model: torch.nn.Module, config: TrialConfig, workload: Workload, *, task: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    try:
        plan = lora_targets(workload, config.lora_targets, task=task, model=model)
    except WorkloadError as exc:
        raise ConfigError(str(exc)) from exc
    assert config.lora_rank is not None and config.effective_lora_alpha is not None, "a LoRA config only"
    lora = LoraConfig(
        r=config.lora_rank, lora_alpha=config.effective_lora_alpha, lora_dropout=0.0, **plan.peft_kwargs()
    )
    try:
        return get_peft_model(model, lora)
    except (ValueError, TypeError) as exc:  # TypeError: e.g. a target inside a head PEFT trains in full
        raise ConfigError(
            f"--lora-targets: {str(exc).splitlines()[0]}; name the modules to adapt, "
            "e.g. --lora-targets q_proj,v_proj, or --lora-targets all-linear"
        ) from exc


def _peft_default_targets(model_type: str | None) -> tuple[str, ...] | None:
    if model_type is None:
        return None
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    targets = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    return tuple(targets) if targets else None
