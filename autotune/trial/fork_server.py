"""A server that imports the heavy libraries once and forks per request, both sides: the trial server
(:mod:`autotune.trial.server`, which forks trials and the device probe) and the estimate server
(:mod:`autotune.estimate.worker`, which forks traces) are each a :func:`serve` with their own answers, and
their callers (the trial runner, the estimate client) each hold a :class:`ServerProcess`.

Protocol: one JSON line per message each way. The server says ``{"ready": 1}`` once its imports are done (what
reads a machine's free cores waits for it), then answers each request line with one or more reply lines of its
own kinds. A server dies with the process that started it (``python -m`` runs it under
:func:`autotune.trial.lifeline.die_with_parent`), and takes what it forked along.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from typing import Any, Callable

__all__ = ["serve", "ServerProcess", "ServerGone", "Reply"]

Reply = Callable[[dict[str, Any]], None]  # writes one reply line


def serve(imports: Callable[[], None], answer: Callable[[dict[str, Any], Reply], None]) -> None:
    """The server's loop: ``imports`` once, the ready line, then ``answer(request, reply)`` for each request
    line on stdin, until the caller closes it."""
    # A CUDA context does not survive fork: nothing here may create one. torch.cuda.is_available(), which some
    # imports call, then asks NVML instead of initialising the CUDA driver.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    imports()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (a model's code, a library's) must not land in the replies

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"ready": 1})
    for line in sys.stdin:
        if line.strip():
            answer(json.loads(line), reply)


class ServerGone(RuntimeError):
    """The server exited (killed from outside, or it crashed): what it was doing has no known end."""


class ServerProcess:
    """The caller's handle on one ``python -m <module>`` server: started on first use, in a session of its own
    (killed whole with what it forked), its replies read with timeouts."""

    START_TIMEOUT_S = 120.0  # its imports, on a slow disk

    def __init__(self, module: str, env: Callable[[], dict[str, str]] | None = None) -> None:
        self.module = module
        self._env = env  # the server's environment, made at each start (None: the caller's)
        self._process: subprocess.Popen[str] | None = None
        self._ready = False  # it said it has imported everything

    def start(self) -> None:
        """Start the server now, if it is not running, without waiting for its imports."""
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", self.module],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
                env=None if self._env is None else self._env(),
            )
            self._ready = False

    @property
    def started(self) -> bool:
        """A server was started and has not been seen to exit."""
        return self._process is not None and self._process.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Start the server if needed and wait for its ready line (TimeoutError, or ServerGone once closed)."""
        self.start()
        if not self._ready:
            self.reply(self.START_TIMEOUT_S if timeout_s is None else timeout_s)
            self._ready = True

    def send(self, request: dict[str, Any]) -> None:
        """Hand one request to the server, started if needed (BrokenPipeError where it is gone); it waits in
        the pipe until the server has done its imports."""
        self.start()
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()

    def reply(self, timeout_s: float) -> dict[str, Any]:
        """The server's next reply line: TimeoutError where none came in ``timeout_s`` (the server is left as it
        is); ServerGone where it exited (closed here)."""
        assert self._process is not None and self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], max(timeout_s, 0.0))
        if not ready:
            raise TimeoutError(f"no reply from {self.module} in {timeout_s:g} s")
        line = self._process.stdout.readline()
        if not line:
            self.close()
            raise ServerGone(f"{self.module} exited")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        """Kill the server and everything it forked (its session's process group), and reap it."""
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            self._process.wait()
            self._process = None
