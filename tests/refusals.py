"""Bad input as a user meets it: ``autotune trial`` refuses in one line on stderr, exit 2, nothing on stdout."""

from __future__ import annotations

import subprocess
import sys

import commands


def trial_refusal(*args: str, model: str, without: tuple[str, ...] = ()) -> str:
    """The refusal of ``autotune trial --model MODEL ARGS``, checked for its form: the command as a user runs it
    (:func:`commands.autotune`). ``without``: packages the command runs as if they were not installed (None in
    sys.modules: importing them fails and ``importlib.util.find_spec`` says "not installed"), in an interpreter
    of its own, since a warm one may have imported them."""
    command = ["trial", "--model", model, *args]
    if without:
        hide = (
            "import sys, runpy\n"
            + "".join(f"sys.modules[{package!r}] = None\n" for package in without)
            + "sys.argv[0] = 'autotune'\n"
            "runpy.run_module('autotune', run_name='__main__')\n"
        )
        proc = subprocess.run([sys.executable, "-c", hide, *command], capture_output=True, text=True, timeout=300)
    else:
        proc = commands.autotune(*command, timeout=300)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr
