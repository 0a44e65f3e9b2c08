"""Timing whole optimizer steps: warm-up untimed, then timed steps each ending in a sync."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from autotune.failures import NonFiniteLossError

__all__ = ["StepTimes", "time_steps"]


@dataclass(frozen=True)
class StepTimes:
    seconds: list[float]
    warmup_s: float
    last_loss: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def iqr_s(self) -> float:
        if len(self.seconds) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return q3 - q1

    @property
    def total_s(self) -> float:
        return sum(self.seconds)


def time_steps(step: Callable[[], float], sync: Callable[[], None], *, warmup: int, steps: int) -> StepTimes:
    """Run ``warmup`` untimed and ``steps`` timed optimizer steps.

    ``step`` runs every accumulation micro-step of one optimizer step and returns the loss as a
    Python float (which waits for the device); ``sync`` waits for whatever else is queued.
    """
    loss = math.nan
    start = time.perf_counter()
    for _ in range(warmup):
        loss = _checked(step())
    sync()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        loss = _checked(step())
        sync()
        times.append(time.perf_counter() - begin)
    return StepTimes(times, warmup_s, loss)


def _checked(loss: float) -> float:
    if not math.isfinite(loss):
        raise NonFiniteLossError(f"the training loss is {loss}")
    return loss
