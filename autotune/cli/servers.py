"""The servers trials and estimates run in, started before the checks that precede the first trial
(trial, find, tune) or estimate (the estimate command).

In the command's own process (:func:`autotune.cli.app.run`), the trial server is a fork of the command once
the command has imported torch and Transformers, which its checks need next (the device, the model's
facts): one import of them for the command and its servers, where a new interpreter would import them
again. Elsewhere (``main`` called from another program's process, whose threads a fork would not copy) the
server is a new interpreter whose imports overlap the checks.
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["start_trial_server", "start_estimate_server", "this_is_the_command"]

_COMMAND_PID: list[int] = []  # the process autotune.cli.run started in


def this_is_the_command() -> None:
    """Mark this process as the command's own (called by :func:`autotune.cli.app.run`): its servers may be
    forked from it."""
    _COMMAND_PID[:] = [os.getpid()]


def start_trial_server(*, estimate: bool = False) -> None:
    """Trials will run in this process: start their server now; with ``estimate``, the estimate server's too
    (the tuner's device probe waits for both), forked from the trial server once its imports are done."""
    from autotune.trial.runner import start_trial_server as start

    forked = _imported_for_a_fork()
    if estimate:
        from autotune.estimate.client import estimate_server_process

        start(sibling=estimate_server_process(), forked=forked)
    else:
        start(forked=forked)


def start_estimate_server() -> None:
    """Estimates will run in this process, and no trial (the estimate command): start their server now, forked
    from this process where it may be (as the trial server is)."""
    from autotune.estimate.client import start_estimate_server as start

    start(forked=_imported_for_a_fork())


def _imported_for_a_fork() -> bool:
    """Whether the trial server may be forked from this process, with torch and Transformers imported here
    first: the command's own process, on Linux (where a server dies with its command), with one thread, and no
    CUDA context (which a fork does not keep)."""
    if _COMMAND_PID != [os.getpid()] or not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    # As the server's own imports do (autotune.trial.fork_server.serve): an import that asks whether CUDA is
    # available asks NVML, and does not initialise the driver.
    nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        import torch
        import transformers  # noqa: F401 - imported here for the command and the server both
    finally:
        if nvml is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml
    return not torch.cuda.is_initialized() and threading.active_count() == 1
