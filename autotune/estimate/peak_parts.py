"""The estimate's live-bytes tracker: the CPU trials' own (:class:`autotune.trial.memory.LiveBytesTracker`), on
fake tensors of any device, that also says whose bytes made the peak, counts each operator's FLOPs and costs,
and records the allocations a CUDA allocator would be asked for.

Imports torch and DTensor as it loads: import it where a trace runs (the estimate server does, once, before
it forks its traces).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from autotune.estimate.results import MODEL_STATES
from autotune.estimate.step_costs import CostRecorder, counted_flops
from autotune.trial.memory import LiveBytesTracker, storages_of

__all__ = ["PeakPartsTracker", "local_shard"]


def local_shard(value: Any) -> Any:
    # The shard itself, not to_local()'s view of it (an autograd function and a dispatch per DTensor,
    # a fifth of a tensor-parallel trace): the same shape, dtype and storage.
    return value._local_tensor if isinstance(value, DTensor) else value


class PeakPartsTracker(LiveBytesTracker):
    """The CPU trials' live-bytes tracker, on every device, that also says whose bytes made its peak.

    Storages are tagged when they become parameters, gradients or optimizer state, and as
    activations when the forward allocates them (what it leaves behind is what the backward
    needs); each new peak copies the live bytes of every tag, so the parts of the peak are what
    was live at that moment and the untagged rest is the temporaries.
    """

    def __init__(self) -> None:
        super().__init__(None)
        self.live = dict.fromkeys((*MODEL_STATES, "activations"), 0)
        self.at_peak = dict(self.live)
        self.in_forward = False
        self._tags: dict[int, str] = {}  # id of the per-storage counter -> tag
        # FLOPs of the matmul-class ops PyTorch's flop counter knows, while asked. Counted here,
        # not under FlopCounterMode: its module hooks change what checkpointing keeps (measured:
        # a checkpointed GPT-2 then traced twice its real peak).
        self.count_flops = False
        self.flops = 0
        # Every operator's FLOPs and bytes while a phase is set: what the step-time model needs.
        self.costs = CostRecorder(self._model_state)
        # Whether ops may come on DTensors (a step traced on a process group: FSDP, tensor or pipeline
        # parallel): only then is each op looked over for them, a cost on every op of the trace.
        self.sees_dtensors = False
        # The storages' allocations and frees in order, (key, new size; 0: freed), once asked:
        # what the CUDA caching allocator would be asked for (estimate.cuda_memory replays it). An allocation
        # made on a stream other than the default one (FSDP2's all-gather copy-in and reduce-scatter streams,
        # entered with ``device_handle.stream(...)`` in _fsdp_collectives.foreach_all_gather / foreach_reduce)
        # carries that stream's number third: the caching allocator caches its block for that stream alone.
        self.events: list[tuple[int, int] | tuple[int, int, int]] | None = None
        self._default_streams: dict[str, Any] = {}  # device type -> its default stream, as recording starts
        self._stream_numbers: dict[tuple[str, int], int] = {}  # a side stream -> its number in events (1, 2, ...)
        self._keys: dict[int, int] = {}  # id of the per-storage counter -> its key in events
        self.marks: dict[str, int] = {}  # phase -> where its events begin
        self.peak_before: dict[str, tuple[int, dict[str, int]]] = {}  # phase -> the peak before it, its parts
        self._next_key = 0
        # Storages made in host memory while the device's are counted (activation offload's copies): never counted.
        self._host: weakref.WeakSet[Any] = weakref.WeakSet()
        self._on_host = 0
        # Storages made inside one fused kernel's stand-in: counted at its end, if they outlive it.
        self._in_kernel: weakref.WeakKeyDictionary[Any, None] = weakref.WeakKeyDictionary()  # in their order
        self._kernel_depth = 0

    @contextlib.contextmanager
    def one_kernel(self) -> Iterator[None]:
        """What is traced inside runs as one kernel on the device: the storages it makes and frees again are
        never live outside it; those it keeps are counted when it ends."""
        self._kernel_depth += 1
        self.costs.begin_kernel()
        try:
            yield
        finally:
            self._kernel_depth -= 1
            if not self._kernel_depth:
                self.costs.end_kernel()
                kept, self._in_kernel = list(self._in_kernel), weakref.WeakKeyDictionary()
                for storage in kept:
                    self._count(storage)

    @contextlib.contextmanager
    def on_host(self) -> Iterator[None]:
        """The storages first seen inside are host memory: not the device's bytes."""
        self._on_host += 1
        try:
            yield
        finally:
            self._on_host -= 1

    def start_recording(self) -> None:
        """From now on, record; the storages live now are allocated first, in the order they were made."""
        self.events = []
        self._default_streams = {"cpu": torch.cpu.current_stream()}
        if torch.cuda.is_available():
            self._default_streams["cuda"] = torch.cuda.default_stream()
        for counter in list(self._counted.values()):
            if counter[0] > 0:
                self._record(counter)

    def mark(self, phase: str) -> None:
        """``phase`` begins here: in the recorded events (when recording), and in ``peak_before``,
        the peak so far and its parts."""
        self.peak_before[phase] = (self.peak_bytes, dict(self.at_peak))
        if self.events is not None:
            self.marks[phase] = len(self.events)

    def _record(self, counter: list[int], *, made_now: bool = False) -> None:
        key = self._keys.get(id(counter))
        if key is None:
            key = self._keys[id(counter)] = self._next_key
            self._next_key += 1
        assert self.events is not None
        stream = self._side_stream() if made_now else None
        self.events.append((key, counter[0]) if stream is None else (key, counter[0], stream))

    def _side_stream(self) -> int | None:
        """The number of the stream current now when it is not a default one (None when it is). Fake tensors'
        storages are on the meta device: the traced device's current stream is what FSDP2 set."""
        for device_type, default in self._default_streams.items():
            current = torch.get_device_module(device_type).current_stream()
            if current != default:
                ident = (device_type, current.stream_id if device_type == "cuda" else id(current))
                return self._stream_numbers.setdefault(ident, len(self._stream_numbers) + 1)
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # The op's inputs and outputs, flattened once (costed, then counted): a trace dispatches 10^5 ops.
        inputs, outputs = tree_leaves((args, kwargs)), tree_leaves(out)
        args, kwargs, costed = self._on_shards(args, kwargs, out, inputs, outputs)
        self._cost(func, args, kwargs, costed, inputs, outputs)
        if not self._kernel_depth and self._engine_sum(func, args, out):
            return out
        for leaf in outputs:
            if isinstance(leaf, torch.Tensor):
                for storage in storages_of(leaf):
                    self._count(storage)
        return out

    def _on_shards(
        self, args: Any, kwargs: Any, out: Any, inputs: list[Any], outputs: list[Any]
    ) -> tuple[Any, Any, Any]:
        """The op's arguments and output as this rank holds them. This mode sees a tensor-parallel op on its
        DTensors, whose shapes are the whole layer's: a rank computes and moves its shards only, so the op is
        counted on them (the recorder takes each leaf's shard itself)."""
        if self.sees_dtensors and any(isinstance(leaf, DTensor) for leaf in (*inputs, *outputs)):
            return tree_map(local_shard, args), tree_map(local_shard, kwargs), tree_map(local_shard, out)
        return args, kwargs, out

    def _cost(self, func: Any, args: Any, kwargs: Any, costed: Any, inputs: list[Any], outputs: list[Any]) -> None:
        """Count the op's FLOPs (while asked) and record its costs (while a phase is set)."""
        counting = self.count_flops or self.costs.phase is not None
        count = flop_registry.get(func.overloadpacket) if counting else None
        flops = counted_flops(count, args, kwargs, costed) if count is not None else 0
        if self.count_flops:
            self.flops += flops
        self.costs.record(func, args, kwargs, inputs, outputs, flops)

    def _model_state(self, tensor: Any) -> bool:
        """Whether ``tensor`` is a model state: what a kernel moves of it does not grow with the micro batch."""
        for storage in storages_of(tensor):
            counter = self._counted.get(storage)
            if counter is not None and self._tags.get(id(counter)) in MODEL_STATES:
                return True
        return False

    def tag(self, tensors: Any, tag: str) -> None:
        for storage in (storage for tensor in tensors for storage in storages_of(tensor)):
            counter = self._counted.get(storage)
            old = None if counter is None else self._tags.get(id(counter))
            if counter is None or old == tag:
                continue  # not allocated under the tracker, or tagged already
            if old is not None:
                self.live[old] -= counter[0]
            self._tags[id(counter)] = tag
            self.live[tag] += counter[0]

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.at_peak = dict(self.live)

    def _count(self, storage: Any) -> None:
        if storage in self._host or self._on_host and storage not in self._counted:
            self._host.add(storage)
            return
        if self._kernel_depth and storage not in self._counted:
            self._in_kernel[storage] = None
            return
        counter = self._counted.get(storage)
        new, before, peak = counter is None, 0 if counter is None else counter[0], self.peak_bytes
        super()._count(storage)
        counter = self._counted[storage]
        if new and self.in_forward:
            self._tags[id(counter)] = "activations"
        tag = self._tags.get(id(counter))
        if tag is not None:
            self.live[tag] += counter[0] - before
        if self.events is not None and counter[0] != before:
            self._record(counter, made_now=True)
        if self.peak_bytes > peak:
            self.at_peak = dict(self.live)

    def _release(self, counter: list[int]) -> None:
        tag = self._tags.pop(id(counter), None)
        if tag is not None:
            self.live[tag] -= counter[0]
        key = self._keys.pop(id(counter), None)  # ids are reused once the counter is gone
        if self.events is not None and key is not None and counter[0] > 0:
            self.events.append((key, 0))
        super()._release(counter)
