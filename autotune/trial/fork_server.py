"""A server that imports the heavy libraries once and forks per request, both sides: the trial server
(:mod:`autotune.trial.server`, which forks trials and the device probe) and the estimate server
(:mod:`autotune.estimate.worker`, which forks traces) are each a :func:`serve` with their own answers, and
their callers (the trial runner, the estimate client) each hold a :class:`ServerProcess`.

Protocol: one JSON line per message each way. The server says ``{"ready": 1, "pid": ...}`` once its imports are
done (what reads a machine's free cores waits for it), then answers each request line with one or more reply lines
of its own kinds. A server dies with the process that started it (``python -m`` runs it under
:func:`autotune.trial.lifeline.die_with_parent`), and takes what it forked along.

The two servers import the same libraries (PyTorch, Transformers: seconds of CPU each). Started together
(``ServerProcess.start(sibling=...)``), the second is forked from the first once its imports are done instead of
importing them again: it runs in a session of its own, handed to the caller (a subreaper) as its child, and dies
with the caller as the first does. A caller that has imported those libraries itself (a command, which needs
them for its own checks: :mod:`autotune.cli.servers`) starts the first ``forked``: a fork of the caller, so that
neither server imports them again.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import IO, Any, Callable

from autotune.trial.lifeline import become_subreaper, die_with_parent

__all__ = ["serve", "ServerProcess", "ServerGone", "Reply"]

Reply = Callable[[dict[str, Any]], None]  # writes one reply line
# Set for a server that forks a sibling once its imports are done: "MODULE REQUESTS_FD REPLIES_FD CALLER_PID".
_SIBLING_ENV = "AUTOTUNE_FORK_SIBLING"


def serve(imports: Callable[[], None], answer: Callable[[dict[str, Any], Reply], None]) -> None:
    """The server's loop: ``imports`` once, the ready line, then ``answer(request, reply)`` for each request
    line on stdin, until the caller closes it."""
    # A CUDA context does not survive fork: nothing here may create one. torch.cuda.is_available(), which some
    # imports call, then asks NVML instead of initialising the CUDA driver.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    imports()
    sibling = os.environ.pop(_SIBLING_ENV, None)
    if sibling:
        _fork_sibling(*sibling.split())
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (a model's code, a library's) must not land in the replies

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"ready": 1, "pid": os.getpid()})
    for line in sys.stdin:
        if line.strip():
            answer(json.loads(line), reply)


def _fork_sibling(module: str, requests: str, replies: str, caller: str) -> None:
    """Fork the server of ``module`` on the pipes ``requests`` and ``replies`` (file descriptors), with this one's
    imports. Forked twice, so that it is no child of this server (whose waits for its own children it would
    disturb): the caller, a subreaper, becomes its parent, and it dies with the caller."""
    middle = os.fork()
    if middle:
        os.waitpid(middle, 0)
        os.close(int(requests))
        os.close(int(replies))
        return
    if os.fork():
        os._exit(0)
    code = 1
    try:
        os.setsid()  # killed with what it forks as its own group, and not with this server's
        deadline = time.monotonic() + 5.0
        while os.getppid() != int(caller) and time.monotonic() < deadline:
            time.sleep(0.001)  # the middle process is exiting: then the caller adopts this one
        die_with_parent(int(caller))
        _onto_stdin_and_stdout(int(requests), int(replies))
        importlib.import_module(module).serve()
        code = 0
    finally:
        os._exit(code)


def _onto_stdin_and_stdout(requests: int, replies: int) -> None:
    """In a forked server, move the pipes ``requests`` and ``replies`` (file descriptors) to its stdin and stdout,
    and close the originals, but any that was 0-2 already (a caller without stdin gets its first pipe at 0)."""
    os.dup2(requests, 0)
    os.dup2(replies, 1)
    for fd in {requests, replies} - {0, 1, 2}:
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, read to its end


def _fork_server(module: str, env: dict[str, str] | None, *, unheld: tuple[int, ...]) -> _Forked:
    """The server of ``module`` as a fork of this process, which has imported the libraries it imports first
    (a command that needs torch and Transformers itself): what ``python -m module`` runs, on two new pipes,
    in a session of its own, dying with this process, its stderr discarded, with ``env`` (None: this
    process's). ``unheld``: descriptors of this process's that the server must not keep open. The caller has
    one thread: a fork copies only the thread that forks, and a lock another thread held would stay held."""
    requests, replies = os.pipe(), os.pipe()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the server would write the caller's buffered output again
    caller = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            die_with_parent(caller)
            devnull = os.open(os.devnull, os.O_RDWR)
            _onto_stdin_and_stdout(requests[0], replies[1])
            os.dup2(devnull, 2)
            for fd in {requests[1], replies[0], devnull, *unheld} - {0, 1, 2}:  # the caller's ends; /dev/null
                os.close(fd)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - fresh streams over the new pipes
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if env is not None:
                os.environ.update(env)
            server = importlib.import_module(module)
            # As `python -m module` would have it: what a library spawns re-imports the server's module as its
            # __main__, not the command's.
            sys.modules["__main__"], sys.argv = server, [server.__file__ or module]
            server.serve()
            code = 0
        finally:
            os._exit(code)
    os.close(requests[0])
    os.close(replies[1])
    forked = _Forked(os.fdopen(requests[1], "w"), os.fdopen(replies[0], "r"))
    forked.pid = pid
    return forked


class ServerGone(RuntimeError):
    """The server exited (killed from outside, or it crashed): what it was doing has no known end."""


class ServerProcess:
    """The caller's handle on one ``python -m <module>`` server: started on first use, in a session of its own
    (killed whole with what it forked), its replies read with timeouts."""

    START_TIMEOUT_S = 120.0  # its imports, on a slow disk

    def __init__(self, module: str, env: Callable[[], dict[str, str]] | None = None) -> None:
        self.module = module
        self._env = env  # the server's environment, made at each start (None: the caller's)
        self._process: subprocess.Popen[str] | _Forked | None = None
        self._ready = False  # it said it has imported everything
        self._unread = b""  # what it wrote past the last reply read

    def start(self, sibling: ServerProcess | None = None, *, forked: bool = False) -> None:
        """Start the server now, if it is not running, without waiting for its imports; and ``sibling``, if it is
        not running, forked from this one once its imports are done (started on its own where that cannot be).
        ``forked``: the server is a fork of this process, not a new interpreter (see :func:`_fork_server`)."""
        if self._process is not None and self._process.poll() is None:
            if sibling is not None:
                sibling.start()
            return
        env = None if self._env is None else self._env()
        pipes: tuple[int, int, int, int] | None = None
        if sibling is not None and not sibling.started and become_subreaper():
            sibling.close()  # one seen to exit: reaped, its pipes closed
            requests, replies = os.pipe(), os.pipe()
            pipes = (requests[0], replies[1], requests[1], replies[0])
            fork = f"{sibling.module} {requests[0]} {replies[1]} {os.getpid()}"
            env = {**(os.environ if env is None else env), _SIBLING_ENV: fork}
        self._unread = b""
        try:
            if forked:
                self._process = _fork_server(self.module, env, unheld=pipes[2:] if pipes is not None else ())
            else:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", self.module],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,
                    env=env,
                    pass_fds=pipes[:2] if pipes is not None else (),
                )
        except BaseException:
            for end in pipes[2:] if pipes is not None else ():
                os.close(end)  # the sibling's other ends: no sibling comes
            raise
        finally:
            for end in pipes[:2] if pipes is not None else ():
                os.close(end)  # the server's ends: it holds them now (or nobody will)
        self._ready = False
        if pipes is not None:
            assert sibling is not None
            sibling._process = _Forked(os.fdopen(pipes[2], "w"), os.fdopen(pipes[3], "r"))
            sibling._ready, sibling._unread = False, b""
        elif sibling is not None:
            sibling.start()

    @property
    def started(self) -> bool:
        """A server was started and has not been seen to exit."""
        return self._process is not None and self._process.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Start the server if needed and wait for its ready line (TimeoutError, or ServerGone once closed)."""
        self.start()
        if not self._ready:
            ready = self.reply(self.START_TIMEOUT_S if timeout_s is None else timeout_s)
            if isinstance(self._process, _Forked):
                self._process.pid = int(ready["pid"])
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
        # Read here, not through the file object: its buffer could hold a second line that select() would not see.
        pipe = self._process.stdout.fileno()
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while b"\n" not in self._unread:
            ready, _, _ = select.select([pipe], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise TimeoutError(f"no reply from {self.module} in {timeout_s:g} s")
            chunk = os.read(pipe, 1 << 16)
            if not chunk:
                self.close()
                raise ServerGone(f"{self.module} exited")
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        """Kill the server and everything it forked (its session's process group), and reap it."""
        if self._process is not None:
            if self._process.pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
            self._process.wait()
            self._process = None


class _Forked:
    """The caller's side of a server forked from another (``ServerProcess.start``'s sibling): what a
    ``subprocess.Popen`` offers the handle, with the pid the server says in its ready line, and its
    caller's child to wait for (a subreaper adopts it). Until it has said its pid, closing only closes its
    pipes: it reads the end of its requests and exits."""

    def __init__(self, stdin: IO[str], stdout: IO[str]) -> None:
        self.stdin, self.stdout = stdin, stdout
        self.pid: int | None = None

    def poll(self) -> int | None:
        if self.pid is None:
            return None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already, or not adopted: gone either way
            return -1
        return os.waitstatus_to_exitcode(status) if pid else None

    def kill(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> None:
        for pipe in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                pipe.close()
        if self.pid is not None:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
