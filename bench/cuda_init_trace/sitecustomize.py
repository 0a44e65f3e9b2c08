"""Which process made a CUDA context, and which forked after it: a harness for a lent GPU, no part of autotune.

A trace forked from a process that made a CUDA context cannot use CUDA ("Cannot re-initialize CUDA in forked
subprocess"); autotune's servers must never make one. With this folder first on PYTHONPATH, every Python process
started (the test's, the trial and estimate servers, torchrun's ranks) appends to $AUTOTUNE_CUDA_INIT_LOG:

- ``init``: the first CUDA initialisation of a process, with its pid, parent, command line and stack;
- ``fork``: a fork made by a process that had initialised CUDA (the fault), with the stack that forked.

    AUTOTUNE_CUDA_INIT_LOG=/tmp/cuda_init.log PYTHONPATH=bench/cuda_init_trace:$PYTHONPATH python3 -m pytest ...

Forked children inherit the patch: they need no second import of this file.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import traceback

_LOG = os.environ.get("AUTOTUNE_CUDA_INIT_LOG")


def _write(kind: str, stack: list[str]) -> None:
    with open(_LOG, "a") as log:  # type: ignore[arg-type]
        log.write(f"== {kind} pid {os.getpid()} parent {os.getppid()} argv {sys.argv[:4]}\n{''.join(stack[-14:])}\n")


def _patch(cuda: object) -> None:
    original = cuda._lazy_init  # type: ignore[attr-defined]

    def lazy_init() -> None:
        if not cuda.is_initialized():  # type: ignore[attr-defined]
            _write("init", traceback.format_stack()[:-1])
        original()

    cuda._lazy_init = lazy_init  # type: ignore[attr-defined]

    def after_fork_in_parent() -> None:
        if cuda.is_initialized():  # type: ignore[attr-defined]
            _write("fork after init", traceback.format_stack()[:-1])

    os.register_at_fork(after_in_parent=after_fork_in_parent)


class _AfterTorchCuda(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torch.cuda":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _LOG:
    sys.meta_path.insert(0, _AfterTorchCuda())
