"""A command's trial server is a fork of the command, once the command has imported torch and Transformers: one
import of them for the two. ``main`` called from another program's process, or from a process with a thread of
its own, starts the server as a new interpreter instead (a fork copies only the thread that forks)."""

from __future__ import annotations

import json
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


_ESTIMATE_SERVER = """
import json
from autotune.cli import servers
from autotune.estimate import client

servers.this_is_the_command()
servers.start_estimate_server()
process = client.estimate_server_process()
process.wait_ready(120)
command = open(f"/proc/{process._process.pid}/cmdline").read().split("\\0")
print(json.dumps({"kind": type(process._process).__name__, "command": command}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a command forks its servers on Linux only")
def test_the_estimate_commands_server_is_a_fork_of_the_command_that_serves():
    # The estimate command (and find --plan) start their estimate server this way: forked, it runs the command's
    # own command line (python -c here), where a new interpreter would run python -m autotune.estimate.worker.
    done = subprocess.run([sys.executable, "-c", _ESTIMATE_SERVER], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    started = json.loads(done.stdout)
    assert started["kind"] == "_Forked"
    assert "autotune.estimate.worker" not in started["command"] and "-c" in started["command"]
