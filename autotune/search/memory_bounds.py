"""What trials and estimates imply about which configs fit: pure rules over configs, with no study or model.

Memory grows with the micro batch, all else the same: a smaller size of a config that fit fits, a larger one
of a config that did not does not, and one estimate draws a straight line through the sizes of its family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autotune.levers import ACTIVATION_OFFLOAD, CHECKPOINTING

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.estimate.results import MemoryEstimate
    from autotune.study.summary import TrialRecord

__all__ = ["straight_line", "implied_fits", "implied_too_big", "recomputes_more_than_fitting", "known_too_big"]


def straight_line(estimate: MemoryEstimate) -> Callable[[int], float]:
    """Peak bytes against the micro batch through one estimate: model states fixed, the rest per sample."""
    states = estimate.parameters_bytes + estimate.gradients_bytes + estimate.optimizer_state_bytes
    per_sample = max(estimate.predicted_peak_bytes - states, 0) / estimate.config.micro_batch
    return lambda micro_batch: states + per_sample * micro_batch


def implied_fits(config: TrialConfig, fitting: list[TrialConfig]) -> bool:
    """A smaller micro batch with the same other knobs as a config that fit needs less memory."""
    return any(
        config.micro_batch <= known.micro_batch and config.replace(micro_batch=known.micro_batch) == known
        for known in fitting
    )


def recomputes_more_than_fitting(config: TrialConfig, fitting: list[TrialConfig], offered: set[TrialConfig]) -> bool:
    """Whether an offered config that fits (measured, or a smaller micro batch of one measured) differs from
    ``config`` only in checkpointing fewer layers (:meth:`CheckpointingLever.recomputes_more`): where the memory
    is there without them, ``config`` does that config's work and more, so no trial of it can win. (Activation
    offload is the exception: :meth:`ActivationOffloadLever.saves_with_more_checkpointing`.)"""
    if ACTIVATION_OFFLOAD.saves_with_more_checkpointing(config):
        return False
    return any(
        config.micro_batch <= known.micro_batch
        and (lighter := known.replace(micro_batch=config.micro_batch)) in offered
        and CHECKPOINTING.recomputes_more(config, lighter)
        for known in fitting
    )


def implied_too_big(config: TrialConfig, too_big: list[TrialConfig]) -> bool:
    """A larger micro batch with the same other knobs as a config that did not fit needs more memory."""
    return any(
        config.micro_batch > known.micro_batch and config.replace(micro_batch=known.micro_batch) == known
        for known in too_big
    )


def known_too_big(records: list[TrialRecord]) -> list[TrialConfig]:
    """Configs known not to fit: out of memory, skipped by the estimator, or measured over the limit."""
    return [r.config for r in records if r.status in ("oom", "skipped") or (r.status == "ok" and not r.fits)]
