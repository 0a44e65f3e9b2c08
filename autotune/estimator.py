"""Predict a config's peak memory without running it: the real training step on fake tensors.

The trial's own model build (checkpointing, LoRA, precision, optimizer) runs under PyTorch's
``FakeTensorMode``, where tensors have shapes and dtypes but no data, with the same live-bytes
tracker the CPU trials use counting their storages. So activations, logits, autocast's weight
copies and the optimizer's state come from the code that will really run, not from a formula;
a 7B model costs seconds and no memory.

What fake tensors cannot show is added or stated:

* ZeRO sharding and offload: DeepSpeed cannot run on fake tensors, so the step runs on plain
  PyTorch and the model states are replaced with DeepSpeed's arithmetic (the ZeRO paper's
  2/2/12 bytes per parameter in mixed precision, 4/4/8 in fp32; optimizer states / N from stage
  1, gradients / N from stage 2, parameters / N at stage 3; offloaded states leave the device).
  DeepSpeed's own estimator says 2Ψ + 18Ψ/N for ZeRO-2: its optimizer also keeps an fp32
  partition of the gradients (4Ψ/N) that the paper's count leaves out. Which one matches
  ``max_memory_allocated`` is for a GPU measurement to settle; until then this follows the paper.
* What no tensor shows on a GPU (CUDA context, allocator reserve, library workspaces): unknown
  until calibrated on a GPU, so ``overhead_bytes`` is ``None`` and the prediction is of
  tensor bytes (what ``max_memory_allocated`` and the CPU tracker count).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

from autotune.errors import AutotuneError
from autotune.knobs import TrialConfig
from autotune.workload import Workload

__all__ = ["MemoryEstimate", "estimate_memory", "predict_memory"]

_OPTIMIZER_STEPS = 2   # the second step is the first with optimizer state, gradients and activations
_MICRO_STEPS = 2       # accumulation past the second micro-step adds nothing: gradients exist by then


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Predicted peak bytes of one rank, and where they go."""

    config: TrialConfig
    predicted_peak_bytes: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int        # saved by the forward for the backward (largest micro-step)
    temporaries_bytes: int        # the rest of the peak: workspaces, casts, the backward's transients
    overhead_bytes: int | None    # what no tensor shows (GPU); None until calibrated
    method: str
    seconds: float

    def fits(self, limit_bytes: int) -> bool:
        return self.predicted_peak_bytes <= limit_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(), "describe": self.config.describe(),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "parameters_bytes": self.parameters_bytes, "gradients_bytes": self.gradients_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes, "activations_bytes": self.activations_bytes,
            "temporaries_bytes": self.temporaries_bytes, "overhead_bytes": self.overhead_bytes,
            "method": self.method, "seconds": self.seconds,
        }


def predict_memory(workload: Workload, config: TrialConfig, *, task: str | None = None,
                   timeout_s: float = 300) -> MemoryEstimate:
    """:func:`estimate_memory` in a fresh process, like a trial: the caller's process stays clean.

    Fake tensors, PEFT and Transformers' model code leave state behind (and, with some models,
    a heap that glibc aborts on at interpreter exit); a process per estimate keeps that away from
    the tuner. Raises EstimateError when the estimate fails.
    """
    import subprocess
    import sys

    spec = json.dumps({"workload": workload.to_dict(), "config": config.to_dict(), "task": task})
    try:
        proc = subprocess.run([sys.executable, "-m", "autotune.estimator"], input=spec, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise EstimateError(f"the estimate took more than {timeout_s:g} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EstimateError(f"the estimate failed (exit {proc.returncode}): {tail}")
    data = json.loads(lines[-1])
    data["config"] = config
    data.pop("describe", None)
    return MemoryEstimate(**data)


class EstimateError(AutotuneError):
    """The estimator could not trace this model or config."""


def estimate_memory(workload: Workload, config: TrialConfig, *, task: str | None = None) -> MemoryEstimate:
    """Predict the peak tensor memory of one rank training ``workload`` with ``config`` (in this process)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.engine import build_engine
    from autotune.memory import LiveBytesTracker
    from autotune.models import resolve_task

    started = time.perf_counter()
    task = task or resolve_task(workload)
    # DeepSpeed cannot run on fake tensors: measure the plain step, then apply ZeRO's arithmetic.
    plain = config.replace(zero_stage=None, offload="none")
    if plain.precision == "tf32":
        plain = plain.replace(precision="fp32")  # same tensors; tf32 only changes the matmul kernels
    tracker = LiveBytesTracker(None)
    with warnings.catch_warnings(), _adapters_stay_put():
        warnings.simplefilter("ignore")  # deprecation chatter from model code; nothing runs for real
        # Model code treats fake tensors as tracing: no data-dependent check runs.
        with FakeTensorMode(allow_non_fake_inputs=True), tracker:
            engine = build_engine(workload=workload.replace(nproc=1), config=plain, task=task,
                                  device=torch.device("cpu"), world_size=1)
            parameters = _bytes([*engine.model.parameters(), *engine.model.buffers()])
            activations, gradients, optimizer_state = _fake_steps(engine, tracker)
    peak = tracker.peak_bytes
    method = "fake-tensor training step"
    if config.uses_deepspeed:
        states = parameters + gradients + optimizer_state
        parameters, gradients, optimizer_state = _zero_states(engine, config, workload.nproc)
        peak += parameters + gradients + optimizer_state - states
        method += " + ZeRO model-state arithmetic"
    temporaries = max(0, peak - parameters - gradients - optimizer_state - activations)
    return MemoryEstimate(config=config, predicted_peak_bytes=peak, parameters_bytes=parameters,
                          gradients_bytes=gradients, optimizer_state_bytes=optimizer_state,
                          activations_bytes=activations, temporaries_bytes=temporaries, overhead_bytes=None,
                          method=method, seconds=time.perf_counter() - started)


@contextlib.contextmanager
def _adapters_stay_put() -> Iterator[None]:
    """PEFT moves each new adapter to its base layer's device, which fake parameters cannot do
    (``Module._apply`` cannot swap them). Under fake tensors both are on the same fake CPU already."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        yield
        return
    import torch

    original_move = BaseTunerLayer._move_adapter_to_device_of_base_layer
    original_to = torch.nn.Module.to

    def to_unless_a_no_op(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not kwargs and len(args) == 1 and isinstance(args[0], (torch.device, str)) \
                and torch.device(args[0]).type == "cpu":
            return module  # everything is on the fake CPU already
        return original_to(module, *args, **kwargs)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *args, **kwargs: None
    torch.nn.Module.to = to_unless_a_no_op
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original_move
        torch.nn.Module.to = original_to


def _fake_steps(engine: Any, tracker: Any) -> tuple[int, int, int]:
    """The trial's step on fake tensors; returns (activations, gradients, optimizer state) bytes.

    Like the trial's step except that nothing reads a value back (``.item()`` has no data here)
    and fp16's loss scaler is left out (its unscale checks values; its state is a few scalars).
    """
    import torch

    from autotune.engine import _loss_of

    activations = gradients = 0
    micro_steps = min(engine.accum, _MICRO_STEPS)
    for _ in range(_OPTIMIZER_STEPS):
        for _ in range(micro_steps):
            before = tracker.live_bytes
            with torch.autocast("cpu", dtype=engine.autocast_dtype, enabled=engine.autocast_dtype is not None):
                loss = _loss_of(engine.forward_model(**engine.batch)) / engine.accum
            activations = max(activations, tracker.live_bytes - before)
            loss.backward()
            del loss
        gradients = _bytes(p.grad for p in engine.model.parameters() if p.grad is not None)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
    state = _bytes(v for s in engine.optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.numel() > 1)
    return activations, gradients, state


def _zero_states(engine: Any, config: TrialConfig, ranks: int) -> tuple[int, int, int]:
    """Per-rank (parameters, gradients, optimizer state) bytes under DeepSpeed ZeRO."""
    total = engine.total_params
    trainable = engine.trainable_params
    mixed = config.precision in ("fp16", "bf16")
    # Mixed precision: 16-bit weights and gradients, fp32 master weights + Adam m and v (12 B).
    parameters = (2 if mixed else 4) * total
    gradients = (2 if mixed else 4) * trainable
    optimizer_state = (12 if mixed else 8) * trainable
    stage = config.zero_stage or 0
    if stage >= 1:
        optimizer_state //= ranks
    if stage >= 2:
        gradients //= ranks
    if stage == 3:
        parameters //= ranks
    if config.offload in ("optimizer", "optimizer+params"):
        optimizer_state = 0
    if config.offload == "optimizer+params":
        parameters = 0
    return parameters, gradients, optimizer_state


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views counted once)."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()  # the C storage's address: one entry per storage
    return sum(storages.values())


if __name__ == "__main__":
    # python -m autotune.estimator < {"workload": ..., "config": ..., "task": ...}: one JSON line out.
    request = json.loads(sys.stdin.read())
    result = estimate_memory(Workload.from_dict(request["workload"]), TrialConfig.from_dict(request["config"]),
                             task=request.get("task"))
    sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: fake tensors' finalisers are not worth waiting (or crashing) for
