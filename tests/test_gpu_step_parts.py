"""bench/gpu_step_parts.py's reading of a profiled step: each kernel in the step-time model's kinds, the update's
kernels found by the profiler's device annotation or, where a release marks only the host, by correlation id."""

from __future__ import annotations

import pytest
from bench_modules import bench_module


@pytest.fixture(scope="module")
def kernel_parts():
    return bench_module("gpu_step_parts").kernel_parts


# Names as an H200's profile printed them (bench/results/gpu_step_parts_NVIDIA_H200.txt), times in microseconds.
KERNELS = [
    {"cat": "kernel", "name": "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "ts": 0, "dur": 40},
    {"cat": "kernel", "name": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "ts": 40, "dur": 20},
    {"cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<8, GeluBackward>", "ts": 60, "dur": 10},
    {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 70, "dur": 5},
    {"cat": "kernel", "name": "void at::native::multi_tensor_apply_kernel<AdamW>", "ts": 110, "dur": 30},
]


def test_each_kernel_lands_in_its_kind_and_the_gaps_are_idle(kernel_parts):
    trace = {
        "traceEvents": [
            *KERNELS,
            {"cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 100, "dur": 45},
        ]
    }
    parts = kernel_parts(trace)
    assert parts == pytest.approx({"matmul": 40e-6, "attention": 20e-6, "other": 15e-6, "update": 30e-6, "idle": 35e-6})


def test_without_a_device_annotation_the_update_is_what_the_host_launched_inside_optimizer_step(kernel_parts):
    kernels = [dict(k, args={"correlation": i}) for i, k in enumerate(KERNELS)]
    launches = [
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5 * i, "dur": 1, "args": {"correlation": i}}
        for i in range(len(KERNELS))
    ]
    host_span = {"cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 19, "dur": 3}  # launch 4's
    parts = kernel_parts({"traceEvents": [*kernels, *launches, host_span]})
    assert parts["update"] == pytest.approx(30e-6)
    assert parts["other"] == pytest.approx(15e-6)
