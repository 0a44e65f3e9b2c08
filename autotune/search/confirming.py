"""Deciding the answer: the contenders re-run, interleaved, and the decision stored with its answer trial (the
rules that decide live in :mod:`autotune.search.confirm`)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from autotune.search.clock import Clock
from autotune.search.confirm import (
    CONFIRM_ROUNDS,
    certainty,
    contenders_of,
    held_answer,
    held_up,
    holds,
    paired_scores,
    proven_order,
    still_racing,
    worth_another_round,
)
from autotune.search.simple import SIMPLE_KEY
from autotune.search.study_trials import ask
from autotune.study.records import (
    ANSWER_ATTR,
    ANSWER_CONSTRAINT,
    CONFIRM_PREFIX,
    DECISION_KEY,
    memory_limit,
    records_of,
    retire_answers,
)

if TYPE_CHECKING:
    import optuna

    from autotune.config.workload import Workload
    from autotune.search.backends import TrialBackend
    from autotune.search.measuring import Measure
    from autotune.search.progress import Progress
    from autotune.search.proposer import Proposer
    from autotune.study.summary import TrialRecord
    from autotune.trial.result import TrialResult

__all__ = ["confirm_winner", "MAX_CONFIRM_ROUNDS", "MAX_CONFIRMATIONS"]

MAX_CONFIRM_ROUNDS = 3  # one more round when the first ones disagree on who leads by more than the noise
MAX_CONFIRMATIONS = 3  # decisions per tune call (a new one when every contender of the last was refuted)


def confirm_winner(
    study: optuna.Study,
    proposer: Proposer,
    workload: Workload,
    measure: Measure,
    progress: Progress,
    backend: TrialBackend,
    clock: Clock | None = None,
) -> None:
    """Re-run the top candidates, interleaved, until a decided answer fits (or re-runs are spent).

    The contenders (:func:`contenders_of`) run in turn (A B C A B C), each re-run a fresh process measuring as
    many steps as a trial, so every round sees them under the same conditions; a challenger behind the held answer
    in a round is out (:func:`still_racing`), and a third round comes when those left disagree on who leads by
    more than the noise (:func:`worth_another_round`). They are ranked by their paired figures: a candidate's figure
    over the round's mean, the median over rounds. A re-run that does not train or does not fit refutes its
    candidate (``confirmed`` False); a slower one only ranks it lower: a refuted speed demotes, it never turns
    "fits" into "nothing". Under ``--max-time`` (``clock``) the leader's first re-run always runs, so the
    answer is confirmed; a further re-run only where the time left holds it.
    """
    clock = clock or Clock(None)
    limit = memory_limit(study.user_attrs["autotune"])
    for _ in range(MAX_CONFIRMATIONS):
        records = records_of(study)
        contenders = contenders_of(records, simple=study.user_attrs.get(SIMPLE_KEY))
        decided = set((study.user_attrs.get(DECISION_KEY) or {}).get("contenders", []))
        if not contenders or {r.number for r in contenders} <= decided:
            return
        runs: dict[int, list[TrialResult]] = {r.number: [] for r in contenders}
        held = held_answer(records, study.user_attrs.get(SIMPLE_KEY))
        racing = contenders
        for round_index in range(MAX_CONFIRM_ROUNDS if len(contenders) > 1 else 1):
            if round_index > 0:
                racing = still_racing(racing, runs, limit, held.number if held is not None else None)
                if len(racing) < 2 or (round_index >= CONFIRM_ROUNDS and not worth_another_round(racing, runs, limit)):
                    break
            for record in racing:  # a refuted contender is out of the race (still_racing): not timed again
                if any(runs.values()) and not clock.holds_a_rerun():
                    break
                progress.confirming(record=record, steps=measure.measure_steps)
                # It warms up one step more, as a call's first trial does (a fresh process after a pause).
                with clock.timing(rerun=True):
                    runs[record.number].append(
                        measure.run(backend, workload, record.config, extra_warmup_steps=1, rerun=True)
                    )
        # Cut short by --max-time: a contender never re-run is not refuted, just not compared.
        _store_decision(study, proposer, [r for r in contenders if runs[r.number]], runs, limit)
        if not clock.holds_a_rerun():
            return


def _store_decision(
    study: optuna.Study,
    proposer: Proposer,
    contenders: list[TrialRecord],
    runs: dict[int, list[TrialResult]],
    limit: int,
) -> None:
    """Record each contender's re-runs, the order their paired figures decide, and the answer trial."""
    scores, rounds = paired_scores(held_up(contenders, runs, limit), runs)
    incumbent = held_answer(records_of(study), study.user_attrs.get(SIMPLE_KEY))
    order = proven_order(
        sorted(scores, key=lambda n: -scores[n]), runs, incumbent.number if incumbent is not None else None
    )
    confirmations = {}
    for record in contenders:
        results = runs[record.number]
        tokens = [x.tokens_per_s for x in results if x.tokens_per_s]
        samples = [x.samples_per_s for x in results if x.samples_per_s]
        figures = [x.throughput for x in results if x.throughput]
        peaks = [x.peak_memory_bytes for x in results if x.peak_memory_bytes is not None]
        failed = next((x for x in results if not holds(x, limit)), None)
        confirmations[record.number] = {
            "confirmed": record.number in scores,
            "status": (failed or results[-1]).status.value if results else "not run",
            "tokens_per_s": statistics.median(tokens) if tokens else None,
            "samples_per_s": statistics.median(samples) if samples else None,
            "throughput": statistics.median(figures) if figures else None,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "measured_steps": sum(x.measured_steps for x in results),
            "runs_throughput": [x.throughput for x in results],
            "error": failed.error if failed is not None else None,
        }
        study.set_user_attr(f"{CONFIRM_PREFIX}{record.number}", confirmations[record.number])
    study.set_user_attr(
        DECISION_KEY,
        {
            "order": order,
            "contenders": [r.number for r in contenders],
            "rounds": rounds,
            "scores": {str(n): v for n, v in scores.items()},
            "certainty": certainty(
                order, runs, {r.number: r for r in contenders}, held=incumbent.number if incumbent else None
            ),
        },
    )
    if order:
        winner = next(r for r in contenders if r.number == order[0])
        _record_answer(study, proposer, winner, confirmations[winner.number], limit)


def _record_answer(
    study: optuna.Study, proposer: Proposer, record: TrialRecord, confirmation: dict[str, Any], limit: int
) -> None:
    """The answer as a trial of its own, the only one feasible for Optuna (see :mod:`autotune.study.records`),
    with the figures its confirmation stored."""
    from optuna.trial import TrialState

    retire_answers(study)  # an earlier decision's answer is feasible no more
    trial, _ = ask(study, proposer, record.config)
    trial.set_user_attr(ANSWER_ATTR, record.number)
    trial.set_user_attr("status", "answer")
    trial.set_constraint("memory", confirmation["peak_memory_bytes"] / limit - 1)
    trial.set_constraint(ANSWER_CONSTRAINT, 0.0)
    study.tell(trial, confirmation["throughput"], state=TrialState.COMPLETE)
