"""What FSDP2 holds on a CUDA device beyond the model states, as arithmetic on a group's shapes.

The estimator does not need these for the traced step: PyTorch's own ``fully_shard`` runs on fake tensors, so
each buffer below is in the trace, on the stream FSDP2 allocates it on (the allocator replay keeps each side
stream's blocks apart). They size what the trace cannot show: a run made in a way autotune's trials are not
(``reshard_after_forward`` other than ``True``) and the bench's accounting of published runs. Sources, PyTorch
2.13's ``torch/distributed/fsdp/_fully_shard/``; ``bench/fsdp2_cuda_memory.md`` reads them at length. NCCL's own
device memory: :mod:`autotune.estimate.nccl_buffers`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = [
    "all_gather_output_bytes",
    "copy_in_stream_bytes",
    "hybrid_all_reduce_bytes",
    "kept_after_forward_bytes",
    "no_sync_gradient_bytes",
    "padded_numel",
    "reduce_scatter_bytes",
]

_MiB = 2**20
Shape = Sequence[int]


def padded_numel(shape: Shape, world_size: int) -> int:
    """Elements of a parameter padded so dim 0 splits evenly over the ranks (``_get_dim0_padded_size`` in
    ``_fsdp_common.py``: ``ceil(dim0 / world_size) * world_size``); a 0-d parameter counts as one row."""
    dims = list(shape) or [1]
    rows = math.ceil(dims[0] / world_size) * world_size
    return rows * math.prod(dims[1:])


def all_gather_output_bytes(shapes: Iterable[Shape], world_size: int, dtype_bytes: int) -> int:
    """One group's all-gather output: every rank's padded shard in the all-gather dtype (``param_dtype``).

    ``foreach_all_gather`` (``_fsdp_collectives.py``) allocates ``all_gather_input_numel * world_size``
    elements on the copy-in stream (``all_gather_comm.allocate``, a plain ``torch.empty`` by default); the
    all-gather input is a view into it (``all_gather_copy_in``), not a buffer of its own."""
    return sum(padded_numel(shape, world_size) for shape in shapes) * dtype_bytes


def copy_in_stream_bytes(
    first_shapes: Iterable[Shape], next_shapes: Iterable[Shape], world_size: int, dtype_bytes: int, cast: bool
) -> int:
    """The most the copy-in stream holds at once in forward: the first group's all-gather output kept in
    ``comm_ctx.all_gather_state`` until the next group's ``wait_for_unshard`` frees it ("Defer free to allow
    for overlap of this copy-out with next all-gather collective", ``FSDPParamGroup.wait_for_unshard``), the
    next group's output, and (``cast``: fp32 shards, a 16-bit ``param_dtype``) the next group's shards cast
    on that stream (``_get_param_all_gather_inputs``)."""
    first = list(first_shapes)
    following = list(next_shapes)
    held = all_gather_output_bytes(first, world_size, dtype_bytes)
    gathered = all_gather_output_bytes(following, world_size, dtype_bytes)
    return held + gathered + (gathered // world_size if cast else 0)


def reduce_scatter_bytes(shapes: Iterable[Shape], world_size: int, reduce_dtype_bytes: int) -> tuple[int, int]:
    """One group's reduce-scatter (input, output) in ``reduce_dtype``.

    ``foreach_reduce`` allocates the input, the padded unsharded gradients concatenated, on the current
    (compute) stream, and keeps it in ``comm_ctx.reduce_scatter_states`` until the next group's post-backward
    (``reduce_scatter_max_input_buffers``, default 1); the output, ``input // world_size``, on the
    reduce-scatter stream, where it becomes the sharded gradient (a view, or cast to the parameters' dtype)."""
    total = sum(padded_numel(shape, world_size) for shape in shapes) * reduce_dtype_bytes
    return total, total // world_size


def hybrid_all_reduce_bytes(shapes: Iterable[Shape], shard_group: int, reduce_dtype_bytes: int) -> int:
    """What hybrid sharding (a 2-D ``(replicate, shard)`` mesh) holds for one group's all-reduce across the
    replicas: the reduce-scatter's output, sized by the shard group (not the world), all-reduced in place on the
    all-reduce stream and kept in ``FSDPParamGroup._all_reduce_state`` until the next group's reduce waits on
    it (``foreach_reduce``, ``_fsdp_collectives.py``; PyTorch PR #140044), so that the next reduce-scatter does
    not reuse its block while the all-reduce runs. Every other buffer of hybrid is the full mode's over
    ``shard_group`` ranks: pass ``shard_group`` as the world size to the functions above."""
    return reduce_scatter_bytes(shapes, shard_group, reduce_dtype_bytes)[1]


def no_sync_gradient_bytes(parameters_held: int, reduce_dtype_bytes: int) -> int:
    """Gradient accumulation without reduction (``set_requires_gradient_sync(False)`` on every micro step but
    the last): ``post_backward`` returns before the reduce-scatter, after ``to_accumulated_grad_if_needed``
    (``_fsdp_param.py``) replaced each unsharded gradient by ``unsharded_grad.to(reduce_dtype)``: every
    parameter a rank holds unsharded (after tensor parallelism) keeps a gradient in the reduce dtype between
    micro steps, whatever the data-parallel degree. ``--grad-sync last`` runs it in the trials and the trace
    (``autotune.levers.grad_reduction``); this is the arithmetic to check them against."""
    return parameters_held * reduce_dtype_bytes


def kept_after_forward_bytes(
    shapes: Iterable[Shape], world_size: int, dtype_bytes: int, reshard_after_forward: bool | int
) -> int:
    """What one group keeps gathered from its forward to its backward, per ``reshard_after_forward``
    (``fully_shard``): ``True`` frees the unsharded parameters after forward (0); ``False`` keeps them all
    (``unshard`` is a no-op in backward while ``is_unsharded``); an int ``k`` keeps a copy sharded over ``k``
    ranks (``FSDPParam.to_sharded_post_forward``): 1/k of the group, on the compute stream."""
    if reshard_after_forward is True:
        return 0
    whole = all_gather_output_bytes(shapes, world_size, dtype_bytes)
    if reshard_after_forward is False:
        return whole
    k = int(reshard_after_forward)
    if k < 1 or world_size % k:
        raise ValueError(f"reshard_after_forward={k} must divide the {world_size} ranks")
    return whole // k
