"""When the search stops on its limits: trial count, time, patience, a broken workload; the stop on
evidence's words; and whether a worker with nothing to start should watch the others' trials."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.study.records import measured

if TYPE_CHECKING:
    from autotune.search.outlook import Outlook
    from autotune.study.summary import TrialRecord

__all__ = ["stop_reason", "settled_reason", "waits_on_others", "patience_spent"]

_BROKEN_AFTER = 2  # stop when this many trials, and every one so far, errored or crashed


def stop_reason(
    records: list[TrialRecord], *, target: int, patience: int | None, timeout_s: float | None, elapsed_s: float
) -> str | None:
    done = measured(records)
    broken = [r for r in done if r.status in ("error", "crashed")]
    if len(done) >= _BROKEN_AFTER and len(broken) == len(done):
        last = (broken[-1].error or "").strip().splitlines()[-1:] or ["no message"]
        return (
            f"every trial so far ended in {broken[-1].status} ({last[0]}); the workload itself fails: "
            f"autotune trial with the same --model shows the whole error"
        )
    running = sum(r.status == "running" for r in records)  # other workers' trials: taken
    if len(done) + running >= target:
        elsewhere = f", {running} more being measured by other workers" if running else ""
        return f"{len(done)} trials measured{elsewhere} (--n-trials {target})"
    if timeout_s is not None and elapsed_s >= timeout_s:
        return f"--timeout {timeout_s:g} s reached"
    if patience is not None and _since_improvement(done) >= patience:
        return f"no faster config that fits in the last {patience} trials (--patience {patience})"
    return None


def settled_reason(outlook: Outlook) -> str | None:
    """The stop on evidence: no untried config is predicted to beat the best by more than the noise."""
    from autotune.search.outlook import MEASUREMENT_NOISE

    if not outlook.settled or outlook.upper is None:
        return None
    gain = outlook.upper / outlook.best - 1
    where = f"at most {gain:.0%} over the best" if gain >= 0 else f"at least {-gain:.0%} under the best"
    left_out = "".join(f"; {text}" for text in (outlook.waived_text(), outlook.recompute_text()) if text)
    return (
        f"settled: the {outlook.untried} untried configs are predicted {where} (the model's error "
        f"included), none more than a trial's {MEASUREMENT_NOISE:.0%} noise ahead" + left_out
    )


def waits_on_others(records: list[TrialRecord], *, target: int, patience: int | None, timed_out: bool) -> bool:
    """Whether a worker with nothing to start should watch the trials other workers are measuring
    rather than end: one of them may yet be lost (its worker killed, preempted) and its config
    re-queued, and the study is only done when none is left RUNNING. Not after ``--timeout``,
    ``--patience`` or a broken workload: those end the search whatever the others measure."""
    done = measured(records)
    running = any(r.status == "running" for r in records)
    return (
        running
        and len(done) < target
        and not timed_out
        and not patience_spent(records, patience)
        and not (len(done) >= _BROKEN_AFTER and all(r.status in ("error", "crashed") for r in done))
    )


def patience_spent(records: list[TrialRecord], patience: int | None) -> bool:
    return patience is not None and _since_improvement(measured(records)) >= patience


def _since_improvement(done: list[TrialRecord]) -> int:
    best, since = 0.0, 0
    for record in sorted(done, key=lambda r: r.number):
        if record.fits and (record.throughput or 0.0) > best:
            best, since = record.throughput or 0.0, 0
        else:
            since += 1
    return since
