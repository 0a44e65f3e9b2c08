"""The checks a tuning makes before it writes anything: its numbers, the memory budget, the nodes and the
workload. Each refusal is one line naming the flag and how to fix it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload

__all__ = ["check_numbers", "memory_budget", "check_nodes", "check_workload"]


def check_numbers(**values: Any) -> None:
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


def memory_budget(memory_budget_bytes: int | None, device: DeviceInfo) -> int:
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


def check_nodes(workload: Workload, *, srun: bool) -> None:
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


def _job_nodes() -> int:
    """The nodes of the SLURM job this worker runs in (its trials' ranks spread over them)."""
    return int(os.environ.get("SLURM_JOB_NUM_NODES") or 1)


def check_workload(workload: Workload, device: DeviceInfo) -> None:
    """Refuse a workload that no trial could run, before a study is created for it."""
    from autotune.errors import WorkloadError
    from autotune.models.sources import check_factory_module, resolve_task

    if device.type == "cuda" and workload.ranks_per_node > device.count:
        raise WorkloadError(
            f"--nproc {workload.nproc} needs {workload.ranks_per_node} GPUs per node; {device.count} visible here"
        )
    check_factory_module(workload)
    resolve_task(workload)
