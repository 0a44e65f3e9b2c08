"""How the search measures one trial: the steps it asks for, the re-run of a disturbed trial, and the step time
that ends a trial whose config cannot compete."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autotune.trial.measure import ENOUGH_MEASURED_S

if TYPE_CHECKING:
    import optuna

    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.search.backends import TrialBackend
    from autotune.study.summary import TrialRecord
    from autotune.trial.result import TrialResult

__all__ = ["Measure", "run_undisturbed", "outpaced_step_s", "DISTURBED_SPREAD", "OUTPACED_FACTOR"]

DISTURBED_SPREAD = 0.2  # a trial whose step times still spread this much (IQR / median) is measured again
# A trial whose timed step takes this many times the fastest fitting config's step is ended there: a disturbed
# step is slower, not this much (see trial.measure.time_steps).
OUTPACED_FACTOR = 3.0


@dataclass(frozen=True, kw_only=True)
class Measure:
    """What each trial of a search is asked to measure, and within what."""

    memory_budget_bytes: int
    trial_timeout_s: float
    warmup_steps: int
    measure_steps: int
    outpaced_step_s: float | None = None  # see trial.measure.time_steps; set per trial from the best so far
    enough_measured_s: float | None = ENOUGH_MEASURED_S  # see trial.measure.time_steps

    def run(
        self,
        backend: TrialBackend,
        workload: Workload,
        config: TrialConfig,
        *,
        extra_warmup_steps: int = 0,
        rerun: bool = False,
    ) -> TrialResult:
        """One trial of ``config`` as asked, with ``extra_warmup_steps`` more untimed steps; a re-run (``rerun``) is
        never cut short as outpaced."""
        return backend.run(
            workload,
            config,
            memory_budget_bytes=self.memory_budget_bytes,
            timeout_s=self.trial_timeout_s,
            warmup_steps=self.warmup_steps + extra_warmup_steps,
            measure_steps=self.measure_steps,
            outpaced_step_s=None if rerun else self.outpaced_step_s,
            enough_measured_s=self.enough_measured_s,
        )


def run_undisturbed(
    backend: TrialBackend, workload: Workload, config: TrialConfig, measure: Measure, trial: optuna.Trial
) -> TrialResult:
    """The trial's result; measured once more where its steps still spread more than ``DISTURBED_SPREAD``
    after the extra steps (something else ran on the cores: its figure would mislead the model and the
    ranking for good), keeping the less disturbed of the two. The first figure is kept on the trial."""
    run = functools.partial(measure.run, backend, workload, config)
    result = run()
    if not result.ok or result.step_time_spread is None or result.step_time_spread <= DISTURBED_SPREAD:
        return result
    trial.set_user_attr("disturbed", {"throughput": result.throughput, "spread": result.step_time_spread})
    again = run()
    return again if again.ok and (again.step_time_spread or 0.0) < result.step_time_spread else result


def outpaced_step_s(records: list[TrialRecord], workload: Workload) -> float | None:
    """The step time ``OUTPACED_FACTOR`` times the fastest fitting config's so far: a timed step that long
    ends a trial (its config cannot compete); None before a config fits."""
    fastest = max((r.samples_per_s or 0.0 for r in records if r.fits), default=0.0)
    return OUTPACED_FACTOR * workload.global_batch / fastest if fastest > 0 else None
