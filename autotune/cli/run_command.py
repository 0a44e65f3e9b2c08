"""``autotune run``: the user's training command run with a tuned config, as its script-mode trials ran it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from autotune.cli.options import command
from autotune.config.knobs import TrialConfig
from autotune.errors import ConfigError


@command
def run_(
    config_file: Annotated[
        str,
        typer.Option(
            "--config", help="An autotune export (--format json or yaml): the config and the workload it was tuned for."
        ),
    ],
    script: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="-- COMMAND...",
            show_default=False,
            help="Your training command, after --: run to its end with the config handed to it as the trials did.",
        ),
    ] = None,
) -> int:
    """Train with a tuned config: run your command with it, as its script-mode trials ran it, unmeasured.

    The config reaches the command the way it reached each trial: AUTOTUNE_CONFIG for a plain loop
    (autotune.current_config()), and a Trainer's TrainingArguments, a Lightning Trainer's and an
    Accelerator's arguments set for it. Exit status: the command's own; 2 when the input was refused.
    """
    from pathlib import Path

    from autotune.prepare.apply import read_export
    from autotune.scripts.runner import run_with_config

    data, workload = read_export(Path(config_file), reader="--config")
    if workload is None:
        raise ConfigError(f"--config {config_file} has no workload; write it with autotune export --format json")
    return run_with_config(list(script or []), TrialConfig.from_dict(data), workload)
