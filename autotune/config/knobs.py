"""The knobs of one trial: a frozen ``TrialConfig`` that flows from sampler to runner to storage.

Exact knobs (micro batch, checkpointing, ZeRO stage, offload) do not change what is trained;
precision and LoRA do, and are only moved where the user's search space allows them.

Every knob family is a lever (``autotune/levers/``): it brings its fields, values, refusals and labels as a
mixin and a registry entry, and ``TrialConfig`` asks them in a loop. What is its own: the micro batch, and how
the ranks split between data parallel and the model's splits (the levers' ``model_ranks``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.levers import CHECK_ORDER, LABEL_ORDER, LEVERS, REFUSAL_ORDER
from autotune.levers.activation_offload import ActivationOffloadFields, offload_device_refusal
from autotune.levers.attention import ATTENTIONS, AttentionFields, attention_device_refusal
from autotune.levers.base import divisors as _divisors
from autotune.levers.base import is_count as _is_count
from autotune.levers.base import overriding
from autotune.levers.checkpointing import CheckpointingFields
from autotune.levers.compile import CompileFields, compile_device_refusal
from autotune.levers.float8 import Float8Fields
from autotune.levers.fsdp import FSDP_MODES, FsdpFields
from autotune.levers.grad_reduction import GradReductionFields
from autotune.levers.lora import LoraFields
from autotune.levers.loss import DEFAULT_LOSS_CHUNKS, LOSSES, LossFields, is_loss
from autotune.levers.offload import OFFLOADS, OffloadFields
from autotune.levers.optimizer import (
    EIGHT_BIT_REFUSAL,
    OPTIMIZERS,
    OptimizerFields,
    eight_bit_library,
    in_backward_refusal,
)
from autotune.levers.pipeline import PP_SCHEDULES, PipelineFields
from autotune.levers.precision import PRECISIONS, PrecisionFields, sixteen_bit_type
from autotune.levers.tensor_parallel import TensorParallelFields
from autotune.levers.zero import ZERO_STAGES, ZeroFields

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo

__all__ = [
    "TrialConfig",
    "PRECISIONS",
    "ATTENTIONS",
    "OFFLOADS",
    "ZERO_STAGES",
    "FSDP_MODES",
    "PP_SCHEDULES",
    "LOSSES",
    "OPTIMIZERS",
    "DEFAULT_LOSS_CHUNKS",
    "is_loss",
    "sixteen_bit_type",
    "attention_device_refusal",
    "compile_device_refusal",
    "in_backward_refusal",
    "offload_device_refusal",
    "eight_bit_library",
    "EIGHT_BIT_REFUSAL",
]


@dataclass(frozen=True, kw_only=True)
class _MicroBatchField:
    micro_batch: int = field(
        default=1,
        metadata={
            "help": "Samples per forward/backward on one rank; accumulation is derived "
            "as global batch / (micro batch x ranks)."
        },
    )


# The levers each loop asks, in its order, less those that keep the default answer (Lever's).
_SPLITTING = overriding(LEVERS, "model_ranks")
_SPLITTING_IN_LABEL_ORDER = overriding(LABEL_ORDER, "model_ranks")
_CONFLICTING = overriding(REFUSAL_ORDER, "conflict")
_REFUSING = overriding(REFUSAL_ORDER, "refusal")


# The levers' fields (autotune/levers/). A dataclass orders the fields of its bases from the last base to the first:
# the mixins are listed last-first so that dataclasses.fields(TrialConfig) keeps the order it has always had
# (micro_batch, precision, checkpointing, ..., zero_stage, fsdp, ...): stored configs and exports read as before.
@dataclass(frozen=True, kw_only=True)
class TrialConfig(
    GradReductionFields,
    PipelineFields,
    TensorParallelFields,
    OffloadFields,
    FsdpFields,
    ZeroFields,
    Float8Fields,
    LoraFields,
    CompileFields,
    ActivationOffloadFields,
    OptimizerFields,
    AttentionFields,
    LossFields,
    CheckpointingFields,
    PrecisionFields,
    _MicroBatchField,
):
    """One point of the search space. ``None`` means a knob is off, never a sentinel number."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the levers' normalising (LoRA's targets as a tuple)
        self._check_values()

    # -- derived values -------------------------------------------------------------------
    @property
    def model_parallel(self) -> int:
        """Ranks one copy of the model is spread over: the product of the levers' splits (tensor x pipeline)."""
        return math.prod(lever.model_ranks(self) for lever in _SPLITTING)

    @property
    def layout(self) -> str:
        """How the ranks hold the model, as a search space writes it: ``dp`` (data parallel only), ``tp2``,
        ``tp2+sp``, ``pp2:1f1b``, or both splits: ``tp2 pp2:1f1b``."""
        return " ".join(word for lever in _SPLITTING_IN_LABEL_ORDER if (word := lever.layout_word(self))) or "dp"

    def split_flags(self, joiner: str = " ") -> str:
        """The model's splits as typed, for messages, e.g. ``--tp 2 --pp 2``."""
        flags = (lever.layout_flag(self) for lever in _SPLITTING_IN_LABEL_ORDER if lever.model_ranks(self) > 1)
        return joiner.join(flag for flag in flags if flag)

    def data_parallel(self, workload: Workload) -> int:
        """Ranks that each train on their own micro batches: --nproc / (tp x pp)."""
        return max(1, workload.nproc // self.model_parallel)

    def grad_accum_steps(self, workload: Workload) -> int:
        """Micro-steps per optimizer step so that micro x accumulation x data-parallel ranks = global batch
        (tensor- and pipeline-parallel ranks share their micro batches)."""
        ranks = self.data_parallel(workload)
        per_step = self.micro_batch * ranks
        if workload.global_batch % per_step:
            over = (
                f"--nproc {workload.nproc}"
                if ranks == workload.nproc
                else f"{ranks} data-parallel ranks (--nproc {workload.nproc} / {self.model_parallel})"
            )
            raise ConfigError(
                f"--micro-batch {self.micro_batch} x {over} does not divide "
                f"--global-batch {workload.global_batch}; pick a micro batch from "
                f"{_divisors(workload.global_batch // ranks) if workload.global_batch % ranks == 0 else [1]}"
            )
        return workload.global_batch // per_step

    # -- validation -----------------------------------------------------------------------
    def _check_values(self) -> None:
        for check in self.value_checks():
            check()

    def validate_for(self, workload: Workload, device: DeviceInfo) -> None:
        """Refuse combinations that cannot run for this workload on this device."""
        for check in self.workload_checks(workload, device):
            check()

    # Each check apart, in the order they run: a search space's enumeration learns from each refusal which
    # fields decided it (autotune.search.candidates). Each raises ConfigError.
    def value_checks(self) -> Iterator[Callable[[], Any]]:
        """The checks of its values alone (run as it is made)."""
        yield self._check_micro_batch
        for lever in CHECK_ORDER:
            yield functools.partial(lever.check, self)

    def workload_checks(self, workload: Workload, device: DeviceInfo) -> Iterator[Callable[[], Any]]:
        """The checks of :meth:`validate_for`."""
        yield functools.partial(self.grad_accum_steps, workload)  # also refuses a micro batch over the per-rank batch
        for lever in _CONFLICTING:
            yield functools.partial(_refuse, lever.conflict, self)
        for lever in _REFUSING:
            yield functools.partial(_refuse, lever.refusal, self, workload, device)

    def _check_micro_batch(self) -> None:
        if not _is_count(self.micro_batch):
            raise ConfigError(f"--micro-batch {self.micro_batch!r} must be a whole number of at least 1")

    # -- (de)serialisation ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name, value in data.items():  # tuples (LoRA's targets) as the lists JSON and YAML write
            if isinstance(value, tuple):
                data[name] = list(value)
        for f in dataclasses.fields(self):  # fields added after studies were stored, as the studies wrote them
            if f.metadata.get("omit_at_default") and data[f.name] == f.default:
                del data[f.name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown knob(s) {unknown}; known knobs: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes: Any) -> TrialConfig:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A short human label, e.g. ``mb=4 bf16 ckpt lora16 zero2+offload``."""
        parts = [f"mb={self.micro_batch}"]
        for lever in LABEL_ORDER:
            parts.extend(lever.labels(self))
        if self.model_parallel > 1:
            parts.append(self.layout)
        return " ".join(parts)


def _refuse(ask: Callable[..., str | None], *args: Any) -> None:
    """Raise the refusal ``ask(*args)`` gives, if it gives one."""
    refusal = ask(*args)
    if refusal is not None:
        raise ConfigError(refusal)
