"""``autotune find``: the fastest config that fits, answered from its study when asked again; with
``--plan``, ranked by prediction without running anything."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated, Callable, Optional

import typer

from autotune.cli.options import OUTPUT_HELP, Script, command
from autotune.cli.parse import duration, size
from autotune.cli.searching import finish, on_slurm, progress, refuse_max_time_on_slurm, search_arguments
from autotune.cli.servers import start_trial_server
from autotune.config.gpus import on_card_nodes
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.search.slurm import Executor


@command
def find(
    *,
    workload: Workload,
    memory_budget: Optional[str],
    space: str,
    n_trials: Optional[int],
    timeout: Optional[float],
    max_time: Optional[str],
    trial_timeout: float,
    headroom: float,
    storage: Optional[str],
    estimate: bool,
    warmup_steps: int,
    steps: int,
    export: Annotated[
        Optional[str], typer.Option("--export", help="Also write the best config in this format (see autotune export).")
    ] = None,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="File for --export; " + OUTPUT_HELP)] = None,
    plan: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Run nothing: rank every config of the space predicted to fit the card (--gpu) by "
            "predicted throughput, with memory, MFU and the configs to verify first.",
        ),
    ] = False,
    gpu: Optional[str] = None,
    gpus_per_node: Optional[int] = None,
    as_json: bool = False,
    workers: int = 1,
    executor: Executor,
    script: Script = None,
) -> int:
    """Find the fastest config that fits: asking the same question again answers from its study.

    Exit status: 0 with a confirmed config (--plan: with one predicted to fit), 1 when none fits, 2 when the
    input was refused.
    """
    from autotune.output.study_export import write_export
    from autotune.search.slurm import worker_spec
    from autotune.search.tuner import find as find_config

    if gpu is not None:
        workload = workload.replace(gpu=gpu)  # checks the name, and that the device is CUDA
    _refuse_what_does_not_go_together(plan, workload=workload, script=script, export=export, output=output)
    if plan:  # the card's nodes: --nodes, else --gpus-per-node's, else its reference node's
        workload = on_card_nodes(workload.replace(nodes=executor.nodes), gpus_per_node)
        return _plan(workload, space=space, budget=size(memory_budget), headroom=headroom, as_json=as_json)
    executor = dataclasses.replace(executor, gpus_per_node=gpus_per_node)
    resources = executor.resources(nproc=workload.nproc, command=script)
    if resources is None and workers != 1:
        raise ConfigError(f"--workers {workers} on find is for --executor slurm; use autotune tune --workers here")
    refuse_max_time_on_slurm(max_time, on_slurm=resources is not None, command="find")
    # autotune.find's arguments, here or in each SLURM worker (which runs tune on the study find names)
    search = search_arguments(
        space=space,
        memory_budget_bytes=size(memory_budget),
        timeout_s=timeout,
        trial_timeout_s=trial_timeout,
        measure_steps=steps,
        script=script,
        n_trials=n_trials,
        headroom=headroom,
        storage=storage,
        estimate=estimate,
        warmup_steps=warmup_steps,
    )
    if resources is not None:
        spec = worker_spec(workload=workload, nodes=executor.nodes, patience=None, **search)
        summary = on_slurm(None, spec, workers=workers, confirm=True, resources=resources, storage=storage)
    else:
        if not script:
            start_trial_server(estimate=estimate)
        with progress(quiet=as_json) as shown:
            summary = find_config(
                workload=workload, max_time_s=duration(max_time, "--max-time"), progress=shown, **search
            )
    written = write_export(summary, export, output) if export is not None and summary.best else None
    return finish(summary, as_json=as_json, exported=written, wanted_export=export)


def _refuse_what_does_not_go_together(
    plan: bool, *, workload: Workload, script: list[str] | None, export: str | None, output: str | None
) -> None:
    """--plan predicts for a named card and runs nothing; without it, find measures here."""
    from autotune.output.study_export import check_format

    if plan and script:
        raise ConfigError(
            "--plan predicts from autotune's own trace of the model, and a training command cannot be "
            "traced: drop the command after -- (and give --model), or drop --plan"
        )
    if plan and export is not None:
        raise ConfigError(
            "--export writes a measured config; a plan has none yet: drop --export, or run find "
            "without --plan on the card"
        )
    if plan:
        return
    if workload.gpu is not None:
        raise ConfigError(
            f"--gpu {workload.gpu} names a card to plan for, and find without --plan runs trials on "
            "the device here: add --plan, or leave --gpu out"
        )
    if export is not None:
        check_format(export)
    elif output is not None:
        raise ConfigError("-o/--output is the file for --export; add --export FORMAT")


def _plan(workload: Workload, *, space: str, budget: int | None, headroom: float, as_json: bool) -> int:
    """``find --plan``: every config of the space predicted to fit, ranked; nothing runs."""
    from autotune.estimate.client import start_estimate_server
    from autotune.estimate.fit import card_budget, estimated_device
    from autotune.search.plan import plan_space

    if workload.gpu is not None:
        device = estimated_device(workload)
        assert device is not None  # a named card
        budget = card_budget(budget, device)
    # A new interpreter, not a fork of this command (as estimate's is): its imports run beside the command's own
    # on a second core, which a plan's wall time keeps (forked, a 7B plan on 8 H100s took 1.0-1.5 s longer, six
    # interleaved runs of six); the fork saves CPU, which a single command on an idle machine has to spare.
    start_estimate_server()
    live = sys.stderr.isatty()
    result = plan_space(
        workload=workload,
        space=space,
        memory_budget_bytes=budget,
        headroom=headroom,
        progress=None if as_json else _plan_progress(live),
    )
    if live and not as_json:
        print(file=sys.stderr)
    if as_json:
        print(json.dumps(result.to_dict()))
    else:
        from autotune.output.render import print_plan

        print_plan(result, workload)
    return 0 if result.rows else 1


def _plan_progress(live: bool) -> Callable[[int, int], None]:
    """The plan's progress on stderr: one line counting up on a terminal, a line per tenth in a log."""

    def counted(done: int, total: int) -> None:
        if live:
            print(f"\rplanning: {done}/{total} families estimated", end="", file=sys.stderr, flush=True)
        elif done == total or done % max(1, total // 10) == 0:
            print(f"planning: {done}/{total} families estimated", file=sys.stderr, flush=True)

    return counted
