"""The trial's config as Transformers' ``TrainingArguments``: what a ``Trainer`` job reads.

One function for both of its readers: the ``hf`` export (a JSON file of keyword arguments) and a
script trial of a Trainer script, whose own ``TrainingArguments`` get these values before the
script's trainer is built (:mod:`autotune.scripts.frameworks`). LoRA is not among them: the peft
export (or ``autotune.prepare``) applies it.
"""

from __future__ import annotations

from typing import Any

from autotune.config.deepspeed_config import deepspeed_config
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.levers import LEVERS, TRAINER_ORDER

__all__ = [
    "trainer_arguments",
    "lightning_arguments",
    "lightning_strategy",
    "accelerate_arguments",
    "accelerate_deepspeed_plugin",
]

# Lightning's registered DeepSpeed strategy names, by (stage, offload).
_LIGHTNING_DEEPSPEED = {
    (1, "none"): "deepspeed_stage_1",
    (2, "none"): "deepspeed_stage_2",
    (2, "optimizer"): "deepspeed_stage_2_offload",
    (3, "none"): "deepspeed_stage_3",
    (3, "optimizer+params"): "deepspeed_stage_3_offload",
}
# The bucket sizes DeepSpeedStrategy takes as arguments. ZeRO-3's prefetch bucket and persistence
# threshold are not among them: DeepSpeed's defaults (5e7 elements, 1e5) stay, which differ from the
# trial's by tens of MB on a 7B model, not by the GBs of the gradient buckets.
_LIGHTNING_BUCKETS = ("reduce_bucket_size", "allgather_bucket_size")

# TrainingArguments fills these from its own arguments; "auto" means the two cannot disagree
# (a concrete value that differs, e.g. DeepSpeed's lr vs learning_rate, makes HF raise).
_AUTO_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_AUTO_OPTIMIZER_KEYS = ("lr", "betas", "eps", "weight_decay")
# The bucket sizes the Trainer fills from its model's hidden size (DeepSpeed's own defaults, 5e8
# elements, allocate a 2 GB gradient buffer whatever the model): per "is ZeRO-3".
_AUTO_BUCKET_KEYS = {
    False: ("reduce_bucket_size",),
    True: ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"),
}


def trainer_arguments(
    config: TrialConfig,
    workload: Workload,
    *,
    device_type: str,
    hidden_size: int | None = None,
    wrap_classes: list[str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``transformers.TrainingArguments`` that train ``config``.

    ``hidden_size``: the model's, for DeepSpeed's bucket sizes (None: DeepSpeed's defaults).
    ``wrap_classes``: FSDP's unit classes (None: the model's own ``_no_split_modules``, which is
    what Accelerate's transformer-based wrap reads when it is given none).
    """
    kwargs: dict[str, Any] = {
        "per_device_train_batch_size": config.micro_batch,
        "gradient_accumulation_steps": config.grad_accum_steps(workload),
    }
    for lever in TRAINER_ORDER:
        kwargs.update(lever.trainer_arguments(config))
    if config.uses_deepspeed:
        ds = deepspeed_config(config, workload, device_type=device_type, hidden_size=hidden_size)
        ds.update(dict.fromkeys(_AUTO_KEYS, "auto"))
        if hidden_size is None:  # the Trainer sizes the buckets from its model, as the trials did (hidden²)
            ds["zero_optimization"].update(dict.fromkeys(_AUTO_BUCKET_KEYS[config.zero_stage == 3], "auto"))
        ds["optimizer"]["params"].update(dict.fromkeys(_AUTO_OPTIMIZER_KEYS, "auto"))
        kwargs["deepspeed"] = ds
    if config.uses_fsdp:  # Transformers 5's FSDP2 settings, read by its Accelerate plugin
        kwargs["fsdp"] = True
        kwargs["fsdp_config"] = {
            "version": 2,
            "reshard_after_forward": config.fsdp in ("full", "hybrid"),
            "cpu_offload": config.offload == "optimizer+params",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            **({} if wrap_classes is None else {"transformer_layer_cls_to_wrap": wrap_classes}),
            "state_dict_type": "SHARDED_STATE_DICT",
            "cpu_ram_efficient_loading": True,
        }
    if device_type == "cpu":
        kwargs["use_cpu"] = True
    return kwargs


def lightning_arguments(config: TrialConfig, workload: Workload) -> dict[str, Any]:
    """The knobs among ``lightning.pytorch.Trainer``'s arguments: precision and accumulation (the micro
    batch is the DataLoader's; checkpointing and LoRA are the model's, applied by ``autotune.prepare``)."""
    return {
        **{key: value for lever in LEVERS for key, value in lever.lightning_arguments(config).items()},
        "accumulate_grad_batches": config.grad_accum_steps(workload),
    }


def lightning_strategy(
    config: TrialConfig, workload: Workload, *, hidden_size: int | None = None
) -> str | dict[str, Any]:
    """``lightning.pytorch.Trainer``'s ``strategy``: a registered name, or LightningCLI's class_path form
    where the knobs need arguments. ``hidden_size``: the model's, for the trial's DeepSpeed bucket sizes
    (None: Lightning's own, 2e8 elements)."""
    if config.tp > 1:  # its configure_model applies autotune.prepare over the strategy's (data, tensor) mesh
        return {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": {"data_parallel_size": config.data_parallel(workload), "tensor_parallel_size": config.tp},
        }
    if config.uses_fsdp:  # the same sharding; Lightning's FSDPStrategy wraps with FSDP's first API
        strategies = {"full": "FULL_SHARD", "grad-op": "SHARD_GRAD_OP", "hybrid": "HYBRID_SHARD"}
        strategy = strategies[config.fsdp or "full"]  # uses_fsdp: a mode is set
        # HYBRID_SHARD's groups as its device_mesh (replicas, shard group); LightningCLI reads the list as the
        # tuple FSDPStrategy takes (without it FSDP1 shards within each node's GPUs).
        mesh = [config.replicate_degree(workload), config.shard_degree(workload)]
        return {
            "class_path": "lightning.pytorch.strategies.FSDPStrategy",
            "init_args": {
                "sharding_strategy": strategy,
                **({"device_mesh": mesh} if config.fsdp == "hybrid" else {}),
                "cpu_offload": config.offload == "optimizer+params",
                "state_dict_type": "sharded",
            },
        }
    if config.zero_stage is None:  # not uses_deepspeed
        return "ddp" if workload.nproc > 1 else "auto"
    zero = deepspeed_config(config, workload, hidden_size=hidden_size)["zero_optimization"]
    buckets = {key: zero[key] for key in _LIGHTNING_BUCKETS if key in zero}
    name = _LIGHTNING_DEEPSPEED.get((config.zero_stage, config.offload))
    if name is not None and not buckets:
        return name
    # No registered name (stage 0, stage 1 + offload, stage 3 + optimizer offload only), or the trial's
    # bucket sizes (Lightning's 2e8-element defaults hold GBs of buffers the trial did not).
    return {
        "class_path": "lightning.pytorch.strategies.DeepSpeedStrategy",
        "init_args": {
            "stage": config.zero_stage,
            "offload_optimizer": config.offload != "none",
            "offload_parameters": config.offload == "optimizer+params",
            **buckets,
        },
    }


def accelerate_arguments(config: TrialConfig, workload: Workload) -> dict[str, Any]:
    """The knobs among ``accelerate.Accelerator``'s arguments: mixed precision and accumulation (the
    micro batch is the DataLoader's; the rest is the model's, applied by ``autotune.prepare``)."""
    return {
        **{key: value for lever in LEVERS for key, value in lever.accelerate_arguments(config).items()},
        "gradient_accumulation_steps": config.grad_accum_steps(workload),
    }


def accelerate_deepspeed_plugin(
    config: TrialConfig, workload: Workload, *, device_type: str, hidden_size: int | None = None
) -> dict[str, Any]:
    """ZeRO as Accelerate takes it: ``accelerate.DeepSpeedPlugin``'s arguments. ``hf_ds_config`` is the
    DeepSpeed config (the accelerate export writes it to the file its YAML names), with the trial's
    bucket sizes: the plugin Accelerate builds from YAML keys alone has DeepSpeed's 5e8-element
    buckets (a 1.9 GB fp32 gradient buffer on a 2-layer model: bench/zero_buckets.py).

    The script's own optimizer stays its own: no ``optimizer`` block (Accelerate refuses one beside an
    optimizer in code). The batch sizes are the trial's, not "auto": Accelerate fills "auto" with its
    own process count, which is 1 for DeepSpeed on CPU ranks (no backend of its own), and DeepSpeed
    then refuses the global batch of a 2-rank job.
    ``hidden_size`` None: the bucket sizes are "auto", filled from the model's config.hidden_size.
    """
    ds = deepspeed_config(config, workload, device_type=device_type, hidden_size=hidden_size)
    del ds["optimizer"]
    if hidden_size is None:
        ds["zero_optimization"].update(dict.fromkeys(_AUTO_BUCKET_KEYS[config.zero_stage == 3], "auto"))
    return {"hf_ds_config": ds, "zero3_init_flag": config.zero_stage == 3}
