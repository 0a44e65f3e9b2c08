"""The DeepSpeed config JSON of a TrialConfig: what a trial initialises, and what is exported."""

from __future__ import annotations

from typing import Any

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload

__all__ = ["deepspeed_config", "LEARNING_RATE"]

LEARNING_RATE = 1e-4  # speed and memory do not depend on it; a plain value keeps losses finite


def deepspeed_config(
    config: TrialConfig, workload: Workload, *, device_type: str = "cuda", hidden_size: int | None = None
) -> dict[str, Any]:
    """A DeepSpeed config for ``config`` (ZeRO stage 0 when the trial config has ZeRO off).

    On a CPU, DeepSpeed's own Adam kernels need a JIT compile; ``torch_adam`` makes it use
    ``torch.optim.AdamW`` instead, the same maths with the same state size.

    Bucket sizes follow the Hugging Face integration's ``"auto"`` values (from the model's
    hidden size): DeepSpeed's defaults (5e8 elements) allocate gigabytes of communication
    buffers whatever the model's size, which no tuned job would keep.
    """
    stage = config.zero_stage or 0
    zero: dict[str, Any] = {"stage": stage}
    if hidden_size:
        zero["reduce_bucket_size"] = hidden_size * hidden_size
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
            zero["stage3_param_persistence_threshold"] = 10 * hidden_size
        else:
            zero["allgather_bucket_size"] = hidden_size * hidden_size
    pin = device_type == "cuda"  # pinned host memory needs a GPU driver
    if config.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if config.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    optimizer_params: dict[str, Any] = {"lr": LEARNING_RATE, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    if device_type != "cuda":
        optimizer_params["torch_adam"] = True
    ds: dict[str, Any] = {
        "train_batch_size": workload.global_batch,
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": config.grad_accum_steps(workload),
        "optimizer": {"type": "AdamW", "params": optimizer_params},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": device_type == "cuda",
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if config.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    elif config.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    return ds
