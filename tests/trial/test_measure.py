"""Timing steps until they settle: scripted step times on a scripted clock. A step "takes" its time by moving
the clock ``time_steps`` reads, so what is tested is the decision (settled, more steps, outpaced, enough), not
how long a sleep took on a busy machine: with real sleeps of tens of ms, a loaded 2-core machine stretched one
step and the decision with it."""

from __future__ import annotations

import pytest

import autotune.trial.measure as measure
from autotune.trial.measure import StepTimes, time_steps


class _Clock:
    """What ``time_steps`` reads of the time module: ``perf_counter``, moved only by ``sleep``."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


CLOCK = _Clock()


@pytest.fixture(autouse=True)
def scripted_clock(monkeypatch):
    CLOCK.now = 0.0
    monkeypatch.setattr(measure, "time", CLOCK)


def _steps(durations: list[float]):
    queue = list(durations)

    def step() -> float:
        CLOCK.sleep(queue.pop(0) if queue else durations[-1])
        return 1.0

    return step


def test_steps_that_disagree_are_measured_again_until_they_settle():
    # The first steps disagree (a disturbed one), then the step settles at 50 ms.
    times = time_steps(_steps([0.05, 0.15, 0.05, 0.05, 0.05, 0.05]), lambda: None, warmup=0, steps=2)
    assert 3 <= len(times.seconds) <= 6
    assert times.settled and times.spread <= 0.1
    assert abs(times.median_s - 0.05) < 0.02  # the median ignores the disturbed step
    assert times.disturbed_steps >= 1


def test_a_settled_measurement_takes_only_the_steps_asked_for():
    times = time_steps(_steps([0.05] * 10), lambda: None, warmup=1, steps=3)
    assert len(times.seconds) == 3 and times.settled


def test_a_measurement_that_never_settles_stops_at_its_bounds_and_says_so():
    times = time_steps(_steps([0.02, 0.08] * 20), lambda: None, warmup=0, steps=2, max_steps=3)
    assert len(times.seconds) == 3 and not times.settled  # the step bound
    times = time_steps(_steps([0.02, 0.08] * 20), lambda: None, warmup=0, steps=2)
    # The time bound: extra steps start only within as much time as the first steps took.
    first, extra = sum(times.seconds[:2]), times.seconds[2:]
    assert sum(extra[:-1]) < first and len(times.seconds) < 6 and not times.settled


def test_every_rank_takes_the_same_decision():
    asked = []

    def agree(more: bool) -> bool:  # another rank settled: nobody measures more
        asked.append(more)
        return False

    times = time_steps(_steps([0.02, 0.08] * 5), lambda: None, warmup=0, steps=2, agree=agree)
    assert asked == [True] and len(times.seconds) == 2


def test_spread_is_the_interquartile_range_over_the_median():
    times = StepTimes([1.0, 1.0, 2.0, 2.0, 3.0], warmup_s=0.0, last_loss=1.0)
    assert times.median_s == 2.0 and times.iqr_s == 1.0 and times.spread == 0.5
    assert times.disturbed_steps == 1 and not times.settled


def test_a_step_too_slow_to_compete_ends_the_measurement_there():
    # The bound is three times a competitor's step: a 60 ms step at a 30 ms bound is the only one timed.
    times = time_steps(_steps([0.06] * 5), lambda: None, warmup=1, steps=3, outpaced_s=0.03)
    assert len(times.seconds) == 1 and times.outpaced
    assert times.seconds[0] >= 0.06  # its figure is the step's own: a bound on what more steps would read
    # Steps under the bound are measured as asked.
    times = time_steps(_steps([0.02] * 5), lambda: None, warmup=1, steps=3, outpaced_s=0.5)
    assert len(times.seconds) == 3 and not times.outpaced


def test_ranks_stop_early_together_when_any_of_them_was_outpaced():
    asked = []

    def agree(wish: bool) -> bool:  # another rank's step took past the bound: every rank stops
        asked.append(wish)
        return True

    times = time_steps(_steps([0.02] * 5), lambda: None, warmup=0, steps=3, agree=agree, outpaced_s=0.5)
    assert asked == [False] and len(times.seconds) == 1 and times.outpaced


def test_warm_up_steps_run_the_engines_warm_up_and_are_not_timed():
    warmed: list[int] = []

    def warm_up() -> float:
        warmed.append(1)
        CLOCK.sleep(0.2)
        return 1.0

    times = time_steps(_steps([0.02] * 5), lambda: None, warmup=2, steps=3, warm_up=warm_up)
    assert len(warmed) == 2 and times.warmup_s >= 0.4
    assert len(times.seconds) == 3 and times.median_s < 0.1


def test_two_long_steps_that_agree_are_enough_for_a_search():
    # 60 ms steps against a 100 ms "enough": two agree and took 120 ms, so the third asked for is not run.
    times = time_steps(_steps([0.06] * 5), lambda: None, warmup=0, steps=4, enough_s=0.1)
    assert len(times.seconds) == 2 and times.settled
    # Short steps take every step asked for; so do long ones that disagree.
    times = time_steps(_steps([0.02] * 5), lambda: None, warmup=0, steps=4, enough_s=0.1)
    assert len(times.seconds) == 4
    times = time_steps(_steps([0.04, 0.12, 0.06, 0.06, 0.06]), lambda: None, warmup=0, steps=3, enough_s=0.1)
    assert len(times.seconds) >= 3
    # Without it (a trial asked for its steps), they are all run.
    times = time_steps(_steps([0.06] * 5), lambda: None, warmup=0, steps=4)
    assert len(times.seconds) == 4
