"""Memory inside a trial: the budget, enforced for real, and the peak, measured.

On CUDA the caching allocator is capped with ``set_per_process_memory_fraction`` and peaks come
from its statistics. On a CPU there is no allocator to ask, so :class:`LiveBytesTracker` counts
the bytes of every tensor storage alive and raises ``torch.OutOfMemoryError`` when they pass the
budget: the same exception, so the same out-of-memory path, as a real device OOM, with the CPU
allocator's own wording, so other tools' OOM matchers recognise it too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from types import FrameType
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

__all__ = [
    "LiveBytesTracker",
    "storages_of",
    "limit_cuda_memory",
    "cuda_peaks",
    "cuda_memory_history",
    "MEMORY_HISTORY_ENV",
    "MEMORY_HISTORY_ENTRIES",
]

# Opt-in, CUDA only: a trial's caching-allocator history, written where this names (see cuda_memory_history).
MEMORY_HISTORY_ENV = "AUTOTUNE_CUDA_MEMORY_HISTORY"
# The history's ring buffer: the last this many allocator events are kept (alloc, free, segment events; each with
# its Python frames: a few KB in memory). A 3B Llama's step makes some thousands.
MEMORY_HISTORY_ENTRIES = 100_000


class LiveBytesTracker(TorchDispatchMode):
    """Counts live tensor-storage bytes on the CPU, keeps the peak, enforces an optional budget.

    Each new storage an operator returns is counted once (views share their base's storage) and
    uncounted when Python finalises it. Unlike PyTorch's ``MemTracker`` it keeps no module
    state, so activation checkpointing's re-entered forward does not trip it.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counted: weakref.WeakKeyDictionary[torch.UntypedStorage, list[int]] = weakref.WeakKeyDictionary()
        # The autograd engine's last sum of two gradients, not counted yet (see _engine_sum): the sum's storage
        # and the counters of its terms.
        self._pending_sum: tuple[torch.UntypedStorage, list[list[int]]] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._engine_sum(func, args, out):
            return out
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                for storage in storages_of(leaf):
                    self._count(storage)
        return out

    def __enter__(self) -> LiveBytesTracker:
        # FSDP frees a gathered parameter by resizing its storage to 0 bytes and re-grows it for the
        # next gather: storage methods, which no dispatch mode sees. Counted here, or every layer
        # once gathered would read as live until the end.
        tracker, resize = self, torch.UntypedStorage.resize_

        def counted_resize(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            if storage in tracker._counted:  # one a counted tensor owns (a fake tensor's is on meta)
                tracker._count(storage)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = counted_resize  # type: ignore[method-assign,assignment]  # while tracking
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _engine_sum(self, func: Any, args: Any, out: Any) -> bool:
        """Whether ``out`` is the autograd engine's sum of two gradients for one input, held back to be
        counted as the engine sums them when no dispatch mode is on.

        The engine (``InputBuffer::accumulate``) adds each new gradient for an input, a tied weight's from
        each of its uses or a residual stream's from each branch, into the one it holds: in place when it
        holds the only reference to it, out of place when not, and always out of place while any dispatch
        mode is on (``isTensorSubclassLike``), this one included. A tied LM head run in eight slices then
        holds three weight-sized gradients at once where the user's job holds two. So the sum is counted
        when the engine drops a term, which it does at once where it summed in place (the sum then takes the
        term's bytes); any allocation before that counts it where it stands, as out of place.
        """
        if (
            func is not torch.ops.aten.add.Tensor
            or torch.is_grad_enabled()
            or not isinstance(out, torch.Tensor)
            or len(args) != 2
            or not all(
                isinstance(term, torch.Tensor)
                and term.shape == out.shape
                and term.dtype == out.dtype
                and term.is_contiguous()
                for term in args
            )
            or not _dispatched_by_the_engine()
        ):
            return False
        terms = [self._counted.get(storage) for term in args for storage in storages_of(term)]
        counted_terms = [counter for counter in terms if counter is not None]
        if len(counted_terms) != len(terms):
            return False
        self._pending_sum = (out.untyped_storage(), counted_terms)
        return True

    def _count_pending_sum(self) -> None:
        if self._pending_sum is not None:
            storage, self._pending_sum = self._pending_sum[0], None
            self._count(storage)

    def _count(self, storage: torch.UntypedStorage) -> None:
        self._count_pending_sum()  # an allocation before the engine let go of a term: it summed out of place
        size = storage.nbytes()
        counted = self._counted.get(storage)
        if counted is None:
            counted = [0]
            self._counted[storage] = counted
            weakref.finalize(storage, self._release, counted)
        if size != counted[0]:  # new, or resized in place
            grown = size - counted[0]
            self.live_bytes += grown
            counted[0] = size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            # Checked on every growth, not only at a new peak: code that catches the OOM and tries
            # again in this process (a batch-size finder) must meet the budget, not the old overshoot.
            if grown > 0 and self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
                message = _budget_exceeded_message(grown, live_bytes=self.live_bytes, budget_bytes=self.budget_bytes)
                # As an allocator's failed request, the bytes are not live (the peak keeps what was
                # asked for): the tensor lives on in the exception's frames, and a handler that
                # allocates a little before it lets go (Lightning's finder does) must not OOM again.
                self.live_bytes -= grown
                counted[0] -= grown
                raise torch.OutOfMemoryError(message)

    def _release(self, counted: list[int]) -> None:
        self.live_bytes -= counted[0]
        counted[0] = 0
        if self._pending_sum is not None and any(term is counted for term in self._pending_sum[1]):
            self._count_pending_sum()  # in the dropped term's bytes, as the engine's add_ would have


# Where backward() enters the autograd engine: the nearest Python frame of the ops the engine dispatches.
_ENGINE_ENTRY = torch.autograd.graph._engine_run_backward.__code__


# The wrappers torch puts around a dispatch mode's __torch_dispatch__ (dynamo's disable): their frames are skipped.
_DISPATCH_WRAPPERS = (os.path.join("torch", "_dynamo", "eval_frame.py"), os.path.join("torch", "_compile.py"))


def _dispatched_by_the_engine() -> bool:
    """Whether the op in dispatch now was dispatched by the autograd engine itself (from C++, beneath
    backward's Python entry), not by Python code: a hook, a checkpoint's recompute, an optimizer."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "__torch_dispatch__":
        frame = frame.f_back
    while frame is not None and (
        frame.f_code.co_name == "__torch_dispatch__" or frame.f_code.co_filename.endswith(_DISPATCH_WRAPPERS)
    ):
        frame = frame.f_back
    return frame is not None and frame.f_code is _ENGINE_ENTRY


def storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s bytes. A wrapper subclass (FSDP's DTensor) owns no bytes
    of its own: its inner tensors (a rank's shard) do, and the wrapper's storage would read as the
    whole unsharded tensor."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        inner = [getattr(tensor, name) for name in names]
        return [storage for t in inner if isinstance(t, torch.Tensor) for storage in storages_of(t)]
    return [tensor.untyped_storage()]


def _budget_exceeded_message(requested: int, *, live_bytes: int, budget_bytes: int) -> str:
    """The tracker's OOM message. It opens with the CPU allocator's own words, which the batch
    size finders of Lightning (``is_oom_error``) and Accelerate (``should_reduce_batch_size``)
    match, so code that handles a real CPU OOM handles this one too."""
    return (
        f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {requested} bytes "
        f"(autotune's CPU memory budget exceeded: {live_bytes} bytes of live tensors "
        f"> --memory-budget {budget_bytes} bytes)"
    )


def limit_cuda_memory(budget_bytes: int, device: torch.device) -> None:
    """Cap this process's CUDA caching allocator at ``budget_bytes`` (raises OOM beyond it)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), device)


def cuda_peaks(device: torch.device) -> tuple[int, int]:
    """(peak allocated, peak reserved) bytes of this process on ``device``."""
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


@contextlib.contextmanager
def cuda_memory_history(device: torch.device, record: dict[str, Any]) -> Iterator[None]:
    """With ``AUTOTUNE_CUDA_MEMORY_HISTORY=PATH`` set, record the CUDA caching allocator's history while inside
    (``torch.cuda.memory._record_memory_history``: every allocation's Python frames, the last
    ``MEMORY_HISTORY_ENTRIES`` events) and write its snapshot to PATH as it ends, however it ends
    (``torch.cuda.memory._dump_snapshot``: a pickle that pytorch.org/memory_viz opens; ranks other than 0 add
    ``.rank<R>``). ``record["memory_history"]`` says where, or why nothing was written.

    A debugging aid for a bench (``bench/gpu_check.py``), never on by default: the frames cost a few microseconds
    an allocation. Inert on any other device: a CPU trial has no caching allocator to record (it says so in the
    record, and runs as without it)."""
    path = os.environ.get(MEMORY_HISTORY_ENV)
    if not path:
        yield
        return
    if device.type != "cuda":
        record["memory_history"] = f"not recorded: {MEMORY_HISTORY_ENV} records CUDA's allocator, not {device.type}'s"
        yield
        return
    rank = os.environ.get("RANK", "0")
    path = path if rank == "0" else f"{path}.rank{rank}"
    memory = torch.cuda.memory
    memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=MEMORY_HISTORY_ENTRIES)
    try:
        yield
    finally:
        try:
            memory._dump_snapshot(path)
            record["memory_history"] = path
        except Exception as exc:  # noqa: BLE001 - the trial's own outcome stands; the record says why
            record["memory_history"] = f"not written: {type(exc).__name__}: {exc}"
        finally:
            memory._record_memory_history(enabled=None)
