"""The trial's step on fake tensors, as the engine the trace builds runs it: the optimizer's state made first,
then the forwards and backwards (or a pipeline rank's schedule) and the update, with the tracker told which
storages are which model state and where each phase begins; and what the engine is changed to first, to run
as the traced config's real step runs on its device.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from autotune.estimate.results import ModelStates
from autotune.estimate.step_costs import BACKWARD, FORWARD, UPDATE, CostRecorder, StepCosts
from autotune.levers.activation_offload import ActivationOffload
from autotune.levers.grad_reduction import gradient_sync
from autotune.levers.optimizer import become_update_twin

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.estimate.measured_with import MeasuredWith

__all__ = ["fake_steps", "run_as_on_target", "step_as_update_twin"]

_MICRO_STEPS = 2  # accumulation past the second micro-step adds nothing: gradients exist by then


def run_as_on_target(
    engine: Any, tracker: Any, config: TrialConfig, *, target: str, traced: str, measured_with: MeasuredWith
) -> None:
    """Change the engine built for ``config``'s plain step to run as ``config``'s real step runs on the ``target``
    device, traced on the ``traced`` one."""
    if config.uses_deepspeed and engine.autocast_dtype is not None:
        # DeepSpeed's fp16/bf16 modes train a 16-bit model (no autocast): 16-bit activations.
        _to_16_bit(engine)
    _step_tensors_together(engine.optimizer, _foreach(target, measured_with))
    if engine.offload is not None:
        # The same hooks the trial's forward runs in, their host copies left out of the device's bytes
        # (on a CPU trace of a CUDA step the host is the traced device too); no pinning on fake tensors.
        engine.offload = ActivationOffload(device_type=traced, pin_memory=False, host=tracker.on_host)
    if target == "cuda" and config.optimizer == "adamw-8bit":
        _steps_as_one_kernel(engine.optimizer, tracker)


def step_as_update_twin(engine: Any, twin: TrialConfig, *, target: str, measured_with: MeasuredWith) -> None:
    """From here on, step the optimizer of ``engine`` (run as on ``target``) as ``twin`` steps it: the
    :func:`autotune.levers.optimizer.update_twin` of the config it was built for."""
    become_update_twin(engine.optimizer, twin)
    _step_tensors_together(engine.optimizer, _foreach(target, measured_with))


def _foreach(target: str, measured_with: MeasuredWith) -> bool:
    """Whether an unfused optimizer steps each operation over all its tensors at once (see
    :func:`_step_tensors_together`): on CUDA, by the PyTorch 2 default."""
    return target == "cuda" and not measured_with.pytorch1_step


def _steps_as_one_kernel(optimizer: Any, tracker: Any) -> None:
    """8-bit AdamW steps each parameter in one kernel on CUDA: bitsandbytes' fused CUDA kernel, or torchao's
    step compiled by Inductor. The trace runs torchao's step eagerly (no compile under fake tensors), whose
    dequantized fp32 moments, casts and updates are tensors of the parameter's size each, none of which those
    kernels allocate: what a step makes and frees is left out of the count; what it keeps (its state) is counted."""
    for one in getattr(optimizer, "optimizers", {}).values() or [optimizer]:  # StepInBackward: one per parameter
        step = one.step

        def fused_step(*args: Any, step: Any = step, **kwargs: Any) -> Any:
            with tracker.one_kernel():
                return step(*args, **kwargs)

        one.step = fused_step


def _step_tensors_together(optimizer: Any, foreach: bool) -> None:
    """An unfused optimizer steps with ``foreach`` (each operation over the list of all tensors at
    once: PyTorch's default on CUDA, one temporary the size of all the moments) or tensor by tensor
    (the CPU's default: one temporary the size of one tensor). A fused one keeps its own kernel."""
    for group in getattr(optimizer, "param_groups", ()):
        if not group.get("fused"):
            group["foreach"] = foreach


def _step(optimizer: Any) -> None:
    with _on_local_shards(optimizer):
        optimizer.step()


@contextlib.contextmanager
def _on_local_shards(optimizer: Any) -> Iterator[None]:
    """Step an elementwise optimizer (PyTorch's Adam, AdamW or SGD) over its DTensor parameters' local shards
    (FSDP's and tensor parallel's), with their gradients' and moments' shards. DTensor's dispatch of each op of
    the step would run that same op on the same shards, after working out their layout: worked out again in
    every forked trace, that was a twentieth of a 7B plan's time. The bytes, the FLOPs and the order of allocations
    are the same. Not where a gradient's layout differs from its parameter's (tensor parallel's replicated
    weights have partial gradients): DTensor moves it first. The state is kept as DTensors between steps, as
    the rest of the trace reads it."""
    import torch
    from torch.distributed.tensor import DTensor

    from autotune.estimate.peak_parts import local_shard

    sharded = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"] if isinstance(p, DTensor)]
    if (
        not sharded
        or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
        or any(p.grad is not None and not _laid_out_as(p.grad, p) for p in sharded)
    ):
        yield
        return
    shard_of = {id(p): p._local_tensor for p in sharded}
    groups = [group["params"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = [shard_of.get(id(p), p) for p in group["params"]]
    for p in sharded:
        shard = shard_of[id(p)]
        shard.grad = local_shard(p.grad)
        if p in optimizer.state:
            optimizer.state[shard] = {k: local_shard(v) for k, v in optimizer.state.pop(p).items()}
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = params
        for p in sharded:
            shard = shard_of[id(p)]
            shard.grad = None
            if shard in optimizer.state:
                optimizer.state[p] = {k: _like(p, v) for k, v in optimizer.state.pop(shard).items()}


def _laid_out_as(gradient: Any, parameter: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(gradient, DTensor) and gradient.placements == parameter.placements


def _like(parameter: Any, value: Any) -> Any:
    """``value`` (a state tensor made on ``parameter``'s shard) as the DTensor the optimizer makes from the
    parameter itself, laid out as it is; anything else (a step count) as it is."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(value, torch.Tensor) or value.shape != parameter._local_tensor.shape:
        return value
    meta = TensorMeta(parameter.shape, parameter.stride(), value.dtype)
    spec = DTensorSpec(parameter.device_mesh, parameter.placements, tensor_meta=meta)
    return DTensor(value, spec, requires_grad=False)


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
                    copies[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
                module._parameters[name] = copies[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)
    # Its state is replaced by DeepSpeed's arithmetic; only its temporaries matter here.
    engine.optimizer = torch.optim.AdamW(
        [p for p in engine.model.parameters() if p.requires_grad], lr=engine.optimizer.defaults["lr"]
    )
    engine.autocast_dtype = None


def fake_steps(
    engine: Any,
    tracker: Any,
    *,
    keep_gradients: bool = False,
    record: bool = False,
    before_update: Callable[[Any], None] | None = None,
) -> tuple[ModelStates, int, StepCosts]:
    """The trial's step on fake tensors; returns the whole model states, the FLOPs per sample
    of its forwards and backwards, and every operator's costs (for the step-time model).

    Like the trial's step except that nothing reads a value back (``.item()`` has no data here)
    and fp16's loss scaler is left out (its unscale checks values; its state is a few scalars).
    The optimizer makes its state on its first step: it makes it here from zero gradients, so
    the one step traced has the state from its start, as every step after the first (the first
    creates it midway, at the same peak). A whole first step traced only to create the state
    cost as long as the step itself. ``keep_gradients``: zero_grad zeroes them in place (PyTorch
    1.x's default) instead of freeing them. ``record``: the tracker keeps every allocation and free
    in order, with where each phase begins (what a CUDA workload's allocator replay needs).
    A pipeline's rank (:class:`autotune.trial.engine.PipelineEngine`) runs its schedule instead of the
    micro steps: see :func:`_pipeline_forwards_and_backwards`. ``before_update(engine)``: called as the
    update begins (where a trace forks to trace another optimizer's update on the same forwards and backwards)."""
    import torch

    from autotune.prepare.quantize import quantization_constants
    from autotune.trial.engine import PipelineEngine

    # A quantized base's scales are model states like the weights they scale.
    parameters = [*engine.model.parameters(), *engine.model.buffers(), *quantization_constants(engine.model)]
    tracker.tag(parameters, "parameters")
    trainable = [p for p in engine.model.parameters() if p.requires_grad]
    if record:
        tracker.start_recording()  # the model's storages, then everything the step does
    tracker.mark("state")
    for p in trainable:
        p.grad = torch.zeros_like(p)
    _step(engine.optimizer)
    engine.optimizer.zero_grad(set_to_none=not keep_gradients)
    if keep_gradients:
        tracker.tag([p.grad for p in trainable], "gradients")
    states = [
        v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    tracker.tag(states, "optimizer_state")
    for p in trainable:
        # After the step inside backward's own hook (registered first), which frees the gradient.
        p.register_post_accumulate_grad_hook(lambda p: tracker.tag([p.grad] if p.grad is not None else [], "gradients"))
    tracker.reset_peak()
    tracker.mark("step")
    tracker.count_flops = True
    if isinstance(engine, PipelineEngine):
        micro_steps, loss = engine.accum, _pipeline_forwards_and_backwards(engine, tracker)
        pipeline: Any = engine.model  # autotune.prepare.pipeline.Pipeline: this rank's stages
        hidden = pipeline.stages[0].hidden_size
    else:
        micro_steps = min(engine.accum, _MICRO_STEPS)
        loss = _micro_steps(engine, tracker, micro_steps)
        hidden = getattr(getattr(engine.model, "config", None), "hidden_size", None)
    tracker.count_flops = False
    gradients = _bytes(p.grad for p in trainable if p.grad is not None)
    if before_update is not None:
        before_update(engine)
    tracker.mark("update")
    tracker.costs.phase = UPDATE
    _step(engine.optimizer)
    engine.optimizer.zero_grad(set_to_none=not keep_gradients)
    del loss  # the last micro step's graph, alive through the update as in the trial's step
    tracker.mark("end")  # what is freed after it (the fake model, as the trace lets it go) is no step's
    tracker.costs.phase = None
    samples = micro_steps * engine.config.micro_batch
    every = list(engine.model.parameters())
    costs = tracker.costs.costs(
        micro_batch=engine.config.micro_batch,
        micro_steps=micro_steps,
        trainable_parameters=sum(p.numel() for p in trainable),
        parameters=sum(p.numel() for p in every),
        parameter_tensors=len(every),
        hidden_size=hidden if isinstance(hidden, int) else None,
    )
    return ModelStates(_bytes(parameters), gradients, _bytes(states)), tracker.flops // samples, costs


def _micro_steps(engine: Any, tracker: Any, micro_steps: int) -> Any:
    """The step's forwards and backwards, ``micro_steps`` of them; returns the last micro step's loss."""
    import torch

    from autotune.models.batches import loss_of

    with _layers_marked(engine.model, tracker.costs):
        for micro in range(micro_steps):
            # The traced last one stands for the step's last (it reduces what the ones before accumulated).
            with gradient_sync(engine.model, engine.config, last=micro == micro_steps - 1):
                tracker.in_forward, tracker.costs.phase = True, FORWARD
                with (
                    torch.autocast(
                        engine.device.type, dtype=engine.autocast_dtype, enabled=engine.autocast_dtype is not None
                    ),
                    engine.saving(),
                ):
                    # Assigned over the last micro step's, as the trial's loop (and a user's) does: its graph
                    # lives until then, and with it what a backward node keeps outside its saved tensors
                    # (bitsandbytes' int8 layers keep their input as an attribute of the node).
                    loss = loss_of(engine.forward_model(**engine.batch)) / engine.accum
                tracker.in_forward, tracker.costs.phase = False, BACKWARD
                loss.backward()
    return loss


@contextlib.contextmanager
def _layers_marked(model: Any, costs: CostRecorder) -> Iterator[None]:
    """While inside, the forwards of the layers activation checkpointing would wrap (Transformers'
    GradientCheckpointingLayer) mark their operators, so that the step-time model can rerun their
    forward for a checkpointed twin of this step without tracing it. A model without such layers is
    left unmarked: the whole forward then stands for theirs."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older Transformers: nothing to mark by
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    hooks = [layer.register_forward_pre_hook(costs.enter_layer) for layer in layers]
    hooks += [layer.register_forward_hook(costs.leave_layer) for layer in layers]
    costs.layers_marked = bool(layers)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _pipeline_forwards_and_backwards(engine: Any, tracker: Any) -> Any:
    """One pipeline rank's schedule over every micro batch of the step, in the schedule's order: the stages'
    forwards marked as forward, everything else it runs as backward. Returns the loss (None off the last
    stage)."""
    import torch

    def forward_begins(*_: Any) -> None:
        tracker.in_forward, tracker.costs.phase = True, FORWARD

    def forward_ends(*_: Any) -> None:
        tracker.in_forward, tracker.costs.phase = False, BACKWARD

    stages = engine.model.stages
    hooks = [stage.register_forward_pre_hook(forward_begins) for stage in stages]
    hooks += [stage.register_forward_hook(forward_ends) for stage in stages]
    tracker.costs.phase = BACKWARD
    try:
        with torch.autocast(engine.device.type, dtype=engine.autocast_dtype, enabled=engine.autocast_dtype is not None):
            return engine.model.step(**engine.batch)
    finally:
        for hook in hooks:
            hook.remove()


def _bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views counted once)."""
    from autotune.trial.memory import storages_of

    storages: dict[int, int] = {}
    for storage in (storage for tensor in tensors for storage in storages_of(tensor)):
        storages[storage._cdata] = storage.nbytes()  # the C storage's address: one entry per storage
    return sum(storages.values())
