"""``autotune export``: a study's best config in the format a training job reads."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from autotune.cli.options import OUTPUT_HELP, command
from autotune.errors import ConfigError


@command
def export(
    study: str,
    fmt: str,
    output: Annotated[
        Optional[str], typer.Option("-o", "--output", help="File to write (default: print it); " + OUTPUT_HELP)
    ] = None,
    storage: Optional[str] = None,
) -> int:
    """Write a study's best config in the format a training job reads."""
    from autotune.output.study_export import check_format, export_text, train_with, trains_line, write_export
    from autotune.study.records import load_summary

    check_format(fmt)
    summary = load_summary(study=study, storage=storage)
    if summary.best is None:
        unconfirmed = any(t.status == "ok" and t.fits and t.confirmed is None for t in summary.trials)
        raise ConfigError(
            f"--study {study} has no confirmed config yet; run autotune tune --study {study} "
            + ("(without --no-confirm) to confirm its fastest fitting config" if unconfirmed else "first")
        )
    if output is None:
        if fmt == "accelerate" and summary.best.config.uses_deepspeed:
            raise ConfigError(
                f"--format accelerate: {summary.best.config.describe()} is two files, the Accelerate "
                "YAML and the DeepSpeed config it names; add -o accelerate_config.yaml to write both"
            )
        print(export_text(summary, fmt), end="")
    else:
        print(
            f"wrote {', '.join(write_export(summary, fmt, output))} ({fmt}: {summary.best.config.describe()})",
            file=sys.stderr,
        )
    print(trains_line(summary.best.config, fmt, summary.workload), file=sys.stderr)
    if summary.workload.nodes > 1 and fmt != "launch":  # deepspeed and hf cannot say it in their files
        w = summary.workload
        print(
            f"nodes: {w.nodes}, {w.ranks_per_node} ranks on each: autotune export --study {study} --format launch "
            "writes the script that starts them",
            file=sys.stderr,
        )
    if fmt in ("json", "yaml") and output is not None and summary.command:
        print(f"train with it: {train_with(summary, output)}", file=sys.stderr)
    return 0
