"""CUDA's autocast policy inside a CPU trace: the ops CUDA runs in fp32 under fp16/bf16 autocast.

Autocast keeps a list per device of ops it runs in fp32 whatever their inputs' dtype. CUDA's
(torch/csrc/autocast_mode.cpp, ``KERNEL_CUDA(..., fp32)``; the AMP docs' "CUDA Ops that can
autocast to float32") holds softmax, layer_norm, exp, sum, pow and more; the CPU's does not, so
a CPU trace of an fp16/bf16 step keeps 16-bit softmax outputs and norms where a CUDA step keeps
fp32 ones, and the 16-bit copies the next matmul makes of them. Measured against nvidia-smi on
bert-large in fp16 (the Transformers docs' V100 row), that was 17% of the whole job.

Within :func:`cuda_fp32_policy` the CPU's autocast runs those ops as CUDA's does: inputs cast to
fp32, autocast off below. The lower-precision list (matmuls, convolutions) is the same on both
devices but for a few rare ops (einsum, mv, addmv, addr), left as the CPU has them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["cuda_fp32_policy", "CUDA_FP32_OPS"]

# CUDA's fp32 list, as aten overloads (the ones models call through torch.* and F.*).
CUDA_FP32_OPS = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "prod",
    "prod.dim_int",
    "sum",
    "sum.dim_IntList",
    "cross_entropy_loss",
)


@contextlib.contextmanager
def cuda_fp32_policy() -> Iterator[None]:
    """While inside, the CPU's autocast runs CUDA's fp32 ops in fp32 (their kernels registered on
    the AutocastCPU key, unregistered on the way out)."""
    import torch
    from torch.utils._pytree import tree_map

    autocast_cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def upcast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
            return value.float()
        return value

    def in_fp32(op: Any) -> Any:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(autocast_cpu):
                args, kwargs = tree_map(upcast, (args, kwargs))
                return op(*args, **kwargs)

        return kernel

    library = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - a scoped override, destroyed below
    try:
        for name in CUDA_FP32_OPS:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default", None)
            if op is not None:
                library.impl(name, in_fp32(op), "AutocastCPU")
        yield
    finally:
        library._destroy()
