"""Timing whole optimizer steps: warm-up untimed, then timed steps each ending in a sync,
measured until the step times settle.

A machine that is busy with something else (a shared GPU node, a laptop, CI) slows some steps
down: a few disturbed steps among three can move a mean by half. So the figure is the median
step, and when the steps' spread (interquartile range over the median) is still wide after the
requested steps, more steps are measured, up to a bound, and the spread is reported either way.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, TypeGuard

from autotune.trial.failures import NonFiniteLossError

__all__ = [
    "StepTimes",
    "time_steps",
    "unsettled",
    "compile_payoff_steps",
    "SETTLED_SPREAD",
    "DISTURBED_FACTOR",
    "MAX_STEPS_FACTOR",
]

SETTLED_SPREAD = 0.10  # steps have settled when their IQR is within 10% of their median
DISTURBED_FACTOR = 1.25  # a step 25% slower than the median was disturbed (by another process, a GC, ...)
MAX_STEPS_FACTOR = 3  # an unsettled measurement takes at most 3x the requested steps...
MAX_EXTRA_TIME_FACTOR = 1  # ...and at most as much extra time as the requested steps took
# Two steps that took this long in all and agree end a search's measurement: at over a second a step, what one
# more step would settle (the timer, a stray interrupt) is far under what differs between two runs of the config,
# which the search's re-runs measure. Only the search asks for it (``enough_s``); a trial asked for N steps runs N.
ENOUGH_MEASURED_S = 2.5


def unsettled(spread: float | None) -> TypeGuard[float]:
    """Whether step times with this spread (IQR / median) still disagreed: a figure to read with it."""
    return spread is not None and spread > SETTLED_SPREAD


@dataclass(frozen=True)
class StepTimes:
    seconds: list[float]
    warmup_s: float
    last_loss: float
    outpaced: bool = False  # stopped after a step that showed the config cannot compete (see time_steps)

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
    def spread(self) -> float:
        """The interquartile range relative to the median: 0.05 means the middle half of the
        steps lie within 5% of the median's length of each other."""
        return self.iqr_s / self.median_s if self.median_s > 0 else 0.0

    @property
    def settled(self) -> bool:
        return not unsettled(self.spread)

    @property
    def disturbed_steps(self) -> int:
        median = self.median_s
        return sum(t > DISTURBED_FACTOR * median for t in self.seconds)

    @property
    def total_s(self) -> float:
        return sum(self.seconds)


def time_steps(
    step: Callable[[], float],
    sync: Callable[[], None],
    *,
    warmup: int,
    steps: int,
    max_steps: int | None = None,
    agree: Callable[[bool], bool] = lambda more: more,
    outpaced_s: float | None = None,
    warm_up: Callable[[], float] | None = None,
    enough_s: float | None = None,
) -> StepTimes:
    """Run ``warmup`` untimed and ``steps`` timed optimizer steps (more while unsettled, fewer where ``enough_s``
    says so).

    ``step`` runs every accumulation micro-step of one optimizer step and returns the loss as a
    Python float (which waits for the device); ``sync`` waits for whatever else is queued.
    ``warm_up`` runs one untimed step (default ``step``; an engine's may run fewer micro batches).
    While the times have not settled (see :data:`SETTLED_SPREAD`), one more step is measured, up
    to ``max_steps`` (default ``MAX_STEPS_FACTOR`` x ``steps``) and ``MAX_EXTRA_TIME_FACTOR`` x the
    time the first ``steps`` took. ``agree`` turns this rank's wish for one more step into every
    rank's decision (ranks of one trial must run the same number of steps).

    ``outpaced_s``: a step time no competitive config takes (a few times the best config's so far). A timed
    step that long ends the measurement there, ``outpaced``: its figure bounds what more steps would read
    (a disturbance slows a step, it never speeds one up), and a config many times too slow is not worth
    them (a 16-bit step on a CPU without 16-bit matmuls can take half a minute).

    ``enough_s``: two or more steps that took this long in all and agree (settled) end the measurement before
    ``steps`` (see :data:`ENOUGH_MEASURED_S`).
    """
    max_steps = max(steps, max_steps if max_steps is not None else MAX_STEPS_FACTOR * steps)
    loss = math.nan
    start = time.perf_counter()
    for _ in range(warmup):
        loss = _checked((warm_up or step)())
    sync()
    warmup_s = time.perf_counter() - start
    times: list[float] = []

    def timed() -> None:
        nonlocal loss
        begin = time.perf_counter()
        loss = _checked(step())
        sync()
        times.append(time.perf_counter() - begin)

    for _ in range(steps):
        timed()
        if outpaced_s is not None and agree(times[-1] >= outpaced_s):
            return StepTimes(times, warmup_s, loss, outpaced=True)
        if enough_s is not None and len(times) < steps and agree(_enough(times, enough_s)):
            return StepTimes(times, warmup_s, loss)
    deadline = time.perf_counter() + MAX_EXTRA_TIME_FACTOR * sum(times)
    while agree(
        len(times) < max_steps and time.perf_counter() < deadline and not StepTimes(times, warmup_s, loss).settled
    ):
        timed()
    return StepTimes(times, warmup_s, loss)


def _enough(times: list[float], enough_s: float) -> bool:
    return len(times) >= 2 and sum(times) >= enough_s and StepTimes(times, 0.0, math.nan).settled


def _checked(loss: float) -> float:
    if not math.isfinite(loss):
        raise NonFiniteLossError(f"the training loss is {loss}")
    return loss


def compile_payoff_steps(compile_s: float, eager_step_s: float, compiled_step_s: float) -> int | None:
    """Steps a run needs before compiling has paid for itself: what compiling cost beyond a compiled
    step, over what each compiled step saves; None when a compiled step saves nothing."""
    saved = eager_step_s - compiled_step_s
    if saved <= 0:
        return None
    return max(1, math.ceil(round(max(0.0, compile_s - compiled_step_s) / saved, 6)))  # round: float fuzz
