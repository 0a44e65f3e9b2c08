"""The fork servers' shared start: a server started with a sibling forks it once its imports are done, so the two
import the libraries once; the sibling answers as if started on its own, is the caller's child, and dies with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autotune.trial.fork_server import ServerProcess

# A server whose imports write this process's pid to a file once: the stand-in for torch and Transformers.
_HEAVY = "import os, pathlib\npathlib.Path(os.environ['IMPORTED']).open('a').write(f'{os.getpid()}\\n')\n"
_ECHO = textwrap.dedent("""
    import os
    from autotune.trial import fork_server

    def serve():
        def imports():
            import heavy  # noqa: F401

        fork_server.serve(imports, lambda request, reply: reply({"echo": request["n"], "pid": os.getpid()}))

    if __name__ == "__main__":
        serve()
""")


@pytest.fixture
def servers(tmp_path: Path):
    (tmp_path / "heavy.py").write_text(_HEAVY)
    (tmp_path / "echo_server.py").write_text(_ECHO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]), IMPORTED=str(tmp_path / "imported"))
    first = ServerProcess("echo_server", env=lambda: env)
    second = ServerProcess("echo_server")
    yield first, second, tmp_path / "imported"
    first.close()
    second.close()


def _ask(server: ServerProcess, n: int) -> dict:
    server.send({"n": n})
    server.wait_ready(60)
    return server.reply(60)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc are Linux's")
def test_a_sibling_is_forked_after_the_imports_and_answers_as_the_callers_child(servers):
    first, second, imported = servers
    first.start(sibling=second)
    one, two = _ask(first, 1), _ask(second, 2)
    assert (one["echo"], two["echo"]) == (1, 2)
    assert one["pid"] != two["pid"]
    assert imported.read_text().split() == [str(one["pid"])]  # the sibling imported nothing again
    assert _parent(two["pid"]) == os.getpid()  # adopted: reaped here, and it dies with this process
    first.close()  # the sibling is in a session of its own: it outlives the first
    assert _ask(second, 3)["echo"] == 3
    second.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(two["pid"], os.WNOHANG)  # reaped by close(): no zombie left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper and /proc are Linux's")
def test_a_sibling_dies_with_its_caller_killed_with_sigkill(tmp_path, servers):
    _, _, imported = servers
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
                import os, sys
                from autotune.trial.fork_server import ServerProcess
                first, second = ServerProcess("echo_server"), ServerProcess("echo_server")
                first.start(sibling=second)
                for server in (first, second):
                    server.send({"n": 0})
                    server.wait_ready(60)
                    print(server.reply(60)["pid"], flush=True)
                sys.stdin.read()
            """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(imported.parent), *sys.path]), IMPORTED=str(imported)),
    )
    assert caller.stdout is not None
    pids = [int(caller.stdout.readline()) for _ in range(2)]
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in pids):
        time.sleep(0.05)
    assert all(not Path(f"/proc/{pid}").exists() or _state(pid) == "Z" for pid in pids), pids


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
