"""``autotune report``: a study as a self-contained HTML report."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from autotune.cli.options import command


@command
def report(
    study: str,
    output: Annotated[str, typer.Option("-o", "--output", help="The HTML file to write.")] = "report.html",
    storage: Optional[str] = None,
) -> int:
    """An HTML report: throughput per trial, memory against throughput, knob importance."""
    from autotune.output.report import write_report
    from autotune.study.records import load_summary

    path = write_report(load_summary(study=study, storage=storage, with_importances=True), output)
    print(f"wrote {path}", file=sys.stderr)
    return 0
