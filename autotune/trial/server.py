"""Where trials start: a server that imports the heavy libraries once and forks each trial's ranks.

A trial in a fresh interpreter pays ``import torch``, Transformers' model module and PEFT every
time: over 4 seconds before a tiny model's first step on the bench's CPU, against a
quarter of a second forked (``bench/fixed_cost.py``). This server (``python -m autotune.trial.server``)
imports them once (the model's module, PEFT and an optimizer's library at the first trial that needs them:
see :func:`preload_libraries`), then for each
request line on stdin forks the trial's ranks, each running
exactly as ``python -m autotune.trial.child`` would (stdout and stderr to the trial's files, the
request's environment, and for several ranks what torchrun's agent would set: RANK, WORLD_SIZE,
MASTER_ADDR/PORT...), all in one new process group, and exiting without teardown; when one rank
fails the others are stopped, as torchrun stops them. The trial is still a process of
its own: its memory, its allocator, its CUDA context and its crash are its own, and the server,
which never touches CUDA or runs a step, stays clean for the next fork.

Protocol, one JSON line each way: ``{"spec", "out", "env", "cwd", "workload", "nproc"}`` in;
``{"pid"}`` (the ranks' process group) out as soon as they exist (so the runner can kill the
group on a timeout), then
``{"exit_code"}`` once it is reaped (negative: the signal that ended it); or ``{"error"}`` when
it cannot fork safely, and the runner starts trials in new interpreters from then on. It dies
with the process that started it.

The device probe (:mod:`autotune.trial.device_probe`) is forked the same way, for the same reason (its
new interpreter's ``import torch`` is most of its time): ``{"probe": [device type, what], "env"}`` in,
``{"pid"}`` (its process group) then ``{"probe": the JSON it measured, or null}`` out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any

from autotune.trial import fork_server
from autotune.trial.fork_server import Reply

__all__ = ["serve", "preload_libraries"]


def serve() -> None:
    fork_server.serve(_import_once, _answer)


def _import_once() -> None:
    import torch  # noqa: F401 - imported once here, inherited by every forked trial
    import transformers  # noqa: F401

    # What every Transformers model's module imports (PreTrainedModel, generation, masking): 2-3 CPU-s of a
    # trial server's first trial. Imported before the estimate server is forked from this one, it is imported
    # once for both, where each would import it at its first request.
    import transformers.modeling_utils  # noqa: F401

    import autotune.trial.child  # noqa: F401
    import autotune.trial.engine  # noqa: F401
    import autotune.trial.measure  # noqa: F401
    import autotune.trial.memory  # noqa: F401


def _answer(request: dict[str, Any], reply: Reply) -> None:
    if "probe" in request:
        _serve_probe(request, reply)
    else:
        _serve_one(request, reply)


def _serve_one(request: dict[str, Any], reply: Reply) -> None:
    from autotune.models.sources import import_model_module

    workload = request["workload"]
    import_model_module(workload["model"], trust_remote_code=bool(workload.get("trust_remote_code")))
    _preload_for_config(request["spec"])
    if not _can_fork(reply):
        return
    nproc = int(request.get("nproc", 1))
    ranks = _rank_envs(nproc)
    leader = 0
    pids = []
    server = os.getpid()
    for rank_env in ranks:
        pid = os.fork()
        if pid == 0:
            _run_trial_child(request, rank_env, group=leader, server=server)  # never returns
        leader = leader or pid
        with contextlib.suppress(PermissionError, ProcessLookupError):  # the child may have done it already
            os.setpgid(pid, leader)  # every rank in one new process group: killed whole on a timeout
        pids.append(pid)
    reply({"pid": leader})
    reply({"exit_code": _reap(pids, leader)})


def _can_fork(reply: Reply) -> bool:
    import torch

    if torch.cuda.is_initialized():  # some import did it anyway: a fork would inherit a dead context
        reply({"error": "CUDA was initialised in the trial server; trials start in new interpreters"})
        return False
    return True


def _serve_probe(request: dict[str, Any], reply: Reply) -> None:
    """Fork the device probe; its pid (process group) as soon as it exists, then what it measured."""
    from autotune.trial.device_probe import forked_probe

    if not _can_fork(reply):
        return
    device_type, what = request["probe"]
    measured = forked_probe(device_type, what, request["env"], forked=lambda pid: reply({"pid": pid}))
    reply({"probe": measured})


def _rank_envs(nproc: int) -> list[dict[str, str]]:
    """What torchrun's agent tells each rank of a one-node group (none for a single rank)."""
    from autotune.trial.rendezvous import one_node_ranks

    return [{}] if nproc == 1 else one_node_ranks(nproc)


def _reap(pids: list[int], group: int) -> int:
    """Wait for every rank; once one fails, stop the others (as torchrun does). The first failure's code."""
    first_failure = 0
    for _ in pids:
        _, status = os.waitpid(-1, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first_failure == 0:
            first_failure = code
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)  # the others would wait in a collective forever
    return first_failure


def _preload_for_config(spec_path: str) -> None:
    """Import what the trial's config needs here, once, before the first trial that needs it (see
    :func:`preload_libraries`): PEFT before the first LoRA trial."""
    from autotune.trial.spec import TrialSpec

    try:
        config = TrialSpec.read(spec_path).config
    except Exception:  # noqa: BLE001 - the trial itself will report what is wrong
        return
    preload_libraries(config, adapters=config.uses_lora)


def preload_libraries(config: Any, *, adapters: bool) -> None:
    """Import in a server that forks trials or estimates, once, what a child of ``config`` would import first:
    PEFT where it may make ``adapters`` (over half of the server's imports, which a study without LoRA would
    pay for nothing) and the optimizer's library; quietly (the child says what is missing).

    Not where a GPU is visible (NVML's answer: the servers set PYTORCH_NVML_BASED_CUDA_CHECK, so asking creates
    no context): bitsandbytes, which PEFT and Transformers' Adafactor import, initialises CUDA as it imports (its
    library's lookup asks each GPU's compute capability). The trial server would then fork no more, and a trace
    forked after it could not run on fake CUDA tensors; each child imports them itself there.
    """
    import torch

    from autotune.levers.optimizer import import_optimizer_module

    if torch.cuda.is_available():
        return
    if adapters and "peft" not in sys.modules:
        with contextlib.suppress(ImportError):
            import peft  # noqa: F401
    import_optimizer_module(config)


def _run_trial_child(request: dict[str, Any], rank_env: dict[str, str], group: int, server: int) -> None:
    """In the forked child: become a trial process (one rank), run it, exit with its code."""
    code = 1
    try:
        from autotune.trial.lifeline import (
            PARENT_PID_ENV,
            TRIAL_PROCESS_NAME,
            die_with_parent,
            name_process,
        )

        # First of all, and against the server's pid taken before the fork: a server killed from here
        # on must take this trial along. Asked later, getppid() would name the reaper that adopted us.
        die_with_parent(server)
        os.setpgid(0, group)  # the first rank leads a new group, the others join it
        name_process(TRIAL_PROCESS_NAME)
        out = request["out"]
        for fd, name, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, os.path.join(out, "stdout.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND),
            (2, os.path.join(out, "stderr.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        ):
            target = os.open(name, flags, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # the server's stream objects are not ours
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(rank_env)
        os.environ[PARENT_PID_ENV] = str(server)  # the trial dies with the server
        _look_like_a_new_interpreter(request["cwd"])
        sys.argv = ["autotune.trial.child", request["spec"], out]

        from autotune.trial.child import main

        code = main([request["spec"], out])
    except BaseException:  # noqa: BLE001 - whatever happened, this process must not return to the server loop
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # no teardown: the trial's finalisers are not worth waiting (or crashing) for


def _look_like_a_new_interpreter(cwd: str) -> None:
    """The runner's working directory and import path, as ``python -m autotune.trial.child`` started there
    would have them: a factory ``module:function`` is imported from the current directory or
    PYTHONPATH, and both may differ from the server's (a test's ``monkeypatch.setenv``, for one)."""
    import importlib

    os.chdir(cwd)
    extra = [cwd] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    importlib.invalidate_caches()  # directories the server listed may have changed since


if __name__ == "__main__":
    from autotune.trial.lifeline import die_with_parent

    die_with_parent()
    serve()
