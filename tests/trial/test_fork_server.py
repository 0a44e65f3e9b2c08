"""The fork servers' shared start: a server started with a sibling forks it once its imports are done, so the two
import the libraries once; the sibling answers as if started on its own, is its caller's child, and dies with it.
A server started ``forked`` is a fork of its caller, which has imported the libraries itself: neither server
imports them again.

The callers here are processes of their own: a caller becomes a subreaper, which the test process must not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc are Linux's")

# A server whose imports write this process's pid to a file once: the stand-in for torch and Transformers.
_HEAVY = "import os, pathlib\npathlib.Path(os.environ['IMPORTED']).open('a').write(f'{os.getpid()}\\n')\n"
_ECHO = textwrap.dedent("""
    import os, sys
    from autotune.trial import fork_server

    def serve():
        def imports():
            import heavy  # noqa: F401

        def answer(request, reply):
            reply({"echo": request["n"], "pid": os.getpid(), "main": sys.modules["__main__"].__name__})

        fork_server.serve(imports, answer)

    if __name__ == "__main__":
        serve()
""")
# The caller: starts the two together, asks each, prints what it saw, then does what stdin says.
_CALLER = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from autotune.trial.fork_server import ServerProcess

    def parent(pid):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def ask(server, n):
        server.send({"n": n})
        server.wait_ready(60)
        return server.reply(60)

    forked = bool(os.environ.get("FORKED"))
    if forked:  # the caller imports what the servers import first, and has output of its own not written yet
        import heavy  # noqa: F401
        print("before", end="")
    first, second = ServerProcess("echo_server"), ServerProcess("echo_server")
    first.start(sibling=second, forked=forked)
    second.send({"n": 2})  # two requests before a reply is read: its replies arrive together
    one, two = ask(first, 1), ask(second, 22)
    seen = {"echo": [one["echo"], two["echo"], second.reply(60)["echo"]], "pids": [one["pid"], two["pid"]],
            "me": os.getpid(), "sibling's parent": parent(two["pid"]), "first's parent": parent(one["pid"]),
            "first's session": os.getsid(one["pid"]), "first's main": one["main"]}
    print(json.dumps(seen), flush=True)
    if sys.stdin.readline().strip() == "close":
        first.close()  # the sibling is in a session of its own: it outlives the first
        seen = {"after the first closed": ask(second, 3)["echo"]}
        second.close()
        try:
            os.waitpid(two["pid"], os.WNOHANG)
            seen["reaped"] = False
        except ChildProcessError:
            seen["reaped"] = True
        print(json.dumps(seen), flush=True)
    sys.stdin.read()
""")


@pytest.fixture(params=["new interpreter", "forked"])
def caller(tmp_path: Path, request: pytest.FixtureRequest):
    (tmp_path / "heavy.py").write_text(_HEAVY)
    (tmp_path / "echo_server.py").write_text(_ECHO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), IMPORTED=str(tmp_path / "imported"))
    forked = request.param == "forked"
    if forked:
        env["FORKED"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-c", _CALLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    yield process, tmp_path / "imported", forked
    process.kill()
    process.wait()


def _read(process: subprocess.Popen, *, before: bool = False) -> dict:
    """The caller's next line; ``before``: after its own output of before the fork, written once."""
    assert process.stdout is not None
    line = process.stdout.readline()
    if before:
        assert line.startswith("before{"), line
        line = line.removeprefix("before")
    return json.loads(line)


def _say(process: subprocess.Popen, line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()


def test_a_sibling_is_forked_after_the_imports_and_answers_as_its_callers_child(caller):
    process, imported, forked = caller
    seen = _read(process, before=forked)
    assert seen["echo"] == [1, 2, 22]  # each reply read, in order, however the pipe delivered them
    first, sibling = seen["pids"]
    assert first != sibling
    # The sibling imported nothing again; nor did a forked first server, whose caller had imported it all.
    assert imported.read_text().split() == [str(seen["me"] if forked else first)]
    assert seen["sibling's parent"] == seen["me"]  # adopted: reaped by its caller, and it dies with it
    assert seen["first's session"] == first  # killed whole, with what it forks
    if forked:  # the caller's child, running as `python -m echo_server` would
        assert seen["first's parent"] == seen["me"] and seen["first's main"] == "echo_server"
    _say(process, "close")
    assert _read(process) == {"after the first closed": 3, "reaped": True}


def test_a_sibling_dies_with_its_caller_killed_with_sigkill(caller):
    process, _, forked = caller
    pids = _read(process, before=forked)["pids"]
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), pids


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that does not reap (PID 1 of a container may not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
