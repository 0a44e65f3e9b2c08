"""The levers: one module per knob family, holding its fields (a frozen mixin of ``TrialConfig``) with their
help text, the values it accepts, its refusals for a workload, a device and a model, how it is applied to a
built model, and its words in a config's label. :data:`LEVERS` lists them in the order they are applied.

The lowest folder after the package's base facts: a lever imports only ``errors``, ``sizes`` and this
folder at run time (type-only imports of ``config`` aside); what it needs to know about a model is handed to
it (:class:`~autotune.levers.base.ModelFacts`).

Still outside their modules: the layout levers' applying (ZeRO's DeepSpeed JSON in ``config/``, FSDP's,
tensor and pipeline parallel's in ``prepare/``) and their export keys; LoRA's quantized base's applying
(``prepare/quantize.py``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from autotune.levers.activation_offload import ActivationOffloadLever
from autotune.levers.attention import AttentionLever
from autotune.levers.base import Axis, Flag, Lever, ModelFacts
from autotune.levers.checkpointing import CheckpointingLever
from autotune.levers.compile import CompileLever
from autotune.levers.float8 import Float8Lever
from autotune.levers.fsdp import FsdpLever
from autotune.levers.grad_reduction import GradReductionLever
from autotune.levers.lora import LoraLever
from autotune.levers.loss import LossLever
from autotune.levers.offload import OffloadLever
from autotune.levers.optimizer import OptimizerLever
from autotune.levers.pipeline import PipelineLever
from autotune.levers.precision import PrecisionLever
from autotune.levers.tensor_parallel import TensorParallelLever
from autotune.levers.zero import ZeroLever

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = [
    "Axis",
    "Flag",
    "Lever",
    "ModelFacts",
    "LEVERS",
    "LEVER_FLAGS",
    "LABEL_ORDER",
    "CHECK_ORDER",
    "REFUSAL_ORDER",
    "MODEL_REFUSAL_ORDER",
    "AXIS_ORDER",
    "DROPPED_ORDER",
    "TRAINER_ORDER",
    "HEADER_ORDER",
    "FORMAT_ORDER",
    "IN_CODE_BEFORE_LAYOUT",
    "IN_CODE_AFTER_LAYOUT",
    "ATTENTION",
    "CHECKPOINTING",
    "LORA",
    "PRECISION",
    "LOSS",
    "OPTIMIZER",
    "ACTIVATION_OFFLOAD",
    "COMPILE",
    "FLOAT8",
    "ZERO",
    "FSDP",
    "OFFLOAD",
    "TENSOR_PARALLEL",
    "PIPELINE",
    "GRAD_REDUCTION",
    "STATES_KEEPERS",
    "model_states_twin",
]

ATTENTION = AttentionLever()
CHECKPOINTING = CheckpointingLever()
LORA = LoraLever()
PRECISION = PrecisionLever()
LOSS = LossLever()
OPTIMIZER = OptimizerLever()
ACTIVATION_OFFLOAD = ActivationOffloadLever()
COMPILE = CompileLever()
FLOAT8 = Float8Lever()
ZERO = ZeroLever()
FSDP = FsdpLever()
OFFLOAD = OffloadLever()
TENSOR_PARALLEL = TensorParallelLever()
PIPELINE = PipelineLever()
GRAD_REDUCTION = GradReductionLever()

# In the order they are applied, as torchtitan's parallelize applies TP, then checkpointing, then compile, then
# FSDP. To the built model (``autotune.prepare``): the attention kernel, checkpointing, LoRA on a base quantized
# or not, where weights are held for the precision (after LoRA: PEFT makes its adapters fp32), float8's Linear
# layers (as torchtitan converts them before it parallelizes), the chunked loss, then the splits: pipeline stages,
# or tensor parallel then FSDP (with its offload policy). Then in the trial's engine: DeepSpeed's engine (ZeRO, with
# its offload) or the optimizer over the prepared parameters, activation offload's hooks around each step, compile
# after the first steps.
LEVERS: tuple[Lever, ...] = (
    ATTENTION,
    CHECKPOINTING,
    LORA,
    PRECISION,
    FLOAT8,
    LOSS,
    PIPELINE,
    TENSOR_PARALLEL,
    FSDP,
    OFFLOAD,
    ZERO,
    OPTIMIZER,
    ACTIVATION_OFFLOAD,
    COMPILE,
    GRAD_REDUCTION,
)

# The layout's levers: how the ranks hold the model (the sharding, its offload, the model's splits), in the order of
# their fields, their words in a label, and their checks (each checks its combinations with those before it).
_LAYOUT: tuple[Lever, ...] = (ZERO, FSDP, OFFLOAD, TENSOR_PARALLEL, PIPELINE)

# Every lever's command-line options, in the order of their fields in TrialConfig (its mixins' order, which --help
# lists them in; tests/levers/test_lever_ownership.py checks it).
LEVER_FLAGS: tuple[Flag, ...] = tuple(
    flag
    for lever in (PRECISION, CHECKPOINTING, LOSS, ATTENTION, OPTIMIZER, ACTIVATION_OFFLOAD, COMPILE, LORA, FLOAT8)
    + _LAYOUT
    + (GRAD_REDUCTION,)
    for flag in lever.flags
)

# The orders the other consumers ask the levers in. Each is the order the knobs were asked in before they were
# levers, so that a label reads as the labels stored in studies do, and where two values are wrong, or two
# refusals hold, the one said first is the one said before. Each names every lever once (a test checks it); a
# new lever goes at the end of each. The layout's levers kept the places their rules had: their refusals for a
# workload come first, and the model's splits are refused for a model before checkpointing is.
LABEL_ORDER: tuple[Lever, ...] = (
    PRECISION,
    CHECKPOINTING,
    ATTENTION,
    LOSS,
    OPTIMIZER,
    ACTIVATION_OFFLOAD,
    COMPILE,
    LORA,
    FLOAT8,
    *_LAYOUT,
    GRAD_REDUCTION,
)
CHECK_ORDER: tuple[Lever, ...] = (
    PRECISION,
    CHECKPOINTING,
    ATTENTION,
    COMPILE,
    OPTIMIZER,
    ACTIVATION_OFFLOAD,
    LOSS,
    LORA,
    FLOAT8,
    *_LAYOUT,
    GRAD_REDUCTION,
)
REFUSAL_ORDER: tuple[Lever, ...] = (
    *_LAYOUT,
    OPTIMIZER,
    LORA,
    ATTENTION,
    COMPILE,
    ACTIVATION_OFFLOAD,
    PRECISION,
    CHECKPOINTING,
    LOSS,
    FLOAT8,
    GRAD_REDUCTION,
)
MODEL_REFUSAL_ORDER: tuple[Lever, ...] = (
    LOSS,
    ATTENTION,
    TENSOR_PARALLEL,
    PIPELINE,
    CHECKPOINTING,
    PRECISION,
    OPTIMIZER,
    ACTIVATION_OFFLOAD,
    COMPILE,
    LORA,
    FLOAT8,
    ZERO,
    FSDP,
    OFFLOAD,
    GRAD_REDUCTION,
)

# A search space's (``autotune.search.space``): the order of the levers' keys in a space file, its errors and its
# dict, and so of the tuner's parameters (the moved-only ones after the others); the order of the lines saying what
# the space drops for a workload and device. (LoRA's ``lora`` parameter is still the space's own: no axes yet.)
AXIS_ORDER: tuple[Lever, ...] = (
    PRECISION,
    CHECKPOINTING,
    LOSS,
    ATTENTION,
    OPTIMIZER,
    ACTIVATION_OFFLOAD,
    COMPILE,
    LORA,
    FLOAT8,
    *_LAYOUT,
    GRAD_REDUCTION,
)
DROPPED_ORDER: tuple[Lever, ...] = (
    PRECISION,
    CHECKPOINTING,
    LOSS,
    ATTENTION,
    COMPILE,
    ACTIVATION_OFFLOAD,
    OPTIMIZER,
    LORA,
    FLOAT8,
    *_LAYOUT,
    GRAD_REDUCTION,
)
# The order of their keys in Transformers' TrainingArguments (as the hf export writes them): the precision's, the
# optimizer's, compile's, checkpointing's, then those of the levers with none.
TRAINER_ORDER: tuple[Lever, ...] = (
    PRECISION,
    OPTIMIZER,
    COMPILE,
    CHECKPOINTING,
    ATTENTION,
    LOSS,
    ACTIVATION_OFFLOAD,
    LORA,
    FLOAT8,
    *_LAYOUT,
    GRAD_REDUCTION,
)

# The order an export asks whether its format can carry their values: the layout's (FSDP's on a CPU first, then the
# splits, which every format but json, yaml and launch refuses), then the format's own refusals.
FORMAT_ORDER: tuple[Lever, ...] = (
    FSDP,
    PIPELINE,
    TENSOR_PARALLEL,
    ZERO,
    OFFLOAD,
    PRECISION,
    CHECKPOINTING,
    LOSS,
    ATTENTION,
    OPTIMIZER,
    ACTIVATION_OFFLOAD,
    COMPILE,
    LORA,
    FLOAT8,
    GRAD_REDUCTION,
)

# The order of their own lines in a YAML export's header (Lever.header_lines): checkpointing, the optimizer, TF32, then
# the levers with none (LoRA's line says which layers it adapts: the exporter writes it, from the model).
HEADER_ORDER: tuple[Lever, ...] = (
    CHECKPOINTING,
    OPTIMIZER,
    PRECISION,
    ATTENTION,
    LOSS,
    ACTIVATION_OFFLOAD,
    COMPILE,
    LORA,
    FLOAT8,
    *_LAYOUT,
    GRAD_REDUCTION,
)

# The order of their lines in an export's header of what a job applies in its own code: how the model is loaded
# and compiled (checkpointing and LoRA have header lines of their own, none here), then the layout's lines (not
# levers yet), then what wraps each step: the optimizer, activation offload's hooks around the forward, the loss.
IN_CODE_BEFORE_LAYOUT: tuple[Lever, ...] = (PRECISION, ATTENTION, CHECKPOINTING, LORA, COMPILE, FLOAT8, ZERO, OFFLOAD)
IN_CODE_AFTER_LAYOUT: tuple[Lever, ...] = (
    FSDP,
    TENSOR_PARALLEL,
    PIPELINE,
    OPTIMIZER,
    ACTIVATION_OFFLOAD,
    LOSS,
    GRAD_REDUCTION,
)

# The levers whose values leave a config's model states (its parameters, gradients and optimizer state per rank)
# as they are: they change what a step computes or keeps of its activations, not what the model holds between
# steps. (Precision, the optimizer, LoRA, float8 and the layout's levers change them.)
STATES_KEEPERS: tuple[Lever, ...] = (ATTENTION, CHECKPOINTING, LOSS, ACTIVATION_OFFLOAD, COMPILE)


def model_states_twin(config: TrialConfig) -> TrialConfig:
    """``config`` at micro batch 1 with every lever of :data:`STATES_KEEPERS` at its default, and AdamW unfused: the
    same model states per rank, so configs with one twin hold the same parameters, gradients and optimizer state.
    (Fused AdamW keeps the moments the default one keeps; only the kernel that steps them differs.)"""
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.name in _KEEPERS_FIELDS}
    return config.replace(micro_batch=1, fused_optimizer=False, **defaults)


_KEEPERS_FIELDS = frozenset(name for lever in STATES_KEEPERS for name in lever.fields)
