"""Where estimates run: a server process that imports the heavy libraries once and forks per estimate.

A traced estimate leaves its process unfit for another (fake tensors, PEFT and some models'
code leave state that can crash a later trace), so each estimate needs a fresh process, and
starting one from scratch pays PyTorch's, Transformers' and PEFT's imports every time. This
server (``python -m autotune.estimate.worker``) imports them once, then for each request line
on stdin forks a child that traces, writes its answer to a pipe and exits without teardown;
the server relays one JSON line per request on stdout. It dies with the process that started it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["serve"]


def serve() -> None:
    # A CUDA context does not survive fork, and an estimate for a CUDA workload traces on fake CUDA
    # tensors (which make one): nothing here may create one. torch.cuda.is_available(), which some
    # imports call, then asks NVML instead of initialising the CUDA driver.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import peft  # noqa: F401 - imported once here, inherited by every forked estimate
    import torch  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
    from transformers import (  # noqa: F401
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    import autotune.trial.engine  # noqa: F401
    import autotune.trial.memory  # noqa: F401

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # model code's stray prints must not land in the replies
    for line in sys.stdin:
        if line.strip():
            replies.write(json.dumps(_estimate_in_child(json.loads(line))) + "\n")
            replies.flush()


def _estimate_in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Fork; the child estimates and writes {"ok": ...} or {"error": ...} to a pipe, then exits."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        with os.fdopen(write_end, "w") as out:
            out.write(json.dumps(_estimate(request)))
        os._exit(0)  # skip teardown: the traced state's finalisers are not worth waiting (or crashing) for
    os.close(write_end)
    with os.fdopen(read_end) as reply:
        text = reply.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"error": f"the estimate's process died ({_describe(status)})"}
    return json.loads(text)


def _estimate(request: dict[str, Any]) -> dict[str, Any]:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.estimator import estimate_memory

    try:
        result = estimate_memory(Workload.from_dict(request["workload"]), TrialConfig.from_dict(request["config"]),
                                 task=request.get("task"), pytorch1_step=bool(request.get("pytorch1_step")))
    except Exception as exc:  # the caller raises it as an EstimateError
        message = (str(exc).strip().splitlines() or [""])[-1]
        return {"error": f"{type(exc).__name__}: {message}"}
    return {"ok": result.to_dict()}


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


if __name__ == "__main__":
    from autotune.trial.lifeline import die_with_parent

    die_with_parent()
    serve()
