"""Predict a config's peak memory without running it: the real training step on fake tensors.

The trial's own model build (checkpointing, LoRA, precision, optimizer) runs under PyTorch's
``FakeTensorMode``, where tensors have shapes and dtypes but no data, with the same live-bytes
tracker the CPU trials use counting their storages. So activations, logits, autocast's weight
copies and the optimizer's state come from the code that will really run, not from a formula;
a 7B model costs seconds and no memory.

What fake tensors cannot show is added or stated:

* ZeRO sharding and offload: DeepSpeed cannot run on fake tensors, so the step runs on plain
  PyTorch and the model states are replaced by what DeepSpeed's ZeRO optimizer allocates
  (arithmetic: :mod:`autotune.estimate.zero_states`).
* Without ZeRO, more than one rank trains under DDP, whose all-reduce buckets hold a second
  copy of every gradient.
* What no tensor shows on a GPU (CUDA context, allocator reserve, library workspaces): unknown
  until calibrated on a GPU, so ``overhead_bytes`` is ``None`` and the prediction is of
  tensor bytes (what ``max_memory_allocated`` and the CPU tracker count).

The parts add up to the peak: model states are whole (what the proposer's straight line
holds fixed), activations and temporaries are what was live at the peak moment, and the
model states not yet allocated then (gradients the backward has not made) are their own
negative part.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import time
import warnings
import weakref
from typing import Any, Iterator

from autotune.config.gpus import GPUS, GpuSpec, gpu_spec
from autotune.config.knobs import TrialConfig, offload_device_refusal
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.cuda_autocast import cuda_fp32_policy
from autotune.estimate.cuda_memory import TraceMarks, predict_cuda_memory
from autotune.estimate.measured_with import AS_INSTALLED, MeasuredWith
from autotune.estimate.patches import (
    adapters_stay_put,
    bnb_4bit_matmul_as_on_cuda,
    cuda_attention,
    fake_process_group,
    grouped_mm_in_any_dtype,
    meshes_on_real_values,
    pipeline_shapes_given,
    sends_hold_their_tensors,
    truncated_normal_without_resampling,
    unpacked_batches,
)
from autotune.estimate.results import MODEL_STATES, EstimateError, MemoryEstimate, ModelStates, TracedStep
from autotune.estimate.step_costs import BACKWARD, FORWARD, UPDATE, CostRecorder, StepCosts
from autotune.estimate.zero_states import zero_peak
from autotune.prepare.offload import ActivationOffload

__all__ = [
    "estimate_from_trace",
    "estimate_memory",
    "may_hold_adapters",
    "pipeline_step",
    "prepare_tracing",
    "trace_key",
    "trace_step",
]

_MICRO_STEPS = 2  # accumulation past the second micro-step adds nothing: gradients exist by then


def estimate_memory(
    workload: Workload, config: TrialConfig, *, task: str | None = None, measured_with: MeasuredWith = AS_INSTALLED
) -> MemoryEstimate:
    """Predict the peak tensor memory of one rank training ``workload`` with ``config`` (in this process).

    ``measured_with``: what a published measurement ran beyond autotune's knobs, to rebuild it
    (:mod:`autotune.estimate.measured_with`).
    """
    traced = trace_step(workload, config, task=task, measured_with=measured_with)
    return estimate_from_trace(traced, workload, config)


def trace_key(
    workload: Workload, config: TrialConfig, *, task: str | None = None, measured_with: MeasuredWith = AS_INSTALLED
) -> str:
    """What :func:`trace_step` traces for ``config``: equal keys, one trace."""
    return json.dumps(
        [
            _traced_workload(workload, config).to_dict(),
            _plain(config).to_dict(),
            config.uses_deepspeed,
            task,
            measured_with.to_dict(),
        ],
        sort_keys=True,
    )


def pipeline_step(stages: list[TracedStep]) -> TracedStep:
    """A pipeline's step from each stage's (in stage order): the largest stands for it, every rank's peak
    beside it."""
    most = max(stages, key=lambda traced: traced.peak_bytes)
    return dataclasses.replace(
        most,
        rank_peak_bytes=[traced.peak_bytes for traced in stages],
        seconds=sum(traced.seconds for traced in stages),
    )


def _traced_ranks(workload: Workload, config: TrialConfig) -> int:
    """Ranks of the traced step: FSDP2's, tensor and pipeline parallel's, on a fake group of them; one for DDP
    and ZeRO (arithmetic)."""
    return workload.nproc if config.uses_fsdp or config.model_parallel > 1 else 1


def _traced_workload(workload: Workload, config: TrialConfig) -> Workload:
    """The workload of the traced step: its ranks (see :func:`_traced_ranks`), on one machine."""
    return workload.replace(nproc=_traced_ranks(workload, config), nodes=1)


def _plain(config: TrialConfig) -> TrialConfig:
    """The config whose step is traced: DeepSpeed cannot run on fake tensors, so ZeRO is arithmetic on
    the plain step; FSDP2 can, so it keeps its offload; compile is traced as eager and tf32 as fp32
    (the same tensors: only the kernels differ)."""
    plain = config.replace(zero_stage=None, compile=False, **({} if config.uses_fsdp else {"offload": "none"}))
    return plain.replace(precision="fp32") if plain.precision == "tf32" else plain


def trace_step(
    workload: Workload,
    config: TrialConfig,
    *,
    task: str | None = None,
    measured_with: MeasuredWith = AS_INSTALLED,
    pipeline_rank: int | None = None,
) -> TracedStep:
    """Trace ``config``'s plain step (see :func:`_plain`) on fake tensors, in this process.

    Pipeline stages hold different layers: each rank's step is traced (``pipeline_rank``, as that rank of a
    fake process group), and the step of the rank that holds the most stands for the config, with every
    rank's peak beside it."""
    if config.pp > 1 and pipeline_rank is None:
        return pipeline_step(
            [
                trace_step(workload, config, task=task, measured_with=measured_with, pipeline_rank=rank)
                for rank in range(config.pp)
            ]
        )
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.models.sources import resolve_task
    from autotune.trial.engine import PipelineEngine, TorchEngine, build_engine

    started = time.perf_counter()
    task = task or resolve_task(workload)
    target, traced, note = _devices(workload)
    sharded = config.uses_fsdp or config.model_parallel > 1
    if sharded and config.offload != "none" and target != "cpu":
        raise EstimateError(
            f"--fsdp {config.fsdp} --offload {config.offload}: the estimator does not predict what "
            "FSDP's CPU offload keeps on a GPU yet; a trial measures it"
        )
    refusal = offload_device_refusal(target) if config.activation_offload else None
    if refusal is not None:
        raise ConfigError(refusal)
    if config.quantize_base == "int8" and target == "cuda":
        raise EstimateError(
            "--quantize-base int8: on CUDA bitsandbytes trains LLM.int8() through its own kernels (outlier "
            "columns kept in 16 bits, found from the data), and the estimator traces only its CPU path; "
            "it does not predict int8 on a GPU yet: a trial measures it"
        )
    plain = _plain(config)
    device = torch.device(traced)
    card = _card(workload) if target == "cuda" else None
    attention_kernels: collections.Counter[str] = collections.Counter()
    as_on_cuda = contextlib.ExitStack()
    if target != traced:  # a CUDA workload traced on the CPU: CUDA's attention kernels and autocast policy
        as_on_cuda.enter_context(cuda_attention(card, attention_kernels))
        as_on_cuda.enter_context(cuda_fp32_policy())
        if config.quantize_base == "nf4":
            as_on_cuda.enter_context(bnb_4bit_matmul_as_on_cuda())
    tracker = _peak_parts_tracker()
    tracker.sees_dtensors = sharded
    ranks = _traced_ranks(workload, config)
    with (
        warnings.catch_warnings(),
        adapters_stay_put(traced, adapters=may_hold_adapters(workload, config)),
        unpacked_batches(),
        as_on_cuda,
        # A pipeline stage's ranks: stage k holds ranks k x tp to k x tp + tp - 1 (its tensor-parallel pairs).
        fake_process_group(ranks, traced, gloo=target == "cpu", tp=config.tp, rank=(pipeline_rank or 0) * config.tp)
        if sharded
        else contextlib.nullcontext() as mesh,
        pipeline_shapes_given(),
        measured_with.in_effect(),
        sends_hold_their_tensors(),
    ):
        warnings.simplefilter("ignore")  # deprecation chatter from model code; nothing runs for real
        # Model code treats fake tensors as tracing: no data-dependent check runs. Whatever the
        # model code allocates without naming a device is born on the traced one (PEFT's adapters).
        with FakeTensorMode(allow_non_fake_inputs=True), grouped_mm_in_any_dtype(), tracker, device:
            with truncated_normal_without_resampling(), meshes_on_real_values():
                engine = build_engine(
                    workload=_traced_workload(workload, config),
                    config=plain,
                    task=task,
                    device=device,
                    world_size=ranks,
                    mesh=mesh,
                )
            # The plain config: ZeRO is arithmetic on it, never DeepSpeed.
            assert isinstance(engine, (TorchEngine, PipelineEngine))
            if config.uses_deepspeed and engine.autocast_dtype is not None:
                # DeepSpeed's fp16/bf16 modes train a 16-bit model (no autocast): 16-bit activations.
                _to_16_bit(engine)
            _step_tensors_together(engine.optimizer, target == "cuda" and not measured_with.pytorch1_step)
            if engine.offload is not None:
                # The same hooks the trial's forward runs in, their host copies left out of the device's bytes
                # (on a CPU trace of a CUDA step the host is the traced device too); no pinning on fake tensors.
                engine.offload = ActivationOffload(device_type=traced, pin_memory=False, host=tracker.on_host)
            if target == "cuda" and plain.optimizer == "adamw-8bit":
                _steps_as_one_kernel(engine.optimizer, tracker)
            whole, flops_per_sample, step_costs = _fake_steps(
                engine, tracker, keep_gradients=measured_with.pytorch1_step, record=target == "cuda"
            )
    method = "fake-tensor training step"
    if sharded:
        split = " x ".join(
            part
            for part, on in (
                (f"tensor parallel {config.tp}", config.tp > 1),
                ("FSDP2", config.uses_fsdp),
                (f"pipeline stages ({config.pp_schedule}), rank {pipeline_rank} of", config.pp > 1),
            )
            if on
        )
        method += f" of {split} on a fake process group of {ranks} ranks"
    backward_peak, backward_parts = tracker.peak_before["update"]
    return TracedStep(
        peak_bytes=tracker.peak_bytes,
        at_peak=ModelStates(**{k: tracker.at_peak[k] for k in MODEL_STATES}),
        whole=whole,
        activations_bytes=tracker.at_peak["activations"],
        backward_peak_bytes=backward_peak,
        backward_at_peak=ModelStates(**{k: backward_parts[k] for k in MODEL_STATES}),
        backward_activations_bytes=backward_parts["activations"],
        flops_per_sample=flops_per_sample,
        step_costs=step_costs,
        total_params=engine.total_params,
        trainable_params=engine.trainable_params,
        events=tracker.events,
        marks=dict(tracker.marks),
        attention_kernels=dict(attention_kernels),
        target=target,
        traced_device=traced,
        device_note=note,
        card=card,
        method=method,
        seconds=time.perf_counter() - started,
    )


def estimate_from_trace(
    traced: TracedStep, workload: Workload, config: TrialConfig, *, cuda_as: MemoryEstimate | None = None
) -> MemoryEstimate:
    """``config``'s estimate from its traced plain step: ZeRO's model states and DDP's buckets by arithmetic,
    then on CUDA the caching allocator replayed over the trace's allocations.

    ``cuda_as``: for a trace without its allocations (one extrapolated from shallower copies), the
    estimate whose reserve over tensor peak, and whose fixed device bytes, stand for this one's.
    """
    started = time.perf_counter()
    peak, at_peak, whole, activations = traced.peak_bytes, traced.at_peak, traced.whole, traced.activations_bytes
    traced_peak, ddp_buckets = peak, 0
    method = traced.method + (
        " (compile predicted as eager: its fused kernels may hold less)" if config.compile else ""
    )
    if config.uses_deepspeed:
        peak, at_peak, whole, activations = zero_peak(traced, config, workload.nproc)
        method += " + ZeRO model-state arithmetic"
    elif config.data_parallel(workload) > 1 and not config.uses_fsdp:
        # DDP copies every gradient into its all-reduce buckets (gradient_as_bucket_view is off),
        # allocated when DDP wraps the model: live all along.
        buckets = ddp_buckets = whole.gradients
        peak += buckets
        whole = dataclasses.replace(whole, gradients=whole.gradients + buckets)
        at_peak = dataclasses.replace(at_peak, gradients=at_peak.gradients + buckets)
        method += " + DDP gradient buckets"
    reserved = device_bytes = parts = None
    if traced.target == "cuda" and traced.events is not None:
        cuda = predict_cuda_memory(
            traced.events,
            TraceMarks(**traced.marks),
            tensor_peak_bytes=peak,
            card=traced.card,
            ranks=workload.nproc,
            ddp_gradient_bytes=ddp_buckets,
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            extra_tensor_bytes=peak - traced_peak - ddp_buckets,
        )
        reserved, device_bytes, parts = cuda.reserved_bytes, cuda.device_bytes, cuda.parts()
        method += f" + {cuda.allocator} replayed"
    elif (
        traced.target == "cuda"
        and cuda_as is not None
        and cuda_as.predicted_reserved_bytes is not None
        and cuda_as.predicted_device_bytes is not None
    ):
        # The allocator's rounding and cached blocks scale with the blocks it holds; the context does not.
        reserved = int(peak * cuda_as.predicted_reserved_bytes / max(cuda_as.predicted_peak_bytes, 1))
        device_bytes = reserved + cuda_as.predicted_device_bytes - cuda_as.predicted_reserved_bytes
    return MemoryEstimate(
        config=config,
        predicted_peak_bytes=peak,
        parameters_bytes=whole.parameters,
        gradients_bytes=whole.gradients,
        optimizer_state_bytes=whole.optimizer_state,
        activations_bytes=activations,
        temporaries_bytes=peak - at_peak.total - activations,
        not_live_at_peak_bytes=at_peak.total - whole.total,
        overhead_bytes=None if device_bytes is None else device_bytes - peak,
        predicted_reserved_bytes=reserved,
        predicted_device_bytes=device_bytes,
        cuda_parts=parts,
        gpu=traced.card.name if traced.card is not None else None,
        attention_kernels=traced.attention_kernels or None,
        step_costs=traced.step_costs,
        traced_device=traced.traced_device,
        device_note=traced.device_note,
        method=method,
        flops_per_sample=traced.flops_per_sample,
        seconds=traced.seconds + time.perf_counter() - started,
        peak_per_rank_bytes=traced.rank_peak_bytes,
    )


def _devices(workload: Workload) -> tuple[str, str, str | None]:
    """(the workload's device type, the device type to trace on, what the output should say about it).

    Kernels decide what is kept for the backward: with dropout, the CPU's attention keeps the
    whole s x s scores (in fp32 under bf16) where CUDA's fused kernels keep a row statistic, so
    a CUDA workload is traced on fake CUDA tensors. Those need a GPU: without one, PyTorch's
    CUDA builds pick the math attention and cannot run the backward, and its CPU builds abort
    the process; there the trace runs on the CPU with attention as CUDA's fused kernels keep it.
    """
    import torch

    cuda_here = torch.cuda.is_available() and not torch.cuda._is_in_bad_fork()
    if workload.device == "cpu" or (workload.device == "auto" and not cuda_here):
        return "cpu", "cpu", None
    if cuda_here:
        return "cuda", "cuda", None
    return (
        "cuda",
        "cpu",
        (
            "no CUDA GPU here: traced with CPU kernels, attention and autocast's fp32 ops as CUDA "
            "runs them; CUDA's other kernels may keep a little more or less"
        ),
    )


def _card(workload: Workload) -> GpuSpec | None:
    """The card a CUDA workload is for: ``--gpu``, else the one here when the table knows it."""
    if workload.gpu is not None:
        return gpu_spec(workload.gpu)
    import torch

    if not torch.cuda.is_available():
        return None
    name, total = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    for card in GPUS.values():
        if card.name.split("-")[0] in name.replace(" ", "") and abs(card.memory_bytes - total) < 0.1 * total:
            return card
    return None


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


def _peak_parts_tracker() -> Any:
    return _peak_parts_tracker_class()()


def prepare_tracing() -> None:
    """Build what every trace uses first (the tracker's class, DTensor's and the flop counter's imports under
    it): the estimate server does it once, so that its forked traces do not each again."""
    _peak_parts_tracker_class()


@functools.cache
def _peak_parts_tracker_class() -> type:
    """The CPU trials' live-bytes tracker, on every device, that also says whose bytes made its peak.

    Storages are tagged when they become parameters, gradients or optimizer state, and as
    activations when the forward allocates them (what it leaves behind is what the backward
    needs); each new peak copies the live bytes of every tag, so the parts of the peak are what
    was live at that moment and the untagged rest is the temporaries.
    """
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves, tree_map
    from torch.utils.flop_counter import flop_registry

    from autotune.trial.memory import LiveBytesTracker, storages_of

    def local(value: Any) -> Any:
        # The shard itself, not to_local()'s view of it (an autograd function and a dispatch per DTensor,
        # a fifth of a tensor-parallel trace): the same shape, dtype and storage.
        return value._local_tensor if isinstance(value, DTensor) else value

    class PeakPartsTracker(LiveBytesTracker):
        def __init__(self) -> None:
            super().__init__(None)
            self.live = dict.fromkeys((*MODEL_STATES, "activations"), 0)
            self.at_peak = dict(self.live)
            self.in_forward = False
            self._tags: dict[int, str] = {}  # id of the per-storage counter -> tag
            # FLOPs of the matmul-class ops PyTorch's flop counter knows, while asked. Counted here,
            # not under FlopCounterMode: its module hooks change what checkpointing keeps (measured:
            # a checkpointed GPT-2 then traced twice its real peak).
            self.count_flops = False
            self.flops = 0
            # Every operator's FLOPs and bytes while a phase is set: what the step-time model needs.
            self.costs = CostRecorder(self._model_state)
            # Whether ops may come on DTensors (a step traced on a process group: FSDP, tensor or pipeline
            # parallel): only then is each op looked over for them, a cost on every op of the trace.
            self.sees_dtensors = False
            # The storages' allocations and frees in order, (key, new size; 0: freed), once asked:
            # what the CUDA caching allocator would be asked for (estimate.cuda_memory replays it).
            self.events: list[tuple[int, int]] | None = None
            self._keys: dict[int, int] = {}  # id of the per-storage counter -> its key in events
            self.marks: dict[str, int] = {}  # phase -> where its events begin
            self.peak_before: dict[str, tuple[int, dict[str, int]]] = {}  # phase -> the peak before it, its parts
            self._next_key = 0
            # Storages made in host memory while the device's are counted (activation offload's copies): never counted.
            self._host: weakref.WeakSet[Any] = weakref.WeakSet()
            self._on_host = 0
            # Storages made inside one fused kernel's stand-in: counted at its end, if they outlive it.
            self._in_kernel: weakref.WeakKeyDictionary[Any, None] = weakref.WeakKeyDictionary()  # in their order
            self._kernel_depth = 0

        @contextlib.contextmanager
        def one_kernel(self) -> Iterator[None]:
            """What is traced inside runs as one kernel on the device: the storages it makes and frees again are
            never live outside it; those it keeps are counted when it ends."""
            self._kernel_depth += 1
            self.costs.begin_kernel()
            try:
                yield
            finally:
                self._kernel_depth -= 1
                if not self._kernel_depth:
                    self.costs.end_kernel()
                    kept, self._in_kernel = list(self._in_kernel), weakref.WeakKeyDictionary()
                    for storage in kept:
                        self._count(storage)

        @contextlib.contextmanager
        def on_host(self) -> Iterator[None]:
            """The storages first seen inside are host memory: not the device's bytes."""
            self._on_host += 1
            try:
                yield
            finally:
                self._on_host -= 1

        def start_recording(self) -> None:
            """From now on, record; the storages live now are allocated first, in the order they were made."""
            self.events = []
            for counter in list(self._counted.values()):
                if counter[0] > 0:
                    self._record(counter)

        def mark(self, phase: str) -> None:
            """``phase`` begins here: in the recorded events (when recording), and in ``peak_before``,
            the peak so far and its parts."""
            self.peak_before[phase] = (self.peak_bytes, dict(self.at_peak))
            if self.events is not None:
                self.marks[phase] = len(self.events)

        def _record(self, counter: list[int]) -> None:
            key = self._keys.get(id(counter))
            if key is None:
                key = self._keys[id(counter)] = self._next_key
                self._next_key += 1
            assert self.events is not None
            self.events.append((key, counter[0]))

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # The op's inputs and outputs, flattened once (costed, then counted): a trace dispatches 10^5 ops.
            inputs, outputs = tree_leaves((args, kwargs)), tree_leaves(out)
            costed = out
            # This mode sees a tensor-parallel op on its DTensors, whose shapes are the whole layer's: a rank
            # computes and moves its shards only, so the op is counted on them (the recorder takes each leaf's
            # shard itself).
            if self.sees_dtensors and any(isinstance(leaf, DTensor) for leaf in (*inputs, *outputs)):
                args, kwargs, costed = tree_map(local, args), tree_map(local, kwargs), tree_map(local, out)
            counting = self.count_flops or self.costs.phase is not None
            count = flop_registry.get(func.overloadpacket) if counting else None
            flops = count(*args, **kwargs, out_val=costed) if count is not None else 0
            if self.count_flops:
                self.flops += flops
            self.costs.record(func, args, kwargs, inputs, outputs, flops)
            if not self._kernel_depth and self._engine_sum(func, args, out):
                return out
            for leaf in outputs:
                if isinstance(leaf, torch.Tensor):
                    for storage in storages_of(leaf):
                        self._count(storage)
            return out

        def _model_state(self, tensor: Any) -> bool:
            """Whether ``tensor`` is a model state: what a kernel moves of it does not grow with the micro batch."""
            for storage in storages_of(tensor):
                counter = self._counted.get(storage)
                if counter is not None and self._tags.get(id(counter)) in MODEL_STATES:
                    return True
            return False

        def tag(self, tensors: Any, tag: str) -> None:
            for storage in (storage for tensor in tensors for storage in storages_of(tensor)):
                counter = self._counted.get(storage)
                old = None if counter is None else self._tags.get(id(counter))
                if counter is None or old == tag:
                    continue  # not allocated under the tracker, or tagged already
                if old is not None:
                    self.live[old] -= counter[0]
                self._tags[id(counter)] = tag
                self.live[tag] += counter[0]

        def reset_peak(self) -> None:
            self.peak_bytes = self.live_bytes
            self.at_peak = dict(self.live)

        def _count(self, storage: Any) -> None:
            if storage in self._host or self._on_host and storage not in self._counted:
                self._host.add(storage)
                return
            if self._kernel_depth and storage not in self._counted:
                self._in_kernel[storage] = None
                return
            counter = self._counted.get(storage)
            new, before, peak = counter is None, 0 if counter is None else counter[0], self.peak_bytes
            super()._count(storage)
            counter = self._counted[storage]
            if new and self.in_forward:
                self._tags[id(counter)] = "activations"
            tag = self._tags.get(id(counter))
            if tag is not None:
                self.live[tag] += counter[0] - before
            if self.events is not None and counter[0] != before:
                self._record(counter)
            if self.peak_bytes > peak:
                self.at_peak = dict(self.live)

        def _release(self, counter: list[int]) -> None:
            tag = self._tags.pop(id(counter), None)
            if tag is not None:
                self.live[tag] -= counter[0]
            key = self._keys.pop(id(counter), None)  # ids are reused once the counter is gone
            if self.events is not None and key is not None and counter[0] > 0:
                self.events.append((key, 0))
            super()._release(counter)

    return PeakPartsTracker


def may_hold_adapters(workload: Workload, config: TrialConfig) -> bool:
    """Whether ``config``'s traced model may hold PEFT adapters: LoRA's, or whatever a factory's or remote
    code makes (a model Transformers ships code for makes none of its own)."""
    from autotune.models.sources import parse_model_source

    return (
        config.lora_rank is not None
        or workload.trust_remote_code
        or parse_model_source(workload.model).kind == "factory"
    )


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


def _fake_steps(
    engine: Any, tracker: Any, *, keep_gradients: bool = False, record: bool = False
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
    micro steps: see :func:`_pipeline_forwards_and_backwards`.
    """
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
    engine.optimizer.step()
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
    tracker.mark("update")
    tracker.costs.phase = UPDATE
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=not keep_gradients)
    del loss  # the last micro step's graph, alive through the update as in the trial's step
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
        for _ in range(micro_steps):
            tracker.in_forward, tracker.costs.phase = True, FORWARD
            with (
                torch.autocast(
                    engine.device.type, dtype=engine.autocast_dtype, enabled=engine.autocast_dtype is not None
                ),
                engine.saving(),
            ):
                # Assigned over the last micro step's, as the trial's loop (and a user's) does: its graph lives
                # until then, and with it what a backward node keeps outside its saved tensors (bitsandbytes'
                # int8 layers keep their input as an attribute of the node).
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
