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
import json
import os
import time
import warnings
from typing import Any, Callable, Iterator

from autotune.config.gpus import GPUS, GpuSpec, gpu_spec
from autotune.config.knobs import TrialConfig, offload_device_refusal
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.cuda_autocast import cuda_fp32_policy
from autotune.estimate.cuda_memory import CudaMemory, TraceMarks, predict_cuda_memory
from autotune.estimate.fake_step import fake_steps, run_as_on_target, step_as_update_twin
from autotune.estimate.measured_with import AS_INSTALLED, MeasuredWith
from autotune.estimate.nccl_buffers import nccl_bytes
from autotune.estimate.patches import (
    adapters_stay_put,
    bnb_4bit_gemm_unfused,
    bnb_4bit_matmul_as_on_cuda,
    cuda_attention,
    fake_kernels_as_real,
    fake_process_group,
    meshes_on_real_values,
    pipeline_shapes_given,
    sends_hold_their_tensors,
    truncated_normal_without_resampling,
    unpacked_batches,
)
from autotune.estimate.results import MODEL_STATES, EstimateError, MemoryEstimate, ModelStates, TracedStep
from autotune.estimate.zero_states import zero_peak
from autotune.levers.optimizer import update_twin

__all__ = [
    "estimate_from_trace",
    "estimate_memory",
    "may_hold_adapters",
    "pipeline_step",
    "prepare_tracing",
    "refuse_untraceable",
    "trace_key",
    "trace_step",
]


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
    fork_update: Callable[[], bool] | None = None,
) -> TracedStep:
    """Trace ``config``'s plain step (see :func:`_plain`) on fake tensors, in this process.

    Pipeline stages hold different layers: each rank's step is traced (``pipeline_rank``, as that rank of a
    fake process group), and the step of the rank that holds the most stands for the config, with every
    rank's peak beside it. ``fork_update``: see :func:`_forked_for_twin`."""
    if config.pp > 1 and pipeline_rank is None:
        return _every_stage_traced(workload, config, task=task, measured_with=measured_with)
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.estimate.peak_parts import PeakPartsTracker
    from autotune.models.sources import resolve_task
    from autotune.trial.engine import PipelineEngine, TorchEngine, build_engine

    started = time.perf_counter()
    task = task or resolve_task(workload)
    target, traced, note = _devices(workload)
    sharded = config.uses_fsdp or config.model_parallel > 1
    _refuse_what_is_not_predicted(config, target, sharded)
    plain = _plain(config)
    device = torch.device(traced)
    card = _card(workload) if target == "cuda" else None
    attention_kernels: collections.Counter[str] = collections.Counter()
    as_on_cuda = _as_on_cuda(config, target, traced, card, attention_kernels)
    tracker = PeakPartsTracker()
    tracker.sees_dtensors = sharded
    ranks = _traced_ranks(workload, config)
    with _around_the_trace(workload, config, traced, target, sharded, pipeline_rank, measured_with, as_on_cuda) as mesh:
        # Model code treats fake tensors as tracing: no data-dependent check runs.
        with FakeTensorMode(allow_non_fake_inputs=True), fake_kernels_as_real(), tracker:
            # What the build allocates without naming a device is born on the traced one (PEFT's adapters), as
            # the trial builds on its device. The step runs without: what it makes without a device is on the host,
            # as in the trial (foreach AdamW's step counts). The device's context would also cost every call.
            with device, truncated_normal_without_resampling(), meshes_on_real_values():
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
                run_as_on_target(engine, tracker, config, target=target, traced=traced, measured_with=measured_with)
            whole, flops_per_sample, step_costs = fake_steps(
                engine,
                tracker,
                keep_gradients=measured_with.pytorch1_step,
                record=target == "cuda",
                before_update=_forked_for_twin(config, fork_update, target=target, measured_with=measured_with),
            )
    return TracedStep(
        **_peak_parts(tracker),
        whole=whole,
        flops_per_sample=flops_per_sample,
        step_costs=step_costs,
        total_params=engine.total_params,
        trainable_params=engine.trainable_params,
        attention_kernels=dict(attention_kernels),
        target=target,
        traced_device=traced,
        device_note=note,
        card=card,
        method=_method(config, sharded, ranks, pipeline_rank),
        seconds=time.perf_counter() - started,
    )


@contextlib.contextmanager
def _around_the_trace(
    workload: Workload,
    config: TrialConfig,
    traced: str,
    target: str,
    sharded: bool,
    pipeline_rank: int | None,
    measured_with: MeasuredWith,
    as_on_cuda: Any,
) -> Iterator[Any]:
    """What :func:`trace_step` traces inside, but for the fake tensors and the tracker: the patches it needs
    (``as_on_cuda``'s among them) and its process group; yields the group's device mesh (None without one)."""
    with (
        warnings.catch_warnings(),
        adapters_stay_put(traced, adapters=may_hold_adapters(workload, config)),
        unpacked_batches(),
        # Whichever the device: a 4-bit base multiplies as matmuls, and its dequantized weight is a temporary.
        bnb_4bit_gemm_unfused() if config.quantize_base == "nf4" else contextlib.nullcontext(),
        as_on_cuda,
        _process_group(config, workload, traced, target=target, sharded=sharded, pipeline_rank=pipeline_rank) as mesh,
        # The pipeline patches reach into torch's private schedules: entered only for a pipeline's trace.
        pipeline_shapes_given() if config.pp > 1 else contextlib.nullcontext(),
        measured_with.in_effect(),
        sends_hold_their_tensors() if config.pp > 1 else contextlib.nullcontext(),
    ):
        warnings.simplefilter("ignore")  # deprecation chatter from model code; nothing runs for real
        yield mesh


def _forked_for_twin(
    config: TrialConfig, fork_update: Callable[[], bool] | None, *, target: str, measured_with: MeasuredWith
) -> Callable[[Any], None] | None:
    """What :func:`trace_step` runs as its update begins: None where it does not fork.

    ``fork_update``, where ``config`` has an update twin (:func:`autotune.levers.optimizer.update_twin`), is
    called as the update begins. It forks, and returns True in the process that goes on to trace the twin's
    update instead of ``config``'s: the step returned there is the twin's, whose forwards and backwards are
    ``config``'s. The optimizer state both make is the same, and what the state's making leaves in its wake is
    freed before the step begins (the replay and the peaks leave it out)."""
    twin = update_twin(config) if config.pp == 1 else None
    if twin is None or fork_update is None:
        return None

    def before_update(engine: Any) -> None:
        if fork_update():  # this process goes on as the twin
            step_as_update_twin(engine, twin, target=target, measured_with=measured_with)

    return before_update


def refuse_untraceable(workload: Workload, config: TrialConfig) -> None:
    """Raise what :func:`trace_step` raises before it traces anything where it cannot predict ``config``: the
    estimate server asks first, and a config it refuses costs no forked process."""
    target, _, _ = _devices(workload)
    _refuse_what_is_not_predicted(config, target, config.uses_fsdp or config.model_parallel > 1)


def _every_stage_traced(
    workload: Workload, config: TrialConfig, *, task: str | None, measured_with: MeasuredWith
) -> TracedStep:
    """A pipeline's step: each stage's rank traced in turn, in this process (see :func:`pipeline_step`)."""
    return pipeline_step(
        [
            trace_step(workload, config, task=task, measured_with=measured_with, pipeline_rank=rank)
            for rank in range(config.pp)
        ]
    )


def _process_group(
    config: TrialConfig, workload: Workload, traced: str, *, target: str, sharded: bool, pipeline_rank: int | None
) -> contextlib.AbstractContextManager[Any]:
    """The fake process group a sharded step is traced on, as this rank (its mesh as the context's value); none
    for a step on one rank. Hybrid sharding's mesh is (replicate, shard): its groups, of the workload's nodes."""
    if not sharded:
        return contextlib.nullcontext()
    shard = config.shard_degree(workload) if config.fsdp == "hybrid" else None
    # A pipeline stage's ranks: stage k holds ranks k x tp to k x tp + tp - 1 (its tensor-parallel pairs).
    rank = (pipeline_rank or 0) * config.tp
    ranks = _traced_ranks(workload, config)
    return fake_process_group(ranks, traced, gloo=target == "cpu", tp=config.tp, rank=rank, shard=shard)


def _refuse_what_is_not_predicted(config: TrialConfig, target: str, sharded: bool) -> None:
    """Raise where the trace cannot predict ``config`` on the ``target`` device (a trial measures it), or
    ``config`` cannot run there at all."""
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


def _as_on_cuda(
    config: TrialConfig, target: str, traced: str, card: GpuSpec | None, attention_kernels: collections.Counter[str]
) -> contextlib.ExitStack:
    """Entered now: for a CUDA workload traced on the CPU, CUDA's attention kernels (counted in
    ``attention_kernels``), autocast policy and 4-bit matmul; nothing otherwise."""
    as_on_cuda = contextlib.ExitStack()
    if target != traced:
        as_on_cuda.enter_context(cuda_attention(card, attention_kernels))
        as_on_cuda.enter_context(cuda_fp32_policy())
        if config.quantize_base == "nf4":
            as_on_cuda.enter_context(bnb_4bit_matmul_as_on_cuda())
    return as_on_cuda


def _peak_parts(tracker: Any) -> dict[str, Any]:
    """The traced step's figures the tracker holds: the peak and its parts, the backward's peak and its parts,
    and the allocations recorded."""
    backward_peak, backward_parts = tracker.peak_before["update"]
    return {
        "peak_bytes": tracker.peak_bytes,
        "at_peak": ModelStates(**{k: tracker.at_peak[k] for k in MODEL_STATES}),
        "activations_bytes": tracker.at_peak["activations"],
        "backward_peak_bytes": backward_peak,
        "backward_at_peak": ModelStates(**{k: backward_parts[k] for k in MODEL_STATES}),
        "backward_activations_bytes": backward_parts["activations"],
        "events": tracker.events,
        "marks": dict(tracker.marks),
    }


def _method(config: TrialConfig, sharded: bool, ranks: int, pipeline_rank: int | None) -> str:
    """How the step was traced, in words."""
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
    return method


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
    reserved, device_bytes, parts, replayed = _cuda_figures(
        traced,
        workload,
        config,
        peak,
        extra_tensor_bytes=peak - traced_peak - ddp_buckets,
        ddp_buckets=ddp_buckets,
        cuda_as=cuda_as,
    )
    method += replayed
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


def _cuda_figures(
    traced: TracedStep,
    workload: Workload,
    config: TrialConfig,
    peak: int,
    *,
    extra_tensor_bytes: int,
    ddp_buckets: int,
    cuda_as: MemoryEstimate | None,
) -> tuple[int | None, int | None, dict[str, int] | None, str]:
    """A CUDA workload's reserved and device bytes, what each part adds, and what the method adds in words: the
    caching allocator replayed over the trace's allocations, or scaled from ``cuda_as`` (see
    :func:`estimate_from_trace`). Nothing for a CPU workload."""
    if traced.target == "cuda" and traced.events is not None:
        cuda = _replayed(
            traced.events,
            traced.marks,
            tensor_peak_bytes=peak,
            card=traced.card,
            communication_bytes=nccl_bytes(traced.card, config, workload),
            ddp_gradient_bytes=ddp_buckets,
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            extra_tensor_bytes=extra_tensor_bytes,
        )
        return cuda.reserved_bytes, cuda.device_bytes, cuda.parts(), f" + {cuda.allocator} replayed"
    if (
        traced.target == "cuda"
        and cuda_as is not None
        and cuda_as.predicted_reserved_bytes is not None
        and cuda_as.predicted_device_bytes is not None
    ):
        # The allocator's rounding and cached blocks scale with the blocks it holds; the context does not.
        reserved = int(peak * cuda_as.predicted_reserved_bytes / max(cuda_as.predicted_peak_bytes, 1))
        return reserved, reserved + cuda_as.predicted_device_bytes - cuda_as.predicted_reserved_bytes, None, ""
    return None, None, None, ""


# The replays made last, each with the events it replayed (kept alive, so that no other list takes its id). A plan
# asks for many configs of one kept trace that replay it alike (compile on and off; tf32 and fp32, some 200
# families apart), and the replay is most of what such an estimate costs.
_REPLAYS: collections.OrderedDict[tuple[Any, ...], tuple[Any, CudaMemory]] = collections.OrderedDict()
_KEPT_REPLAYS = 256


def _replayed(events: list[Any], marks: dict[str, int], **figures: Any) -> CudaMemory:
    """:func:`predict_cuda_memory` of ``events``, once for each set of figures (it reads nothing else)."""
    key = (id(events), tuple(sorted(marks.items())), tuple(sorted(figures.items())))
    kept = _REPLAYS.get(key)
    if kept is None:
        kept = _REPLAYS[key] = (events, predict_cuda_memory(events, TraceMarks(**marks), **figures))
        if len(_REPLAYS) > _KEPT_REPLAYS:
            _REPLAYS.popitem(last=False)
    _REPLAYS.move_to_end(key)
    return kept[1]


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


def prepare_tracing() -> None:
    """Build what every trace uses first (the tracker's class, DTensor's and the flop counter's imports under
    it): the estimate server does it once, so that its forked traces do not each again."""
    import autotune.estimate.peak_parts  # noqa: F401


def may_hold_adapters(workload: Workload, config: TrialConfig) -> bool:
    """Whether ``config``'s traced model may hold PEFT adapters: LoRA's, or whatever a factory's or remote
    code makes (a model Transformers ships code for makes none of its own)."""
    from autotune.models.sources import parse_model_source

    return config.uses_lora or workload.trust_remote_code or parse_model_source(workload.model).kind == "factory"
