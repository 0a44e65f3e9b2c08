"""The ``autotune`` command line: parse, call the Python API, render. Nothing else lives here.

One module per command; ``options`` declares each option shared by commands once (with the
``command`` decorator that hands them to a command), ``parse`` turns flag values into the API's,
``app`` holds the Typer app and the entry point (``main``, ``run``). Every error autotune raises on
purpose, and every usage error, ends as one line on stderr and exit status 2. May import anything.
"""

from __future__ import annotations

from autotune.cli.app import app, main, run

# Each module registers its command as it is imported: --help lists them in this order.
# isort: off
from autotune.cli import trial, find, tune, grid, studies, show  # noqa: F401
from autotune.cli import export, run_command, report, estimate, models, worker  # noqa: F401

# isort: on
from autotune.cli.options import KNOB_OPTIONS, OPTIONS, WORKLOAD_OPTIONS

__all__ = ["app", "main", "run", "OPTIONS", "WORKLOAD_OPTIONS", "KNOB_OPTIONS"]
