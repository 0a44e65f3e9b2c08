"""What one traced training step asks of a device, operator by operator: FLOPs and bytes moved.

The estimator's fake-tensor trace dispatches every operator the real step runs, with the kernels the
target device would pick (recomputed forwards under checkpointing included, as the backward reruns
them). Each operator that launches a kernel is counted here: its FLOPs (PyTorch's flop counter, the
matmul-class ops), the bytes it reads and writes, the dtype it computes in, and whether it is a
collective. Views launch nothing and move nothing: they are left out.

Nothing here knows a device. :mod:`autotune.estimate.step_time` turns these counts into seconds
against a device's roofline. The counts are kept per sample where they grow with the micro batch
(activations, FLOPs) and whole where they do not (weights, gradients, optimizer state: storages the
tracker has tagged as model states), so one trace answers every micro batch of its family.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["OpCost", "StepCosts", "CostRecorder", "counted_flops"]

# Phases of a traced step: the forward of a micro step, its backward (recomputed forwards
# included), the optimizer's update once per step.
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
MATMUL, ATTENTION, COLLECTIVE, OTHER = "matmul", "attention", "collective", "other"
# A compiled step's operator that joins the kernel of the one before it (``OpCost.fusable``): it launches nothing,
# and moves its ``fused_*_bytes`` (see OpCost).
FUSED = "fused"
# Causal attention kernels (flash, memory-efficient) skip the masked half of the score blocks;
# PyTorch's flop counter counts the whole square.
_CAUSAL_WORK = 0.5
_NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "lift_fresh",
    "_local_scalar_dense",
    "set_",
    "resize_",
    "record_stream",
}


@dataclass(frozen=True)
class OpCost:
    """Operators of one kind that cost the same, and how many times the step runs them."""

    phase: str  # forward, backward or update
    kind: str  # matmul, attention, collective or other
    name: str  # the ATen operator
    dtype: str  # the dtype it computes in (a matmul's inputs)
    flops: float  # per sample (forward/backward) or whole (update)
    fixed_bytes: float  # moved whatever the micro batch: model states
    sample_bytes: float  # moved per sample
    count: float = 1.0  # per micro step (forward, backward) or per update
    # Reads what the operator just before it (elementwise or a reduction, as it is) wrote: a compiler
    # fuses the two into one kernel, and the tensor between them never goes through memory.
    fusable: bool = False
    # A forward operator of a layer that activation checkpointing wraps: under checkpointing it runs
    # again in the backward (the embedding, the head and the loss do not).
    in_layer: bool = False
    # What a fusable operator adds to its fused kernel's traffic: its bytes less twice the tensor it reads from the
    # operator before it, which that one no longer writes and it no longer reads. Over a chain this leaves what
    # Inductor's kernel moves: the head's inputs, every other tensor read from memory, and the last output.
    fused_fixed_bytes: float = 0.0
    fused_sample_bytes: float = 0.0

    def to_list(self) -> list[Any]:
        return [
            self.phase,
            self.kind,
            self.name,
            self.dtype,
            self.flops,
            self.fixed_bytes,
            self.sample_bytes,
            self.count,
            self.fusable,
            self.in_layer,
            self.fused_fixed_bytes,
            self.fused_sample_bytes,
        ]

    @classmethod
    def from_list(cls, row: list[Any]) -> OpCost:
        return cls(
            str(row[0]),
            str(row[1]),
            str(row[2]),
            str(row[3]),
            float(row[4]),
            float(row[5]),
            float(row[6]),
            float(row[7]),
            bool(row[8]) if len(row) > 8 else False,
            bool(row[9]) if len(row) > 9 else False,
            float(row[10]) if len(row) > 10 else 0.0,
            float(row[11]) if len(row) > 11 else 0.0,
        )


@dataclass(frozen=True)
class StepCosts:
    """The traced step's operators, per micro step (forward and backward) and per update."""

    ops: tuple[OpCost, ...]
    forward_flops_per_sample: float  # the model's forward FLOPs (what MFU counts, 3x with the backward)
    trainable_parameters: int = 0  # what the optimizer steps (and ZeRO/DDP communicate)
    parameters: int = 0  # all of them (ZeRO-3 gathers the frozen ones too)
    parameter_tensors: int = 0  # ZeRO-3 gathers them one module at a time
    hidden_size: int | None = None  # sets the DeepSpeed buckets autotune configures (hidden^2 elements)
    layers_marked: bool = False  # the forward's operators say whether a checkpointed layer ran them (in_layer)
    micro_steps: int = 1  # the micro steps traced, over which each operator's count per micro step is a mean

    def micro_step(
        self, micro_batch: int, phase: str | None = None, *, fused: bool = False
    ) -> list[tuple[str, str, float, float, float]]:
        """(kind, dtype, FLOPs, bytes, count) of one micro step's operators at ``micro_batch`` (of ``phase``
        alone: forward or backward). ``fused``: as a compiler runs them, each chain of elementwise
        operators one kernel: the chain's head launches it, the others join it (kind ``fused``, with what
        they add to its traffic, which is negative where they save more than they move)."""
        return [
            (FUSED, op.dtype, 0.0, op.fused_fixed_bytes + op.fused_sample_bytes * micro_batch, op.count)
            if fused and op.fusable
            else (op.kind, op.dtype, op.flops * micro_batch, op.fixed_bytes + op.sample_bytes * micro_batch, op.count)
            for op in self.ops
            if op.phase != UPDATE and phase in (None, op.phase)
        ]

    def update(self) -> list[tuple[str, str, float, float, float]]:
        return [
            (op.kind, op.dtype, op.flops, op.fixed_bytes + op.sample_bytes, op.count)
            for op in self.ops
            if op.phase == UPDATE
        ]

    def with_forward_rerun(self, share: float) -> StepCosts:
        """These costs with ``share`` of the layers' forward run again in the backward: the step of the same
        config under activation checkpointing of that share of its layers, which reruns their forward to
        rebuild the activations it did not keep. Where the trace did not mark the layers' operators, the
        whole forward stands for theirs: at most what the checkpointed step costs."""
        rerun = tuple(
            dataclasses.replace(op, phase=BACKWARD, count=op.count * share, in_layer=False)
            for op in self.ops
            if op.phase == FORWARD and (op.in_layer or not self.layers_marked)
        )
        return dataclasses.replace(self, ops=self.ops + rerun)

    def with_all_weights_trained(self) -> StepCosts:
        """These costs of a LoRA step (a frozen base) as the same model's step with every weight trained: each
        forward matmul gains its weight gradient's matmul in the backward (as many FLOPs, about the same
        bytes), and the update moves every parameter where it moved the adapters' (the same kernels over more
        bytes). An approximation to place an untraced family by, not a trace: the adapters' own weight
        gradients count twice (a few percent of a small rank's matmuls). Unchanged where all are trained."""
        if not self.trainable_parameters or self.trainable_parameters >= self.parameters:
            return self
        scale = self.parameters / self.trainable_parameters
        ops = tuple(
            dataclasses.replace(
                op, flops=op.flops * scale, fixed_bytes=op.fixed_bytes * scale, sample_bytes=op.sample_bytes * scale
            )
            if op.phase == UPDATE
            else op
            for op in self.ops
        )
        weight_gradients = tuple(
            dataclasses.replace(op, phase=BACKWARD, in_layer=False)
            for op in self.ops
            if op.phase == FORWARD and op.kind == MATMUL
        )
        return dataclasses.replace(self, ops=ops + weight_gradients, trainable_parameters=self.parameters)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ops": [op.to_list() for op in self.ops],
            "forward_flops_per_sample": self.forward_flops_per_sample,
            "trainable_parameters": self.trainable_parameters,
            "parameters": self.parameters,
            "parameter_tensors": self.parameter_tensors,
            "hidden_size": self.hidden_size,
            "layers_marked": self.layers_marked,
            "micro_steps": self.micro_steps,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCosts:
        return cls(
            tuple(OpCost.from_list(row) for row in data["ops"]),
            float(data["forward_flops_per_sample"]),
            int(data.get("trainable_parameters", 0)),
            int(data.get("parameters", 0)),
            int(data.get("parameter_tensors", 0)),
            data.get("hidden_size"),
            bool(data.get("layers_marked", False)),
            int(data.get("micro_steps", 1)),
        )


class CostRecorder:
    """Counts the operators dispatched while a phase is set (the estimator's tracker calls :meth:`record`)."""

    def __init__(self, model_state: Any) -> None:
        """``model_state(tensor)``: whether the tracker knows ``tensor`` as a model state (or a copy of one)."""
        self._model_state = model_state
        self.phase: str | None = None
        self._ops: Counter[tuple[str, str, str, str, float, float, float, bool, bool, float, float]] = Counter()
        self._derived: set[Any] = set()  # storages made from model states alone (autocast's weight copies)
        self._last_written: set[Any] = set()  # what the last elementwise operator wrote (a chain continues from it)
        self._forward_flops = 0.0
        self._kernel: _OneKernel | None = None  # operators traced as one kernel (see begin_kernel)
        self.layers_marked = False  # the caller marks the checkpointable layers' forwards (enter/leave_layer)
        self._in_layers = 0

    def enter_layer(self, *_: Any) -> None:
        """A layer that activation checkpointing wraps begins its forward (a module's forward pre-hook)."""
        self._in_layers += 1

    def leave_layer(self, *_: Any) -> None:
        self._in_layers -= 1

    def begin_kernel(self) -> None:
        """What is dispatched until :meth:`end_kernel` runs as one kernel on the device (bitsandbytes' fused
        8-bit step, traced as torchao's eager one): one operator that reads each tensor from before it once
        and writes each it changes once; the tensors made inside never go through memory."""
        if self._kernel is None and self.phase is not None:
            self._kernel = _OneKernel()

    def end_kernel(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is None or self.phase is None or not kernel.moved:
            return
        fixed = sum(nbytes for nbytes, state in kernel.moved.values() if state)
        sample = sum(nbytes for nbytes, state in kernel.moved.values() if not state)
        self._last_written = set()
        in_layer = self.phase == FORWARD and self._in_layers > 0
        dtype = kernel.dtype or "float32"
        key = (self.phase, OTHER, "one_kernel", dtype, kernel.flops, fixed, sample, False, in_layer, 0.0, 0.0)
        self._ops[key] += 1

    def record(
        self, func: Any, args: Any, kwargs: dict[str, Any], in_leaves: list[Any], out_leaves: list[Any], flops: float
    ) -> None:
        """One dispatched operator: its arguments, the leaves of its arguments and of its output (flattened
        by the caller, who needs them too), and ``flops`` from PyTorch's flop counter (0 where it counts none)."""
        if self.phase is None or getattr(func, "is_view", False):
            return
        name = func.overloadpacket.__name__
        if not flops and name.startswith("_scaled_dot_product_flash_attention_for_cpu"):
            flops = _cpu_flash_flops(name, args)
        if name in _NO_KERNEL or name.startswith("sym_"):
            return
        # A DTensor (FSDP2's sharded weights, gradients and optimizer state) moves its local shard.
        inputs = [_local(t) for t in in_leaves if _is_tensor(t)]
        outputs = [_local(t) for t in out_leaves if _is_tensor(t)]
        mutates = func._schema.is_mutable
        kind = _kind(name)
        # Each tensor's storage once: an operator asks it of each tensor up to four times below.
        in_storages, out_storages = [_storage(t) for t in inputs], [_storage(t) for t in outputs]
        if kind != COLLECTIVE and (not (outputs or mutates) or (not mutates and _shares(out_storages, in_storages))):
            return  # a query (prim.device) or a view by another name (_unsafe_view, alias): no kernel
        if self._kernel is not None:
            self._kernel.add(inputs, outputs, mutates, flops, self._state)
            return
        in_states = [self._stored_state(t, storage) for t, storage in zip(inputs, in_storages, strict=True)]
        if kind != COLLECTIVE:
            states = [*in_states, *map(self._stored_state, outputs, out_storages)]
            moved = [(_bytes_touched(tensor), state) for tensor, state in zip((*inputs, *outputs), states, strict=True)]
        else:  # a collective is timed by the whole buffer it gathers or scatters (its largest tensor)
            largest = max((*inputs, *outputs), key=_bytes_touched)
            moved = [(_bytes_touched(largest), self._state(largest))]
        fixed = sum(nbytes for nbytes, state in moved if state)
        sample = sum(nbytes for nbytes, state in moved if not state)
        if inputs and all(in_states):
            self._derived.update(out_storages)
        # What it reads of the tensors the operator before it wrote: if the two fuse, that one never writes them
        # (once each) and this one never reads them (each time it does).
        chained = (
            [
                (storage, nbytes, state)
                for storage, (nbytes, state) in zip(in_storages, moved[: len(inputs)], strict=True)
                if storage in self._last_written
            ]
            if kind == OTHER
            else []
        )
        fusable = bool(chained)
        saved = [0.0, 0.0]  # model-state bytes, per-sample bytes
        for _, nbytes, state in chained:  # its reads
            saved[not state] += nbytes
        for nbytes, state in {storage: (nbytes, state) for storage, nbytes, state in chained}.values():
            saved[not state] += nbytes  # the writes the operator before it no longer makes
        fused_fixed, fused_sample = (fixed - saved[0], sample - saved[1]) if fusable else (0.0, 0.0)
        self._last_written = set(out_storages) if kind == OTHER else set()
        if kind == ATTENTION and _causal(func, args, kwargs):
            flops *= _CAUSAL_WORK
        dtype = _computed_in(inputs[0]) if kind == MATMUL and inputs else _type_name((inputs or outputs)[0].dtype)
        if self.phase == FORWARD:
            self._forward_flops += flops
        in_layer = self.phase == FORWARD and self._in_layers > 0
        self._ops[
            (self.phase, kind, name, dtype, float(flops), fixed, sample, fusable, in_layer, fused_fixed, fused_sample)
        ] += 1

    def _state(self, tensor: Any) -> bool:
        """A model state, or made from model states alone: moved whole whatever the micro batch."""
        return self._stored_state(tensor, _storage(tensor))

    def _stored_state(self, tensor: Any, storage: Any) -> bool:
        """:meth:`_state` of ``tensor``, whose storage (:func:`_storage`) the caller has already."""
        return self._model_state(tensor) or storage in self._derived

    def costs(
        self,
        *,
        micro_batch: int,
        micro_steps: int,
        trainable_parameters: int,
        parameters: int = 0,
        parameter_tensors: int = 0,
        hidden_size: int | None = None,
    ) -> StepCosts:
        """The counts so far: ``micro_steps`` micro steps of ``micro_batch`` samples each, and one update."""
        micro_steps = max(micro_steps, 1)
        ops = tuple(
            OpCost(phase, kind, name, dtype, flops, fixed + sample, 0.0, count, fusable, in_layer, 0.0, 0.0)
            if phase == UPDATE
            # a micro step's operator: model-state bytes whole, the rest per sample; the traced micro
            # steps differ a little (the first assigns gradients, the next accumulate): their mean
            else OpCost(
                phase,
                kind,
                name,
                dtype,
                flops / micro_batch,
                fixed,
                sample / micro_batch,
                count / micro_steps,
                fusable,
                in_layer,
                fused_fixed,
                fused_sample / micro_batch,
            )
            for (
                (phase, kind, name, dtype, flops, fixed, sample, fusable, in_layer, fused_fixed, fused_sample),
                count,
            ) in self._ops.items()
        )
        return StepCosts(
            ops,
            self._forward_flops / (micro_batch * micro_steps),
            trainable_parameters,
            parameters,
            parameter_tensors,
            hidden_size,
            self.layers_marked,
            micro_steps,
        )


class _OneKernel:
    """The operators of one fused kernel: the bytes it reads of the tensors made before it (once each) and
    writes of those it changes (once each); FLOPs summed."""

    def __init__(self) -> None:
        self.made: set[Any] = set()  # storages made inside: registers, never memory
        self.moved: dict[Any, tuple[float, bool]] = {}  # storage -> (bytes, a model state)
        self.written: set[Any] = set()
        self.flops = 0.0
        self.dtype: str | None = None

    def add(self, inputs: list[Any], outputs: list[Any], mutates: bool, flops: float, state: Any) -> None:
        self.flops += flops
        for tensor in inputs:
            storage = _storage(tensor)
            if storage not in self.made and storage not in self.moved:
                self.moved[storage] = (_bytes_touched(tensor), bool(state(tensor)))
                self.dtype = self.dtype or str(tensor.dtype).removeprefix("torch.")
        for tensor in outputs:
            storage = _storage(tensor)
            if storage in self.moved and mutates and storage not in self.written:  # changed in place: written back
                self.written.add(storage)
                nbytes, is_state = self.moved[storage]
                self.moved[storage] = (2 * nbytes, is_state)
            elif storage not in self.moved:
                self.made.add(storage)


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _local(tensor: Any) -> Any:
    return getattr(tensor, "_local_tensor", tensor)


def _storage(tensor: Any) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _shares(outputs: list[Any], inputs: list[Any]) -> bool:
    """Whether an output's storage (of ``outputs``) is one of ``inputs``' (None: a tensor without storage)."""
    held = set(inputs) - {None}
    return any(storage in held for storage in outputs)


def _type_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _computed_in(tensor: Any) -> str:
    """The type a matmul on ``tensor`` runs in: a wrapper subclass's floating-point data's (torchao's
    Float8TrainingTensor says the type it stands for, bf16, and holds float8 data, which its ``mm`` hands to
    ``torch._scaled_mm``); a wrapper of integer codes (a 4-bit base's) computes in the type it says."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:
        inner = getattr(tensor, flatten()[0][0])
        if inner.is_floating_point():
            return _computed_in(inner)
    return _type_name(tensor.dtype)


def _bytes_touched(tensor: Any) -> float:
    """What a kernel reads or writes of ``tensor``: its elements, at most its storage (a broadcast
    view is read once); of a wrapper subclass (torchao's 8-bit optimizer state), the tensors it holds."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None:
        return float(sum(_bytes_touched(getattr(tensor, name)) for name in flatten()[0]))
    elements = tensor.numel() * tensor.element_size()
    try:
        return float(min(elements, tensor.untyped_storage().nbytes()))
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
        return float(elements)


def counted_flops(count: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """``count`` (a formula of torch's flop counter) for one op. Grouped-query attention (the key and value with
    fewer heads than the query) is counted as the kernel computes it, each query head against its group's key and
    value: as with those heads repeated. torch 2.13's attention formulas count it so; 2.11's refuse the shapes
    (``sdpa_flop_count: query/key/value shapes are incompatible``), and are given the repeated heads."""
    try:
        return count(*args, **kwargs, out_val=out)
    except AssertionError:
        import torch  # only here: every traced operator comes through the line above

        heads = [a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
        if not heads or any(max(heads) % h for h in heads):
            raise
        wide = max(heads)

        def repeated(a: Any) -> Any:  # the formulas read shapes only (flop_counter's shape_wrapper)
            if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != wide:
                return torch.Size((a.shape[0], wide, *a.shape[2:]))
            return a

        return count(*(repeated(a) for a in args), **kwargs, out_val=out)


def _cpu_flash_flops(name: str, args: Any) -> float:
    """The CPU's fused attention kernel, which the flop counter does not know: counted as its CUDA
    flash counterpart is (same maths)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if name.endswith("_backward"):
        grad_out, query, key, value = args[:4]
        return float(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape))
    query, key, value = args[:3]
    return float(sdpa_flop_count(query.shape, key.shape, value.shape))


def _kind(name: str) -> str:
    if "attention" in name:
        return ATTENTION
    if name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "convolution",
        "convolution_backward",
        "_convolution",
        "matmul",
        "_grouped_mm",
        "linear",
    ):
        return MATMUL
    if any(
        word in name.replace("_", "") for word in ("allgather", "reducescatter", "allreduce", "broadcast", "alltoall")
    ):
        return COLLECTIVE
    return OTHER


def _causal(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an SDPA kernel call is causal (its ``is_causal`` argument, by name in its schema)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "is_causal":
            if argument.name in kwargs:
                return bool(kwargs[argument.name])
            return bool(args[index]) if index < len(args) else False
    return False
