"""The step-time model's prior for the proposer's ranking: each config's step predicted from its family's traced
step, or from a traced twin's where the two differ by arithmetic, or else placed at the traced families' steps
with its own knobs and its precision's matmul speed (:mod:`autotune.search.throughput` corrects it by the trials).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable

from autotune.levers import CHECKPOINTING
from autotune.search.throughput import ThroughputModel

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_costs import StepCosts
    from autotune.estimate.step_time import DeviceProfile

__all__ = ["StepPrior"]


class StepPrior:
    """Predicted log samples/s of configs on this device, from the traced steps the proposer keeps (``traced``:
    a family at micro batch 1 -> an estimate with its traced costs, filled as families are traced)."""

    def __init__(
        self, workload: Workload, traced: dict[TrialConfig, MemoryEstimate], precision_speed: dict[str, float] | None
    ) -> None:
        self.profile: DeviceProfile | None = None  # this device's roofline: the step-time model's prior
        self.precision_speed = precision_speed  # the device probe's matmul speed per precision over fp32's
        self._workload = workload
        self._traced = traced
        # config -> traced family -> that family's step as the config's (log samples/s), each pair worked out once
        self._placed_by_family: dict[TrialConfig, dict[TrialConfig, float | None]] = {}
        self._placed_for: tuple[Any, Any] = (None, None)  # the profile and precision speeds they were worked out for
        self._predicted_at: tuple[tuple[int, int], dict[TrialConfig, float | None]] = ((0, 0), {})

    def model(self, params_of: Callable[[TrialConfig], dict[str, Any]], configs: list[TrialConfig]) -> ThroughputModel:
        """The throughput model of ``configs`` with this prior (``params_of``: the knob values it is corrected on)."""
        return ThroughputModel(
            params_of,
            self.predicted,
            configs,
            unpredicted_factor=self.matmul_factor,
            placed=self.placed,
        )

    def matmul_factor(self, config: TrialConfig) -> float:
        """log of the device probe's matmul speed of ``config``'s precision over fp32's."""
        return math.log((self.precision_speed or {}).get(config.precision) or 1.0)

    def predicted(self, config: TrialConfig) -> float | None:
        """log samples/s of ``config`` by the step-time model; None without a traced step of its family.
        Kept until another family is traced (a ranking pass asks for each open config many times)."""
        from autotune.estimate.step_time import predict_step_time

        key = (len(self._traced), id(self.profile))
        if self._predicted_at[0] != key:
            self._predicted_at = (key, {})
        predicted = self._predicted_at[1]
        if config in predicted:
            return predicted[config]
        estimate = self._traced.get(config.replace(micro_batch=1)) or self._twin(config)
        if estimate is None or self.profile is None:
            predicted[config] = None
            return None
        if estimate.config != config:
            estimate = dataclasses.replace(estimate, config=config)  # its costs are kept per sample
        step = predict_step_time(estimate, self._workload, self.profile)
        predicted[config] = math.log(step.samples_per_s) if step is not None else None
        return predicted[config]

    def _twin(self, config: TrialConfig) -> MemoryEstimate | None:
        """The traced step of a family not traced yet, from a twin's trace where the two steps differ by
        arithmetic: ZeRO's stage and offload (the same step, its partitions and transfers worked out from
        the trace, as the estimator works them out) and checkpointing (the checkpointed layers' forward
        run again in the backward; its memory is another matter, which the family's own trace settles when
        its frontier is needed). None when no such twin is traced."""
        family = config.replace(micro_batch=1)
        unsharded = family.replace(zero_stage=None, offload="none") if family.uses_deepspeed else family
        twins = [unsharded]
        if CHECKPOINTING.forward_rerun_share(family) is not None:  # selective: only a trace of it says what it reruns
            plain = unsharded.replace(checkpointing=False, checkpoint_every=1) if family.checkpointing else unsharded
            twins += [plain.replace(zero_stage=family.zero_stage, offload=family.offload), plain]
        for twin_family in dict.fromkeys(twins):
            twin = self._traced.get(twin_family)
            if twin is not None and twin.step_costs is not None and twin_family != family:
                return _step_as(twin, twin.step_costs, twin_family, config)
        return None

    def placed(self, config: TrialConfig) -> float | None:
        """log samples/s where a family with no traced step (nor a twin's) sits until it is traced: each
        traced family's step with ``config``'s own micro batch, ZeRO, offload, checkpointing and (from a LoRA
        trace) weights trained, and its precision's matmul speed in place of the traced one's; their mean.
        None before any trace."""
        from autotune.estimate.step_time import predict_step_time

        if self._placed_for[0] is not self.profile or self._placed_for[1] is not self.precision_speed:
            # Both are set after the proposer is made: its placed figures are worked out anew for them.
            self._placed_for, self._placed_by_family = (self.profile, self.precision_speed), {}
        by_family = self._placed_by_family.setdefault(config, {})
        logs: list[float] = []
        for family, estimate in self._traced.items():
            if family not in by_family:  # a family traced since: only its step is worked out
                by_family[family] = None
                if estimate.step_costs is not None and self.profile is not None:
                    as_config = _step_as(estimate, estimate.step_costs, family, config)
                    step = predict_step_time(as_config, self._workload, self.profile)
                    if step is not None:
                        by_family[family] = (
                            math.log(step.samples_per_s) - self.matmul_factor(family) + self.matmul_factor(config)
                        )
            placed = by_family[family]
            if placed is not None:
                logs.append(placed)
        return sum(logs) / len(logs) if logs else None


def _step_as(estimate: MemoryEstimate, costs: StepCosts, family: TrialConfig, config: TrialConfig) -> MemoryEstimate:
    """``estimate`` (``family``'s trace, of ``costs``) as ``config``'s step: the checkpointed layers' forward run
    again where ``config`` checkpoints and the trace did not, and the base's weight gradients and an update over
    every parameter where ``config`` trains all weights and the trace was a LoRA step."""
    rerun = CHECKPOINTING.forward_rerun_share(config)
    if rerun and not family.checkpointing:
        costs = costs.with_forward_rerun(rerun)
    if not config.uses_lora and family.uses_lora:
        costs = costs.with_all_weights_trained()
    return dataclasses.replace(estimate, config=config, step_costs=costs)
