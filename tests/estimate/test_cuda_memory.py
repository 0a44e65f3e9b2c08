"""The CUDA figures without a GPU: reserved from the replayed trace, nvidia-smi's from reserved."""

from __future__ import annotations

import json
import os

import commands
import pytest

from autotune.config.gpus import gpu_spec
from autotune.estimate.cuda_memory import TraceMarks, predict_cuda_memory

MiB = 2**20


def test_the_state_takes_the_freed_activations_blocks_and_the_next_forward_needs_new_ones():
    # A trace in the estimator's order: the model (100 MiB), the optimizer's state made from a zero
    # gradient (gradient 100 MiB made and freed, state 200 MiB), then the step: activations 300 MiB
    # made and freed, the gradient 100 MiB made, the update frees it. Sizes >= 10 MiB get segments of
    # their own size (2 MiB multiples); cuBLAS's 8.125 MiB workspace (V100) takes a 20 MiB segment.
    events = [
        (0, 100 * MiB),  # model
        (1, 100 * MiB),
        (2, 200 * MiB),
        (1, 0),  # state made from a zero gradient
        (3, 300 * MiB),
        (3, 0),
        (4, 100 * MiB),  # forward and backward
        (4, 0),
    ]  # update, zero_grad
    marks = TraceMarks(state=1, step=4, update=7)
    # Replayed as a real job runs: model 100 (segment 1); workspace (segment 2, 20 MiB); first step:
    # activations 300 (segment 3), freed; gradient 100 takes segment 3's first 100 MiB (the 200 MiB
    # rest is over 1 MiB: split); the state, made in the first update, takes the other 200; the
    # gradient is freed. Second step: activations 300 find no free block of 300: segment 4 (300 MiB).
    # The gradient takes segment 3's free 100 MiB. Third step: as the second. Reserved: 100 + 20 + 300
    # + 300 = 720 MiB.
    tensor_peak = 600 * MiB  # model + state + activations
    cuda = predict_cuda_memory(
        events,
        marks,
        tensor_peak_bytes=tensor_peak,
        card=gpu_spec("V100-16GB"),
        communication_bytes=0,
        ddp_gradient_bytes=0,
        alloc_conf=None,
    )
    workspace = 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cuda.reserved_bytes == 720 * MiB
    assert cuda.cublas_workspace_bytes == workspace
    assert cuda.allocator_cache_bytes == 720 * MiB - tensor_peak - workspace
    assert cuda.device_bytes == 720 * MiB + 1_343 * MiB and cuda.communication_bytes == 0


def test_ddp_buckets_are_allocated_as_ddp_makes_them():
    # 60 MiB of gradients: buckets of 25, 25 and 10 MiB, each of which the allocator rounds (>= 10 MiB:
    # to 2 MiB multiples: 26, 26, 10) into a segment of its own, made when DDP wraps the model.
    events = [(0, 60 * MiB), (1, 60 * MiB), (1, 0)]
    marks = TraceMarks(state=1, step=3, update=3)
    cuda = predict_cuda_memory(
        events,
        marks,
        tensor_peak_bytes=120 * MiB,
        card=gpu_spec("H100-80GB"),
        communication_bytes=384 * MiB,
        ddp_gradient_bytes=60 * MiB,
        alloc_conf=None,
    )
    # model 60 + buckets 26 + 26 + 10 + workspace 32 (sm90) = 154 MiB reserved; the state phase
    # frees its gradient before the step, so nothing else is live.
    assert cuda.reserved_bytes == 154 * MiB
    assert cuda.device_bytes == cuda.reserved_bytes + cuda.context_bytes + 384 * MiB  # NCCL's, outside the reserve


def _estimate_json(*flags: str, env: dict[str, str] | None = None) -> dict:
    args = [
        "estimate",
        "--model",
        "builtin:llama-tiny-32k",
        "--seq-len",
        "256",
        "--global-batch",
        "8",
        "--micro-batch",
        "8",
        "--precision",
        "bf16",
        "--json",
        *flags,
    ]
    done = commands.autotune(*args, timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_estimate_for_a_named_card_names_three_figures_and_their_parts():
    result = _estimate_json("--gpu", "H100-80GB")
    peak, reserved, device = (
        result[k] for k in ("predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes")
    )
    parts = result["cuda_parts"]
    assert peak < reserved < device
    assert reserved == peak + parts["allocator cache"] + parts["cuBLAS workspace"]
    assert device == reserved + parts["CUDA context"] + parts["NCCL buffers"]
    assert parts["cuBLAS workspace"] == 32 * MiB  # Hopper's default
    assert set(result["figures"]) == {"predicted_peak_bytes", "predicted_reserved_bytes", "predicted_device_bytes"}
    assert result["gpu"] == "H100-80GB" and result["memory_budget_bytes"] == gpu_spec("H100-80GB").memory_bytes
    assert result["fits"] is True and result["attention_kernels"] == {"flash": 2}


@pytest.mark.slow
def test_expandable_segments_change_the_reserve_and_a_cpu_workload_has_none():
    plain = _estimate_json("--device", "cuda")
    expandable = _estimate_json("--device", "cuda", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert plain["predicted_peak_bytes"] == expandable["predicted_peak_bytes"]
    assert plain["predicted_reserved_bytes"] != expandable["predicted_reserved_bytes"]
    assert "expandable segments" in expandable["method"] and "expandable" not in plain["method"]
    on_cpu = _estimate_json("--device", "cpu")
    assert on_cpu["predicted_reserved_bytes"] is None and on_cpu["predicted_device_bytes"] is None


def test_the_tracker_records_the_side_stream_an_allocation_was_made_on():
    # FSDP2 enters its copy-in and reduce-scatter streams with device_handle.stream(...) (torch.cpu.stream
    # when traced on the CPU): what is allocated inside carries the stream's number, the rest none.
    import torch

    from autotune.estimate.peak_parts import PeakPartsTracker

    tracker = PeakPartsTracker()
    copy_in, reduce_scatter = torch.cpu.Stream(), torch.cpu.Stream()
    with tracker:
        tracker.start_recording()
        a = torch.empty(1024)
        with torch.cpu.stream(copy_in):
            b = torch.empty(2048)
        with torch.cpu.stream(reduce_scatter):
            c = torch.empty(512)
        d = torch.empty(256)
        del b
    assert tracker.events == [(0, 4096), (1, 8192, 1), (2, 2048, 2), (3, 1024), (1, 0)]
    del a, c, d


def test_side_stream_events_survive_the_steps_repeats_and_cost_their_own_segments():
    # The same trace on one stream and with the gathered weights (40 MiB) on a side stream: the step's
    # activations (40 MiB) cannot take the gathered weights' freed block, so reserved holds both.
    one = [(0, 10 * MiB), (1, 40 * MiB), (1, 0), (2, 40 * MiB), (2, 0)]
    two = [(0, 10 * MiB), (1, 40 * MiB, 1), (1, 0), (2, 40 * MiB), (2, 0)]
    marks = TraceMarks(state=1, step=1, update=5)
    figures = [
        predict_cuda_memory(
            events,
            marks,
            tensor_peak_bytes=50 * MiB,
            card=gpu_spec("H100-80GB"),
            communication_bytes=0,
            ddp_gradient_bytes=0,
            alloc_conf=None,
        )
        for events in (one, two)
    ]
    assert figures[1].reserved_bytes - figures[0].reserved_bytes == 40 * MiB


def test_a_trace_is_replayed_once_for_the_configs_that_replay_it_alike(monkeypatch):
    # Compile on and off share a trace and every figure its replay reads: one replay answers both; DDP's buckets
    # (two ranks) are another replay.
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate import trace

    workload = Workload(model="builtin:llama-tiny", seq_len=32, global_batch=4, gpu="A100-80GB")
    config = TrialConfig(micro_batch=2, precision="bf16")
    traced = trace.trace_step(workload, config)
    replays = []
    real = trace.predict_cuda_memory
    monkeypatch.setattr(trace, "predict_cuda_memory", lambda *args, **kw: replays.append(kw) or real(*args, **kw))
    eager = trace.estimate_from_trace(traced, workload, config)
    compiled = trace.estimate_from_trace(traced, workload, config.replace(compile=True))
    assert len(replays) == 1 and compiled.predicted_reserved_bytes == eager.predicted_reserved_bytes
    assert compiled.cuda_parts == eager.cuda_parts and compiled.method != eager.method
    trace.estimate_from_trace(traced, workload.replace(nproc=2), config)
    assert len(replays) == 2
