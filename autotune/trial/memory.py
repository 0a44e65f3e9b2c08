"""Memory inside a trial: the budget, enforced for real, and the peak, measured.

On CUDA the caching allocator is capped with ``set_per_process_memory_fraction`` and peaks come
from its statistics. On a CPU there is no allocator to ask, so :class:`LiveBytesTracker` counts
the bytes of every tensor storage alive and raises ``torch.OutOfMemoryError`` when they pass the
budget: the same exception, so the same out-of-memory path, as a real device OOM, with the CPU
allocator's own wording, so other tools' OOM matchers recognise it too.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytesTracker", "storages_of", "limit_cuda_memory", "cuda_peaks"]


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

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
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

    def _count(self, storage: torch.UntypedStorage) -> None:
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
