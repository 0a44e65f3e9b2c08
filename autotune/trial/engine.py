"""The training step a trial measures: model, LoRA, checkpointing, precision, optimizer, ZeRO, FSDP.

Two engines, one interface: plain PyTorch (autocast, GradScaler for fp16, DDP across ranks, or
FSDP2's sharded model) when ZeRO is off, and DeepSpeed's engine when a ZeRO stage is set.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from autotune.config.deepspeed_config import LEARNING_RATE, deepspeed_config
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.levers.activation_offload import ActivationOffload
from autotune.levers.grad_reduction import gradient_sync
from autotune.levers.optimizer import StepInBackward, build_optimizer
from autotune.models.batches import (
    factory_batch,
    loss_of,
    model_attr,
    synthetic_batch,
    throughput_unit,
)
from autotune.models.sources import (
    build_model_and_batch,
    image_size,
    parse_model_source,
)
from autotune.prepare.apply import prepare
from autotune.prepare.quantize import parameter_numel
from autotune.prepare.sharding import INIT_STD, parameters_on_meta, torch_fake_mode_active
from autotune.trial.memory import storages_of

__all__ = ["TrainingEngine", "build_engine"]


class TrainingEngine:
    """Runs one optimizer step (all accumulation micro-steps) and reports model facts."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        batch: dict[str, Any],
        unit: str,
        config: TrialConfig,
        workload: Workload,
        device: torch.device,
    ) -> None:
        self.model = model
        self.batch = batch  # one micro batch, fed at every micro-step
        self.throughput_unit = unit  # tokens/s, images/s or samples/s: what the trial's figure counts
        self.config = config
        self.accum = config.grad_accum_steps(workload)
        self.device = device
        # ZeRO-3 partitions from the build on: a parameter's own numel is then 0, its ds_numel the whole.
        # NF4 packs two weights in a byte: its tensor has half the elements the layer has weights.
        self.total_params = sum(getattr(p, "ds_numel", parameter_numel(p)) for p in model.parameters())
        self.trainable_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        # What the forward saves for the backward: in device memory, or (activation offload) in pinned host memory.
        self.offload = ActivationOffload(device_type=device.type) if config.activation_offload else None

    def saving(self) -> Any:
        """The context the forward runs in: activation offload's saved-tensor hooks, or nothing."""
        return self.offload.hooks() if self.offload is not None else contextlib.nullcontext()

    def step(self) -> float:
        raise NotImplementedError

    def warm_up(self) -> float:
        """One untimed optimizer step, to make the timed ones warm: here a whole step. An engine that can step
        after fewer micro batches does so (its kernels, buffers and optimizer state are the same ones)."""
        return self.step()

    def optimizer_state_bytes(self) -> int:
        raise NotImplementedError

    def compile(self, backend: str = "inductor") -> None:
        raise NotImplementedError


class TorchEngine(TrainingEngine):
    def __init__(self, *, world_size: int, workload: Workload, **kwargs: Any) -> None:
        super().__init__(workload=workload, **kwargs)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Stepped inside the backward (optimizer_in_backward), its step() below finds no gradient left.
        self.optimizer = build_optimizer(params, self.config, lr=LEARNING_RATE)
        self.autocast_dtype = getattr(torch, self.config.autocast_type) if self.config.autocast_type else None
        self.scaler = torch.amp.GradScaler(self.device.type) if self.config.precision == "fp16" else None
        self.forward_model: Any = self.model  # the model, DDP's wrapper of it, or torch.compile's
        # FSDP reduces the gradients itself; tensor-parallel ranks share their batch (no copies to average).
        if world_size > 1 and self.config.data_parallel(workload) > 1 and not self.config.uses_fsdp:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.forward_model = DistributedDataParallel(self.model, device_ids=ids)

    def step(self) -> float:
        return self._step(self.accum)

    def warm_up(self) -> float:
        """An optimizer step after one micro batch: every kernel, buffer and optimizer state a whole step uses, in
        1/accum of its time (a warm-up of 8 micro batches of a wide-vocabulary model takes seconds on a CPU)."""
        return self._step(1)

    def _step(self, micro_batches: int) -> float:
        total = torch.zeros((), device=self.device)
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            sync = (
                contextlib.nullcontext() if last or self.forward_model is self.model else self.forward_model.no_sync()
            )
            with sync, gradient_sync(self.model, self.config, last=last):
                autocast = torch.autocast(
                    self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
                )
                with autocast, self.saving():
                    loss = loss_of(self.forward_model(**self.batch)) / self.accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach().float()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total.item()

    def optimizer_state_bytes(self) -> int:
        return _state_bytes(self.optimizer)

    def compile(self, backend: str = "inductor") -> None:
        """From the next step on, the forward (and, through AOTAutograd, the backward) runs compiled."""
        self.forward_model = torch.compile(self.forward_model, backend=backend)


class PipelineEngine(TrainingEngine):
    """Pipeline parallel: the model is this rank's stages (:class:`autotune.prepare.pipeline.Pipeline`), and
    the batch one optimizer step's whole batch, which the schedule cuts into the micro batches."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # The whole model's parameters, as the other engines count them (this rank holds its stages').
        self.total_params, self.trainable_params = self.model.whole_parameters, self.model.whole_trainable
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, self.config, lr=LEARNING_RATE)
        self.autocast_dtype = getattr(torch, self.config.autocast_type) if self.config.autocast_type else None

    def step(self) -> float:
        import torch.distributed as dist

        autocast = torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
        pipeline: Any = self.model  # a Pipeline (autotune.prepare.pipeline), whose step runs the schedule
        with autocast, self.saving():
            loss = pipeline.step(**self.batch)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Every rank reports the loss the last stage computed (the others hold none).
        total = loss.detach().float() if loss is not None else torch.zeros((), device=self.device)
        dist.all_reduce(total)
        return total.item()

    def optimizer_state_bytes(self) -> int:
        return _state_bytes(self.optimizer)

    def compile(self, backend: str = "inductor") -> None:
        raise NotImplementedError("--compile is refused with --pp")


class DeepSpeedEngine(TrainingEngine):
    def __init__(self, *, workload: Workload, **kwargs: Any) -> None:
        super().__init__(workload=workload, **kwargs)
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        ds_config = deepspeed_config(
            self.config, workload, device_type=self.device.type, hidden_size=model_attr(self.model, "hidden_size")
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model, model_parameters=params, config=ds_config
        )

    def step(self) -> float:
        total = torch.zeros((), device=self.device)
        for _ in range(self.accum):
            with self.saving():
                loss = loss_of(self.engine(**self.batch))
            self.engine.backward(loss)
            self.engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            total += loss.detach().float() / self.accum
        return total.item()

    def optimizer_state_bytes(self) -> int:
        return _state_bytes(self.optimizer)

    def compile(self, backend: str = "inductor") -> None:
        """DeepSpeed's own ``engine.compile()``: it compiles the wrapped module and keeps ZeRO's hooks
        (partitioned parameters' gather and release) outside the graph."""
        self.engine.compile(backend=backend)


def build_engine(
    *, workload: Workload, config: TrialConfig, task: str, device: torch.device, world_size: int, mesh: Any = None
) -> TrainingEngine:
    """The trial's model, prepared and wrapped, and its optimizer. ``mesh``: FSDP's device mesh
    (default: every rank of the process group)."""
    if config.precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # bf16-true builds in bf16: the build's peak is then the 16-bit model's, not an fp32 copy's.
    dtype = getattr(torch, config.sixteen_bit) if config.true_16_bit and config.sixteen_bit else None
    with _built_where_it_lives(workload, config, device):
        model, make_batch = build_model_and_batch(workload, task=task, device=device, dtype=dtype)
    _random_partitions(model)
    # A pipeline is fed one optimizer step's batch at once: its schedule cuts it into the micro batches.
    fed = config.micro_batch * (config.grad_accum_steps(workload) if config.pp > 1 else 1)
    if make_batch is not None:  # the factory's own inputs, checked against the model it built
        batch = factory_batch(make_batch, model, micro_batch=config.micro_batch, device=device, source=workload.model)
    else:
        batch = synthetic_batch(
            model,
            task=task,
            micro_batch=fed,
            seq_len=workload.seq_len,
            target_len=workload.decoder_len,
            image_size=image_size(workload, model),
            device=device,
        )
    # What a user's job applies the same way (FSDP's sharding last).
    model = prepare(model, config, workload=workload, task=task, device=device, mesh=mesh)
    model.train()
    common = dict(
        model=model,
        batch=batch,
        unit=throughput_unit(task, own_batch=make_batch is not None),
        config=config,
        device=device,
    )
    if config.uses_deepspeed:
        return DeepSpeedEngine(workload=workload, **common)
    if config.pp > 1:
        return PipelineEngine(workload=workload, **common)
    return TorchEngine(workload=workload, world_size=world_size, **common)


def _built_where_it_lives(workload: Workload, config: TrialConfig, device: torch.device) -> Any:
    """Where a sharded model's parameters are made, so that no rank ever holds the whole model.

    FSDP: a Hugging Face model's parameters on the meta device, each rank then makes its shard
    (:mod:`autotune.prepare.sharding`; a factory's model is built whole). A quantized base: the same,
    each layer then made and quantized in turn (:mod:`autotune.prepare.quantize`). ZeRO-3: inside
    ``deepspeed.zero.Init``, which partitions each layer's parameters as soon as it is built.
    Fake tensors (the estimator's) hold no memory to save: built as they are.
    """
    if device.type == "meta" or torch_fake_mode_active():
        return contextlib.nullcontext()
    if (config.uses_fsdp or config.model_parallel > 1) and parse_model_source(workload.model).kind != "factory":
        return parameters_on_meta()  # each rank then makes its own shards
    if config.quantizes_base and parse_model_source(workload.model).kind != "factory":
        return parameters_on_meta()  # each linear layer made and quantized in turn, as from_pretrained loads it
    if config.zero_stage == 3:
        import deepspeed

        # DeepSpeed's view of the process group the trial joined: Init partitions over its ranks.
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        stack = contextlib.ExitStack()
        stack.enter_context(
            deepspeed.zero.Init(config_dict_or_path=deepspeed_config(config, workload, device_type=device.type))
        )
        # Transformers' weight init would index the empty partitions (an embedding's padding row:
        # IndexError since Transformers 5); _random_partitions fills each rank's partition instead.
        stack.enter_context(_no_transformers_init())
        return stack
    return contextlib.nullcontext()


@contextlib.contextmanager
def _no_transformers_init() -> Iterator[None]:
    """Transformers builds the model without initialising its weights (each module marked as done);
    everything else post_init does, tying the LM head to the embedding included, still happens."""
    from transformers import PreTrainedModel

    original = getattr(PreTrainedModel, "_initialize_weights", None)
    if original is None:  # a Transformers without the per-module hook: as it is
        yield
        return

    def mark_done(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        module._is_hf_initialized = True  # type: ignore[assignment]  # a flag; Module's __setattr__ types tensors

    PreTrainedModel._initialize_weights = mark_done  # type: ignore[method-assign]  # patched inside
    try:
        yield
    finally:
        PreTrainedModel._initialize_weights = original  # type: ignore[method-assign]  # restored


def _random_partitions(model: torch.nn.Module) -> None:
    """Weights built under ``deepspeed.zero.Init`` missed Transformers' init (it ran on empty,
    partitioned tensors): each rank's partition gets the same random weights a trial's model
    has elsewhere (their values change neither speed nor memory; they keep the loss sane)."""
    with torch.no_grad():
        for param in model.parameters():
            partition = getattr(param, "ds_tensor", None)
            if partition is not None and partition.is_floating_point():
                partition.normal_(0.0, INIT_STD)


def _state_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state tensors (Adam moments), unwrapping DeepSpeed's optimizer wrappers."""
    seen: set[int] = set()
    while (
        not isinstance(optimizer, torch.optim.Optimizer)
        and hasattr(optimizer, "optimizer")
        and id(optimizer) not in seen
    ):
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, (torch.optim.Optimizer, StepInBackward)):
        return 0
    storages: dict[int, int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:  # skip scalar step counters
                for storage in storages_of(value):  # FSDP's DTensor: this rank's shard
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
