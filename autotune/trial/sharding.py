"""FSDP2 for a trial: the model built where it will live, one ``fully_shard`` unit per layer.

A Hugging Face model is built with its parameters on the meta device (its buffers, such as
rotary frequencies, stay real: they are small and computed at build), prepared as a user's job
prepares it (checkpointing, LoRA, precision, loss), sharded per decoder layer and then at the
root (what Transformers' and Accelerate's auto-wrap do), and only then materialised: each rank
allocates its own shard, never the whole model. A factory's model is built whole, then sharded.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = ["parameters_on_meta", "shard_model", "shard_units"]

_INIT_STD = 0.02  # random weights: their values change neither speed nor memory, only stay finite


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lives on the meta device; buffers stay where they are made.

    Each parameter is made on the build's device, then moved: the build holds one parameter at a
    time, at most (Accelerate's ``init_empty_weights(include_buffers=False)`` does the same).
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kept = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(kept.to("meta"), requires_grad=kept.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers each made one FSDP unit: the model's ``_no_split_modules`` classes (Transformers'
    decoder layers, the auto-wrap of Accelerate and Transformers), else the blocks of the longest
    ``ModuleList`` of one class (a factory's model)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names]
    if units:
        return units
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
             and len({type(block) for block in m}) == 1]
    return list(max(lists, key=len)) if lists else []


def shard_model(model: torch.nn.Module, config: TrialConfig, device: torch.device,
                mesh: Any = None) -> torch.nn.Module:
    """``fully_shard`` each unit, then the root, with the config's reshard, precision and offload
    policies; then give each rank its shard of the parameters (meta ones made, random)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    options: dict[str, Any] = {"reshard_after_forward": config.fsdp == "full", "mesh": mesh}
    if config.autocast_type is not None:  # mixed precision: 16-bit compute copies, fp32 gradient reduction
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, config.autocast_type),
                                                    reduce_dtype=torch.float32)
    # Pinned memory needs a GPU; on a CPU device "offload" keeps the same policy, its copies are plain.
    options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda") \
        if config.offload == "optimizer+params" else OffloadPolicy()
    for unit in shard_units(model):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    _materialise(model, config, device)
    return model


def _materialise(model: torch.nn.Module, config: TrialConfig, device: torch.device) -> None:
    if not any(p.device.type == "meta" for p in model.parameters()):
        return
    # Buffers are real (only parameters went to meta) and where FSDP put them: to_empty would
    # replace them with empty ones, so the same tensors go back in.
    buffers = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()]
    # Offloaded shards live in CPU memory, the others on the device (torchtitan does the same).
    model.to_empty(device=torch.device("cpu") if config.offload == "optimizer+params" else device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.normal_(0.0, _INIT_STD)
