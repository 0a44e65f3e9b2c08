"""Classifying how a trial ended, from the exception type first and the exit signal second.

Pure functions, tested on their own; no grepping of stderr.
"""

from __future__ import annotations

import signal
from typing import Iterator

from autotune.trial.result import TrialStatus

__all__ = ["NonFiniteLossError", "classify_exception", "classify_exit", "describe_exit"]

# Allocator failures that some libraries raise as a plain RuntimeError rather than as
# torch.OutOfMemoryError (cuBLAS/cuDNN workspace allocation, the CPU allocator).
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


class NonFiniteLossError(ArithmeticError):
    """The training loss became NaN or infinite."""


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def classify_exception(exc: BaseException) -> TrialStatus:
    """The status of a trial that raised ``exc`` (its cause chain included)."""
    import torch  # the child has it loaded already

    chain = list(_chain(exc))
    if any(isinstance(e, torch.OutOfMemoryError) for e in chain):
        return TrialStatus.OOM
    if any(isinstance(e, MemoryError) for e in chain):  # the host ran out of RAM
        return TrialStatus.OOM
    if any(isinstance(e, RuntimeError) and any(m in str(e) for m in _OOM_MESSAGES) for e in chain):
        return TrialStatus.OOM
    if any(isinstance(e, NonFiniteLossError) for e in chain):
        return TrialStatus.NAN
    return TrialStatus.ERROR


def classify_exit(returncode: int, *, timed_out: bool) -> TrialStatus:
    """The status of a trial process that left no result of its own."""
    if timed_out:
        return TrialStatus.TIMEOUT
    return TrialStatus.CRASHED


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer sends this when the host runs out of RAM)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exited with status {returncode} without writing a result"
