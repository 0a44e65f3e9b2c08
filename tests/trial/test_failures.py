import signal

import pytest
import torch

from autotune.trial.failures import (
    NonFiniteLossError,
    classify_exception,
    classify_exit,
    describe_exit,
)
from autotune.trial.result import TrialStatus


def _raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        try:
            if cause is not None:
                raise cause
        finally:
            raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


@pytest.mark.parametrize(
    "exc, status",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), TrialStatus.OOM),
        (MemoryError(), TrialStatus.OOM),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"), TrialStatus.OOM),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"), TrialStatus.OOM),
        (NonFiniteLossError("the training loss is nan"), TrialStatus.NAN),
        (ValueError("bad"), TrialStatus.ERROR),
        (RuntimeError("an error that mentions memory but is not an allocator failure"), TrialStatus.ERROR),
        (KeyboardInterrupt(), TrialStatus.ERROR),
    ],
)
def test_classify_by_exception_type(exc, status):
    assert classify_exception(exc) is status


def test_an_oom_wrapped_by_a_library_is_still_an_oom():
    wrapped = _raised(RuntimeError("engine step failed"), cause=torch.OutOfMemoryError("out of memory"))
    assert classify_exception(wrapped) is TrialStatus.OOM


def test_exit_classification():
    assert classify_exit(-signal.SIGSEGV, timed_out=False) is TrialStatus.CRASHED
    assert classify_exit(-signal.SIGKILL, timed_out=True) is TrialStatus.TIMEOUT
    assert "SIGSEGV" in describe_exit(-signal.SIGSEGV)
    assert "OOM killer" in describe_exit(-signal.SIGKILL)
    assert "status 3" in describe_exit(3)
