"""The driver: search the knobs in an Optuna study, learn from OOMs, confirm the winner.

``tune`` owns one study and carries it on wherever it stopped (a finished trial is never
measured again; one interrupted by Ctrl-C or ``kill -9`` is retried). ``find`` is ``tune``
under a name derived from the question, so asking it again answers from the study.

How a trial lands in the study (direction: maximise tokens/s):

* ok -> COMPLETE with its tokens/s, and a ``memory`` constraint (peak / limit - 1; > 0 when it
  does not fit with headroom), which Optuna's samplers and ``best_trial`` honour;
* oom, timeout -> PRUNED (TPE ranks pruned trials among the worst; it ignores FAIL ones),
  an oom with a violated ``memory`` constraint;
* crashed, nan, error -> FAIL; interrupted -> FAIL with status ``interrupted``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import statistics
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from autotune.config.device import DeviceInfo, detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import AutotuneError, ConfigError
from autotune.search.backends import LocalBackend, ScriptBackend, TrialBackend
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
    rounds_agree,
    still_racing,
)
from autotune.search.measuring import Measure, outpaced_step_s, run_undisturbed
from autotune.search.simple import SIMPLE_KEY, next_ramp_config, ramp_answer, ramp_family
from autotune.search.space import SearchSpace, is_preset, load_space
from autotune.search.workers import (
    gpu_slices,
    proposal_lock,
    start_helpers,
    wait_helpers,
)
from autotune.study.records import (
    ANSWER_ATTR,
    ANSWER_CONSTRAINT,
    CONFIRM_PREFIX,
    DECISION_KEY,
    STOP_KEY,
    measured,
    memory_limit,
    ranking,
    records_of,
    retire_answers,
    summarize,
)
from autotune.study.stale import RETRY_ATTR, record_heartbeat, record_worker_job, recover_stale_trials
from autotune.study.summary import StudySummary, TrialRecord
from autotune.trial.result import TrialResult, TrialStatus
from autotune.trial.runner import DEFAULT_TRIAL_TIMEOUT_S

if TYPE_CHECKING:
    import optuna

    from autotune.estimate.results import MemoryEstimate
    from autotune.estimate.step_time import DeviceProfile
    from autotune.search.proposer import Outlook, Proposer

__all__ = ["tune", "find", "find_name", "Progress", "TrialBackend", "LocalBackend", "DEFAULT_HEADROOM"]

DEFAULT_HEADROOM = 0.10  # a config fits when its peak stays 10% under the budget
CONFIRM_STEPS_FACTOR = 2  # a candidate's first re-run measures 2x as many steps: the fit held over a longer run
WARM_MICRO_BATCHES = 4  # a warm-up step of this many micro batches warms a cold trial without another step
MAX_CONFIRM_ROUNDS = 3  # one more round when the first ones disagree on who leads
MAX_CONFIRMATIONS = 3  # decisions per tune call (a new one when every contender of the last was refuted)
PROBE_KEY = "device_probe"  # study user attribute: matmul speed per precision relative to fp32
ROOFLINE_KEY = "device_roofline"  # study user attribute: the device profile the step-time model times against
SKIP_MARGIN = 0.05  # skip a config predicted more than 5% over the limit; closer ones still run
_BROKEN_AFTER = 2  # stop when this many trials, and every one so far, errored or crashed
_WATCH_S = 2.0  # how often a worker with nothing left to start looks at the others' trials


_stop = {"requested": False, "in_trial": False}


def interrupt_safely() -> None:
    """For a signal handler (a SLURM worker's pre-termination notice): interrupt the tuning as Ctrl-C
    does, at once while a trial is measured, else at the next safe point, never inside a write to the
    study (a journal's lock left held would stall every worker)."""
    _stop["requested"] = True
    if _stop["in_trial"]:
        raise KeyboardInterrupt


def _stop_point() -> None:
    if _stop["requested"]:
        raise KeyboardInterrupt


class Progress(Protocol):
    """What the driver tells its caller while it works (the CLI prints it; the API ignores it)."""

    def started(self, *, study: str, storage: str, measured: int, target: int, recovered: list[int]) -> None: ...
    def trial_started(self, *, index: int, target: int, config: TrialConfig, retry: bool) -> None: ...
    def trial_finished(
        self, *, record: TrialRecord, best: TrialRecord | None, elapsed_s: float, leading: TrialRecord | None = None
    ) -> None: ...
    def simple_answer(self, *, record: TrialRecord | None, elapsed_s: float, accumulation: int) -> None: ...
    def skipped(self, *, record: TrialRecord, limit_bytes: int) -> None: ...
    def dropped(self, *, reasons: list[str]) -> None: ...
    def space_kept(self, *, name: str, added: list[str]) -> None: ...
    def confirming(self, *, record: TrialRecord, steps: int) -> None: ...
    def standing(self, *, text: str) -> None: ...
    def stopped(self, *, reason: str) -> None: ...
    def lost(self, *, numbers: list[int]) -> None: ...


class _Silent:
    def __getattr__(self, name: str) -> Any:
        return lambda **_: None


def tune(
    *,
    study: str,
    workload: Workload | None = None,
    space: str | Path | SearchSpace = "default",
    memory_budget_bytes: int | None = None,
    n_trials: int | None = None,
    timeout_s: float | None = None,
    max_time_s: float | None = None,
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
    patience: int | None = None,
    stop_on_evidence: bool = True,
    headroom: float = DEFAULT_HEADROOM,
    storage: str | None = None,
    warmup_steps: int = 1,
    measure_steps: int = 3,
    estimate: bool = True,
    workers: int = 1,
    confirm: bool = True,
    progress: Progress | None = None,
    backend: TrialBackend | None = None,
    command: list[str] | None = None,
    worker_number: int | None = None,
    srun: bool = False,
    simple_first: bool = True,
) -> StudySummary:
    """Search ``space`` for the fastest config of ``workload`` that fits; return the study read back.

    ``n_trials`` is the study's total of measured trials (default: the space's), so running
    the same call again carries an unfinished study on to it. It stops early on ``timeout_s``
    (this call's wall time), when no untried config is predicted to beat the best by more than
    the noise (the model's error included: see :class:`~autotune.search.proposer.Outlook`), after
    ``patience`` measured trials without a faster fit, or on an exhausted space (``stop_on_evidence``
    off: not on the prediction, so configs are measured up to the other limits); then re-runs the
    winner longer to confirm it. ``max_time_s`` bounds the whole call: the search stops early
    enough to leave the confirmation its share, and the answer says what stayed untried. With ``estimate``, a config
    the memory estimator predicts over the limit by more than 5% is not run but recorded as
    ``skipped`` with its prediction.

    ``workers`` > 1 runs that many processes on the study (this one and helpers, each on its own
    GPUs where there are several); the winner is confirmed once all are done. Workers elsewhere
    join by tuning the same study on the same storage URL, with ``confirm`` off but for one.

    ``backend`` runs the trials and estimates (default: real ones, :class:`LocalBackend`); the
    search benchmarks pass one that replays a measured grid through this same driver.

    ``simple_first``: before the search, measure what a one-knob batch-size finder answers
    (:mod:`autotune.search.simple`); the search's configs replace it only by beating it in every
    interleaved re-run. Helpers that join a study (``confirm`` off, a ``worker_number``) leave it to
    the worker that confirms.
    """
    from autotune.estimate.step_time import matmul_speedups
    from autotune.search.proposer import Proposer
    from autotune.study.storage import create_study, open_storage
    from autotune.study.stored_facts import record as record_model_facts

    clock = Clock(max_time_s)
    workload = workload or Workload()
    progress = progress or _Silent()
    _check_numbers(
        n_trials=n_trials,
        timeout_s=timeout_s,
        max_time_s=max_time_s,
        trial_timeout_s=trial_timeout_s,
        patience=patience,
        headroom=headroom,
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
        workers=workers,
    )
    device = detect_device(workload.device)
    space = space if isinstance(space, SearchSpace) else load_space(space)
    budget = _budget(memory_budget_bytes, device)
    # A user's command: its model is its own, so nothing is estimated and every config is measured.
    estimate = estimate and not command
    backend = backend or (ScriptBackend(device.type, command) if command else LocalBackend(device.type, srun=srun))
    _check_nodes(workload, srun=srun)  # before the storage is opened: a refused worker writes nothing
    _check_workload(workload, device)
    space.choices(workload, device)  # a space with nothing to run here is refused before a study is written
    if isinstance(backend, LocalBackend):
        backend.start(estimate=estimate)  # their imports beside the storage's opening (the CLI started them sooner)
    gpus = gpu_slices(workers, workload.nproc, device)
    opened = open_storage(storage)
    space = _space_to_resume(opened, study, space, progress)
    meta = question(
        workload=workload, space=space, device=device, memory_budget_bytes=budget, headroom=headroom, command=command
    )
    the_study = create_study(opened, study, meta)
    record_worker_job(the_study, worker=worker_number)
    recovered = recover_stale_trials(the_study)
    limit = memory_limit(the_study.user_attrs["autotune"])
    oracle = _Oracle(backend, workload) if estimate else None
    proposer = Proposer(
        space, workload, device, estimator=oracle.lookup if oracle else None, limit_bytes=limit, margin=SKIP_MARGIN
    )
    proposer.hurry = clock.hurried
    proposer.out_of_time = clock.out_of_time
    # What show and export need about the model (LoRA's targets, hidden size), resolved as the trials resolve it.
    record_model_facts(the_study, workload, proposer.choices.get("lora", ()), script=bool(command))
    target = n_trials or space.n_trials
    patience = patience if patience is not None else space.patience
    measure = Measure(
        memory_budget_bytes=budget,
        trial_timeout_s=trial_timeout_s,
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
    )
    from autotune.study.storage import display_url

    progress.started(
        study=study,
        storage=display_url(storage),
        measured=len(measured(records_of(the_study))),
        target=target,
        recovered=recovered,
    )
    progress.dropped(reasons=space.dropped_knobs(workload, device))
    helpers = start_helpers(
        dict(
            study=study,
            workload=workload.to_dict(),
            space=space.name,
            memory_budget_bytes=budget,
            n_trials=target,
            timeout_s=timeout_s,
            max_time_s=max_time_s,
            trial_timeout_s=trial_timeout_s,
            patience=patience,
            stop_on_evidence=stop_on_evidence,
            headroom=headroom,
            storage=storage,
            warmup_steps=warmup_steps,
            measure_steps=measure_steps,
            estimate=estimate,
            command=command,
        ),
        gpus[1:],
    )
    search = _Search(  # --timeout counts from here, as the helpers start
        study=the_study,
        storage=storage,
        proposer=proposer,
        oracle=oracle,
        workload=workload,
        measure=measure,
        backend=backend,
        progress=progress,
        clock=clock,
        target=target,
        patience=patience,
        timeout_s=timeout_s,
        stop_on_evidence=stop_on_evidence,
    )
    try:
        with _visible_gpus(gpus[0]):
            # Helpers search meanwhile: the ramp takes its configs under the same lock as their proposals.
            if simple_first and (confirm or worker_number is None) and SIMPLE_KEY not in the_study.user_attrs:
                _simple_answer(
                    the_study,
                    proposer,
                    oracle,
                    workload,
                    measure,
                    backend,
                    progress,
                    clock,
                    storage=storage,
                    target=target,
                )
            # The step-time model's device profile, probed after the simple answer (which needs none): the answer
            # the one-knob finders give comes as soon as theirs.
            proposer.profile = _device_profile(the_study, backend, ranks=workload.nproc) if estimate else None
            # Until a family's step is traced (or, with no step-time model, until measured), the matmul speed of
            # its precision places it: the roofline's, else the device probe's.
            proposer.precision_speed = (
                _precision_speed(the_study, backend, proposer.choices.get("precision", ()))
                if proposer.profile is None
                else matmul_speedups(proposer.profile, proposer.choices.get("precision", ()))
            )
            search.run()
            wait_helpers(helpers)
    except KeyboardInterrupt:
        for helper in helpers:  # a terminal's Ctrl-C reached them too; a signal to this process alone did not
            helper.send_signal(signal.SIGINT)
        wait_helpers(helpers)
        raise
    finally:
        for helper in helpers:
            if helper.poll() is None:
                helper.kill()
                helper.wait()
    if confirm:
        _confirm_winner(the_study, proposer, workload, measure, progress, backend, clock)
    return summarize(the_study, url=storage)


@dataclass(kw_only=True)
class _Search:
    """One call's search loop: under the proposal lock, decide whether to stop and which config to take;
    then measure it (or skip it on its estimate), until a stop rule or the space says the search is over."""

    study: optuna.Study
    storage: str | None
    proposer: Proposer
    oracle: _Oracle | None
    workload: Workload
    measure: Measure
    backend: TrialBackend
    progress: Progress
    clock: Clock
    target: int
    patience: int | None
    timeout_s: float | None
    stop_on_evidence: bool
    started: float = dataclasses.field(default_factory=time.monotonic)

    def run(self) -> None:
        while True:
            _stop_point()
            step = self._next_step()
            if step.waiting:  # another worker's trial may still be lost and owe a retry: watch until it ends
                time.sleep(_WATCH_S)
                continue
            if step.reason:
                self.progress.stopped(reason=step.reason)
                self.study.set_user_attr(STOP_KEY, step.reason)
                return
            assert step.trial is not None and step.config is not None  # no reason: a config was taken
            self._measure(step.trial, step.config, step.records)

    def _next_step(self) -> _Step:
        """Choose and take a config atomically (other workers propose under the same lock), or say why not."""
        from autotune.study.storage import DEFAULT_STORAGE

        with proposal_lock(self.storage or DEFAULT_STORAGE, self.study.study_name):
            _recover_lost(self.study, self.progress)  # trials of workers that died since
            records = records_of(self.study)
            outlook = self.proposer.outlook(records)
            if measured(records):
                self.progress.standing(text=outlook.describe())  # how sure the best so far is
            # Patience caps a search only once no evidence is owed (see Proposer.owed_values).
            owed = bool(outlook.owed) and _patience_spent(records, self.patience)
            reason = self._why_stop(records, outlook, owed)
            config = None if reason else self.proposer.next_config(records, unmeasured_only=owed)
            if config is not None and self.clock.out_of_time():  # the estimates on the way spent the time
                reason, config = self.clock.search_over(outlook), None
            if owed and config is None:
                reason = _stop_reason(
                    records, target=self.target, patience=self.patience, timeout_s=None, elapsed_s=0.0
                )
            _record_ruled_out(self.study, self.proposer, self.oracle, records, self.progress)
            if reason is None and config is None:
                reason = "every config of the space is measured, being measured or implied to run out of memory"
            if reason is not None:
                timed_out = self._timed_out() or self.clock.search_over(outlook) is not None
                patience = None if owed else self.patience
                waiting = _waits_on_others(records, target=self.target, patience=patience, timed_out=timed_out)
                return _Step(records=records, reason=reason, waiting=waiting)
            assert config is not None  # no reason: a config is left
            trial, config = _ask(self.study, self.proposer, config)
            return _Step(records=records, trial=trial, config=config)

    def _why_stop(self, records: list[TrialRecord], outlook: Outlook, owed: bool) -> str | None:
        return (
            _stop_reason(
                records,
                target=self.target,
                patience=None if owed else self.patience,
                timeout_s=self.timeout_s,
                elapsed_s=time.monotonic() - self.started,
            )
            or self.clock.search_over(outlook)
            or (_settled_reason(outlook) if self.stop_on_evidence else None)
        )

    def _timed_out(self) -> bool:
        return self.timeout_s is not None and time.monotonic() - self.started >= self.timeout_s

    def _measure(self, trial: optuna.Trial, config: TrialConfig, records: list[TrialRecord]) -> None:
        # The trial beats from its start: a worker that dies while estimating is found out too.
        with _heartbeat(self.study, trial):
            prediction = self.oracle.estimate(config, records) if self.oracle else None
            if prediction is not None and _skip_if_too_big(self.study, trial, prediction, self.progress):
                return
            record = _start_and_measure(
                self.study,
                trial,
                config,
                records,
                self.workload,
                self.measure,
                prediction,
                self.backend,
                self.progress,
                self.clock,
                target=self.target,
            )
        _report_finished(self.study, record, self.progress, self.clock)


@dataclass(frozen=True, kw_only=True)
class _Step:
    """What the search loop does next: measure ``trial`` (``config``), watch other workers, or stop (``reason``)."""

    records: list[TrialRecord]
    trial: optuna.Trial | None = None
    config: TrialConfig | None = None
    reason: str | None = None
    waiting: bool = False


@contextlib.contextmanager
def _visible_gpus(visible: str | None) -> Iterator[None]:
    """This worker's GPUs for the trials it starts (its helpers were given theirs)."""
    if visible is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def find(
    *,
    workload: Workload | None = None,
    space: str | Path | SearchSpace = "default",
    memory_budget_bytes: int | None = None,
    n_trials: int | None = None,
    timeout_s: float | None = None,
    max_time_s: float | None = None,
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
    headroom: float = DEFAULT_HEADROOM,
    storage: str | None = None,
    estimate: bool = True,
    warmup_steps: int = 1,
    measure_steps: int = 3,
    progress: Progress | None = None,
    command: list[str] | None = None,
) -> StudySummary:
    """One question, one answer: ``tune`` under a study name derived from workload, device, budget, space.
    (How many steps a trial measures is how the question is answered, not part of it.)"""
    workload = workload or Workload()
    space = space if isinstance(space, SearchSpace) else load_space(space)
    name, budget = find_name(
        workload=workload, space=space, memory_budget_bytes=memory_budget_bytes, headroom=headroom, command=command
    )
    return tune(
        study=name,
        workload=workload,
        space=space,
        memory_budget_bytes=budget,
        n_trials=n_trials,
        timeout_s=timeout_s,
        max_time_s=max_time_s,
        trial_timeout_s=trial_timeout_s,
        headroom=headroom,
        storage=storage,
        estimate=estimate,
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
        progress=progress,
        command=command,
    )


def find_name(
    *,
    workload: Workload,
    space: SearchSpace,
    memory_budget_bytes: int | None,
    headroom: float = DEFAULT_HEADROOM,
    command: list[str] | None = None,
) -> tuple[str, int]:
    """The study ``find`` keeps a question in, and the memory budget it resolves to on this device
    (a SLURM worker derives both where it runs: the submitting machine may have no GPU)."""
    from autotune.study.storage import find_study_name

    device = detect_device(workload.device)
    budget = _budget(memory_budget_bytes, device)
    meta = question(
        workload=workload, space=space, device=device, memory_budget_bytes=budget, headroom=headroom, command=command
    )
    return find_study_name(meta, space.name), budget


def _space_to_resume(
    storage: optuna.storages.BaseStorage, study: str, space: SearchSpace, progress: Progress
) -> SearchSpace:
    """The space a study goes on with: a preset that grew since the study began resumes as the
    study stored it (its trials answer that question; the new values are a new study's)."""
    from autotune.study.storage import stored_question

    stored = stored_question(storage, study)
    if (
        stored is None
        or stored.get("space_digest") == space.digest
        or not is_preset(space.name)
        or stored.get("space", {}).get("name") != space.name
    ):
        return space
    kept = SearchSpace.from_dict(stored["space"])
    if kept.digest != stored["space_digest"]:
        return space  # stored by a version whose space this one cannot rebuild: the study is refused as before
    progress.space_kept(name=space.name, added=space.added_since(kept))
    return kept


def question(
    *,
    workload: Workload,
    space: SearchSpace,
    device: DeviceInfo,
    memory_budget_bytes: int,
    headroom: float,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """What a study answers; a study is only resumed for the same question (and, in script mode,
    for the same command)."""
    return {
        "version": 1,
        "workload": workload.to_dict(),
        "space": space.to_dict(),
        "space_digest": space.digest,
        "device": {
            "type": device.type,
            "name": device.name,
            "count": device.count,
            "total_memory_bytes": device.total_memory_bytes,
        },
        "memory_budget_bytes": memory_budget_bytes,
        "headroom": headroom,
        "command": list(command) if command else None,
    }


# -- the simple answer first ---------------------------------------------------------------------
def _simple_answer(
    study: optuna.Study,
    proposer: Proposer,
    oracle: _Oracle | None,
    workload: Workload,
    measure: Measure,
    backend: TrialBackend,
    progress: Progress,
    clock: Clock,
    *,
    storage: str | None,
    target: int,
) -> None:
    """Measure the ramp of :mod:`autotune.search.simple` and store its answer, the first one held.

    The first trial of the call warms up one step more: the machine's first trial after the servers'
    start-up (caches, the first fork's page faults) is not measured cold. Not where a step holds
    ``WARM_MICRO_BATCHES`` micro batches or more: its warm-up step alone runs that many forwards and backwards."""
    from autotune.study.storage import DEFAULT_STORAGE

    family = ramp_family(proposer.candidates)
    limit = memory_limit(study.user_attrs["autotune"])
    first = dataclasses.replace(measure, warmup_steps=measure.warmup_steps + 1)
    while family:
        _stop_point()
        with proposal_lock(storage or DEFAULT_STORAGE, study.study_name):
            _recover_lost(study, progress)  # other workers' trials, as the search's loop does
            records = records_of(study)
            config = next_ramp_config(family, records, proposer.memory_estimate if oracle else None, limit)
            if config is None or len(measured(records)) >= target:
                break
            trial, config = _ask(study, proposer, config)
        with _heartbeat(study, trial):
            prediction = oracle.estimate(config, records) if oracle else None
            # Predicted well over the limit (the smallest size, where none is predicted under): skipped, as the
            # search skips it; the ramp ends with no answer, as a finder's would at its first size.
            if prediction is not None and _skip_if_too_big(study, trial, prediction, progress):
                continue
            warm = first if config.grad_accum_steps(workload) < WARM_MICRO_BATCHES else measure
            record = _start_and_measure(
                study, trial, config, records, workload, warm, prediction, backend, progress, clock, target=target
            )
        first = measure
        _report_finished(study, record, progress, clock)
    answer = ramp_answer(family, records_of(study))
    study.set_user_attr(SIMPLE_KEY, answer.number if answer is not None else None)
    accumulation = answer.config.grad_accum_steps(workload) if answer is not None else 0
    progress.simple_answer(record=answer, elapsed_s=clock.elapsed(), accumulation=accumulation)


def _recover_lost(study: optuna.Study, progress: Progress) -> None:
    """Fail the trials of workers that died since (see :mod:`autotune.study.stale`), and say so."""
    lost = recover_stale_trials(study)
    if lost:
        progress.lost(numbers=lost)


def _start_and_measure(
    study: optuna.Study,
    trial: optuna.Trial,
    config: TrialConfig,
    records: list[TrialRecord],
    workload: Workload,
    measure: Measure,
    prediction: MemoryEstimate | None,
    backend: TrialBackend,
    progress: Progress,
    clock: Clock,
    *,
    target: int,
) -> TrialRecord:
    """Measure a trial taken for ``config``, marked as the retry of a lost trial of it (another worker's, or
    this study's before a restart) where there is one."""
    retry_of = _retry_of(records, config)
    if retry_of is not None:
        trial.set_user_attr(RETRY_ATTR, retry_of)
    progress.trial_started(index=len(measured(records)) + 1, target=target, config=config, retry=retry_of is not None)
    measure = dataclasses.replace(measure, outpaced_step_s=outpaced_step_s(records, workload))
    with clock.timing():
        return _measure_in_study(study, trial, config, workload, measure, prediction, backend)


def _report_finished(study: optuna.Study, record: TrialRecord, progress: Progress, clock: Clock) -> None:
    records = records_of(study)
    held = held_answer(records, study.user_attrs.get(SIMPLE_KEY))
    top = max(ranking(records), key=lambda r: r.throughput or 0.0, default=None)
    leading = top if top is not None and held is not None and top.number != held.number else None
    progress.trial_finished(record=record, best=held, elapsed_s=clock.elapsed(), leading=leading)


# -- one trial in the study ----------------------------------------------------------------------
def _measure_in_study(
    study: optuna.Study,
    trial: optuna.Trial,
    config: TrialConfig,
    workload: Workload,
    measure: Measure,
    prediction: MemoryEstimate | None,
    backend: TrialBackend,
) -> TrialRecord:
    from optuna.trial import TrialState

    if prediction is not None:
        trial.set_user_attr("estimate", prediction.to_dict())  # predicted next to measured, for show
    try:
        _stop_point()
        _stop["in_trial"] = True
        try:
            _stop_point()
            result = run_undisturbed(backend, workload, config, measure, trial)
        finally:
            _stop["in_trial"] = False
    except KeyboardInterrupt:
        trial.set_user_attr("status", "interrupted")
        study.tell(trial, state=TrialState.FAIL)
        raise
    except AutotuneError as exc:  # refused before it started (the space let through what cannot run)
        result = TrialResult(config=config, status=TrialStatus.ERROR, error=str(exc))
    limit = memory_limit(study.user_attrs["autotune"])
    trial.set_user_attr("status", result.status.value)
    trial.set_user_attr("result", _stored(result))
    peak = result.peak_memory_bytes
    if result.ok:
        trial.set_constraint("memory", (peak / limit - 1) if peak is not None else 0.0)
        trial.set_constraint(ANSWER_CONSTRAINT, 1.0)  # a measurement; only a confirmed answer is feasible
        study.tell(trial, result.throughput)
    elif result.status in (TrialStatus.OOM, TrialStatus.TIMEOUT):
        if result.status is TrialStatus.OOM:
            trial.set_constraint("memory", max(peak or 0, measure.memory_budget_bytes) / limit - 1)
        study.tell(trial, state=TrialState.PRUNED)
    else:
        study.tell(trial, state=TrialState.FAIL)
    return next(r for r in records_of(study) if r.number == trial.number)


def _precision_speed(
    study: optuna.Study, backend: TrialBackend, precisions: tuple[str, ...]
) -> dict[str, float] | None:
    """The device's matmul speed per precision the space offers, probed once per study (stored)."""
    if len(precisions) < 2:
        return None
    stored = study.user_attrs.get(PROBE_KEY) or {}
    if stored.get("asked") != sorted(precisions):
        probe = getattr(backend, "probe", None)
        stored = {"asked": sorted(precisions), "speed": probe(list(precisions)) if probe is not None else None}
        study.set_user_attr(PROBE_KEY, stored)
    return stored["speed"] or None


def _device_profile(study: optuna.Study, backend: TrialBackend, *, ranks: int) -> DeviceProfile | None:
    """This device's roofline (matmul FLOP/s per dtype, bandwidth, per-operator time), probed once per
    study and stored; None where the backend cannot probe or the probe failed. The latency of a
    collective between ranks (two more processes on a CPU, seconds) only where the study's trials
    have several ranks: one rank communicates nothing, and the study's workload is fixed."""
    from autotune.estimate.step_time import DeviceProfile

    if ROOFLINE_KEY not in study.user_attrs:
        probe = getattr(backend, "profile", None)
        probed = probe(between_ranks=ranks > 1, stored=lambda: study.user_attrs.get(ROOFLINE_KEY)) if probe else None
        study.set_user_attr(ROOFLINE_KEY, probed or {})
    stored = study.user_attrs[ROOFLINE_KEY]
    return DeviceProfile.from_dict(stored) if stored else None


class _Oracle:
    """The estimator's predictions, each asked once per tune call: the proposer bisects with them,
    and a trial stores its config's next to what it measured."""

    def __init__(self, backend: TrialBackend, workload: Workload) -> None:
        self._backend = backend
        self._workload = workload
        self._cache: dict[TrialConfig, MemoryEstimate | None] = {}

    def estimate(self, config: TrialConfig, records: list[TrialRecord]) -> MemoryEstimate | None:
        """The prediction for a trial, unless a larger micro batch with the same knobs already fit."""
        from autotune.search.memory_bounds import implied_fits

        if config not in self._cache and implied_fits(config, [r.config for r in records if r.fits]):
            return None
        return self.lookup(config)

    def lookup(self, config: TrialConfig) -> MemoryEstimate | None:
        if config not in self._cache:
            self._cache[config] = self._backend.estimate(self._workload, config)
        return self._cache[config]


def _record_ruled_out(
    study: optuna.Study, proposer: Proposer, oracle: _Oracle | None, records: list[TrialRecord], progress: Progress
) -> None:
    """Record the configs the proposer's estimates put over the limit as skipped trials, so the
    study shows why they never ran (and a resumed or parallel search does not estimate them again)."""
    known = {r.config for r in records}
    for config in proposer.take_ruled_out():
        prediction = oracle.estimate(config, records) if oracle else None
        if config in known or prediction is None or not _too_big(study, prediction):
            continue  # within the margin: it stays a candidate, never a trial asked for and left open
        known.add(config)
        trial, config = _ask(study, proposer, config)
        _skip_if_too_big(study, trial, prediction, progress)


def _skip_if_too_big(study: optuna.Study, trial: optuna.Trial, prediction: MemoryEstimate, progress: Progress) -> bool:
    """Record a config predicted well over the limit as skipped, unrun; borderline ones still run."""
    from optuna.trial import TrialState

    if not _too_big(study, prediction):
        return False
    limit = memory_limit(study.user_attrs["autotune"])
    trial.set_user_attr("status", "skipped")
    trial.set_user_attr("estimate", prediction.to_dict())
    trial.set_user_attr(
        "reason",
        f"not run: predicted peak {prediction.predicted_peak_bytes} B is more than "
        f"{SKIP_MARGIN:.0%} over the memory limit {limit} B",
    )
    trial.set_constraint("memory", prediction.predicted_peak_bytes / limit - 1)
    study.tell(trial, state=TrialState.PRUNED)  # the sampler learns from it as from an OOM
    record = next(r for r in records_of(study) if r.number == trial.number)
    progress.skipped(record=record, limit_bytes=limit)
    return True


def _too_big(study: optuna.Study, prediction: MemoryEstimate) -> bool:
    return prediction.predicted_peak_bytes > memory_limit(study.user_attrs["autotune"]) * (1 + SKIP_MARGIN)


def _ask(study: optuna.Study, proposer: Proposer, config: TrialConfig) -> tuple[optuna.Trial, TrialConfig]:
    """A new trial of the study holding ``config`` (enqueued, so the sampler is not consulted),
    and the config it really holds."""
    from autotune.study.stale import worker_id

    # Who runs it is stored with the trial as it is made: a worker killed the moment after study.ask() left
    # a RUNNING trial naming no worker, which no recovery could tell was lost (until its heartbeat aged).
    study.enqueue_trial(proposer.params_of(config), user_attrs={"worker": worker_id(), "config": config.to_dict()})
    with warnings.catch_warnings():
        # Optuna warns that heartbeats are meant for Study.optimize; _heartbeat records them here.
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        trial = study.ask()
    record_heartbeat(study, trial.number)  # a trial without one is never stale on an RDB storage
    config = proposer.suggest(trial)  # the enqueued params (another worker may have taken ours)
    trial.set_user_attr("config", config.to_dict())
    trial.set_user_attr("worker", worker_id())
    return trial, config


class _heartbeat:
    """Record heartbeats while a trial runs, so other workers can tell it is alive (:mod:`autotune.study.stale`)."""

    def __init__(self, study: optuna.Study, trial: optuna.Trial) -> None:
        from autotune.study.stale import heartbeat_s

        self._study = study
        self._number = trial.number
        self._stop = threading.Event()
        self._interval = heartbeat_s()
        self._thread = threading.Thread(target=self._beat, name="autotune-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                record_heartbeat(self._study, self._number)
            except Exception:  # a missed beat is not worth failing the trial for
                pass

    def __enter__(self) -> _heartbeat:
        record_heartbeat(self._study, self._number)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _stored(result: TrialResult) -> dict[str, Any]:
    data = result.to_dict()
    del data["config"]  # stored once, as the trial's "config"
    return data


# -- confirming the winner -----------------------------------------------------------------------
def _confirm_winner(
    study: optuna.Study,
    proposer: Proposer,
    workload: Workload,
    measure: Measure,
    progress: Progress,
    backend: TrialBackend,
    clock: Clock | None = None,
) -> None:
    """Re-run the top candidates, interleaved, until a decided answer fits (or re-runs are spent).

    The contenders (:func:`contenders_of`) run in turn (A B C A B C), so every round sees them under the same
    conditions; a challenger behind the held answer in a round is out (:func:`still_racing`), and a third round
    comes when those left disagree on who leads. They are ranked by their paired figures: a candidate's figure
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
                if len(racing) < 2 or (round_index >= CONFIRM_ROUNDS and rounds_agree(racing, runs, limit)):
                    break
            # The first round proves each contender's fit over a longer run; later rounds pair figures, and
            # every contender of a round measures as many steps as the others.
            factor = CONFIRM_STEPS_FACTOR if round_index == 0 else 1
            steps = measure.measure_steps * factor
            for record in racing:  # a refuted contender is out of the race (still_racing): not timed again
                if any(runs.values()) and not clock.holds_a_rerun():
                    break
                progress.confirming(record=record, steps=steps)
                cold = record.config.grad_accum_steps(workload) < WARM_MICRO_BATCHES  # warmed as a first trial
                # It measures ``factor`` x the steps, so it gets as many times the trial's time.
                with clock.timing(rerun=True):
                    runs[record.number].append(
                        backend.run(
                            workload,
                            record.config,
                            memory_budget_bytes=measure.memory_budget_bytes,
                            timeout_s=measure.trial_timeout_s * factor,
                            warmup_steps=measure.warmup_steps + cold,
                            measure_steps=steps,
                        )
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
            "certainty": certainty(order, runs, {r.number: r for r in contenders}),
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
    trial, _ = _ask(study, proposer, record.config)
    trial.set_user_attr(ANSWER_ATTR, record.number)
    trial.set_user_attr("status", "answer")
    trial.set_constraint("memory", confirmation["peak_memory_bytes"] / limit - 1)
    trial.set_constraint(ANSWER_CONSTRAINT, 0.0)
    study.tell(trial, confirmation["throughput"], state=TrialState.COMPLETE)


# -- checks --------------------------------------------------------------------------------------
def _stop_reason(
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


def _settled_reason(outlook: Outlook) -> str | None:
    """The stop on evidence: no untried config is predicted to beat the best by more than the noise."""
    from autotune.search.proposer import MEASUREMENT_NOISE

    if not outlook.settled or outlook.upper is None:
        return None
    gain = outlook.upper / outlook.best - 1
    where = f"at most {gain:.0%} over the best" if gain >= 0 else f"at least {-gain:.0%} under the best"
    left_out = "".join(f"; {text}" for text in (outlook.waived_text(), outlook.recompute_text()) if text)
    return (
        f"settled: the {outlook.untried} untried configs are predicted {where} (the model's error "
        f"included), none more than a trial's {MEASUREMENT_NOISE:.0%} noise ahead" + left_out
    )


def _waits_on_others(records: list[TrialRecord], *, target: int, patience: int | None, timed_out: bool) -> bool:
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
        and not _patience_spent(records, patience)
        and not (len(done) >= _BROKEN_AFTER and all(r.status in ("error", "crashed") for r in done))
    )


def _retry_of(records: list[TrialRecord], config: TrialConfig) -> int | None:
    """The interrupted trial of ``config`` that a trial of it now measures again (the latest), if any."""
    retried = {r.retry_of for r in records if r.retry_of is not None}
    return max(
        (r.number for r in records if r.status == "interrupted" and r.config == config and r.number not in retried),
        default=None,
    )


def _patience_spent(records: list[TrialRecord], patience: int | None) -> bool:
    return patience is not None and _since_improvement(measured(records)) >= patience


def _since_improvement(done: list[TrialRecord]) -> int:
    best, since = 0.0, 0
    for record in sorted(done, key=lambda r: r.number):
        if record.fits and (record.throughput or 0.0) > best:
            best, since = record.throughput or 0.0, 0
        else:
            since += 1
    return since


def _budget(memory_budget_bytes: int | None, device: DeviceInfo) -> int:
    if memory_budget_bytes is not None:
        if memory_budget_bytes <= 0:
            raise ConfigError("--memory-budget must be more than 0, e.g. 24GiB")
        if device.total_memory_bytes is not None and memory_budget_bytes > device.total_memory_bytes:
            raise ConfigError(
                f"--memory-budget {memory_budget_bytes} B is more than {device.name} has "
                f"({device.total_memory_bytes} B); use at most that"
            )
        return memory_budget_bytes
    if device.total_memory_bytes is None:
        raise ConfigError("--memory-budget is needed: this device does not say how much memory it has")
    return device.total_memory_bytes


def _job_nodes() -> int:
    """The nodes of the SLURM job this worker runs in (its trials' ranks spread over them)."""
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or 1)


def _check_nodes(workload: Workload, *, srun: bool) -> None:
    """A trial spans the nodes its workload says (the study's question): a SLURM worker's job must hold
    that many, and a trial outside such a job (no ``srun``) runs on this machine alone."""
    here = _job_nodes() if srun else 1
    if workload.nodes == here:
        return
    if not srun:
        raise ConfigError(
            f"--nodes {workload.nodes}: a trial spans several nodes only in a SLURM worker job; "
            "tune with --executor slurm, or drop --nodes"
        )
    job = os.environ.get("SLURM_JOB_ID", "?")
    raise ConfigError(
        f"--nodes {workload.nodes}: this worker's SLURM job {job} spans {here} node(s), and the study's "
        f"trials span {workload.nodes}; submit its workers with --nodes {workload.nodes} "
        "(and no --slurm-option nodes=...)"
    )


def _check_workload(workload: Workload, device: DeviceInfo) -> None:
    """Refuse a workload that no trial could run, before a study is created for it."""
    from autotune.errors import WorkloadError
    from autotune.models.sources import resolve_task

    if device.type == "cuda" and workload.ranks_per_node > device.count:
        raise WorkloadError(
            f"--nproc {workload.nproc} needs {workload.ranks_per_node} GPUs per node; {device.count} visible here"
        )
    resolve_task(workload)


def _check_numbers(**values: Any) -> None:
    flags = {
        "n_trials": "--n-trials",
        "timeout_s": "--timeout",
        "trial_timeout_s": "--trial-timeout",
        "patience": "--patience",
        "max_time_s": "--max-time",
        "warmup_steps": "--warmup-steps",
        "measure_steps": "--steps",
        "workers": "--workers",
    }
    for key, flag in flags.items():
        value = values[key]
        minimum = 0 if key == "warmup_steps" else 1
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < minimum
            or (key in ("timeout_s", "trial_timeout_s") and value <= 0)
        ):
            raise ConfigError(f"{flag} {value!r} must be a number of at least {minimum}")
    headroom = values["headroom"]
    if not isinstance(headroom, (int, float)) or not 0 <= headroom < 0.9:
        raise ConfigError(f"--headroom {headroom!r} must be a fraction from 0 to 0.9, e.g. 0.1 for 10%")
