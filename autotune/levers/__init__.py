"""The levers: one module per knob family, holding its fields (a frozen mixin of ``TrialConfig``) with their
help text, the values it accepts, its refusals for a workload, a device and a model, how it is applied to a
built model, and its words in a config's label. :data:`LEVERS` lists them in the order they are applied.

The lowest folder after the package's base facts: a lever imports only ``errors``, ``sizes`` and this
folder at run time (type-only imports of ``config`` aside); what it needs to know about a model is handed to
it (:class:`~autotune.levers.base.ModelFacts`).

Not yet levers (their fields, checks and labels are still in ``config/knobs.py``, their applying in
``prepare/``): LoRA and the quantized base, ZeRO, FSDP, offload, tensor and sequence parallel, pipeline parallel.
"""

from __future__ import annotations

from autotune.levers.activation_offload import ActivationOffloadLever
from autotune.levers.attention import AttentionLever
from autotune.levers.base import Lever, ModelFacts
from autotune.levers.checkpointing import CheckpointingLever
from autotune.levers.compile import CompileLever
from autotune.levers.loss import LossLever
from autotune.levers.optimizer import OptimizerLever
from autotune.levers.precision import PrecisionLever

__all__ = [
    "Lever",
    "ModelFacts",
    "LEVERS",
    "LABEL_ORDER",
    "ATTENTION",
    "CHECKPOINTING",
    "PRECISION",
    "LOSS",
    "OPTIMIZER",
    "ACTIVATION_OFFLOAD",
    "COMPILE",
]

ATTENTION = AttentionLever()
CHECKPOINTING = CheckpointingLever()
PRECISION = PrecisionLever()
LOSS = LossLever()
OPTIMIZER = OptimizerLever()
ACTIVATION_OFFLOAD = ActivationOffloadLever()
COMPILE = CompileLever()

# In the order they are applied, as torchtitan's parallelize applies TP, then checkpointing, then compile, then
# FSDP. To the built model (``autotune.prepare``): the attention kernel, checkpointing, [LoRA on a base quantized
# or not], where weights are held for the precision (after LoRA: PEFT makes its adapters fp32), the chunked loss,
# [pipeline stages, or tensor parallel then FSDP]. Then in the trial's engine: the optimizer over the prepared
# parameters, activation offload's hooks around each step, compile after the first steps.
# Refusals and value checks are asked in this order too (the first one found is the one said).
LEVERS: tuple[Lever, ...] = (ATTENTION, CHECKPOINTING, PRECISION, LOSS, OPTIMIZER, ACTIVATION_OFFLOAD, COMPILE)

# The order of their words in ``TrialConfig.describe()``: the labels stored in studies and results files read
# this way, so it stays as it was before the registry. Every lever appears once (a test checks it).
LABEL_ORDER: tuple[Lever, ...] = (PRECISION, CHECKPOINTING, ATTENTION, LOSS, OPTIMIZER, ACTIVATION_OFFLOAD, COMPILE)
