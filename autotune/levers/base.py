"""What every lever is: :class:`Lever`, and the facts about a model that its refusals are handed.

A lever is one knob family (its fields are a frozen mixin of :class:`~autotune.config.knobs.TrialConfig`).
Its class says, for a config, which of its values are wrong (:meth:`Lever.check`), why they cannot go with the
other levers' values (:meth:`Lever.conflict`) or run for a workload on a device (:meth:`Lever.refusal`), why a
model cannot take them (:meth:`Lever.model_refusal`, from :class:`ModelFacts` read once per workload), how it
changes a built model (:meth:`Lever.apply`), its words in a config's label (:meth:`Lever.labels`), its keys in
Transformers' ``TrainingArguments``, Lightning's ``Trainer`` and Accelerate's ``Accelerator``
(:meth:`Lever.trainer_arguments` and its two neighbours) and torchtitan's job config
(:meth:`Lever.torchtitan_keys`), what a job applies in its own code for it
where no library's config can (:meth:`Lever.in_code`), and its axes
in a search space (:class:`Axis`: the space file's keys it owns, how their values parse, which of them can run
for a workload on a device, and the tuner's parameters they are). A lever that says nothing for one of these
keeps the default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from autotune.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "Axis",
    "Flag",
    "Lever",
    "ModelFacts",
    "is_count",
    "divisors",
    "overriding",
    "a_bool",
    "one_of",
    "on_off",
    "keep_off_where_refused",
]


class ModelFacts(Protocol):
    """What a lever's refusal may ask about the workload's model; read lazily, once per workload
    (``autotune.prepare.workload_facts.WorkloadFacts`` reads them)."""

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

    @property
    def default_lora_refusal(self) -> str | None:
        """Why LoRA on its default targets cannot adapt the model (nothing but its task head is linear, or a
        factory's model cannot be built to find its layers), or None."""
        ...

    @property
    def model_type(self) -> str | None:
        """The Hugging Face config's ``model_type`` (``llama``), or None (a factory's model)."""
        ...

    @property
    def new_head(self) -> bool:
        """The task puts a new head on the model (a classifier), which trains in full beside LoRA's adapters."""
        ...

    @property
    def hf_config(self) -> Any:
        """The model's Hugging Face config (a ``transformers.PretrainedConfig``); asked only of a model that is not
        a factory's."""
        ...

    @property
    def linear_layers(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """The last names (as PEFT matches them) of the model's linear layers outside its task head, and of its
        heads: of the built model where the facts were read from one, else of one built on the meta device;
        None where it cannot be built to find out (a factory whose build failed)."""
        ...


@dataclass(frozen=True)
class Axis:
    """One key of a search space file that a lever owns (``knobs.<key>``, the ``SearchSpace`` field of that name,
    and the tuner's parameter of that name): a tuple of values, each parsed from the file on load."""

    key: str
    allowed: str  # what a file may give it, said in its errors ("a list of true/false")
    default: Any  # its one value where a file leaves the key out (a config's default)
    parse: Callable[[Any], Any]  # one value in a file -> the value the space holds; None: not allowed
    # A tuner parameter only where the space's values that can run here are more than the default: the studies,
    # grids and samplers of the spaces before it see the parameters they always had.
    moved_only: bool = False
    # Added after the first studies: a space at the default keeps the digest it had before (its studies resume),
    # and a stored config's parameters may lack it.
    added_later: bool = False


@dataclass(frozen=True)
class Flag:
    """One command-line option a lever owns, which every command that takes a config offers (``autotune.cli``):
    ``names`` for the field ``field`` (whose help it shows, after ``help_prefix``), its type and default as typed,
    and how a typed value makes the lever's fields (``parse``; by default the value is the field's)."""

    field: str
    names: tuple[str, ...]
    type: Any = str
    default: Any = None
    help_prefix: str = ""
    parse: Callable[[Any], dict[str, Any]] | None = None

    def fields_of(self, value: Any) -> dict[str, Any]:
        """The config's fields from the value typed (a bad one: ConfigError naming the flag)."""
        return self.parse(value) if self.parse is not None else {self.field: value}

    @classmethod
    def on_off(cls, field: str, flag: str) -> Flag:
        """An on/off option for a bool field (on, off, true, false, yes, no, 1, 0)."""
        return cls(field, (flag,), str, "off", "off or on. ", lambda value: {field: on_off(value, flag)})


class Lever:
    """One knob family. Subclasses set ``name`` and ``fields`` and override what concerns them."""

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]  # its TrialConfig fields, in their order
    axes: ClassVar[tuple[Axis, ...]] = ()  # its keys in a search space, in the order a space lists them
    flags: ClassVar[tuple[Flag, ...]] = ()  # its command-line options, in its fields' order

    def check(self, config: TrialConfig) -> None:
        """Raise ConfigError when one of this lever's values (alone, or with its own others) is not known, or (the
        layout's levers) cannot go with the values of the levers checked before it: a config refused here is
        never built."""

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

    def trainer_arguments(self, config: TrialConfig) -> dict[str, Any]:
        """Its keys of ``transformers.TrainingArguments`` (the hf export, and a Trainer script's trial); raise
        ConfigError, naming ``--format hf``, where the Trainer has none for its values."""
        return {}

    def format_refusal(self, config: TrialConfig, format_name: str, device_type: str) -> str | None:
        """Why export format ``format_name`` (``autotune export --format``) cannot carry this lever's values for a
        job on a ``device_type`` device (a line that names the format and what to export instead); None: it can.
        A format that cannot must not drop them: the job would train another config than the one measured."""
        return None

    def accelerate_config(self, config: TrialConfig) -> dict[str, Any]:
        """Its keys in an ``accelerate config`` file (the accelerate export), beside the Accelerator's own."""
        return {}

    def lightning_arguments(self, config: TrialConfig) -> dict[str, Any]:
        """Its keys among ``lightning.pytorch.Trainer``'s arguments (what the model's code does not apply)."""
        return {}

    def accelerate_arguments(self, config: TrialConfig) -> dict[str, Any]:
        """Its keys among ``accelerate.Accelerator``'s arguments (what the model's code does not apply)."""
        return {}

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        """Its keys in torchtitan's TOML job config (the torchtitan export), by section; raise ConfigError, naming
        ``--format torchtitan``, where that config has none for its values. By default a lever has none: at its
        fields' defaults it says nothing, at any other value it refuses (an export must not drop a value)."""
        defaults = {field.name: field.default for field in fields(config)}
        changed = [name for name in self.fields if getattr(config, name) != defaults[name]]
        if not changed:
            return {}
        said = " ".join(self.labels(config)) or ", ".join(f"{name}={getattr(config, name)!r}" for name in changed)
        raise ConfigError(
            f"--format torchtitan: this config trains with {said}, for which torchtitan's job config has no key; "
            "export --format json and apply it with autotune.prepare, or pick a config without it"
        )

    # -- the layout: how the ranks hold the model ------------------------------------------------------------
    def model_ranks(self, config: TrialConfig) -> int:
        """Ranks one copy of the model is split over by this lever's values (tensor, pipeline parallel); 1: it
        splits nothing. A config's model-parallel ranks are the product over the levers."""
        return 1

    def layout_word(self, config: TrialConfig) -> str | None:
        """Its word in a layout as a search space writes it (``tp2+sp``, ``pp2:1f1b``); None: it splits nothing."""
        return None

    def layout_fields(self, word: str) -> dict[str, Any] | None:
        """The config's fields of one word of a layout (``tp2+sp``) where the word is this lever's; None: it is not
        (a space's ``layout`` values are read word by word, each by the lever it names)."""
        return None

    def layout_words(self, nproc: int) -> list[str]:
        """This lever's words for every split of ``nproc`` ranks, which a space's ``layout: auto`` offers."""
        return []

    def layout_flag(self, config: TrialConfig) -> str | None:
        """Its split's flag as typed (``--tp 2``), for a config's ``split_flags`` in messages; None: it splits nothing.
        (The sharding's flags are functions of their modules: ``zero_flag``, ``fsdp_flag``, ``offload_flag``.)"""
        return None

    def stage_refusal(self, config: TrialConfig) -> str | None:
        """Why its values cannot run on pipeline stages (``--pp``; the pipeline's check says it); None: they can."""
        return None

    def maths_note(self, config: TrialConfig) -> str | None:
        """How its values change what is trained beyond the precision and LoRA (said in every output's note of
        what is trained, ``autotune.study.summary.what_is_trained``); None: they do not."""
        return None

    def in_code(self, config: TrialConfig) -> list[str]:
        """What a job must apply in its own code for this lever's values, because no library's config carries
        them: a line each, for the exports' headers (none at its default)."""
        return []

    def header_lines(self, config: TrialConfig) -> list[str]:
        """Its lines in a YAML export's header (the Lightning and Accelerate formats), for what the format's keys
        leave unsaid: how the job turns it on, or that it is off."""
        return []

    # -- its axes in a search space (``autotune.search.space``) ------------------------------------------------
    def runnable(
        self, key: str, values: tuple[Any, ...], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> tuple[Any, ...]:
        """The values of its axis ``key`` that a space offers and that can run for this workload on ``device``
        (``facts``: its model's, read only when asked). None can: raise ConfigError, ``knobs.<key> [...]: why;
        what to add`` (the space prefixes its name). By default: an on/off axis without on where
        :meth:`on_refusal` says why."""
        return keep_off_where_refused(key, values, self.on_refusal(key, device))

    def dropped(
        self, space: Mapping[str, tuple[Any, ...]], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> list[str]:
        """One line for each refusal that makes :meth:`runnable` leave out values the space offers (``space``: its
        axes' values there), said once by the tuner; the precisions a device lacks go unsaid. By default:
        :meth:`on_refusal` for each on/off axis the space turns on."""
        refusals = [self.on_refusal(axis.key, device) for axis in self.axes if True in space[axis.key]]
        return [refusal for refusal in refusals if refusal is not None]

    def on_refusal(self, key: str, device: DeviceInfo) -> str | None:
        """Why its on/off axis ``key`` cannot be on for any workload on ``device`` (None: it can)."""
        return None

    def param_of(self, key: str, config: TrialConfig) -> Any:
        """The value of the tuner's parameter ``key`` (one of its axes) that makes ``config``."""
        return getattr(config, key)

    def config_fields(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Its TrialConfig fields from one value per tuner parameter (the inverse of :meth:`param_of`)."""
        return {
            axis.key: params.get(axis.key, axis.default) if axis.added_later else params[axis.key] for axis in self.axes
        }

    def __repr__(self) -> str:
        return f"<lever {self.name}>"


def overriding(levers: tuple[Lever, ...], method: str) -> tuple[Lever, ...]:
    """Those of ``levers`` (in their order) whose class overrides ``method`` of :class:`Lever`: a loop that asks
    every lever skips the defaults' answers (a search space builds and validates millions of configs)."""
    return tuple(lever for lever in levers if getattr(type(lever), method) is not getattr(Lever, method))


def is_count(value: Any) -> bool:
    """A whole number of at least 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def divisors(n: int) -> list[int]:
    """The whole numbers that divide ``n``, smallest first (what a message offers in place of a bad split)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def a_bool(value: Any) -> bool | None:
    """A space file's true/false (None: anything else)."""
    return value if isinstance(value, bool) else None


def one_of(names: tuple[str, ...]) -> Callable[[Any], Any]:
    """The parser of a space file's value among ``names`` (None: anything else)."""
    return lambda value: value if value in names else None


def on_off(value: str, flag: str) -> bool:
    """A command line's on/off for ``flag`` (ConfigError naming it for anything else)."""
    if value.lower() in ("on", "true", "yes", "1"):
        return True
    if value.lower() in ("off", "false", "no", "0"):
        return False
    raise ConfigError(f"{flag} {value!r} must be on or off")


def keep_off_where_refused(key: str, values: tuple[Any, ...], refusal: str | None) -> tuple[Any, ...]:
    """An on/off axis's values without ``True`` where ``refusal`` says why on cannot run here (None: it can)."""
    kept = tuple(value for value in values if not value or refusal is None)
    if not kept:
        raise ConfigError(f"knobs.{key} [true]: {refusal}; add false")
    return kept
