"""FSDP2: one ``fully_shard`` unit per layer, then the root, and a model built where it will live.

:func:`shard_model` is ``prepare``'s last step, in a trial and in a user's job alike: each
decoder layer one unit, then the root (what Transformers' and Accelerate's auto-wrap do). A
trial builds a Hugging Face model inside :func:`parameters_on_meta` (its buffers, such as rotary
frequencies, stay real: they are small and computed at build), so only the sharded parameters
are ever made: each rank allocates its own shard, never the whole model. A factory's model is
built whole, then sharded.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig

__all__ = [
    "materialise",
    "torch_device",
    "torch_fake_mode_active",
    "parameters_on_meta",
    "shard_model",
    "shard_units",
    "hybrid_mesh",
    "INIT_STD",
]

INIT_STD = 0.02  # random weights: their values change neither speed nor memory, only stay finite


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
            assert kept is not None  # registered just now
            module._parameters[name] = torch.nn.Parameter(kept.to("meta"), requires_grad=kept.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]  # patched inside
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]  # restored


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers each made one FSDP unit: the model's ``_no_split_modules`` classes (Transformers'
    decoder layers, the auto-wrap of Accelerate and Transformers), else the blocks of the longest
    ``ModuleList`` of one class (a factory's model)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names]
    if units:
        return units
    lists = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) > 1 and len({type(block) for block in m}) == 1
    ]
    return [*max(lists, key=len)] if lists else []


def shard_model(
    model: torch.nn.Module, config: TrialConfig, device: torch.device | None = None, mesh: Any = None
) -> torch.nn.Module:
    """``fully_shard`` each unit, then the root, with the config's reshard, precision and offload
    policies; then give each rank its shard of the parameters (meta ones made, random)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    from autotune.errors import ConfigError
    from autotune.levers.grad_reduction import fsdp_precision

    if mesh is None and not dist.is_initialized():
        raise ConfigError(
            f"--fsdp {config.fsdp} shards over the ranks of a process group: run the job under "
            "torchrun and call torch.distributed.init_process_group() before autotune.prepare"
        )
    device = device or torch_device(model)
    if config.fsdp == "hybrid" and mesh is None:
        mesh = hybrid_mesh(config, device.type)
    # hybrid reshards as full does, within its shard group (FSDP1's HYBRID_SHARD is FULL_SHARD per group).
    options: dict[str, Any] = {"reshard_after_forward": config.fsdp in ("full", "hybrid"), "mesh": mesh}
    precision = fsdp_precision(config)  # mixed precision's 16-bit copies, or --reduce-dtype fp32 on bf16 weights
    if precision is not None:
        param_dtype, reduce_dtype = precision
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, param_dtype), reduce_dtype=getattr(torch, reduce_dtype)
        )
    # Pinned memory needs a GPU; on a CPU device "offload" keeps the same policy, its copies are plain.
    options["offload_policy"] = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if config.offload == "optimizer+params" else OffloadPolicy()
    )
    for unit in shard_units(model):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    # Offloaded shards live in CPU memory, the others on the device (torchtitan does the same).
    materialise(model, torch.device("cpu") if config.offload == "optimizer+params" else device)
    return model


def hybrid_mesh(config: TrialConfig, device_type: str) -> Any:
    """The process group's ranks as a 2-D ``(replicate, shard)`` mesh: consecutive ranks (one node's, as
    torchrun numbers them) form a shard group. ``fully_shard`` on a 2-D mesh shards over its last dimension
    and replicates over its first (``_fully_shard/_fsdp_init.py``: ``HSDPMeshInfo``), as torchtitan's
    ``dp_replicate`` x ``dp_shard`` mesh. The group: ``--shard-group``, else the ranks of this node (torchrun's
    ``LOCAL_WORLD_SIZE``)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autotune.errors import ConfigError

    world = dist.get_world_size()
    group = config.shard_group or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % group or not 1 < group < world:
        raise ConfigError(
            f"--fsdp hybrid: a shard group of {group} ranks must divide the {world} ranks of the process group "
            "and leave two or more groups; set --shard-group to such a divisor"
        )
    return init_device_mesh(device_type, (world // group, group), mesh_dim_names=("replicate", "shard"))


def torch_fake_mode_active() -> bool:
    """Whether this runs on fake tensors (the estimator's trace), where values are unknown."""
    return torch._guards.active_fake_mode() is not None


def _tied_parameters(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """Where each plain parameter shared by several modules is registered (a tied embedding and LM head
    beside tensor-parallel layers). FSDP's sharded ones are left to FSDP, which keeps them shared."""
    places: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not hasattr(param, "to_local"):
                places.setdefault(id(param), []).append((module, name))
    return [where for where in places.values() if len(where) > 1]


def torch_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (a GPU job moves it there before preparing); the CPU when all are
    on the meta device (a trial's sharded build)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def materialise(model: torch.nn.Module, device: torch.device) -> None:
    """Make a model's meta parameters (each rank's shard of them, for DTensors) on ``device``, random.

    Every rank draws the same values: a parameter whole on every rank (a norm, the embedding beside
    tensor-parallel layers) must hold the same weights everywhere for the ranks to compute the same step.
    """
    if not any(p.device.type == "meta" for p in model.parameters()):
        return
    # Buffers are real (only parameters went to meta) and where FSDP put them: to_empty would
    # replace them with empty ones, so the same tensors go back in.
    buffers = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()]
    tied = _tied_parameters(model)
    model.to_empty(device=device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    for (first, first_name), *others in tied:  # to_empty makes each module its own copy of a shared weight
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    draws = torch.Generator(device=device)
    draws.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            local.normal_(0.0, INIT_STD, generator=draws)
