"""Run an autotune command as a user types it, and read what it printed and how it exited.

:func:`autotune` is ``subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True, text=True)``
and :func:`start` is ``subprocess.Popen`` of it, both run as a fork of a warm interpreter (:mod:`cli_zygote`) that
has imported what every command imports: the same process, environment, signals and exit, without a new
interpreter's 4-5 CPU-s of imports. One warm interpreter per xdist worker and environment. A test that reads how a
new interpreter starts (the console script, its imports) runs ``subprocess`` itself.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

__all__ = ["autotune", "start", "Command"]

TESTS = Path(__file__).parent
# Read afresh by each command, never at import: the warm interpreter's imports do not depend on them.
# PATH too: a command looks its tools up when it runs them (shutil.which), and a test that hides SLURM's gets no
# interpreter of its own for it.
_PER_COMMAND = {"PYTEST_CURRENT_TEST", "AUTOTUNE_TEST_MARK", "TMPDIR", "COLUMNS", "LINES", "PATH"}
_MOST_WARM = 2  # interpreters kept, one per environment the worker's tests ran commands with
_REQUESTS = itertools.count()


def autotune(
    *args: str, cwd: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m autotune ARGS`` in ``cwd`` with ``env`` (None: this process's), its output captured as
    text; raise :class:`subprocess.TimeoutExpired` after killing it, as :func:`subprocess.run` does."""
    return start(*args, cwd=cwd, env=env).finish(timeout)


def start(*args: str, cwd: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> Command:
    """Start ``python -m autotune ARGS`` as :func:`autotune` runs it, and return at once, as
    ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` does."""
    environment = dict(os.environ if env is None else env)
    return Command(_WarmInterpreter.for_environment(environment), list(args), cwd, environment)


class Command:
    """A running command: what :class:`subprocess.Popen` offers of one (``pid``, ``args``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill``, ``returncode``), its output read once it has ended."""

    def __init__(
        self, server: _WarmInterpreter, args: list[str], cwd: str | os.PathLike[str] | None, env: dict[str, str]
    ) -> None:
        self.args = [sys.executable, "-m", "autotune", *args]
        self.returncode: int | None = None
        self._server = server
        self._output = tempfile.TemporaryDirectory(prefix="autotune-command-")
        self._stdout, self._stderr = Path(self._output.name) / "stdout", Path(self._output.name) / "stderr"
        self._stdout.touch()
        self._stderr.touch()
        request = {
            "args": args,
            "cwd": str(cwd if cwd is not None else os.getcwd()),
            "env": env,
            "stdout": str(self._stdout),
            "stderr": str(self._stderr),
            "cores": sorted(os.sched_getaffinity(0)),
        }
        self.pid = server.run(request)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def finish(self, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """Wait for the command's end and return what :func:`subprocess.run` would; raise
        :class:`subprocess.TimeoutExpired` after killing it, as :func:`subprocess.run` does."""
        try:
            out, err = self.communicate(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.communicate()
            raise subprocess.TimeoutExpired(self.args, timeout, out, err) from None
        assert self.returncode is not None
        return subprocess.CompletedProcess(self.args, self.returncode, out, err)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        out, err = self._stdout.read_text(), self._stderr.read_text()
        self._output.cleanup()
        return out, err

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _WarmInterpreter:
    """A :mod:`cli_zygote` process and the replies it has sent: which command started as which pid, which
    ended with which status."""

    _warm: dict[tuple[tuple[str, str], ...], _WarmInterpreter] = {}

    @classmethod
    def for_environment(cls, environment: dict[str, str]) -> _WarmInterpreter:
        """This worker's warm interpreter for ``environment`` (started on first use), the others stopped beyond
        ``_MOST_WARM``."""
        key = tuple(sorted((k, v) for k, v in environment.items() if k not in _PER_COMMAND))
        server = cls._warm.pop(key, None)
        if server is None or server.process.poll() is not None:
            server = cls(environment)
        cls._warm[key] = server  # the most recently used last
        idle = [other for other, warm in cls._warm.items() if other != key and not warm.running]  # oldest first
        for other in idle[: max(0, len(cls._warm) - _MOST_WARM)]:
            cls._warm.pop(other).stop()
        return server

    def __init__(self, environment: dict[str, str]) -> None:
        paths = [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
        path = os.pathsep.join(paths if str(TESTS) in paths else [str(TESTS), *paths])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cli_zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**environment, "PYTHONPATH": path},
            cwd=TESTS,
        )
        self._pending = b""
        self._started: dict[int, int] = {}  # request id: pid
        self._ended: dict[int, int] = {}  # pid: return code
        self.running: set[int] = set()  # the pids of its commands not yet waited for
        if self._next(300) != {"ready": 1}:
            raise RuntimeError("the warm interpreter of tests/cli_zygote.py did not start: see the test's stderr")

    def run(self, request: dict[str, Any]) -> int:
        """Send ``request``; the pid of the command it started."""
        number = next(_REQUESTS)
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps({**request, "id": number}) + "\n").encode())
        self.process.stdin.flush()
        while number not in self._started:
            self._take(self._next(None))  # waiting without a timeout: never None
        pid = self._started.pop(number)
        self.running.add(pid)
        return pid

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s return code once it has ended, waiting ``timeout`` seconds at most (None: until it ends)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self._ended:
            message = self._next(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if message is None:
                return None  # none came in time (timeout 0: none had come)
            self._take(message)
        self.running.discard(pid)
        return self._ended.pop(pid)

    def _take(self, message: dict[str, Any] | None) -> None:
        assert message is not None
        if "request" in message:
            self._started[message["request"]] = message["pid"]
        else:
            self._ended[message["pid"]] = message["returncode"]

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next reply, or None after ``timeout`` seconds without one."""
        assert self.process.stdout is not None
        replies = self.process.stdout.fileno()
        while b"\n" not in self._pending:
            if not select.select([replies], [], [], timeout)[0]:
                return None
            read = os.read(replies, 1 << 16)
            if not read:
                raise RuntimeError("the warm interpreter of tests/cli_zygote.py exited: see the test's stderr")
            self._pending += read
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@atexit.register
def _stop_all() -> None:
    while _WarmInterpreter._warm:
        _WarmInterpreter._warm.popitem()[1].stop()
