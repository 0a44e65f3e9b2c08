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
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from autotune.config.device import DeviceInfo, detect_device
from autotune.config.workload import Workload
from autotune.search.backends import LocalBackend, ScriptBackend, TrialBackend
from autotune.search.checks import check_nodes, check_numbers, check_workload, memory_budget
from autotune.search.clock import Clock
from autotune.search.device_probes import device_profile, precision_speed
from autotune.search.interrupt import interrupt_safely, keeps_ctrl_c
from autotune.search.measuring import Measure
from autotune.search.presets import is_preset, load_space
from autotune.search.progress import Progress, Silent
from autotune.search.simple import SIMPLE_KEY
from autotune.search.space import SearchSpace
from autotune.search.study_trials import SKIP_MARGIN, Oracle
from autotune.search.tuning import Tuning
from autotune.search.workers import gpu_slices, start_helpers, wait_helpers
from autotune.study.records import measured, memory_limit, records_of, summarize
from autotune.study.stale import record_worker_job, recover_stale_trials
from autotune.study.summary import StudySummary
from autotune.trial.runner import DEFAULT_TRIAL_TIMEOUT_S

if TYPE_CHECKING:
    import optuna

    from autotune.search.proposer import Proposer

__all__ = [
    "tune",
    "find",
    "find_name",
    "question",
    "interrupt_safely",
    "Progress",
    "TrialBackend",
    "LocalBackend",
    "DEFAULT_HEADROOM",
]

DEFAULT_HEADROOM = 0.10  # a config fits when its peak stays 10% under the budget


@keeps_ctrl_c
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

    ``n_trials``: the study's total of measured trials (default: the space's), so the same call again carries
    an unfinished study on. The search stops early on ``timeout_s`` (this call's wall time), on evidence (no
    untried config predicted to beat the best by more than the noise, the model's error included:
    :class:`~autotune.search.proposer.Outlook`; ``stop_on_evidence`` off: only on the other limits), after
    ``patience`` trials without a faster fit, or on an exhausted space; then the contenders are re-run
    (``confirm``). ``max_time_s`` bounds the whole call. ``estimate``: a config predicted over the limit by more
    than 5% is ``skipped``, not run. ``workers`` > 1: helpers on the study (each on its own GPUs).
    ``backend``: the trials and estimates (default: real ones; the benchmarks replay a grid). ``simple_first``:
    first measure a one-knob batch-size finder's answer (:mod:`autotune.search.simple`).
    """
    clock, workload, progress = Clock(max_time_s), workload or Workload(), progress or Silent()
    check_numbers(
        n_trials=n_trials, timeout_s=timeout_s, max_time_s=max_time_s, trial_timeout_s=trial_timeout_s,
        patience=patience, headroom=headroom, warmup_steps=warmup_steps, measure_steps=measure_steps, workers=workers,
    )  # fmt: skip
    device = detect_device(workload.device)
    space = space if isinstance(space, SearchSpace) else load_space(space)
    budget = memory_budget(memory_budget_bytes, device)
    estimate = estimate and not command  # a user's command: its model is its own, every config is measured
    backend = backend or (ScriptBackend(device.type, command) if command else LocalBackend(device.type, srun=srun))
    _check_before_writing(workload, space, device, srun=srun)
    if isinstance(backend, LocalBackend):
        backend.start(estimate=estimate)  # their imports beside the storage's opening (the CLI started them sooner)
    gpus = gpu_slices(workers, workload.nproc, device)
    the_study, space, target = _open_study(
        study, storage, space, progress, worker_number, n_trials,
        workload=workload, device=device, memory_budget_bytes=budget, headroom=headroom, command=command,
    )  # fmt: skip
    patience = patience if patience is not None else space.patience
    helpers = start_helpers(  # the same call, resolved: the study's space, trials, patience and budget
        dict(
            study=study, workload=workload.to_dict(), space=space.name, memory_budget_bytes=budget, n_trials=target,
            timeout_s=timeout_s, max_time_s=max_time_s, trial_timeout_s=trial_timeout_s, patience=patience,
            stop_on_evidence=stop_on_evidence, headroom=headroom, storage=storage, warmup_steps=warmup_steps,
            measure_steps=measure_steps, estimate=estimate, command=command,
        ),
        gpus[1:],
    )  # fmt: skip
    oracle = Oracle(backend, workload) if estimate else None
    tuning = Tuning(  # --timeout counts from here, as the helpers start
        study=the_study, storage=storage, oracle=oracle, workload=workload, backend=backend, progress=progress,
        proposer=_proposer(the_study, space, workload, device, clock, oracle=oracle, command=command), clock=clock,
        measure=Measure(memory_budget_bytes=budget, trial_timeout_s=trial_timeout_s, warmup_steps=warmup_steps,
                        measure_steps=measure_steps),
        target=target, patience=patience, timeout_s=timeout_s, stop_on_evidence=stop_on_evidence,
    )  # fmt: skip
    simple_first = simple_first and (confirm or worker_number is None)  # a helper leaves it to the confirming worker
    _search_beside_helpers(tuning, helpers, gpus[0], simple_first=simple_first, estimate=estimate)
    if confirm:
        tuning.confirm()
    return summarize(the_study, url=storage)


def _check_before_writing(workload: Workload, space: SearchSpace, device: DeviceInfo, *, srun: bool) -> None:
    """Refuse, before the storage is opened (a refused call writes nothing), what no trial here could run: the
    workload's nodes outside a job of as many, a workload this device cannot hold, a space with nothing to run."""
    check_nodes(workload, srun=srun)
    check_workload(workload, device)
    space.choices(workload, device)


def _open_study(
    name: str,
    storage: str | None,
    space: SearchSpace,
    progress: Progress,
    worker_number: int | None,
    n_trials: int | None,
    **question_of: Any,
) -> tuple[optuna.Study, SearchSpace, int]:
    """The study of the question (``question_of``: see :func:`question`), created or resumed, with the space it
    goes on with and the study's total of trials; this worker recorded on it, the trials of workers that died
    since failed, and said."""
    from autotune.study.storage import create_study, display_url, open_storage

    opened = open_storage(storage)
    space = _space_to_resume(opened, name, space, progress)
    the_study = create_study(opened, name, question(space=space, **question_of))
    record_worker_job(the_study, worker=worker_number)
    recovered = recover_stale_trials(the_study)
    target = n_trials or space.n_trials
    progress.started(
        study=name,
        storage=display_url(storage),
        measured=len(measured(records_of(the_study))),
        target=target,
        recovered=recovered,
    )
    progress.dropped(reasons=space.dropped_knobs(question_of["workload"], question_of["device"]))
    return the_study, space, target


def _proposer(
    the_study: optuna.Study,
    space: SearchSpace,
    workload: Workload,
    device: DeviceInfo,
    clock: Clock,
    *,
    oracle: Oracle | None,
    command: list[str] | None,
) -> Proposer:
    """The proposer of the study's configs, under the call's ``--max-time``; what show and export need about
    the model (LoRA's targets, hidden size) recorded on the study, resolved as the trials resolve it."""
    from autotune.search.proposer import Proposer
    from autotune.study.stored_facts import record as record_model_facts

    limit = memory_limit(the_study.user_attrs["autotune"])
    estimator, prefetcher = (oracle.lookup, oracle.prefetch) if oracle else (None, None)
    proposer = Proposer(
        space, workload, device, estimator=estimator, prefetcher=prefetcher, limit_bytes=limit, margin=SKIP_MARGIN
    )
    proposer.hurry = clock.hurried
    proposer.out_of_time = clock.out_of_time
    record_model_facts(the_study, workload, proposer.choices.get("lora", ()), script=bool(command))
    return proposer


def _search_beside_helpers(
    tuning: Tuning, helpers: list[Any], visible_gpus: str | None, *, simple_first: bool, estimate: bool
) -> None:
    """The simple answer (where it is due: not measured yet) and the search, while the helper workers search the
    same study."""
    from autotune.estimate.step_time import matmul_speedups

    proposer = tuning.proposer
    try:
        with _visible_gpus(visible_gpus):
            # Helpers search meanwhile: the ramp takes its configs under the same lock as their proposals.
            if simple_first and SIMPLE_KEY not in tuning.study.user_attrs:
                tuning.simple_answer()
            # The step-time model's device profile, probed after the simple answer (which needs none): the answer
            # the one-knob finders give comes as soon as theirs.
            ranks = tuning.workload.nproc
            proposer.profile = device_profile(tuning.study, tuning.backend, ranks=ranks) if estimate else None
            # Until a family's step is traced (or, with no step-time model, until measured), the matmul speed of
            # its precision places it: the roofline's, else the device probe's.
            precisions = proposer.choices.get("precision", ())
            proposer.precision_speed = (
                precision_speed(tuning.study, tuning.backend, precisions)
                if proposer.profile is None
                else matmul_speedups(proposer.profile, precisions)
            )
            tuning.search()
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
    budget = memory_budget(memory_budget_bytes, device)
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
# -- one trial in the study ----------------------------------------------------------------------
# -- confirming the winner -----------------------------------------------------------------------
# -- checks --------------------------------------------------------------------------------------
