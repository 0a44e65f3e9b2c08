"""Search spaces: which values of each knob the tuner may try, from a YAML preset or file.

A space file has ``knobs`` (one entry per TrialConfig knob, a value or a list of values) and
optional ``description``, ``n_trials`` and ``patience``. It is checked on load: an unknown
key or a bad value is an error naming the file, the key and what is allowed.

Knobs that change what is trained (precision, LoRA) take only the values the file lists; the
presets keep LoRA off except ``lora``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.config.knobs import FSDP_MODES, OFFLOADS, PP_SCHEDULES, ZERO_STAGES, TrialConfig
from autotune.errors import ConfigError
from autotune.levers import AXIS_ORDER, DROPPED_ORDER, FSDP, LABEL_ORDER, LORA, ZERO
from autotune.levers.base import Axis, Lever
from autotune.levers.lora import QUANTIZATIONS, QUANTIZE_REFUSAL, quantize_library_refusal
from autotune.search.candidates import FieldGroup, runnable_configs

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload
    from autotune.levers.base import ModelFacts

__all__ = ["SearchSpace", "parse_space", "KNOBS", "LATER_KNOBS", "later_knob_value"]

# The levers' axes (autotune/levers/), in the order a space lists them.
_AXES: tuple[tuple[Lever, Axis], ...] = tuple((lever, axis) for lever in AXIS_ORDER for axis in lever.axes)
# Knob -> what the file may give it (said in errors).
KNOBS = {
    "micro_batch": "auto, or a list of whole numbers >= 1 that divide the per-rank batch",
    **{axis.key: axis.allowed for _, axis in _AXES},
    "zero_stage": "a list of off, 0, 1, 2, 3 (empty beside fsdp modes: FSDP alone)",
    "fsdp": "a list of off, full, grad-op (FSDP2 instead of ZeRO)",
    "offload": f"a list of {', '.join(OFFLOADS)}",
    "lora_rank": "a list of off and/or whole numbers >= 1",
    "lora_alpha": "one whole number >= 1, or null for 2 x rank",
    "lora_targets": "a list of default, all-linear or comma-separated module names",
    "quantize_base": f"a list of {', '.join(QUANTIZATIONS)} (with LoRA: the frozen base quantized; changes the maths)",
    "layout": "auto (every split of --nproc into data x tensor x pipeline parallel), or a list of dp, tpN, tpN+sp, "
    f"ppN or ppN:SCHEDULE ({', '.join(PP_SCHEDULES)}), or a tensor and a pipeline split together ('tp2 pp2:1f1b')",
}
# Knobs that are tuner parameters only in the spaces that move them (see SearchSpace.choices).
LATER_KNOBS = (*(axis.key for _, axis in _AXES if axis.moved_only), "layout")
_TOP_LEVEL = {"description", "knobs", "n_trials", "patience"}
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "micro_batch": ("auto",),
    **{axis.key: (axis.default,) for _, axis in _AXES},
    "zero_stage": (None,),
    "fsdp": (None,),
    "offload": ("none",),
    "lora_rank": (None,),
    "lora_targets": ("default",),
    "quantize_base": ("off",),
    "layout": ("dp",),
}
# Knobs added after the first studies -> their value before: a space at it keeps its digest (its studies resume).
_ADDED_LATER = {
    **{axis.key: [axis.default] for _, axis in _AXES if axis.added_later},
    **dict(fsdp=[None], quantize_base=["off"], layout=["dp"]),
}


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The values each knob may take. ``zero_stage``/``lora_rank`` use ``None`` for off."""

    name: str  # preset name, or the file's path
    description: str = ""
    micro_batch: tuple[int, ...] | None = None  # None: every divisor of the per-rank batch
    precision: tuple[str, ...] = ("fp32",)
    checkpointing: tuple[bool | str, ...] = (False,)  # False, True (every layer) or "every-N"
    loss: tuple[str, ...] = ("standard",)
    attention: tuple[str, ...] = ("auto",)
    fused_optimizer: tuple[bool, ...] = (False,)
    optimizer: tuple[str, ...] = ("adamw",)
    optimizer_in_backward: tuple[bool, ...] = (False,)
    activation_offload: tuple[bool, ...] = (False,)
    compile: tuple[bool, ...] = (False,)
    float8: tuple[bool, ...] = (False,)
    zero_stage: tuple[int | None, ...] = (None,)
    fsdp: tuple[str | None, ...] = (None,)  # None: off; else an FSDP2 mode (full, grad-op)
    offload: tuple[str, ...] = ("none",)
    lora_rank: tuple[int | None, ...] = (None,)
    lora_alpha: int | None = None
    lora_targets: tuple[str, ...] = ("default",)  # "default", "all-linear" or "a,b,c"
    quantize_base: tuple[str, ...] = ("off",)  # with LoRA: off, nf4, int8
    layout: tuple[str, ...] = ("dp",)  # "dp" (data parallel only), "tp2", "tp2+sp", "pp2:1f1b", ... or "auto"
    n_trials: int = 30
    patience: int | None = None

    @property
    def digest(self) -> str:
        """Identifies what the space searches (not its name or description)."""
        knobs = {k: v for k, v in self.to_dict().items() if k not in ("name", "description")}
        for knob, old in _ADDED_LATER.items():
            if knobs[knob] == old:
                del knobs[knob]  # a knob added later, at its old behaviour: studies made before it still resume
        return hashlib.sha256(json.dumps(knobs, sort_keys=True).encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"name": self.name, "description": self.description}
        for knob in KNOBS:
            value = getattr(self, knob)
            data[knob] = value if knob == "lora_alpha" else "auto" if value is None else list(value)
        return {**data, "n_trials": self.n_trials, "patience": self.patience}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchSpace:
        """The inverse of :meth:`to_dict` (a study's stored space); knobs added since default to off."""
        knobs = {k: v for k, v in data.items() if k in KNOBS}
        top = {k: data[k] for k in ("description", "n_trials", "patience") if k in data}
        return parse_space({**top, "knobs": knobs}, str(data["name"]))

    def added_since(self, older: SearchSpace) -> list[str]:
        """``knob value`` for each value this space searches that ``older`` did not."""
        mine, theirs = self.to_dict(), older.to_dict()
        added = []
        for knob in KNOBS:
            if knob == "lora_alpha" or mine[knob] == theirs[knob]:
                continue
            new = [v for v in _as_list(mine[knob]) if v not in _as_list(theirs[knob])]
            added += [f"{knob} {_yaml_word(v)}" for v in new]
        return added

    # -- what can run here ---------------------------------------------------------------------
    def choices(self, workload: Workload, device: DeviceInfo) -> dict[str, tuple[Any, ...]]:
        """The tuner's parameters and their values for this workload and device.

        ZeRO stage and offload form one parameter (``off``, ``2``, ``3+optimizer``, ...) holding
        only the pairs that mean something for the rank count, and LoRA rank and targets another
        (``off``, ``16``, ``16:all-linear``), so the sampler never proposes a pair that cannot run.
        """
        per_rank = workload.global_batch // workload.nproc
        micro = self.micro_batch or tuple(d for d in range(1, per_rank + 1) if per_rank % d == 0)
        bad = [m for m in micro if per_rank % m]
        if bad:
            raise ConfigError(
                f"{self.name}: knobs.micro_batch {bad} do not divide the per-rank batch "
                f"{per_rank} (--global-batch {workload.global_batch} / --nproc {workload.nproc})"
            )
        facts = _facts(workload)
        choices = {"micro_batch": tuple(micro), **self._runnable(workload, device, facts, moved_only=False)}
        # FSDP shares ZeRO's parameter: one sharding per config, each value a (stage or mode, offload) pair.
        zero = ZERO.sharding_values(self.zero_stage, self.offload, workload.nproc, device.type)
        zero += FSDP.sharding_values(self.fsdp, self.offload, workload.nproc, device.type)
        if not zero:
            why = "on one rank ZeRO and FSDP need offload" + (
                "; on a CPU device offloading to the CPU changes nothing" if device.type == "cpu" else ""
            )
            raise ConfigError(
                f"{self.name}: knobs.zero_stage {list(self.zero_stage)}, fsdp "
                f"{['off' if m is None else m for m in self.fsdp]} x offload {list(self.offload)}: "
                f"no pair means something on {workload.nproc} rank(s) of a {device.type} ({why}); "
                "add off to zero_stage"
            )
        # A quantized base only under LoRA: each rank's labels with each quantization (16/nf4:q_proj,v_proj).
        quantize = tuple(q for q in self.quantize_base if q == "off" or quantize_library_refusal() is None)
        if not quantize:
            raise ConfigError(f"{self.name}: knobs.quantize_base {list(self.quantize_base)}: {QUANTIZE_REFUSAL}")
        lora = LORA.lora_values(self.lora_rank, self.lora_targets, quantize)
        refusal = _facts(workload).default_lora_refusal if self._default_lora() else None
        if refusal is not None:  # the model has nothing PEFT's defaults (or our fallback) would adapt
            lora = tuple(label for label in lora if label == "off" or ":" in label)
            if not lora:
                raise ConfigError(
                    f"{self.name}: knobs.lora_rank {list(self.lora_rank)}: {refusal}; add null "
                    "(LoRA off), or name lora_targets"
                )
        choices["zero"] = tuple(dict.fromkeys(zero))
        choices["lora"] = lora
        # Those added later are parameters only where the space moves them (Axis.moved_only).
        choices.update(self._runnable(workload, device, facts, moved_only=True))
        layouts = tuple(label for label in self._layouts(workload) if _layout_refusal(workload, label) is None)
        if layouts != ("dp",):
            choices["layout"] = layouts or ("dp",)
        return choices

    def _runnable(
        self, workload: Workload, device: DeviceInfo, facts: ModelFacts, *, moved_only: bool
    ) -> dict[str, tuple[Any, ...]]:
        """The values of the levers' axes that can run here (each lever says): the moved-only ones, or the others."""
        found = {}
        for lever, axis in _AXES:
            if axis.moved_only != moved_only:
                continue
            try:
                values = lever.runnable(axis.key, getattr(self, axis.key), workload, device, facts)
            except ConfigError as exc:
                raise ConfigError(f"{self.name}: {exc}") from None
            if not moved_only or values != (axis.default,):
                found[axis.key] = values
        return found

    def _layouts(self, workload: Workload) -> tuple[str, ...]:
        """The layout labels the space offers for the workload's ranks: ``auto`` expands to every split."""
        if "auto" not in self.layout:
            return self.layout
        found = ["dp", *(word for lever in LABEL_ORDER for word in lever.layout_words(workload.nproc))]
        return tuple(dict.fromkeys([*found, *(label for label in self.layout if label != "auto")]))

    def _default_lora(self) -> bool:
        """Whether the space offers LoRA on its default targets."""
        return any(rank is not None for rank in self.lora_rank) and "default" in self.lora_targets

    def dropped_knobs(self, workload: Workload, device: DeviceInfo) -> list[str]:
        """Knob values this space offers that :meth:`choices` leaves out for this model and device,
        beyond the precisions the device lacks: one line each, said once by the tuner."""
        dropped = []
        refusal = _facts(workload).default_lora_refusal if self._default_lora() else None
        if refusal is not None:
            dropped.append(f"lora on its default targets: {refusal}")
        facts, space = _facts(workload), {axis.key: getattr(self, axis.key) for _, axis in _AXES}
        for lever in DROPPED_ORDER:
            dropped += lever.dropped(space, workload, device, facts)
        if set(self.quantize_base) - {"off"} and quantize_library_refusal() is not None:
            dropped.append(QUANTIZE_REFUSAL)
        refusals = [_layout_refusal(workload, label) for label in self._layouts(workload)]
        dropped += list(dict.fromkeys(refusal for refusal in refusals if refusal is not None))
        offloads = [o for o in self.offload if o != "none"]
        modes = [m for m in self.fsdp if m]
        if modes and workload.nproc == 1 and (device.type == "cpu" or "optimizer+params" not in self.offload):
            dropped.append(
                f"fsdp {', '.join(modes)}: on one rank FSDP shards nothing, and its offload "
                + ("changes nothing on a CPU device" if device.type == "cpu" else "is not in the space")
            )
        if device.type == "cpu" and offloads and any(stage is not None for stage in self.zero_stage):
            dropped.append(
                f"offload {', '.join(offloads)}: the device is the CPU, and offloading from the CPU "
                "to the CPU changes nothing"
            )
        return dropped

    def config_of(self, params: dict[str, Any]) -> TrialConfig:
        """The TrialConfig of one value per parameter (see :meth:`choices`)."""
        return TrialConfig(
            **{name: value for _, fields_of in self.field_groups() for name, value in fields_of(params).items()}
        )

    def field_groups(self) -> list[FieldGroup]:
        """How :meth:`config_of` makes a config's fields: groups of parameters, each with what makes its fields out
        of their values (it reads no other parameter)."""
        groups: list[FieldGroup] = [(("micro_batch",), lambda params: {"micro_batch": params["micro_batch"]})]
        groups += [(tuple(axis.key for axis in lever.axes), lever.config_fields) for lever in AXIS_ORDER]
        return [
            *groups,
            (("zero",), lambda params: FSDP.sharding_fields(params["zero"]) or ZERO.sharding_fields(params["zero"])),
            (("lora",), lambda params: LORA.lora_fields(params["lora"], self.lora_alpha)),
            (("layout",), lambda params: layout_knobs(params.get("layout", "dp"))),
        ]

    @staticmethod
    def params_of(config: TrialConfig) -> dict[str, Any]:
        """The inverse of :meth:`config_of`."""
        values = {axis.key: (axis, lever.param_of(axis.key, config)) for lever, axis in _AXES}
        levers = {key: value for key, (axis, value) in values.items() if not axis.moved_only}
        levers |= {key: value for key, (axis, value) in values.items() if axis.moved_only and value != axis.default}
        return {
            "micro_batch": config.micro_batch,
            **levers,
            **({} if config.model_parallel == 1 else {"layout": config.layout}),
            "zero": FSDP.sharding_param(config) or ZERO.sharding_param(config),
            "lora": LORA.lora_param(config),
        }

    def candidates(self, workload: Workload, device: DeviceInfo) -> list[TrialConfig]:
        """Every config of the space that can run here, in a stable order (the product of :meth:`choices`)."""
        found, refused = runnable_configs(self.choices(workload, device), self.field_groups(), workload, device)
        if not found and refused:
            raise ConfigError(f"{self.name}: no config of this space can run here: {refused}")
        return found


def _facts(workload: Workload) -> ModelFacts:
    """The workload's model's facts that the levers' axes ask for, each read once, when first asked."""
    from autotune.prepare.workload_facts import WorkloadFacts  # its task imports transformers: only when asked

    return WorkloadFacts(workload)


def parse_space(data: Any, label: str) -> SearchSpace:
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: a search space is a mapping with keys {sorted(_TOP_LEVEL)}")
    unknown = sorted(set(data) - _TOP_LEVEL)
    if unknown:
        raise ConfigError(f"{label}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(_TOP_LEVEL))}")
    knobs = data.get("knobs")
    if not isinstance(knobs, dict) or not knobs:
        raise ConfigError(f"{label}: 'knobs' must map knob names to values; knobs: {', '.join(KNOBS)}")
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise ConfigError(f"{label}: unknown knob {unknown[0]!r}; knobs: {', '.join(KNOBS)}")
    values = {name: _as_list(knobs.get(name, _DEFAULTS.get(name))) for name in KNOBS if name != "lora_alpha"}
    return SearchSpace(
        name=label,
        description=str(data.get("description") or ""),
        micro_batch=_micro_batch(values["micro_batch"], label),
        **{axis.key: _each(values[axis.key], label, axis.key, axis.parse) for _, axis in _AXES},
        zero_stage=_zero_stages(values, label),
        fsdp=_each(values["fsdp"], label, "fsdp", lambda v: v if v in FSDP_MODES else None),
        offload=_each(values["offload"], label, "offload", lambda v: v if v in OFFLOADS else None),
        lora_rank=_each(values["lora_rank"], label, "lora_rank", _lora_rank),
        lora_alpha=_lora_alpha(knobs.get("lora_alpha"), label),
        lora_targets=_each(values["lora_targets"], label, "lora_targets", _lora_target),
        quantize_base=_each(values["quantize_base"], label, "quantize_base", _quantization),
        layout=_each(values["layout"], label, "layout", lambda v: v if v == "auto" or _is_layout(v) else None),
        n_trials=_count(data.get("n_trials", 30), label, "n_trials"),
        patience=None if data.get("patience") is None else _count(data["patience"], label, "patience"),
    )


# -- one knob's values ---------------------------------------------------------------------------
_OFF = object()  # marks a value the parser refused (None is a real value: "off")


def _quantization(value: Any) -> str | None:
    if value is False:  # YAML reads a bare off as false
        return "off"
    return value if value in QUANTIZATIONS else None


def later_knob_value(config: TrialConfig, knob: str) -> Any:
    """The config's value of one of :data:`LATER_KNOBS` as the tuner's parameter holds it."""
    return config.layout if knob == "layout" else getattr(config, knob)


def layout_knobs(label: str) -> dict[str, Any]:
    """The TrialConfig knobs of a layout label (:attr:`TrialConfig.layout`): ``dp``, ``tp2``, ``tp2+sp``,
    ``pp2`` or ``pp2:gpipe``, or a tensor and a pipeline split together (``tp2 pp2:1f1b``)."""
    return {name: value for _, fields in _layout_words(label) or [] for name, value in fields.items()}


def _layout_words(label: str) -> list[tuple[Lever, dict[str, Any]]] | None:
    """Each word of a layout label (``dp`` has none) with the lever it names and its fields; None where a word
    is no lever's."""
    found = []
    for word in label.split() if label != "dp" else []:
        owned = [(lever, fields) for lever in LABEL_ORDER if (fields := lever.layout_fields(word)) is not None]
        if not owned:
            return None
        found += owned
    return found


def _is_layout(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    if value == "dp":
        return True
    words = _layout_words(value)
    levers = [id(lever) for lever, _ in words or []]
    return bool(levers) and len(levers) == len(set(levers))  # one word per lever


@functools.lru_cache(maxsize=64)  # the tuner asks for the choices before every trial; each reads the model's config
def _layout_refusal(workload: Workload, label: str) -> str | None:
    """Why the layout cannot split the workload's ranks or model (None: it can), said before any trial."""
    words = _layout_words(label) or []
    if not words:
        return None
    degree = math.prod(lever.model_ranks(TrialConfig(**fields)) for lever, fields in words)
    if workload.nproc % degree:
        return f"layout {label}: {degree} ranks do not divide --nproc {workload.nproc}"
    from autotune.prepare import refusal_before_trial

    return refusal_before_trial(workload, TrialConfig(**layout_knobs(label)))


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, tuple):
        return list(value)
    return value if isinstance(value, list) else [value]


def _each(values: list[Any], label: str, knob: str, parse: Any) -> tuple[Any, ...]:
    if not values:
        raise ConfigError(f"{label}: knobs.{knob} is empty; allowed: {KNOBS[knob]}")
    parsed = []
    for value in values:
        result = parse(value)
        if result is None and not _means_off(value, knob) or result is _OFF:
            raise ConfigError(f"{label}: knobs.{knob}: {value!r} is not allowed; allowed: {KNOBS[knob]}")
        if result not in parsed:
            parsed.append(result)
    return tuple(parsed)


def _zero_stages(values: dict[str, list[Any]], label: str) -> tuple[Any, ...]:
    """zero_stage's values, none at all only beside an FSDP mode: a space of FSDP alone (the one way to leave out
    the config that shards nothing, which zero_stage's off is)."""
    if values["zero_stage"] == [] and any(not _means_off(value, "fsdp") for value in values["fsdp"]):
        return ()
    return _each(values["zero_stage"], label, "zero_stage", _zero_stage)


def _yaml_word(value: Any) -> str:
    return "off" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _means_off(value: Any, knob: str) -> bool:
    # YAML reads `off` as false; zero_stage and lora_rank use None for off.
    return knob in ("zero_stage", "lora_rank", "fsdp") and (value is None or value is False or value == "off")


def _micro_batch(values: list[Any], label: str) -> tuple[int, ...] | None:
    if values == ["auto"]:
        return None
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{label}: knobs.micro_batch: {value!r} is not allowed; allowed: {KNOBS['micro_batch']}")
    return tuple(sorted(set(values)))


def _zero_stage(value: Any) -> Any:
    if _means_off(value, "zero_stage"):
        return None
    return value if value in ZERO_STAGES and not isinstance(value, bool) else _OFF


def _lora_rank(value: Any) -> Any:
    if _means_off(value, "lora_rank"):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else _OFF


def _lora_alpha(value: Any, label: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(
        f"{label}: knobs.lora_alpha: {value!r} is not allowed; allowed: {KNOBS['lora_alpha']} "
        "(alpha changes neither speed nor memory, so it is not searched)"
    )


def _lora_target(value: Any) -> Any:
    if value is None or value == "default":
        return "default"
    if isinstance(value, str) and value.strip() and all(part.strip() for part in value.split(",")):
        return ",".join(part.strip() for part in value.split(","))
    return _OFF


def _count(value: Any, label: str, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{label}: {key}: {value!r} must be a whole number of at least 1")
    return value
