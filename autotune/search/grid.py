"""Measure every config of a space: the ground truth that search strategies are replayed against.

Each line of the output is one ``autotune trial --json`` object plus ``trial_seconds`` (the wall
time the trial cost, launch to exit, which a replay charges for it) and ``workload``. Lines are
appended and flushed as trials finish, so a stopped grid keeps what it measured; running it
again measures only the configs missing from the file.

Beside the file, ``GRID.roofline.json`` keeps the device's roofline as the device probe measured it
before the trials (what the step-time model times configs against), so a replay on another machine
ranks the grid's configs as the driver did on the machine that measured them.

Then each line gets the memory estimator's prediction for its config (``estimate``: the
estimate, with ``estimate_seconds``, its round trip through a warm estimate server, and
``estimator_start_s``, what starting that server cost once), so a replayed driver can bisect
with the estimator and pay what it would have paid. Lines that have one keep it, unless the
estimates are made again (after the estimator changed: its figures and its seconds both move).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.search.space import SearchSpace
from autotune.trial.runner import run_trial

__all__ = ["measure_grid", "estimate_grid", "read_grid", "roofline_path"]


def measure_grid(
    workload: Workload,
    space: SearchSpace,
    out: Path,
    *,
    memory_budget_bytes: int | None,
    trial_timeout_s: float,
    warmup_steps: int,
    measure_steps: int,
    on_trial: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> int:
    """Measure the configs of ``space`` not yet in ``out``; return how many were measured now."""
    configs = space.candidates(workload, detect_device(workload.device))
    done = {TrialConfig.from_dict(line["config"]) for line in read_grid(out, workload)} if out.exists() else set()
    todo = [c for c in configs if c not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    roofline = roofline_path(out)
    if todo and not roofline.exists():
        from autotune.trial.device_probe import probe_profile

        # The collective's latency only where the grid's trials have several ranks: one communicates nothing.
        # Forked from the trial server the trials below are forked from (no interpreter of its own to start).
        profile = probe_profile(
            detect_device(workload.device).type, between_ranks=workload.nproc > 1, trial_server=True
        )
        if profile is not None:
            roofline.write_text(json.dumps(profile, indent=1) + "\n")
    with out.open("a") as sink:
        for index, config in enumerate(todo, start=1):
            started = time.monotonic()
            result = run_trial(
                workload,
                config,
                memory_budget_bytes=memory_budget_bytes,
                timeout_s=trial_timeout_s,
                warmup_steps=warmup_steps,
                measure_steps=measure_steps,
            )
            line = {**result.to_dict(), "trial_seconds": time.monotonic() - started, "workload": workload.to_dict()}
            sink.write(json.dumps(line) + "\n")
            sink.flush()
            if on_trial is not None:
                on_trial(index, len(todo), line)
    return len(todo)


def roofline_path(grid: Path) -> Path:
    """Where the roofline of the machine that measured ``grid`` is kept."""
    return grid.with_suffix(".roofline.json")


def estimate_grid(
    path: Path, on_estimate: Callable[[int, int, dict[str, Any]], None] | None = None, *, again: bool = False
) -> int:
    """Add the estimator's prediction to every line of ``path`` lacking one (``again``: to every
    line); return how many were added.

    The file is rewritten whole (to a temporary file, then renamed), so a stop leaves it as it was.
    """
    from autotune.estimate.client import predict_memory
    from autotune.estimate.results import EstimateError

    lines = list(read_grid(path))
    todo = [line for line in lines if again or "estimate" not in line]
    if not todo:
        return 0
    workload = Workload.from_dict(todo[0]["workload"])
    started = time.monotonic()
    with contextlib.suppress(EstimateError):  # the first one starts the server: timed apart
        predict_memory(workload, TrialConfig.from_dict(todo[0]["config"]))
    start_s = time.monotonic() - started
    for index, line in enumerate(todo, start=1):
        started = time.monotonic()
        try:
            estimate: dict[str, Any] = predict_memory(workload, TrialConfig.from_dict(line["config"])).to_dict()
        except EstimateError as exc:
            estimate = {"error": str(exc)}
        line["estimate"] = estimate
        line["estimate_seconds"] = time.monotonic() - started
        if on_estimate is not None:
            on_estimate(index, len(todo), line)
    first = todo[0]["estimate_seconds"]
    for line in todo:
        line["estimator_start_s"] = max(0.0, start_s - first)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(line) + "\n" for line in lines))
    partial.replace(path)
    return len(todo)


def read_grid(path: Path, workload: Workload | None = None) -> Iterator[dict[str, Any]]:
    """The grid's lines; with ``workload``, refuse a file measured for another one."""
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except ValueError:
            raise ConfigError(f"{path}:{number} is not a JSON line of a grid") from None
        if workload is not None and line.get("workload") != workload.to_dict():
            raise ConfigError(
                f"{path} was measured for another workload ({line.get('workload')}); "
                "use a new -o file or the same workload flags"
            )
        yield line
