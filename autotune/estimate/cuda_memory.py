"""What a CUDA job holds beyond its live tensors: the allocator's reserve, the context, buffers.

Three figures, each the one before plus what it leaves out:

* **allocated** (``max_memory_allocated``): the live tensors, as the fake-tensor step traced them;
* **reserved** (``max_memory_reserved``): the traced step's allocations and frees, in order,
  replayed through a model of PyTorch's caching allocator (:mod:`autotune.estimate.cuda_allocator`),
  with what PyTorch allocates through it that no tensor of the step shows: cuBLAS's workspace and
  DDP's gradient buckets. The step is replayed twice: the second pass is the steady state every
  step after the first reaches (its blocks come from the first pass's cache). Each allocation is made
  on the stream the trace saw it made on: FSDP2's all-gather outputs on its copy-in stream and its
  reduce-scatter outputs (the sharded gradients) on its reduce-scatter stream keep their blocks in
  those streams' pools, out of the compute stream's reach;
* **device** (``nvidia-smi``): reserved, plus what the process holds outside the allocator: the
  CUDA context with its kernels, and NCCL's communication buffers when ranks talk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from autotune.config.gpus import GpuSpec
from autotune.estimate.cuda_allocator import AllocatorSettings, Event, replay

__all__ = [
    "CudaMemory",
    "TraceMarks",
    "predict_cuda_memory",
    "describe_figures",
    "TYPICAL_CONTEXT_BYTES",
    "DDP_BUCKET_BYTES",
]

_MiB = 2**20
TYPICAL_CONTEXT_BYTES = 400 * _MiB  # no card named: a lazily loaded CUDA context (see config.gpus)
DDP_BUCKET_BYTES = 25 * _MiB  # DistributedDataParallel's bucket_cap_mb default


@dataclass(frozen=True, kw_only=True)
class CudaMemory:
    """The reserved and nvidia-smi figures of one rank, and the parts each adds."""

    reserved_bytes: int
    device_bytes: int
    allocator_cache_bytes: int  # reserved - the tensors' peak - the workspace: cached free blocks, rounding
    cublas_workspace_bytes: int  # allocated through the allocator, once per process
    context_bytes: int  # outside the allocator
    communication_bytes: int  # NCCL's own buffers, outside the allocator
    allocator: str  # which allocator behaviour was replayed
    context_source: str

    def parts(self) -> dict[str, int]:
        """What reserved adds to the tensors' peak, then what the device adds to reserved: they sum to
        ``device_bytes - tensor peak``."""
        return {
            "allocator cache": self.allocator_cache_bytes,
            "cuBLAS workspace": self.cublas_workspace_bytes,
            "CUDA context": self.context_bytes,
            "NCCL buffers": self.communication_bytes,
        }


def predict_cuda_memory(
    events: Sequence[Event],
    marks: TraceMarks,
    *,
    tensor_peak_bytes: int,
    card: GpuSpec | None,
    communication_bytes: int,
    ddp_gradient_bytes: int,
    alloc_conf: str | None,
    extra_tensor_bytes: int = 0,
) -> CudaMemory:
    """The CUDA figures of a traced step.

    ``events``: the trace's storages as (key, new size) in order (0: freed), from the model on the
    device to the step's end, with a third item, the stream, for those made on a side stream (FSDP2's);
    ``marks``: where its phases begin.
    ``tensor_peak_bytes``: the live-tensor peak the estimate reports (DDP's buckets included);
    ``communication_bytes``: NCCL's buffers, outside the allocator (:mod:`autotune.estimate.nccl_buffers`);
    ``ddp_gradient_bytes``: what DDP's buckets hold (0 without DDP), replayed as DDP allocates them;
    ``extra_tensor_bytes``: what else that peak holds beyond the trace's (ZeRO's states, by
    arithmetic; negative when ZeRO shards them): added to the reserve as it is.
    """
    settings = AllocatorSettings.from_conf(alloc_conf)
    workspace = (
        card.cublas_workspace_bytes() if card is not None else 4096 * 1024 * 2 + 16 * 1024 * 8
    )  # PyTorch's default before Hopper
    buckets = _ddp_buckets(ddp_gradient_bytes)
    if card is not None:
        context, source = card.context_bytes, f"{card.name}'s typical context"
    else:
        context, source = TYPICAL_CONTEXT_BYTES, "a typical CUDA 12 context (name the card with --gpu)"
    # On a named card the allocator can reserve what the context, NCCL and the states the trace did not
    # allocate leave; near it, it gives its cached free segments back before it fails (cuda_allocator).
    capacity = card.memory_bytes - context - communication_bytes - extra_tensor_bytes if card is not None else None
    replayed = replay(
        _with_what_pytorch_adds(events, marks, workspace, buckets), settings=settings, capacity_bytes=capacity
    )
    # What the trace did not allocate (ZeRO's states by arithmetic) shifts the reserve as it is.
    reserved = replayed.peak_reserved_bytes + extra_tensor_bytes
    cache = max(0, reserved - tensor_peak_bytes - workspace)
    reserved = tensor_peak_bytes + workspace + cache
    mode = "expandable segments" if settings.expandable_segments else "segments"
    return CudaMemory(
        reserved_bytes=reserved,
        device_bytes=reserved + context + communication_bytes,
        allocator_cache_bytes=cache,
        cublas_workspace_bytes=workspace,
        context_bytes=context,
        communication_bytes=communication_bytes,
        allocator=f"PyTorch 2.13's CUDA caching allocator ({mode})",
        context_source=source,
    )


def _with_what_pytorch_adds(
    events: Sequence[Event], marks: TraceMarks, workspace: int, buckets: list[int]
) -> Iterable[Event]:
    """The trace's events in the order a real job makes them, with what PyTorch adds.

    The trace makes the optimizer's state before its step (from zero gradients); a real job makes
    it inside its first step, after the backward freed the activations, so the state takes
    blocks the activations had and the next forward needs new ones: that is where most of a
    training job's cache comes from. So: the model's storages; DDP's buckets (made when DDP wraps
    the model) and cuBLAS's workspace (the first matmul's); the first step with the state made in
    its update; then two more steps, whose new storages get keys of their own (but for what the first
    step made and kept).
    """
    # The trace's teardown frees every storage after the step: replayed as part of the step, the next steps
    # found the model and its optimizer's state freed, and the reserve read the first step's alone.
    events = events[: marks.end]
    made_before_step = events[marks.state : marks.step]
    freed = {event[0] for event in made_before_step if event[1] == 0}
    state = [event for event in made_before_step if event[1] and event[0] not in freed]
    yield from events[: marks.state]
    for index, size in enumerate(buckets):
        yield ("ddp bucket", index), size
    yield ("cublas workspace",), workspace
    yield from events[marks.step : marks.update]
    yield from state
    yield from events[marks.update :]
    step = events[marks.step :]
    born_in_step = {event[0] for event in step if event[1]}
    size_at_end = {event[0]: event[1] for event in step}  # the last event of each storage wins
    # What the first step makes and keeps (gradients zero_grad keeps, a pipeline's receive buffers) a real job
    # makes once: the next steps use it again.
    kept = {key for key in born_in_step if size_at_end[key]}
    for repeat in (2, 3):
        for event in step:
            key = event[0]
            if key not in kept:
                yield ((repeat, key) if key in born_in_step else key, *event[1:])


@dataclass(frozen=True)
class TraceMarks:
    """Where the trace's phases begin in its events: the optimizer's state made (after the model's
    storages), the step (its forwards and backwards), the update (optimizer step and zero_grad), and
    where the step ends (None: with the events)."""

    state: int
    step: int
    update: int
    end: int | None = None


def _ddp_buckets(gradient_bytes: int) -> list[int]:
    """DDP's flat buckets: ``bucket_cap_mb`` each (the last holds the rest)."""
    if gradient_bytes <= 0:
        return []
    full, rest = divmod(gradient_bytes, DDP_BUCKET_BYTES)
    return [DDP_BUCKET_BYTES] * full + ([rest] if rest else [])


def describe_figures() -> dict[str, str]:
    """What each figure holds, for ``estimate --json`` and the table's footer."""
    return {
        "predicted_peak_bytes": "peak allocated (max_memory_allocated): live tensors at the step's peak",
        "predicted_reserved_bytes": "peak reserved (max_memory_reserved): allocated + cuBLAS workspace + DDP "
        "buckets + the caching allocator's cached free blocks and rounding",
        "predicted_device_bytes": "what nvidia-smi shows: reserved + the CUDA context and kernels + NCCL buffers",
    }
