"""A command's trial server is a fork of the command, once the command has imported torch and Transformers: one
import of them for the two. ``main`` called from another program's process, or from a process with a thread of
its own, starts the server as a new interpreter instead (a fork copies only the thread that forks)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_DECIDE = """
import sys, threading
from autotune.cli import servers
if "command" in sys.argv:
    servers.this_is_the_command()
if "thread" in sys.argv:
    threading.Thread(target=threading.Event().wait, daemon=True).start()
print(servers._imported_for_a_fork(), "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("marks", "forks_and_imports"),
    [(["command"], ["True", "True"]), ([], ["False", "False"]), (["command", "thread"], ["False", "False"])],
    ids=["the command", "another program", "a thread"],
)
def test_only_the_commands_own_process_with_one_thread_forks_its_server(marks, forks_and_imports):
    done = subprocess.run([sys.executable, "-c", _DECIDE, *marks], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == forks_and_imports
