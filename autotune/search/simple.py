"""The simple answer: what a one-knob batch-size finder answers, measured first.

Lightning's ``scale_batch_size`` and Accelerate's ``find_executable_batch_size`` search one knob: the
micro batch, every other knob at its default, up a power-of-two ramp until memory runs out. A search
over every knob starts with the same answer, so that it is never behind them: the largest power-of-two
micro batch that fits with headroom, at the space's first value of every other knob (its defaults:
fp32, no checkpointing, the standard loss, ...), with accumulation up to the global batch.

With a memory estimator the ramp starts where the prediction puts the largest size that fits (one
trial where the finders spend several); a size that then does not fit sends it one size down. Without
one, each trial halves the sizes left unknown, as the finders' binary search does.

The search's later configs replace this answer only by beating it in interleaved re-runs (see
:func:`autotune.search.tuner.tune`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autotune.config.knobs import TrialConfig
from autotune.study.records import SIMPLE_KEY

if TYPE_CHECKING:
    from autotune.estimate.results import MemoryEstimate
    from autotune.study.summary import TrialRecord

__all__ = ["SIMPLE_KEY", "ramp_family", "next_ramp_config", "ramp_answer"]


Estimator = Callable[[TrialConfig], "MemoryEstimate | None"]  # None when it cannot say
_BROKEN = ("error", "crashed", "nan", "timeout")  # a ramp trial that failed so ends the ramp
_LINE_SLACK = 0.05  # a size the straight line puts more than 5% over the limit is not estimated


def ramp_family(candidates: list[TrialConfig]) -> list[TrialConfig]:
    """The configs of the ramp, smallest micro batch first: each power-of-two micro batch of the family of
    the space's first candidate (every knob at its first value, the space's defaults, where that runs here)."""
    if not candidates:
        return []
    first = candidates[0]
    family = [c for c in candidates if c.replace(micro_batch=first.micro_batch) == first]
    sizes = {c.micro_batch for c in family}
    powers = {s for s in sizes if s & (s - 1) == 0}
    return sorted((c for c in family if c.micro_batch in (powers or sizes)), key=lambda c: c.micro_batch)


def _bounds(family: list[TrialConfig], records: list[TrialRecord]) -> tuple[int, int]:
    """Indices into ``family``: the largest size measured to fit (-1: none), the smallest known not to fit,
    or not to run at all (``len(family)``: none)."""
    fit, big = -1, len(family)
    index = {c: i for i, c in enumerate(family)}
    for record in records:
        i = index.get(record.config)
        if i is None or record.status in ("running", "interrupted"):
            continue
        if record.fits:
            fit = max(fit, i)
        else:
            big = min(big, i)  # out of memory, over the limit, skipped, or a failure: the ramp ends below it
    return fit, big


def next_ramp_config(
    family: list[TrialConfig], records: list[TrialRecord], estimate: Estimator | None, limit_bytes: int
) -> TrialConfig | None:
    """The ramp's next trial, or None once its answer is known.

    With an estimator: the largest unknown size predicted under ``limit_bytes`` (the limit itself, no
    margin: the answer must fit), found from the top down, a straight line through the last estimate
    passing over sizes it puts clearly over; where none is predicted under and nothing fits yet, the
    smallest unknown size (a borderline prediction is not proof that nothing fits; one well over the limit
    is skipped by the tuner, as the search skips it, and ends the ramp with no answer). Without one: the middle of the
    unknown sizes, so that each trial halves them (the finders double from the bottom: one trial per size).
    A size another worker is measuring is not unknown: it is never taken twice at once.
    Where the estimator cannot say: the smallest unknown size.
    """
    from autotune.search.memory_bounds import straight_line

    if any(r.config in family and r.status in _BROKEN for r in records):
        return None  # not a matter of memory: the search's own rule on a broken workload decides what follows
    fit, big = _bounds(family, records)
    running = {r.config for r in records if r.status == "running"}
    unknown = [c for c in family[fit + 1 : big] if c not in running]
    if not unknown:
        return None
    if estimate is None:
        # A ramp by halves: what fits sends it up, what does not down. A size another worker is measuring is
        # not taken again: the middle of the sizes left.
        return unknown[len(unknown) // 2]
    line: Callable[[int], float] | None = None
    for config in reversed(unknown):
        if line is not None and line(config.micro_batch) > limit_bytes * (1 + _LINE_SLACK):
            continue
        predicted = estimate(config)
        if predicted is None:
            return unknown[0]  # the estimator cannot say: ramp as the finders do
        if predicted.predicted_peak_bytes <= limit_bytes:
            return config
        line = straight_line(predicted)
    return unknown[0] if fit < 0 else None


def ramp_answer(family: list[TrialConfig], records: list[TrialRecord]) -> TrialRecord | None:
    """The simple answer: the largest size of the ramp measured to fit (its first trial of that config)."""
    fitting = [r for r in records if r.fits and r.config in family]
    if not fitting:
        return None
    return min(fitting, key=lambda r: (-r.config.micro_batch, r.number))
