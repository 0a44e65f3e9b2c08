"""A CPU trial's gloo collectives let go of their buffers before they return, in every run: the reduce-scatter's
copy of its input, and an all-gather's hold on its input.

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

An all-gather through PyTorch's functional collectives (DTensor's redistribution: tensor parallel's gathered
logits and sequence parallel's gathered activations) has the same race with its input: gloo's all-gather work
holds the input until the worker thread drops it, after the caller's wait. A 2-rank tensor-parallel trial of a
32k vocabulary read its peak 4,097,032 bytes (its rank's half of the logits) higher in one run of many, the
estimator's figure in the others. :func:`all_gather_frees_its_input` waits on the gather and for the worker to
let go of the input before the call returns, where gloo's prompt worker would have.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

__all__ = [
    "reduce_scatter_frees_its_copy",
    "all_gather_frees_its_input",
    "gloo_collectives_let_go",
    "fsdp_reduce_scatter_name",
]

# How long a reduce-scatter waits for gloo's worker thread to let go of its copy: the worker drops it right
# after it has finished the all-reduce; past this the copy is left to it, as gloo's own would be.
WORKER_RELEASE_S = 5.0


def fsdp_reduce_scatter_name() -> str:
    """The ``torch.distributed`` function FSDP2 reduce-scatters its gradients with: ``reduce_scatter_single``
    where the release has it (torch 2.13's ``_fsdp_collectives.py`` calls it), ``reduce_scatter_tensor`` before
    (torch 2.11's; the same arguments: output, input, op, group, async_op)."""
    import torch.distributed as dist

    return "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


@contextlib.contextmanager
def reduce_scatter_frees_its_copy() -> Iterator[None]:
    """FSDP2's reduce-scatter (:func:`fsdp_reduce_scatter_name`) on a gloo group (synchronous, a sum or a mean:
    what FSDP2 calls on a CPU) as gloo runs it, its copy of the input freed before it returns. Other groups and
    calls are torch's own."""
    import torch
    import torch.distributed as dist

    name = fsdp_reduce_scatter_name()
    original = getattr(dist, name)

    def reduce_scatter(
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
        _until_let_go(storage, ours)
        return None

    setattr(dist, name, reduce_scatter)
    try:
        yield
    finally:
        setattr(dist, name, original)


@contextlib.contextmanager
def all_gather_frees_its_input() -> Iterator[None]:
    """``torch.distributed._functional_collectives.all_gather_single`` (what DTensor calls), waited on, and returning
    only once gloo's worker thread has let go of its input. Under torch.compile it is torch's own."""
    import torch
    from torch.distributed import _functional_collectives as funcol

    original = funcol.all_gather_single

    def all_gather_single(self: torch.Tensor, gather_dim: int, group: Any, tag: str = "") -> torch.Tensor:
        if torch.compiler.is_compiling():
            return original(self, gather_dim, group, tag)
        storage = self.untyped_storage()
        ours = torch._C._storage_Use_Count(storage._cdata)  # the caller's tensors', and `storage`'s
        # gloo's work holds the tensor it is given, not another reference to its storage: given a view of its
        # own, it does add one, which the count shows until the worker drops the work.
        sent = self.view(self.shape)
        gathered = original(sent, gather_dim, group, tag)
        del sent
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered.trigger_wait()
        _until_let_go(storage, ours)
        return gathered

    funcol.all_gather_single = all_gather_single
    try:
        yield
    finally:
        funcol.all_gather_single = original


@contextlib.contextmanager
def gloo_collectives_let_go() -> Iterator[None]:
    """Both of the above: what a CPU trial of several ranks runs under."""
    with reduce_scatter_frees_its_copy(), all_gather_frees_its_input():
        yield


def _until_let_go(storage: Any, ours: int) -> None:
    """Wait until no more than ``ours`` references hold ``storage``: gloo's worker thread drops its work (and the
    tensors it holds) a moment after the collective is done; past WORKER_RELEASE_S the work is left to it."""
    import torch

    deadline = time.monotonic() + WORKER_RELEASE_S
    while torch._C._storage_Use_Count(storage._cdata) > ours and time.monotonic() < deadline:
        time.sleep(1e-5)
