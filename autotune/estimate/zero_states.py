"""ZeRO's per-rank model states, by arithmetic on the traced plain step.

DeepSpeed cannot run on fake tensors, so the step is traced on plain PyTorch (a 16-bit model without
autocast in fp16/bf16, as DeepSpeed trains) and the model states are replaced by what DeepSpeed's
ZeRO-1/2 optimizer allocates (read from its source and checked against real 2-rank trials on a CPU):
16-bit (or fp32) weights and gradients, an fp32 master partition (a clone even in fp32) and Adam's m
and v: 12 bytes per trainable parameter / N from stage 1, gradients / N from stage 2, weights / N at
stage 3; offloaded states leave the device. DeepSpeed's own estimator says 2Ψ + 18Ψ/N for
mixed-precision ZeRO-2: it adds the fp32 copy of the gradient partition (4Ψ/N), which lives only
during the optimizer step; here it counts only where the step, not the backward, sets the peak.
ZeRO-3 also keeps up to ``stage3_max_live_parameters`` (1e9) gathered weights through the forward
and backward: for smaller models the whole model, as DeepSpeed's estimator (which counts only the
largest layer) leaves out; they are counted as temporaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.estimate.results import ModelStates, TracedStep

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = ["ZERO3_MAX_LIVE_PARAMETERS", "zero3_gathered", "zero_model_states", "zero_peak"]

ZERO3_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's default stage3_max_live_parameters (our configs keep it)


def zero_peak(traced: TracedStep, config: TrialConfig, ranks: int) -> tuple[int, ModelStates, ModelStates, int]:
    """(peak, model states live at it, whole model states, activations live at it) of one rank under ZeRO,
    from the traced plain step."""
    p, g, o, step_extra = zero_model_states(traced, config, ranks, offload_stays=traced.target == "cpu")
    zero_whole = ModelStates(p, g, o)
    # The forwards' and backwards' peak with ZeRO's states in place of the traced ones. The traced
    # optimizer step is not DeepSpeed's: its temporaries span every weight, DeepSpeed's a partition.
    at_peak, activations = traced.backward_at_peak, traced.backward_activations_bytes
    # ZeRO-2/3 keep a gradient partition through the backward; ZeRO-1 keeps the gradients as made.
    zero_at_peak = ModelStates(p, g if (config.zero_stage or 0) >= 2 else at_peak.gradients, o)
    backward_peak = traced.backward_peak_bytes - at_peak.total + zero_at_peak.total + zero3_gathered(traced, config)
    step_peak = zero_whole.total + step_extra  # after the backward: no activation is live
    if backward_peak >= step_peak:
        return backward_peak, zero_at_peak, zero_whole, activations
    return step_peak, zero_whole, zero_whole, 0


def zero_model_states(
    traced: TracedStep, config: TrialConfig, ranks: int, *, offload_stays: bool
) -> tuple[int, int, int, int]:
    """Per-rank (parameters, gradients, optimizer state, step-time extra) bytes under DeepSpeed ZeRO.

    ``offload_stays``: the device is the host (a CPU trial), so offloaded states stay in the
    memory measured, joined by the offload path's host buffers (a staging copy of the weight
    partition and an fp32 gradient partition).

    The step-time extra is the gradient partition cast to fp32 for the optimizer in fp16/bf16:
    it lives only during ``step()``, after the activations are gone (counted by DeepSpeed's
    estimator as part of its 18 bytes per parameter, which would overstate a peak set by activations).
    """
    total = traced.total_params
    trainable = traced.trainable_params
    mixed = config.precision in ("fp16", "bf16")
    # The model's own weights and gradients: 16-bit in DeepSpeed's fp16/bf16 modes.
    parameters = (2 if mixed else 4) * total
    gradients = (2 if mixed else 4) * trainable
    # The optimizer's partition: an fp32 master copy of the weights (a clone even in fp32) and Adam's m, v.
    optimizer_state = 12 * trainable
    step_extra = 4 * trainable if mixed else 0  # in fp32, .to(fp32) returns the gradient itself
    stage = config.zero_stage or 0
    if stage >= 1:
        optimizer_state //= ranks
        step_extra //= ranks
    if stage >= 2:
        gradients //= ranks
    if stage == 3:
        parameters //= ranks
    if config.offload != "none" and offload_stays:
        optimizer_state += ((2 if mixed else 4) + 4) * trainable // ranks
    elif config.offload != "none":
        optimizer_state = step_extra = 0
        if config.offload == "optimizer+params":
            parameters = 0
    return parameters, gradients, optimizer_state, step_extra


def zero3_gathered(traced: TracedStep, config: TrialConfig) -> int:
    """Bytes of whole weights ZeRO-3 gathers for the forward and backward and keeps until the step.

    DeepSpeed keeps up to ``stage3_max_live_parameters`` gathered (and reuses them in the
    backward), so below that many parameters the whole model is live as in ZeRO-1. They are
    counted as temporaries: the rank's own shard is its ``parameters``.
    """
    if config.zero_stage != 3:
        return 0
    return (2 if config.precision in ("fp16", "bf16") else 4) * min(traced.total_params, ZERO3_MAX_LIVE_PARAMETERS)
