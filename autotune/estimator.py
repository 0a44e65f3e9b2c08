"""Predict a config's peak memory without running it: the real training step on fake tensors.

The trial's own model build (checkpointing, LoRA, precision, optimizer) runs under PyTorch's
``FakeTensorMode``, where tensors have shapes and dtypes but no data, with the same live-bytes
tracker the CPU trials use counting their storages. So activations, logits, autocast's weight
copies and the optimizer's state come from the code that will really run, not from a formula;
a 7B model costs seconds and no memory.

What fake tensors cannot show is added or stated:

* ZeRO sharding and offload: DeepSpeed cannot run on fake tensors, so the step runs on plain
  PyTorch (a 16-bit model without autocast in fp16/bf16, as DeepSpeed trains) and the model
  states are replaced by what DeepSpeed's ZeRO-1/2 optimizer allocates (read from its source
  and checked against real 2-rank trials on a CPU): 16-bit (or fp32) weights and gradients, an
  fp32 master partition (a clone even in fp32) and Adam's m and v: 12 bytes per trainable
  parameter / N from stage 1, gradients / N from stage 2, weights / N at stage 3; offloaded
  states leave the device. DeepSpeed's own estimator says 2Ψ + 18Ψ/N for mixed-precision ZeRO-2:
  it adds the fp32 copy of the gradient partition (4Ψ/N), which lives only during the
  optimizer step; here it counts only where the step, not the backward, sets the peak.
  ZeRO-3 also keeps up to ``stage3_max_live_parameters`` (1e9) gathered weights through the
  forward and backward: for smaller models the whole model, as DeepSpeed's estimator (which
  counts only the largest layer) leaves out; they are counted as temporaries.
* Without ZeRO, more than one rank trains under DDP, whose all-reduce buckets hold a second
  copy of every gradient.
* What no tensor shows on a GPU (CUDA context, allocator reserve, library workspaces): unknown
  until calibrated on a GPU, so ``overhead_bytes`` is ``None`` and the prediction is of
  tensor bytes (what ``max_memory_allocated`` and the CPU tracker count).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

from autotune.errors import AutotuneError
from autotune.knobs import TrialConfig
from autotune.workload import Workload

__all__ = ["MemoryEstimate", "estimate_memory", "predict_memory"]

_OPTIMIZER_STEPS = 2   # the second step is the first with optimizer state, gradients and activations
ZERO3_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's default stage3_max_live_parameters (our configs keep it)
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

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryEstimate:
        fields = {k: v for k, v in data.items() if k != "describe"}
        return cls(**{**fields, "config": TrialConfig.from_dict(data["config"])})


def predict_memory(workload: Workload, config: TrialConfig, *, task: str | None = None,
                   timeout_s: float = 300) -> MemoryEstimate:
    """:func:`estimate_memory` in a fresh process, like a trial: the caller's process stays clean.

    Fake tensors, PEFT and Transformers' model code leave state behind that can crash a later
    estimate in the same process, so each runs in its own process, forked by a server that has
    the libraries imported already (:mod:`autotune.estimate_worker`, started on first use and
    kept for the caller's lifetime). Raises EstimateError when the estimate fails or takes
    longer than ``timeout_s``.
    """
    request = {"workload": workload.to_dict(), "config": config.to_dict(), "task": task}
    reply = _SERVER.ask(request, timeout_s)
    if "error" in reply:
        raise EstimateError(f"the estimate failed: {reply['error']}")
    return MemoryEstimate.from_dict(reply["ok"])


class _EstimateServer:
    """The caller's handle on one ``python -m autotune.estimate_worker`` process."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        with self._lock:
            process = self._running()
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], timeout_s)
            line = process.stdout.readline() if ready else ""
            if not line:
                self.close()  # a late answer must not be read as the next request's
                if not ready:
                    raise EstimateError(f"the estimate took more than {timeout_s:g} s")
                raise EstimateError("the estimate server exited")
            return json.loads(line)

    def _running(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "autotune.estimate_worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        return self._process

    def close(self) -> None:
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)  # the server and an estimate it forked
            self._process.wait()
            self._process = None


_SERVER = _EstimateServer()
atexit.register(_SERVER.close)


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
            if config.uses_deepspeed and engine.autocast_dtype is not None:
                # DeepSpeed's fp16/bf16 modes train a 16-bit model (no autocast): 16-bit activations.
                _to_16_bit(engine)
            parameters = _bytes([*engine.model.parameters(), *engine.model.buffers()])
            activations, gradients, optimizer_state = _fake_steps(engine, tracker)
    peak = tracker.peak_bytes
    method = "fake-tensor training step"
    if config.uses_deepspeed:
        states = parameters + gradients + optimizer_state
        from autotune.device import detect_device

        on_cpu = detect_device(workload.device).type == "cpu"
        parameters, gradients, optimizer_state, step_extra = _zero_states(engine, config, workload.nproc,
                                                                          offload_stays=on_cpu)
        states_now = parameters + gradients + optimizer_state
        peak = max(peak - states + states_now + _zero3_gathered(engine, config), states_now + step_extra)
        method += " + ZeRO model-state arithmetic"
    elif workload.nproc > 1:
        # DDP copies every gradient into its all-reduce buckets (gradient_as_bucket_view is off).
        peak += gradients
        gradients *= 2
        method += " + DDP gradient buckets"
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


def _to_16_bit(engine: Any) -> None:
    """Cast the model to the autocast dtype and train it without autocast, as DeepSpeed does.

    Fake parameters cannot be cast in place (``Module._apply`` cannot swap them), so each one is
    replaced by a 16-bit copy (tied weights stay tied) and the optimizer is rebuilt over them.
    """
    import torch

    dtype = engine.autocast_dtype
    copies: dict[int, torch.nn.Parameter] = {}
    for module in engine.model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_floating_point():
                if id(param) not in copies:
                    copies[id(param)] = torch.nn.Parameter(param.detach().to(dtype),
                                                           requires_grad=param.requires_grad)
                module._parameters[name] = copies[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)
    # Its state is replaced by DeepSpeed's arithmetic; only its temporaries matter here.
    engine.optimizer = torch.optim.AdamW([p for p in engine.model.parameters() if p.requires_grad],
                                         lr=engine.optimizer.defaults["lr"])
    engine.autocast_dtype = None


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


def _zero_states(engine: Any, config: TrialConfig, ranks: int, *,
                 offload_stays: bool) -> tuple[int, int, int, int]:
    """Per-rank (parameters, gradients, optimizer state, step-time extra) bytes under DeepSpeed ZeRO.

    ``offload_stays``: the device is the host (a CPU trial), so offloaded states stay in the
    memory measured, joined by the offload path's host buffers (a staging copy of the weight
    partition and an fp32 gradient partition).

    The step-time extra is the gradient partition cast to fp32 for the optimizer in fp16/bf16:
    it lives only during ``step()``, after the activations are gone (counted by DeepSpeed's
    estimator as part of its 18 bytes per parameter, which would overstate a peak set by activations).
    """
    total = engine.total_params
    trainable = engine.trainable_params
    mixed = config.precision in ("fp16", "bf16")
    # The model's own weights and gradients: 16-bit in DeepSpeed's fp16/bf16 modes.
    parameters = (2 if mixed else 4) * total
    gradients = (2 if mixed else 4) * trainable
    # The optimizer's partition: an fp32 master copy of the weights (a clone even in fp32) and Adam's m, v.
    optimizer_state = 12 * trainable
    step_extra = 4 * trainable if mixed else 0  # in fp32, .to(fp32) returns the gradient itself
    stage = config.zero_stage or 0
    if stage >= 1:
        optimizer_state //= ranks
        step_extra //= ranks
    if stage >= 2:
        gradients //= ranks
    if stage == 3:
        parameters //= ranks
    if config.offload != "none" and offload_stays:
        optimizer_state += ((2 if mixed else 4) + 4) * trainable // ranks
    elif config.offload != "none":
        optimizer_state = step_extra = 0
        if config.offload == "optimizer+params":
            parameters = 0
    return parameters, gradients, optimizer_state, step_extra


def _zero3_gathered(engine: Any, config: TrialConfig) -> int:
    """Bytes of whole weights ZeRO-3 gathers for the forward and backward and keeps until the step.

    DeepSpeed keeps up to ``stage3_max_live_parameters`` gathered (and reuses them in the
    backward), so below that many parameters the whole model is live as in ZeRO-1. They are
    counted as temporaries: the rank's own shard is its ``parameters``.
    """
    if config.zero_stage != 3:
        return 0
    return (2 if config.precision in ("fp16", "bf16") else 4) * min(engine.total_params, ZERO3_MAX_LIVE_PARAMETERS)


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views counted once)."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()  # the C storage's address: one entry per storage
    return sum(storages.values())
