"""Bad input as a user meets it: ``autotune trial`` refuses in one line on stderr, exit 2, nothing on stdout."""

from __future__ import annotations

import subprocess
import sys


def trial_refusal(*args: str, model: str, without: tuple[str, ...] = ()) -> str:
    """The refusal of ``autotune trial --model MODEL ARGS``, checked for its form. ``without``: packages the
    command runs as if they were not installed (None in sys.modules: importing them fails and
    ``importlib.util.find_spec`` says "not installed")."""
    runs = ["-m", "autotune"]
    if without:
        hide = (
            "import sys, runpy\n"
            + "".join(f"sys.modules[{package!r}] = None\n" for package in without)
            + "sys.argv[0] = 'autotune'\n"
            "runpy.run_module('autotune', run_name='__main__')\n"
        )
        runs = ["-c", hide]
    proc = subprocess.run(
        [sys.executable, *runs, "trial", "--model", model, *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr
