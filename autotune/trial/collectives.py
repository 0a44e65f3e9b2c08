"""A CPU trial's gloo reduce-scatter, its copy freed when the call returns, in every run.

gloo reduce-scatters a copy of its whole input: ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``
clones the input, all-reduces the clone on gloo's worker thread and copies this rank's chunk out in the
calling thread's ``wait``. The copy is freed by whichever thread lets go of it last: the caller, as it drops
the work when ``reduce_scatter_single`` returns, or the worker thread, which keeps its all-reduce work (and
the copy with it) a moment after it has told the caller that the work is done (``runLoop`` drops it after
``AsyncWork::execute``). When the worker is last, the caller has already gone on: FSDP's cast of the reduced
gradients to the parameters' dtype (``_to_dtype_if_needed``, with ``--reduce-dtype fp32`` under bf16-true)
then allocates while the copy still lives, and the trial's CPU peak reads one rank's cast higher in some runs
and not in others. Under the tracker the worker's free also waits for the GIL (the tracker made the copy's
storage a Python object), which widens the window to milliseconds.

:func:`reduce_scatter_frees_its_copy` runs the same reduce-scatter in Python (the clone, gloo's all-reduce,
this rank's chunk copied out) and returns only once the worker has let go of the copy, then frees it: at the
moment a prompt worker frees gloo's own, so no memory the job holds is hidden, and at the same point of every
run. NCCL makes no such copy; the estimator traces gloo's as held for the call (``estimate/patches.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

__all__ = ["reduce_scatter_frees_its_copy"]

# How long a reduce-scatter waits for gloo's worker thread to let go of its copy: the worker drops it right
# after it has finished the all-reduce; past this the copy is left to it, as gloo's own would be.
WORKER_RELEASE_S = 5.0


@contextlib.contextmanager
def reduce_scatter_frees_its_copy() -> Iterator[None]:
    """``torch.distributed.reduce_scatter_single`` on a gloo group (synchronous, a sum or a mean: what FSDP2
    calls on a CPU) as gloo runs it, its copy of the input freed before it returns. Other groups and calls are
    torch's own."""
    import torch
    import torch.distributed as dist

    original = dist.reduce_scatter_single

    def reduce_scatter_single(
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        if (
            async_op
            or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
            or dist.get_backend(group) != "gloo"
            or not input.is_contiguous()
        ):
            return original(output, input, op=op, group=group, async_op=async_op)
        copy = input.clone()  # gloo's copy of the whole input
        storage = copy.untyped_storage()
        ours = torch._C._storage_Use_Count(storage._cdata)  # the copy's and `storage`'s references
        reduced = copy.view(copy.shape)  # the tensor gloo's work holds, apart from ours: seen in the count
        dist.all_reduce(reduced, op=op, group=group)
        del reduced
        output.copy_(copy.chunk(dist.get_world_size(group))[dist.get_rank(group)])
        deadline = time.monotonic() + WORKER_RELEASE_S
        while torch._C._storage_Use_Count(storage._cdata) > ours and time.monotonic() < deadline:
            time.sleep(1e-5)  # the worker thread drops its work a moment after the all-reduce is done
        return None

    dist.reduce_scatter_single = reduce_scatter_single
    try:
        yield
    finally:
        dist.reduce_scatter_single = original
