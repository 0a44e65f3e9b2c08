"""``autotune.prepare(model, config)``: apply to a built model what a trial applied to its own.

The trial's engine calls this same function, so what was measured is what the user's job runs:
the attention kernel, activation checkpointing (every N-th layer too), LoRA adapters on a base quantized or
not, where each weight is held for the precision (a 16-bit frozen base, bf16-true), the chunked loss,
tensor parallel, FSDP's sharding and pipeline stages. What a training loop does itself is not here: the
optimizer, autocast and the loss scaler, the micro batch and the accumulation (the exports carry those,
in the target library's own keys).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.levers import LEVERS, LORA

if TYPE_CHECKING:
    import torch

__all__ = ["prepare", "read_export"]


def prepare(
    model: torch.nn.Module,
    config: TrialConfig | dict[str, Any] | str | Path | None = None,
    *,
    workload: Workload | None = None,
    task: str | None = None,
    device: torch.device | None = None,
    mesh: Any = None,
    **knobs: Any,
) -> torch.nn.Module:
    """Apply ``config``'s knobs to ``model`` and return the model to train (PEFT's wrapper with LoRA).

    ``config``: a TrialConfig, its dict, or the path of an ``autotune export --format json|yaml``
    file (which also carries the workload); ``knobs``: knob values instead, or over the config's,
    e.g. ``prepare(model, loss="chunked:8")`` for only what no library flag sets. ``workload``
    (the export's when it has one) names the model for LoRA's default targets and messages.
    With ``fsdp`` set the model is sharded last, over ``mesh`` (default: every rank of the process
    group, which must exist; ``hybrid``: a (replicate, shard) mesh of its ``shard_group``, else of each
    node's ranks), on ``device`` (default: where its parameters are).
    """
    config, workload = _resolve(config, workload, knobs)
    source = f"the model from --model {workload.model}" if workload is not None else "the model"
    for lever in LEVERS:  # those that change the model; the others return it as it is
        # LoRA's adapters need the built model's facts (their targets), a quantized base the device: _lora.
        model = (
            _lora(model, config, workload, task, device) if lever is LORA else lever.apply(model, config, source=source)
        )
    if config.pp > 1:  # this rank's stages, and the schedule that runs them
        from autotune.prepare.pipeline import Pipeline
        from autotune.prepare.sharding import torch_device, torch_fake_mode_active

        if workload is None:
            raise ConfigError(
                "prepare(): --pp's micro batches are the accumulation steps, which depend on the global batch; "
                "pass workload=Workload(...), or the path of the autotune export, which carries it"
            )
        # Traced on fake tensors (the estimator), the stages are told their shapes: they cannot vote on them.
        traced = torch_fake_mode_active()
        return Pipeline(
            model,
            config,
            micro_batches=config.grad_accum_steps(workload),
            device=device or torch_device(model),
            shapes=(config.micro_batch, workload.seq_len) if traced else None,
        )
    if config.tp > 1:  # then FSDP, if set, over the other ranks (2-D: FSDP x TP)
        mesh = _tensor_parallel(model, config, device, mesh)
    if config.uses_fsdp:
        from autotune.prepare.sharding import shard_model

        model = shard_model(model, config, device, mesh)
    return model


def _lora(
    model: torch.nn.Module, config: TrialConfig, workload: Workload | None, task: str | None, device: Any
) -> torch.nn.Module:
    """LoRA's adapters, on a base quantized first if the config says so; the model as it is without LoRA."""
    if not config.uses_lora:
        return model
    from autotune.models.sources import resolve_task
    from autotune.prepare.workload_facts import WorkloadFacts

    if workload is None:
        raise ConfigError(
            "prepare(): LoRA's targets depend on the model; pass workload=Workload(model=...), "
            "or the path of the autotune export, which carries it"
        )
    task = task or resolve_task(workload)
    if config.quantizes_base:  # before LoRA, which wraps the quantized layers
        from autotune.prepare.model_facts import head_names
        from autotune.prepare.quantize import quantize_base

        quantize_base(model, config, heads=tuple(head_names(model, task=task)), device=device)
    return LORA.adapt(model, config, WorkloadFacts(workload, task=task, built=model))


def _tensor_parallel(model: torch.nn.Module, config: TrialConfig, device: torch.device | None, mesh: Any) -> Any:
    """Split the model's layers over the ``tp`` ranks of ``mesh`` (default: the process group's ranks as a
    (dp, tp) mesh); returns the mesh FSDP shards the data-parallel copies over (its ``dp`` ranks)."""
    from autotune.prepare.sharding import materialise, torch_device
    from autotune.prepare.tensor_parallel import layout_mesh, tensor_parallel

    device = device or torch_device(model)
    if mesh is None:
        mesh = layout_mesh(config, device.type)
    names = tuple(mesh.mesh_dim_names or ())
    # autotune's own names, or Lightning ModelParallelStrategy's (its device_mesh in configure_model).
    tensor = next((name for name in ("tp", "tensor_parallel") if name in names), None)
    data = next((name for name in ("dp", "data_parallel") if name in names), None)
    if tensor is None:
        raise ConfigError(
            f"prepare(): --tp {config.tp} needs a device mesh with a 'tp' (or 'tensor_parallel') dimension, and "
            f"'dp' (or 'data_parallel') for FSDP; this one has {names or 'no names'}"
        )
    tensor_parallel(model, config, mesh[tensor])
    if not config.uses_fsdp:  # FSDP makes its own shards of what is still on the meta device
        materialise(model, device)
    return mesh[data] if data is not None else None


def _resolve(
    config: TrialConfig | dict[str, Any] | str | Path | None, workload: Workload | None, knobs: dict[str, Any]
) -> tuple[TrialConfig, Workload | None]:
    if isinstance(config, (str, Path)):
        config, exported = read_export(Path(config))
        workload = workload or exported
    if config is None:
        config = TrialConfig()
    elif isinstance(config, dict):
        config = TrialConfig.from_dict(config)
    elif not isinstance(config, TrialConfig):
        raise ConfigError(
            f"prepare(): config must be a TrialConfig, its dict or an export's path, not {type(config).__name__}"
        )
    return (TrialConfig.from_dict({**config.to_dict(), **knobs}) if knobs else config), workload


def read_export(path: Path, *, reader: str = "prepare()") -> tuple[dict[str, Any], Workload | None]:
    """The config (and workload) of an ``autotune export --format json`` or ``yaml`` file.
    ``reader``: who asks, for the errors (a function, or a flag such as ``--config``)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{reader}: cannot read {path}: {exc.strerror}") from None
    import yaml

    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{reader}: {path} is not an autotune export ({first})") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        raise ConfigError(f"{reader}: {path} has no config; write one with autotune export --format json (or yaml)")
    workload = Workload.from_dict(data["workload"]) if isinstance(data.get("workload"), dict) else None
    return data["config"], workload
