"""The estimate server's traces, each in a child forked from it, as many at once as there are cores.

A trace is one core's work. :class:`TraceChildren` keeps the children of traces under way; the server starts
one whenever a core is free and reads what each child writes as it writes it, so that a child is never held
up by a full pipe while the server waits on another. Children started for what the caller will ask next run
on while the server answers the request in hand (see :meth:`autotune.estimate.worker._Traces.get_all`).

A child traces, writes the traced step (or why it failed) to a pipe as JSON and exits without teardown. One
that also traces an update twin forks once more as its update begins (see
:func:`autotune.estimate.trace.trace_step`'s ``fork_update``): its own child writes the twin's step to a second
pipe, and is waited for before the first exits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
from typing import Any

__all__ = ["TraceChildren", "TraceFailed", "one_line", "traced_in_children"]


class TraceFailed(Exception):
    """A trace's exception, in words (it happened in the child)."""


def one_line(exc: BaseException) -> str:
    message = (str(exc).strip().splitlines() or [""])[-1]
    return f"{type(exc).__name__}: {message}"


@dataclasses.dataclass
class _Child:
    """A trace under way: its process, and what each of its pipes has said so far (the first its own step's,
    the second, where it has one, its update twin's)."""

    pid: int
    key: str
    twin_key: str | None
    said: dict[int, bytearray]
    open: list[int]

    def results(self, status: int) -> list[tuple[str, Any]]:
        """``(key, traced step or the TraceFailed that says why not)``, then the twin's where it was traced."""
        from autotune.estimate.results import TracedStep

        own, *twin = (bytes(text) for text in self.said.values())
        if not own:
            answer: Any = TraceFailed(f"the estimate's process died ({_describe(status)})")
        else:
            result = json.loads(own)
            answer = TracedStep.from_dict(result["ok"]) if "ok" in result else TraceFailed(result["error"])
        results = [(self.key, answer)]
        twin_result = json.loads(twin[0]) if twin and twin[0] else {}
        if self.twin_key is not None and "ok" in twin_result:  # a twin whose trace failed is traced when asked for
            results.append((self.twin_key, TracedStep.from_dict(twin_result["ok"])))
        return results


class TraceChildren:
    """The children of traces under way, at most ``at_once`` (the cores) of them."""

    def __init__(self, at_once: int | None = None) -> None:
        self.at_once = at_once or max(1, os.cpu_count() or 1)
        self._running: dict[str, _Child] = {}
        self._twins: set[str] = set()

    def __contains__(self, key: str) -> bool:
        """Whether the step of ``key`` is being traced (by its own child, or as an update twin)."""
        return key in self._running or key in self._twins

    def __len__(self) -> int:
        return len(self._running)

    @property
    def free(self) -> int:
        return self.at_once - len(self._running)

    def start(
        self,
        key: str,
        workload: Any,
        config: Any,
        task: str | None,
        measured_with: Any,
        *,
        pipeline_rank: int | None = None,
        twin_key: str | None = None,
    ) -> None:
        """Fork a child that traces ``config``'s step for ``key``; with ``twin_key``, also its update twin's."""
        pid, pipes = _fork_trace(workload, config, task, measured_with, pipeline_rank, twin_key is not None)
        self._running[key] = _Child(pid, key, twin_key, {fd: bytearray() for fd in pipes}, list(pipes))
        if twin_key is not None:
            self._twins.add(twin_key)

    def wait(self) -> list[tuple[str, Any]]:
        """Wait until a child has more to say, and read it: ``(key, traced step or TraceFailed)`` of each child
        done by then (none if none is), its twin's beside it."""
        by_pipe = {fd: child for child in self._running.values() for fd in child.open}
        ready, _, _ = select.select(list(by_pipe), [], [])
        results = []
        for fd in ready:
            child = by_pipe[fd]
            chunk = os.read(fd, 1 << 20)
            if chunk:
                child.said[fd] += chunk
                continue
            os.close(fd)
            child.open.remove(fd)
            if not child.open:  # both pipes closed: the child has written all and exits (its twin first)
                _, status = os.waitpid(child.pid, 0)
                del self._running[child.key]
                self._twins.discard(child.twin_key or "")
                results += child.results(status)
        return results


def traced_in_children(traces: list[tuple[Any, Any, str | None, Any, int | None]]) -> list[Any]:
    """Each ``(workload, config, task, measured_with, pipeline_rank)``'s traced step, in order, or the
    :class:`TraceFailed` that says why not: traced in children, as many at once as there are cores."""
    children = TraceChildren()
    done: dict[str, Any] = {}
    waiting = list(enumerate(traces))
    while waiting or len(children):
        while waiting and children.free:
            index, (workload, config, task, measured_with, pipeline_rank) = waiting.pop(0)
            children.start(str(index), workload, config, task, measured_with, pipeline_rank=pipeline_rank)
        done.update(children.wait())
    return [done[str(index)] for index in range(len(traces))]


def _fork_trace(
    workload: Any, config: Any, task: str | None, measured_with: Any, pipeline_rank: int | None, with_twin: bool
) -> tuple[int, list[int]]:
    """Fork a child that traces (see the module); returns its pid and the read ends of its pipes."""
    read_end, write_end = os.pipe()
    twin_read, twin_write = os.pipe() if with_twin else (-1, -1)
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        if with_twin:
            os.close(twin_read)
        out, forked = [write_end, twin_write], []

        def fork_update() -> bool:
            """Fork; True in the new process, which writes the twin's step from here on. Not where this trace has
            made a CUDA context (a GPU here: the card's properties, a kernel's capability check): torch refuses to
            initialise CUDA again in a fork, so the twin could not trace there. Its pipe is closed unwritten, and
            the twin is traced in a child of its own when asked for."""
            import torch  # the trace has imported it

            if torch.cuda.is_initialized():
                os.close(out.pop())
                return False
            branch = os.fork()
            if branch == 0:
                os.close(out.pop(0))
                return True
            forked.append(branch)
            os.close(out.pop())
            return False

        result = _trace(workload, config, task, measured_with, pipeline_rank, fork_update if with_twin else None)
        with os.fdopen(out[0], "w") as pipe:
            pipe.write(json.dumps(result))
        for branch in forked:  # the twin's process: written and gone before this one is
            os.waitpid(branch, 0)
        os._exit(0)  # skip teardown: the traced state's finalisers are not worth waiting (or crashing) for
    os.close(write_end)
    if with_twin:
        os.close(twin_write)
    return pid, [read_end, twin_read] if with_twin else [read_end]


def _trace(
    workload: Any, config: Any, task: str | None, measured_with: Any, pipeline_rank: int | None, fork_update: Any
) -> dict[str, Any]:
    from autotune.estimate.trace import trace_step

    try:
        traced = trace_step(
            workload,
            config,
            task=task,
            measured_with=measured_with,
            pipeline_rank=pipeline_rank,
            fork_update=fork_update,
        )
        return {"ok": traced.to_dict()}
    except Exception as exc:
        return {"error": one_line(exc)}


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"
