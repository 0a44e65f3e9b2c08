"""What every lever is: :class:`Lever`, and the facts about a model that its refusals are handed.

A lever is one knob family (its fields are a frozen mixin of :class:`~autotune.config.knobs.TrialConfig`).
Its class says, for a config, which of its values are wrong (:meth:`Lever.check`), why they cannot go with the
other levers' values (:meth:`Lever.conflict`) or run for a workload on a device (:meth:`Lever.refusal`), why a
model cannot take them (:meth:`Lever.model_refusal`, from :class:`ModelFacts` read once per workload), how it
changes a built model (:meth:`Lever.apply`) and its words in a config's label (:meth:`Lever.labels`). A lever
that says nothing for one of these keeps the default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["Lever", "ModelFacts", "is_count"]


class ModelFacts(Protocol):
    """What a lever's refusal may ask about the workload's model; read lazily, once per workload
    (``autotune.prepare.model_facts.WorkloadFacts`` reads them)."""

    @property
    def model(self) -> str:
        """The ``--model`` reference, for messages."""
        ...

    @property
    def is_factory(self) -> bool:
        """The model is a factory's (``module:function``), whose layers autotune does not know."""
        ...

    @property
    def task(self) -> str:
        """The workload's task (``causal-lm``, ``seq-cls``, ...)."""
        ...

    @property
    def model_class(self) -> type | None:
        """The Hugging Face model class for the task, or None (a factory, or unknown)."""
        ...

    @property
    def missing_checkpointing(self) -> str | None:
        """Why the model cannot checkpoint activations, or None (it can, or it is unknown before a trial)."""
        ...


class Lever:
    """One knob family. Subclasses set ``name`` and ``fields`` and override what concerns them."""

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]  # its TrialConfig fields, in their order

    def check(self, config: TrialConfig) -> None:
        """Raise ConfigError when one of this lever's values (alone, or with its own others) is not known."""

    def conflict(self, config: TrialConfig) -> str | None:
        """Why this lever's values cannot go with the other levers' values, whatever the workload and device;
        None: they can. Asked before the layout's checks; :meth:`refusal` after them."""
        return None

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        """Why this workload on ``device`` (with what is installed) cannot run this lever's values; None: it can."""
        return None

    def needs_model_facts(self, config: TrialConfig) -> bool:
        """Whether :meth:`model_refusal` has anything to ask of the model for this config."""
        return False

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        """Why the workload's model cannot take this lever's values, said before any trial; None: it can."""
        return None

    def apply(self, model: torch.nn.Module, config: TrialConfig, *, source: str) -> torch.nn.Module:
        """Apply the lever to a built model (in trials and in users' jobs alike); ``source`` names the model
        in messages. Returns the model to go on with."""
        return model

    def labels(self, config: TrialConfig) -> list[str]:
        """Its words in ``TrialConfig.describe()`` (none when the lever is at its default)."""
        return []

    def __repr__(self) -> str:
        return f"<lever {self.name}>"


def is_count(value: Any) -> bool:
    """A whole number of at least 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
