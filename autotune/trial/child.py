"""The trial process: ``python -m autotune.trial.child SPEC.json OUT_DIR`` (one per rank under torchrun).

It builds the workload's model with the trial's knobs, runs untimed warm-up steps and timed
optimizer steps, and writes ``OUT_DIR/rank<R>.json``: a TrialResult as JSON, whatever happened.
Its status comes from the exception's type (see :mod:`autotune.trial.failures`); when the process
dies without writing, the runner classifies it from the exit signal instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.trial.spec import TrialSpec

if TYPE_CHECKING:
    import torch

__all__ = ["main", "record_peaks", "error_tail", "write_record", "LAUNCH_TIME_ENV"]

LAUNCH_TIME_ENV = "AUTOTUNE_LAUNCH_TIME"
ERROR_TAIL_LINES = 12


def main(argv: list[str]) -> int:
    from autotune.trial.lifeline import die_with_parent, expected_parent

    # A single rank is the runner's child; a rank under torchrun is torchrun's.
    die_with_parent(expected_parent() if "LOCAL_RANK" not in os.environ else None)
    spec_path, out_dir = Path(argv[0]), Path(argv[1])
    rank = int(os.environ.get("RANK", "0"))
    record: dict[str, Any] = {"config": None, "status": "error", "phases": {}}
    try:
        spec = TrialSpec.read(spec_path)
        record["config"] = spec.config.to_dict()
        _run(spec, record)
        record["status"] = "ok"
        code = 0
    except BaseException as exc:  # noqa: BLE001 - every way a trial ends is recorded
        from autotune.trial.failures import classify_exception

        record["status"] = classify_exception(exc).value
        record["error"] = error_tail(exc)
        code = 1
    write_record(out_dir / f"rank{rank}.json", record)
    return code


def _run(spec: TrialSpec, record: dict[str, Any]) -> None:
    import torch

    started = time.time()
    launched = float(os.environ.get(LAUNCH_TIME_ENV, started))
    record["phases"]["startup_s"] = started - launched
    workload, config, budget = spec.workload, spec.config, spec.memory_budget_bytes
    device = _init_device(spec.device_type)
    if spec.cpu_cores:  # before any thread starts: they inherit the pinning
        from autotune.trial.cpu_cores import use_rank_cores

        record.update(use_rank_cores(spec.cpu_cores, int(os.environ.get("LOCAL_RANK", "0")), workload.nproc, torch))
    world_size = _init_distributed(workload, config, device)
    record.update(
        device=str(device),
        world_size=world_size,
        memory_budget_bytes=budget,
        grad_accum_steps=config.grad_accum_steps(workload),
    )

    from autotune.trial.memory import cuda_memory_history

    tracker = None
    if device.type == "cuda":
        from autotune.trial.memory import limit_cuda_memory

        if budget is not None:
            limit_cuda_memory(budget, device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        from autotune.trial.memory import LiveBytesTracker

        tracker = LiveBytesTracker(budget)
    if config.uses_deepspeed:
        import deepspeed  # noqa: F401 - imported before the tracker starts counting

    try:
        with (
            tracker if tracker is not None else contextlib.nullcontext(),
            _gloo_copies(device, world_size),
            cuda_memory_history(device, record),  # opt-in: AUTOTUNE_CUDA_MEMORY_HISTORY
        ):
            _train(
                spec,
                record,
                device=device,
                world_size=world_size,
                peak_so_far=lambda: _peak_allocated(device, tracker),
            )
    finally:
        record_peaks(record, device, tracker)


def _train(
    spec: TrialSpec,
    record: dict[str, Any],
    *,
    device: torch.device,
    world_size: int,
    peak_so_far: Any,
) -> None:
    from autotune.levers.optimizer import optimizer_library
    from autotune.prepare.quantize import quantization_line
    from autotune.trial.engine import build_engine
    from autotune.trial.measure import time_steps
    from autotune.trial.result import TOKENS_PER_S

    workload, config = spec.workload, spec.config
    assert spec.task is not None, "autotune's own trials carry their task (the runner resolves it)"
    begin = time.perf_counter()
    engine = build_engine(workload=workload, config=config, task=spec.task, device=device, world_size=world_size)
    record.update(trainable_params=engine.trainable_params, total_params=engine.total_params)
    record["phases"]["build_s"] = time.perf_counter() - begin
    record["build_peak_bytes"] = peak_so_far()  # tells a build-time peak from a training-step one

    def sync() -> None:
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    if config.compile:
        record["eager_step_s"], record["phases"]["compile_s"] = _compile(engine, sync)
    times = time_steps(
        engine.step,
        sync,
        warmup=spec.warmup_steps,
        steps=spec.measure_steps,
        max_steps=spec.max_measure_steps,
        agree=_agreed(world_size, device),
        outpaced_s=spec.outpaced_step_s,
        warm_up=engine.warm_up,
        enough_s=spec.enough_measured_s,
    )
    # Per optimizer step, from the median step: a few steps slowed by another process move a
    # mean, not a median (the spread says how much they disagreed).
    record["phases"].update(warmup_s=times.warmup_s, measure_s=times.total_s)
    tokens_per_sample = workload.tokens_per_sample(spec.task) if engine.throughput_unit == TOKENS_PER_S else None
    record.update(
        samples_per_s=workload.global_batch / times.median_s,
        tokens_per_s=None if tokens_per_sample is None else workload.global_batch * tokens_per_sample / times.median_s,
        throughput_unit=engine.throughput_unit,
        step_time_median_s=times.median_s,
        step_time_iqr_s=times.iqr_s,
        step_time_spread=times.spread,
        disturbed_steps=times.disturbed_steps,
        measured_steps=len(times.seconds),
        outpaced=times.outpaced,
        final_loss=times.last_loss,
        optimizer_state_bytes=engine.optimizer_state_bytes(),
        optimizer=optimizer_library(config),
        quantized_base=quantization_line(config) or None,
    )
    if config.compile:
        from autotune.trial.measure import compile_payoff_steps

        record["compile_payoff_steps"] = compile_payoff_steps(
            record["phases"]["compile_s"], record["eager_step_s"], times.median_s
        )


def _compile(engine: Any, sync: Any) -> tuple[float, float]:
    """Time one eager step (after one that makes the optimizer's state), then compile and time the
    first compiled step: (eager step seconds, compile seconds). Neither is in tokens/s."""
    engine.step()
    sync()
    begin = time.perf_counter()
    engine.step()
    sync()
    eager_s = time.perf_counter() - begin
    engine.compile()
    begin = time.perf_counter()
    engine.step()
    sync()
    return eager_s, time.perf_counter() - begin


def _gloo_copies(device: Any, world_size: int) -> Any:
    """Between CPU ranks (gloo), each reduce-scatter's copy of its input and each all-gather's input let go of before
    it returns: in every run, not only where gloo's worker thread let go of it first
    (see :mod:`autotune.trial.collectives`)."""
    if device.type != "cpu" or world_size == 1:
        return contextlib.nullcontext()
    from autotune.trial.collectives import gloo_collectives_let_go

    return gloo_collectives_let_go()


def _agreed(world_size: int, device: Any) -> Any:
    """One more timed step only if any rank wants one: every rank must run the same steps."""
    if world_size == 1:
        return lambda more: more

    def agree(more: bool) -> bool:
        import torch
        import torch.distributed as dist

        wish = torch.tensor([int(more)], device=device)
        dist.all_reduce(wish, op=dist.ReduceOp.MAX)
        return bool(wish.item())

    return agree


def _init_device(device_type: str) -> Any:
    import torch

    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _init_distributed(workload: Any, config: Any, device: Any) -> int:
    """Join the torchrun group; DeepSpeed and FSDP need a (one-rank) group even without torchrun."""
    if workload.nproc == 1 and not config.uses_deepspeed and not config.uses_fsdp:
        return 1
    if "WORLD_SIZE" not in os.environ:  # a single-rank DeepSpeed or FSDP trial
        from autotune.trial.rendezvous import one_node_ranks

        os.environ.update(one_node_ranks(1)[0])
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    return dist.get_world_size()


def _peak_allocated(device: Any, tracker: Any) -> int:
    if device.type == "cuda":
        from autotune.trial.memory import cuda_peaks

        return cuda_peaks(device)[0]
    return tracker.peak_bytes


def record_peaks(record: dict[str, Any], device: Any, tracker: Any) -> None:
    if device.type == "cuda":
        from autotune.trial.memory import cuda_peaks

        allocated, reserved = cuda_peaks(device)
        record.update(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, peak_memory_bytes=reserved)
    elif tracker is not None:
        record.update(peak_allocated_bytes=tracker.peak_bytes, peak_memory_bytes=tracker.peak_bytes)


def error_tail(exc: BaseException) -> str:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return "\n".join(lines[-ERROR_TAIL_LINES:])


def write_record(path: Path, record: dict[str, Any], *, replace: bool = True) -> None:
    """Write ``record`` to ``path`` whole or not at all; with ``replace=False``, keep a record already there."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    if replace:
        os.replace(tmp, path)
        return
    with contextlib.suppress(FileExistsError):
        os.link(tmp, path)  # atomic, and fails where the path exists
    tmp.unlink()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
