"""``autotune tune``: a named study tuned, stopped any time and carried on by the same command."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Optional

import typer

from autotune.cli.options import Script, command
from autotune.cli.parse import duration, size
from autotune.cli.searching import finish, on_slurm, progress, refuse_max_time_on_slurm, search_arguments
from autotune.cli.servers import start_trial_server
from autotune.config.workload import Workload
from autotune.search.slurm import Executor


@command
def tune(
    study: str,
    workload: Workload,
    memory_budget: Optional[str],
    space: str,
    n_trials: Optional[int],
    timeout: Optional[float],
    max_time: Optional[str],
    trial_timeout: float,
    patience: Optional[int],
    headroom: float,
    storage: Optional[str],
    estimate: bool,
    warmup_steps: int,
    steps: int,
    workers: int,
    confirm: bool,
    as_json: bool,
    executor: Executor,
    gpus_per_node: Optional[int] = None,
    stop_on_evidence: Annotated[
        bool,
        typer.Option(
            "--stop-on-evidence/--measure-all",
            help="Stop when no untried config is predicted to beat the best by more than the noise; "
            "--measure-all measures configs until --n-trials, --patience or the space runs out.",
        ),
    ] = True,
    script: Script = None,
) -> int:
    """Tune a named study; stop it any time (Ctrl-C) and run the same command to carry on.

    Exit status: 0 with a confirmed config (with --no-confirm: with any that fits), 1 when none fits, 2 when
    the input was refused, 130 when interrupted.
    """
    from autotune.search.slurm import worker_spec
    from autotune.search.tuner import tune as tune_study

    executor = dataclasses.replace(executor, gpus_per_node=gpus_per_node)
    resources = executor.resources(nproc=workload.nproc, command=script)
    refuse_max_time_on_slurm(max_time, on_slurm=resources is not None, command="tune")
    # autotune.tune's arguments, here or in each SLURM worker
    search = search_arguments(
        space=space,
        memory_budget_bytes=size(memory_budget),
        timeout_s=timeout,
        trial_timeout_s=trial_timeout,
        measure_steps=steps,
        script=script,
        n_trials=n_trials,
        patience=patience,
        stop_on_evidence=stop_on_evidence,
        headroom=headroom,
        storage=storage,
        estimate=estimate,
        warmup_steps=warmup_steps,
    )
    if resources is not None:
        spec = worker_spec(workload=workload, nodes=executor.nodes, **search)
        summary = on_slurm(study, spec, workers=workers, confirm=confirm, resources=resources, storage=storage)
        return finish(summary, as_json=as_json, confirmed=confirm)
    if not script and workers == 1:  # several workers each start their own
        start_trial_server(estimate=estimate)
    with progress(quiet=as_json) as shown:
        summary = tune_study(
            study=study,
            workload=workload,
            max_time_s=duration(max_time, "--max-time"),
            workers=workers,
            confirm=confirm,
            progress=shown,
            **search,
        )
    return finish(summary, as_json=as_json, confirmed=confirm)
