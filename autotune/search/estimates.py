"""Estimates without running (``autotune estimate``): one config, or every config of a space, each
with its predicted memory, whether it fits, and its step time on the device's roofline.

The setup (device, budget, configs, roofline) is checked in :func:`estimate_configs`, before any
trace; the rows come one at a time from :meth:`Estimates.rows`, since each is a traced step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_time import DeviceProfile, StepTime

__all__ = ["EstimateRow", "Estimates", "estimate_configs"]


@dataclass(frozen=True)
class EstimateRow:
    """One config's estimate: its memory, whether it fits (None: no budget), its step (None: no roofline)."""

    estimate: MemoryEstimate
    fits: bool | None
    step: StepTime | None


@dataclass(frozen=True)
class Estimates:
    """What the configs are estimated for: the device judged against, the budget and its limit, the roofline."""

    workload: Workload
    configs: list[TrialConfig]
    device: DeviceInfo | None
    budget_bytes: int | None
    limit_bytes: int | None
    profile: DeviceProfile | None  # None: nowhere to time the step
    task: str | None

    def rows(self) -> Iterator[EstimateRow]:
        """Each config's estimate, in order; a model that cannot be built or traced is refused at its first."""
        from autotune.estimate.client import predict_memory
        from autotune.estimate.fit import estimate_fits
        from autotune.estimate.results import EstimateError
        from autotune.estimate.step_time import predict_step_time

        for config in self.configs:
            try:
                estimate = predict_memory(self.workload, config, task=self.task)
            except EstimateError as exc:
                raise ConfigError(f"--model {self.workload.model}: {exc}") from None
            step = None
            if self.profile is not None:
                step = predict_step_time(estimate, self.workload, self.profile, task=self.task)
            fits = estimate_fits(estimate, limit_bytes=self.limit_bytes, workload=self.workload, device=self.device)
            yield EstimateRow(estimate=estimate, fits=fits, step=step)


def estimate_configs(
    *,
    workload: Workload,
    config: TrialConfig,
    space: str | None = None,
    memory_budget_bytes: int | None = None,
    headroom: float = 0.1,
) -> Estimates:
    """Estimate ``config`` (or, with ``space``, every config of that space) for ``workload``: on its
    named card (``workload.gpu``) or the device here. Starts the estimate server, whose imports run
    beside the device and model checks made here."""
    from autotune.estimate.client import start_estimate_server
    from autotune.estimate.fit import card_budget, estimated_device, memory_limit
    from autotune.estimate.step_time import profile_for
    from autotune.models.sources import check_factory_module, resolve_task

    check_factory_module(workload)  # before the estimate server starts: a typo is said at once
    start_estimate_server()
    device = estimated_device(workload)
    budget = memory_budget_bytes
    if workload.gpu is not None:
        assert device is not None  # a named card
        budget = card_budget(budget, device)
    if space is not None:
        from autotune.search.presets import load_space

        if device is None:
            from autotune.config.device import detect_device

            device = detect_device(workload.device)  # refuses --device cuda without a GPU or --gpu
        configs = load_space(space).candidates(workload, device)
    else:
        configs = [config]
        config.grad_accum_steps(workload)  # refuses a micro batch the global batch does not divide into
        if device is not None:
            config.validate_for(workload, device)
    task = resolve_task(workload)
    if space is None:
        from autotune.prepare import refusal_before_trial

        # Refused before the device's roofline is probed (seconds, a collective between processes for several
        # ranks): a config the model cannot take is bad input, said at once.
        refusal = refusal_before_trial(workload, config, task)
        if refusal is not None:
            raise ConfigError(refusal)
    return Estimates(
        workload=workload,
        configs=list(configs),
        device=device,
        budget_bytes=budget,
        limit_bytes=memory_limit(budget, headroom),
        profile=profile_for(workload, device.type if device is not None else None),
        task=task,
    )
