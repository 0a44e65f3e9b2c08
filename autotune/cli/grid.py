"""``autotune grid``: every config of a space measured, a JSON line each, for replaying searches."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer

from autotune.cli.options import command
from autotune.cli.parse import size
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError


@command
def grid(
    output: Annotated[str, typer.Option("-o", "--output", help="The .jsonl file to write (appended to).")],
    workload: Workload,
    memory_budget: Optional[str],
    space: str,
    trial_timeout: float,
    warmup_steps: int,
    steps: int,
    estimate: bool,
    re_estimate: Annotated[
        bool,
        typer.Option(
            "--re-estimate",
            help="Estimate every line again, not only those without an estimate (after the estimator changed).",
        ),
    ] = False,
) -> int:
    """Measure every config of a space, one `autotune trial --json` line each (for replaying searches).

    A stopped grid keeps its lines; the same command measures only the configs still missing.
    Each line then gets the memory estimator's prediction for its config (--no-estimate: not).
    """
    from pathlib import Path

    from autotune.search.grid import estimate_grid, measure_grid
    from autotune.search.presets import load_space
    from autotune.sizes import format_size
    from autotune.trial.result import TrialResult

    if trial_timeout <= 0:
        raise ConfigError(f"--trial-timeout {trial_timeout:g} must be more than 0 seconds")
    if re_estimate and not estimate:
        raise ConfigError("--re-estimate and --no-estimate contradict each other: drop one")

    def report(index: int, total: int, line: dict[str, Any]) -> None:
        result = TrialResult.from_dict(line)
        figure = f"{result.throughput:,.1f} {result.throughput_unit}" if result.throughput else "no figure"
        print(
            f"{index}/{total} {TrialConfig.from_dict(line['config']).describe()}: {line['status']}, {figure}, "
            f"{line['trial_seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    def report_estimate(index: int, total: int, line: dict[str, Any]) -> None:
        estimate = line["estimate"]
        figure = (
            format_size(estimate["predicted_peak_bytes"]) if "predicted_peak_bytes" in estimate else estimate["error"]
        )
        print(
            f"estimate {index}/{total} {TrialConfig.from_dict(line['config']).describe()}: {figure}, "
            f"{line['estimate_seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    measured = measure_grid(
        workload,
        load_space(space),
        Path(output),
        memory_budget_bytes=size(memory_budget),
        trial_timeout_s=trial_timeout,
        warmup_steps=warmup_steps,
        measure_steps=steps,
        on_trial=report,
    )
    print(f"{output}: {measured} config(s) measured now", file=sys.stderr)
    if estimate:
        estimated = estimate_grid(Path(output), on_estimate=report_estimate, again=re_estimate)
        print(f"{output}: {estimated} config(s) estimated now", file=sys.stderr)
    return 0
