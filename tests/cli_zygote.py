"""A warm interpreter that runs ``python -m autotune`` as forks of itself, for the suite's commands
(:func:`commands.autotune`).

Every command a test runs is a process of its own: its exit status, its output, its servers and trials are the
real ones. A new interpreter spends its first 4-5 CPU-s importing PyTorch, Transformers and the rest (seconds on a
2-core machine, over every command of the suite: minutes). This server imports them once, then forks per request
and runs the command in the fork as ``python -m autotune`` would: ``runpy``, the request's argv, working directory,
environment and cores, stdin from /dev/null, stdout and stderr into the request's files, and the interpreter's own
exit steps (thread joins, atexit handlers) at the end, but for tearing down every module (see :func:`_exit`).

Protocol: one JSON line each way per message. The server says ``{"ready": 1}`` once its imports are done; for each
request (``{"id": I, "args": [...], ...}``) it answers ``{"request": I, "pid": N}`` as the command starts and
``{"pid": N, "returncode": R}`` as it ends (negative: killed by a signal, as :mod:`subprocess` reports it).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import sys
from typing import Any


def _import_once() -> None:
    # What every command imports before its first trial or estimate (autotune.cli.servers forks its servers from
    # a command with these imported): the CLI, PyTorch, Transformers and its modeling base, Optuna's storage.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # no CUDA context, which a fork would not keep
    # The CLI first: it quiets the libraries' import-time warnings, as a command does. alembic: Optuna's RDB
    # storage imports it as it opens a study.
    for module in ("autotune.cli", "autotune.output.render", "autotune.search.tuner", "alembic.context", "optuna"):
        importlib.import_module(module)
    for module in ("torch", "transformers", "transformers.modeling_utils"):
        importlib.import_module(module)
    del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]


def _serve() -> dict[str, Any]:
    """Answer requests until stdin closes (then exit); return a request only in the fork that runs it. Commands
    run side by side (a test may start one, then another beside it): the loop forks each as it comes and reaps
    each as it ends."""
    from autotune.trial.lifeline import die_with_parent

    die_with_parent()
    _import_once()
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints must not land in the replies

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    gc.freeze()  # the imports' objects: the forks' collections never visit them, nor copy their pages
    reply({"ready": 1})
    running: set[int] = set()
    pending = b""
    while True:
        if select.select([0], [], [], 0.05 if running else None)[0]:
            read = os.read(0, 1 << 16)
            if not read:
                sys.exit(0)  # the caller is gone: what runs goes on, as a subprocess would
            pending += read
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    replies.close()
                    return request
                running.add(pid)
                reply({"request": request["id"], "pid": pid})
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _become_the_command(request: dict[str, Any]) -> None:
    """In the fork: take the request's process state, as a new interpreter started with it would have it."""
    import tempfile

    import torch

    from autotune.trial.cpu_cores import use_cores

    stdin = os.open(os.devnull, os.O_RDONLY)
    stdout = os.open(request["stdout"], os.O_WRONLY)
    stderr = os.open(request["stderr"], os.O_WRONLY)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # python -m puts its working directory first
    importlib.invalidate_caches()  # directories listed before may have changed
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # read again from TMPDIR
    cores = request["cores"]
    if cores:
        use_cores(cores, len(cores), torch)  # as many torch threads as torch starts with on these cores


def _run(args: list[str]) -> int:
    """``python -m autotune ARGS``, and the exit status the interpreter would give it."""
    import runpy

    sys.argv = ["autotune", *args]
    try:
        runpy.run_module("autotune", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit(code: int) -> None:
    """Exit as the interpreter does (threads joined, atexit handlers run, output flushed), but for tearing down
    every module: in a fork, that would touch, and so copy, every page the warm interpreter shares with it."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    command = _serve()
    _become_the_command(command)
    _exit(_run(command["args"]))
