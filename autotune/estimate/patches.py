"""What the trace changes in other libraries, so that the trial's own step runs on fake tensors and keeps what
the real step would keep: torch's process groups, meshes, pipeline schedules, attention and initialisers,
bitsandbytes' 4-bit matmul, Transformers' masks and initialisers, PEFT's adapter moves.

Each is a context manager whose change lasts while it is entered, and says which versions of the library it is
written for (the version installed where it was last checked, and the range pyproject.toml allows): these reach
into internals that a new release may move.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import sys
import types
from typing import Any, Iterator

from autotune.config.gpus import GpuSpec
from autotune.estimate.results import EstimateError

__all__ = [
    "adapters_stay_put",
    "bnb_4bit_gemm_unfused",
    "bnb_4bit_matmul_as_on_cuda",
    "cuda_attention",
    "fake_kernels_as_real",
    "fake_process_group",
    "meshes_on_real_values",
    "pipeline_shapes_given",
    "sends_hold_their_tensors",
    "truncated_normal_without_resampling",
    "unpacked_batches",
]


@contextlib.contextmanager
def fake_process_group(
    ranks: int, device_type: str, *, gloo: bool, tp: int = 1, rank: int = 0, shard: int | None = None
) -> Iterator[Any]:
    """A process group of ``ranks`` whose collectives move nothing (PyTorch's "fake" backend), this
    process as rank ``rank``, and its device mesh, made before fake tensors (the mesh reads real values):
    1-D, or (data, tensor) parallel named ``dp`` and ``tp`` when ``tp`` > 1, or hybrid sharding's
    (replicate, shard) of groups of ``shard`` ranks (``shard``: set for --fsdp hybrid).

    ``gloo``: the trials' CPU backend. Its reduce-scatter reduces a copy of its whole input
    (measured: a 50 MB input takes 50 MB more while it runs), which NCCL does not.

    Written for torch 2.13 (pyproject: torch>=2.4): its testing-internal ``FakeStore`` and fake backend.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise EstimateError("FSDP and TP are traced on a process group of their own; this process has one already")
    from autotune.trial.collectives import fsdp_reduce_scatter_name

    dist.init_process_group("fake", rank=rank, world_size=ranks, store=FakeStore())
    name = fsdp_reduce_scatter_name()
    reduce_scatter = getattr(dist, name)

    def gloo_reduce_scatter(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        scratch = torch.empty_like(input)  # noqa: F841 - held while the collective runs, as gloo's copy
        return reduce_scatter(output, input, *args, **kwargs)

    if gloo:
        setattr(dist, name, gloo_reduce_scatter)
    try:
        if shard is not None:
            yield init_device_mesh(device_type, (ranks // shard, shard), mesh_dim_names=("replicate", "shard"))
        elif tp > 1:
            yield init_device_mesh(device_type, (ranks // tp, tp), mesh_dim_names=("dp", "tp"))
        else:
            yield init_device_mesh(device_type, (ranks,))
    finally:
        setattr(dist, name, reduce_scatter)
        dist.destroy_process_group()


@contextlib.contextmanager
def bnb_4bit_matmul_as_on_cuda() -> Iterator[None]:
    """Within a CPU trace, bitsandbytes' 4-bit layers multiply as on CUDA. On a CPU ``matmul_4bit``
    first sets the weight's dequantized type to the input's (``quant_state.dtype = A.dtype``); on CUDA a
    training input goes to ``MatMul4Bit`` as it is, which dequantizes to the type the weight was quantized
    from and casts that copy to the input's: two copies of the weight where the types differ (a base
    quantized from float16 under bf16 compute, as Lightning's plugin quantizes it). In 0.50 only its backward
    does: its forward's ``gemm_4bit`` dequantizes to the input's type (see :func:`bnb_4bit_gemm_unfused`).

    Written for bitsandbytes 0.50.2 (pyproject: >=0.48, its CPU backend; 0.49's CPU path retyped the weight).
    """
    import bitsandbytes

    on_cpu = bitsandbytes.matmul_4bit

    def as_on_cuda(A: Any, B: Any, quant_state: Any, out: Any = None, bias: Any = None) -> Any:
        # A training step's inputs have more than one row: CUDA's one-row inference kernel never runs.
        return bitsandbytes.autograd._functions.MatMul4Bit.apply(A, B, out, bias, quant_state)

    bitsandbytes.matmul_4bit = as_on_cuda
    try:
        yield
    finally:
        bitsandbytes.matmul_4bit = on_cpu


@contextlib.contextmanager
def bnb_4bit_gemm_unfused() -> Iterator[None]:
    """Within a trace, bitsandbytes' 4-bit matmul runs as the training step runs it: the weight dequantized
    to the input's type, then a matmul, each an operator the trace counts.

    Since 0.50 ``MatMul4Bit.forward`` (and ``matmul_4bit`` without a gradient) calls one custom operator,
    ``bitsandbytes::gemm_4bit`` (autograd/_functions.py). On fake tensors its registered fake kernel
    (_ops.py) only makes the output: the trace saw one operator of no FLOPs, not a matmul, and no weight
    copy. The real one, past 1,536 rows on CUDA (a training micro step's tokens), dequantizes and calls
    ``F.linear`` (backends/cuda/ops.py, ``_dequant_linear_fallback``), as its default kernel does on the CPU
    (backends/default/ops.py, ``_gemm_4bit_default_impl``), which runs here in its place. Below that, CUDA
    may pick its fused kernel where calibrated faster: the same FLOPs, less traffic.

    Written for bitsandbytes 0.50.2 (pyproject: >=0.48); a release without the operator: left alone.
    """
    import torch

    try:
        import bitsandbytes  # noqa: F401 - registers the bitsandbytes operators
        from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
    except ImportError:
        yield
        return
    namespace = torch.ops.bitsandbytes
    if not hasattr(namespace, "gemm_4bit"):
        yield
        return
    # The namespace caches each operator it has resolved as an attribute, which bitsandbytes' calls read.
    fused = namespace.gemm_4bit
    namespace.gemm_4bit = types.SimpleNamespace(default=_gemm_4bit_default_impl)  # type: ignore[attr-defined]  # patched inside
    try:
        yield
    finally:
        namespace.gemm_4bit = fused  # type: ignore[attr-defined]  # restored


@contextlib.contextmanager
def cuda_attention(card: GpuSpec | None, picked: collections.Counter[str]) -> Iterator[None]:
    """Within a CPU trace, ``scaled_dot_product_attention`` runs the kernel CUDA would pick, so the
    trace keeps what that kernel keeps for the backward; ``picked`` counts the kernels.

    PyTorch tries flash, then memory-efficient, then math attention (sdp_utils.cpp). Flash takes
    fp16/bf16 without a mask, head size up to 256, on sm80 or newer (grouped-query heads too);
    memory-efficient takes fp32 and masks, not grouped-query heads. Both keep the output and a
    log-sum-exp per row (dropout is regenerated, not stored); math keeps the s x s weights.
    Without a named card, an sm80-or-newer one is assumed.

    Written for torch 2.13's SDPA selection and its private ``aten`` kernels (pyproject: torch>=2.4).
    """
    import torch

    original = torch.nn.functional.scaled_dot_product_attention

    def as_cuda(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        if torch.is_autocast_enabled(query.device.type):  # as autocast casts SDPA's inputs, on CUDA too
            dtype = torch.get_autocast_dtype(query.device.type)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dtype)
        grouped = enable_gqa and key.size(-3) != query.size(-3)
        sixteen_bit = query.dtype in (torch.float16, torch.bfloat16)
        flash = query.size(-1) <= 256 if card is None else card.flash_trains_head_size(query.size(-1))
        if flash and attn_mask is None and sixteen_bit:
            picked["flash"] += 1
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
        if grouped or (query.dtype == torch.bfloat16 and card is not None and not card.bf16):
            picked["math"] += 1
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA turns it into a bias
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
            attn_mask = bias.masked_fill(~attn_mask, float("-inf"))
        picked["memory-efficient"] += 1
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]

    torch.nn.functional.scaled_dot_product_attention = as_cuda
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def fake_kernels_as_real() -> Any:
    """A dispatch mode under which two fake kernels do what the real ones do.

    - ``_grouped_mm`` takes what the CPU's kernel takes. Its fake kernel checks the bf16-only rule of CUDA's fast
      kernel, so mixture-of-experts layers (Transformers' grouped experts: fp32 weights, inputs cast to them,
      autocast or not) failed to trace, where the CPU's kernel takes fp32: same output shape, in the inputs'
      dtype. The bf16 stand-ins live below the tracker, which counts only the result.
    - A functional collective's ``wait_tensor`` returns the tensor it waits on, as its kernels do
      (``torch/csrc/distributed/c10d/Functional.cpp``: ``wait_tensor`` returns its argument), where its fake
      kernel (the Meta one, ``_wait_tensor_meta``: ``empty_like``) makes a second tensor of the same size. The
      tracker counted that copy: a split LM head's gathered logits read a gathered copy more while its shard was
      alive (+8.2 MB at 2 ranks, 32,000 words and 128 tokens, measured against gloo's ranks).

    Written for torch 2.13's fake ``aten._grouped_mm`` and ``_c10d_functional.wait_tensor`` (pyproject: >=2.4) and
    Transformers 5.24's experts (>=4.45).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default

    class FakeKernelsAsReal(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func is wait_tensor:
                return args[0]
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
                dtype = kwargs.get("out_dtype") or args[0].dtype
                stand_ins = [
                    arg.to(torch.bfloat16) if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg
                    for arg in args
                ]
                return func(*stand_ins, **kwargs).to(dtype)
            return func(*args, **kwargs)

    return FakeKernelsAsReal()


@contextlib.contextmanager
def pipeline_shapes_given() -> Iterator[None]:
    """Pipeline schedules skip their first exchange between the ranks, which votes (with ``.item()``) on
    whether each stage's shapes are known: on fake tensors they are, given by the stages
    (:class:`autotune.prepare.pipeline.Pipeline`'s ``shapes``).

    Written for torch 2.13's private ``_PipelineSchedule._warmup_p2p`` (pyproject: torch>=2.4). Releases without
    it (2.11 has neither the vote nor ``InferenceMode``) have no such exchange to skip.
    """
    from torch.distributed.pipelining import schedules

    try:
        from torch.distributed.pipelining._utils import InferenceMode
    except ImportError:
        yield
        return
    original = schedules._PipelineSchedule._warmup_p2p

    def shapes_given(self: Any, stages: list[Any], *args: Any, **kwargs: Any) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = shapes_given  # type: ignore[method-assign]  # patched inside
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original  # type: ignore[method-assign]  # restored


class _HeldSends(list):  # type: ignore[type-arg]  # of dist.Work, as the schedules type it
    """A batch's works, holding the tensors it sends for as long as the schedule holds the works."""

    sent: list[Any]


@contextlib.contextmanager
def sends_hold_their_tensors() -> Iterator[None]:
    """A pipeline schedule's sends keep their tensors alive while it holds their works, as the real backends'
    works do and the fake group's do not: gloo's ``SendWork`` keeps a reference to its tensor "to prevent it
    from being deallocated while the operation is still in flight" (ProcessGroupGloo.hpp), NCCL's point-to-point
    work keeps it in ``outputs_`` (ProcessGroupNCCL.cpp, ``pointToPoint``). 1F1B holds one forward's send until the
    next; interleaved 1F1B holds every send of the step until it ends (``_PipelineScheduleRuntime``'s
    ``send_ops``, torch/distributed/pipelining/schedules.py): forward outputs past their backward and every input
    gradient sent, on a 2-rank CPU trial 1.0-1.2 MiB the trace had freed.

    Written for torch 2.13's private ``schedules._batch_p2p`` (pyproject: torch>=2.4).
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    batch_p2p = schedules._batch_p2p

    def holding(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        works = _HeldSends(batch_p2p(p2p_ops, desc))
        works.sent = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return works

    schedules._batch_p2p = holding
    try:
        yield
    finally:
        schedules._batch_p2p = batch_p2p


@contextlib.contextmanager
def meshes_on_real_values() -> Iterator[None]:
    """Device meshes made during the trace (FSDP x TP joins the data- and tensor-parallel meshes into one; a
    pipeline of tensor-parallel stages makes its own) are made on real values: a mesh finds this rank's
    coordinates with ``nonzero``, which fake tensors, whose values are unknown, cannot answer.

    Written for torch 2.13's ``DeviceMesh`` and ``init_device_mesh`` (pyproject: torch>=2.4).
    """
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    made, init = device_mesh.DeviceMesh.__init__, device_mesh.init_device_mesh

    def made_for_real(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            made(self, *args, **kwargs)

    def init_for_real(*args: Any, **kwargs: Any) -> Any:  # a pipeline's (pp, tp) mesh: its rank map too
        with unset_fake_temporarily():
            return init(*args, **kwargs)

    device_mesh.DeviceMesh.__init__ = made_for_real  # type: ignore[method-assign]  # patched inside
    device_mesh.init_device_mesh = init_for_real
    try:
        yield
    finally:
        device_mesh.DeviceMesh.__init__ = made  # type: ignore[method-assign]  # restored
        device_mesh.init_device_mesh = init


@contextlib.contextmanager
def truncated_normal_without_resampling() -> Iterator[None]:
    """torch's trunc_normal_ (ViT's init, for one) draws again until every value lies in range, which
    asks fake weights for values they do not have: here it draws once and clamps (weights' values
    change neither speed nor memory).

    Written for torch 2.13 and Transformers 5.24 (pyproject: >=2.4, >=4.45); no ``initialization`` table: torch's only.
    """
    import torch

    def draw_and_clamp(
        tensor: torch.Tensor,
        mean: float = 0.0,
        std: float = 1.0,
        a: float = -2.0,
        b: float = 2.0,
        generator: Any = None,
    ) -> torch.Tensor:
        with torch.no_grad():
            return tensor.normal_(mean, std, generator=generator).clamp_(a, b)

    tables: list[tuple[Any, str]] = [(torch.nn.init.__dict__, "trunc_normal_")]
    try:
        from transformers.initialization import (
            TORCH_INIT_FUNCTIONS,  # what Transformers' init calls
        )

        tables.append((TORCH_INIT_FUNCTIONS, "trunc_normal_"))
    except ImportError:
        pass
    saved = [(table, key, table[key]) for table, key in tables if key in table]
    try:
        for table, key, _ in saved:
            table[key] = draw_and_clamp
        yield
    finally:
        for table, key, original in saved:
            table[key] = original


@contextlib.contextmanager
def unpacked_batches() -> Iterator[None]:
    """Transformers' masks treat the batch as the real step sees it: one sequence per row.

    Given position ids, Transformers looks for several sequences packed in one row; on fake
    tensors it cannot read them, so it assumes packing and builds an explicit mask (and its
    copies) that the real step, whose synthetic rows are never packed, skips for SDPA's causal
    flag. Checkpointed layers keep that mask to the end of the backward: +0.8% on a small Llama,
    +7% on a small Mixtral.

    Written for Transformers 5.24 (pyproject: >=4.45); one without ``find_packed_sequence_indices``: left alone.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def adapters_stay_put(device_type: str, *, adapters: bool) -> Iterator[None]:
    """PEFT moves each new adapter to its base layer's device (and, for an adapted parameter such as
    fused experts, dtype), which fake parameters cannot do (``Module._apply`` cannot swap them).
    Under fake tensors both are on the traced device already. PEFT is imported for it only where
    the model may hold ``adapters`` (:func:`autotune.estimate.trace.may_hold_adapters`): over a second, and none
    are made otherwise.

    Written for PEFT 0.21.2's ``BaseTunerLayer`` and torch 2.13's ``Module.to`` (pyproject: peft>=0.12, torch>=2.4).
    """
    if importlib.util.find_spec("peft") is None:
        yield
        return
    import torch

    if adapters or "peft.tuners.tuners_utils" in sys.modules:
        from peft.tuners.tuners_utils import BaseTunerLayer

        tuner_layer: Any = BaseTunerLayer
        original_move = tuner_layer._move_adapter_to_device_of_base_layer
    else:
        tuner_layer = original_move = None
    original_to = torch.nn.Module.to

    def to_unless_a_no_op(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
        if (device is None or device.type == device_type) and (dtype is None or all(t.dtype == dtype for t in tensors)):
            return module  # everything is on the traced device, in that dtype, already
        return original_to(module, *args, **kwargs)

    if tuner_layer is not None:
        tuner_layer._move_adapter_to_device_of_base_layer = lambda self, *args, **kwargs: None
    torch.nn.Module.to = to_unless_a_no_op  # type: ignore[method-assign,assignment]  # patched inside
    try:
        yield
    finally:
        if tuner_layer is not None:
            tuner_layer._move_adapter_to_device_of_base_layer = original_move
        torch.nn.Module.to = original_to  # type: ignore[method-assign]  # restored
