"""What ``find`` and ``tune`` share around the search itself: its progress lines, the SLURM worker jobs
submitted and watched, and the answer printed with the command's exit status."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.search.slurm import SlurmResources
    from autotune.study.summary import StudySummary

__all__ = ["progress", "on_slurm", "finish", "search_arguments", "refuse_max_time_on_slurm"]


def search_arguments(
    *,
    space: str,
    memory_budget_bytes: int | None,
    timeout_s: float | None,
    trial_timeout_s: float,
    measure_steps: int,
    script: list[str] | None,
    n_trials: int | None,
    headroom: float,
    storage: str | None,
    estimate: bool,
    warmup_steps: int,
    **more: Any,
) -> dict[str, Any]:
    """The search's arguments ``find`` and ``tune`` both pass, here or in each SLURM worker's spec (``more``:
    a command's own, after ``n_trials``)."""
    return {
        "space": space,
        "memory_budget_bytes": memory_budget_bytes,
        "timeout_s": timeout_s,
        "trial_timeout_s": trial_timeout_s,
        "measure_steps": measure_steps,
        "command": list(script) if script else None,
        "n_trials": n_trials,
        **more,
        "headroom": headroom,
        "storage": storage,
        "estimate": estimate,
        "warmup_steps": warmup_steps,
    }


def progress(*, quiet: bool) -> Any:
    """Progress on stderr; none with --json, whose stdout is the one JSON object."""
    import contextlib

    from autotune.output.render import ConsoleProgress

    return contextlib.nullcontext() if quiet else ConsoleProgress()


def refuse_max_time_on_slurm(max_time: str | None, *, on_slurm: bool, command: str) -> None:
    """--max-time bounds a search on this machine, not SLURM jobs that start when the queue lets them."""
    if on_slurm and max_time is not None:
        raise ConfigError(
            f"--max-time {max_time} bounds a {command} on this machine; SLURM workers start when the queue lets "
            "them: bound each worker's job with --time, or the search with --timeout"
        )


def on_slurm(
    study: str | None,
    spec: dict[str, Any],
    *,
    workers: int,
    confirm: bool,
    resources: SlurmResources,
    storage: str | None,
) -> StudySummary:
    """Submit the worker jobs, say their ids and states on stderr while they run, read the study back."""
    from autotune.search.slurm import tune_on_slurm
    from autotune.study.records import load_summary

    def submitted(ids: list[str], directory: Any) -> None:
        confirms = " (worker 1 confirms the winner)" if confirm else ""
        print(
            f"submitted SLURM job(s) {', '.join(ids)}{confirms}; their logs: {directory}/", file=sys.stderr, flush=True
        )

    def changed(states: dict[str, str]) -> None:
        now = ", ".join(f"{job} {state}" for job, state in sorted(states.items())) or "all ended"
        print(f"worker jobs: {now}", file=sys.stderr, flush=True)

    name, _ = tune_on_slurm(
        study=study,
        spec=spec,
        workers=workers,
        confirm=confirm,
        resources=resources,
        storage=storage,
        on_submitted=submitted,
        on_change=changed,
    )
    return load_summary(study=name, storage=storage)


def finish(
    summary: StudySummary,
    *,
    as_json: bool,
    exported: list[str] | None = None,
    wanted_export: str | None = None,
    confirmed: bool = True,
) -> int:
    """Print the answer (a table, or one JSON object) and what was exported; return the exit status."""
    if as_json:
        print(json.dumps(_answer_json(summary, exported, wanted_export)))
    else:
        _print_answer(summary, exported, wanted_export)
    if not confirmed:  # --no-confirm: another worker confirms; a measured fit is this one's success
        return 0 if any(t.fits for t in summary.trials) else 1
    return 0 if summary.best is not None else 1


def _answer_json(summary: StudySummary, exported: list[str] | None, wanted_export: str | None) -> dict[str, Any]:
    from autotune.output.study_export import train_with

    data = summary.to_dict()
    if wanted_export is not None:
        data["export"] = exported[0] if exported else None
        if exported and len(exported) > 1:  # an Accelerate ZeRO export: the YAML and its DeepSpeed file
            data["export_files"] = exported
    if summary.best is not None and summary.command and exported and wanted_export in ("json", "yaml"):
        data["train_command"] = train_with(summary, exported[0])
    return data


def _print_answer(summary: StudySummary, exported: list[str] | None, wanted_export: str | None) -> None:
    from autotune.output.render import print_summary
    from autotune.output.study_export import train_with, trains_line

    print_summary(summary)
    if exported:
        assert wanted_export is not None and summary.best is not None  # exported only when asked, and found
        print(
            f"wrote {', '.join(exported)} ({wanted_export}); "
            f"{trains_line(summary.best.config, wanted_export, summary.workload)}"
        )
    elif wanted_export:
        print("nothing exported: no config fits yet", file=sys.stderr)
    if summary.best is not None and summary.command:
        given = exported[0] if exported and wanted_export in ("json", "yaml") else None
        how = "" if given else f" (after autotune export --study {summary.name} --format json -o autotune.json)"
        print(f"train with it: {train_with(summary, given)}{how}")
