"""Exporters: a tuned TrialConfig as a file that the target library itself loads.

One small function per format, each returning the file's text. Every export says which
precision is used and whether LoRA is trained (docs/design.md: never hand over LoRA silently): as a
``trains`` key in JSON/YAML and as comment lines in the YAML formats. DeepSpeed and
TrainingArguments JSON can hold neither comments nor extra keys: their precision keys say it,
and LoRA travels in the peft export (adapter_config.json). The model's facts these need (hidden
size, LoRA's targets) come from the study when it stored them (:mod:`autotune.study.stored_facts`):
then no format imports torch, transformers or PEFT.

A trial over several nodes (``--nodes``, a SLURM job's) exports for as many: Accelerate's
``num_machines``, Lightning's ``num_nodes``, and the launch script (``--format launch``) that starts
the job's ranks as the trials started theirs: ``srun``, one torchrun per node and a c10d rendezvous
on the first node, with DeepSpeed's hostfile lines for a ZeRO config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from autotune.config.deepspeed_config import deepspeed_config
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.levers import FORMAT_ORDER, HEADER_ORDER, IN_CODE_AFTER_LAYOUT, IN_CODE_BEFORE_LAYOUT, LEVERS
from autotune.output.torchtitan import dump_toml, torchtitan_config, torchtitan_launch
from autotune.prepare.model_facts import layer_classes
from autotune.prepare.quantize import bitsandbytes_config, quantization_lines
from autotune.prepare.training_args import (
    accelerate_arguments,
    accelerate_deepspeed_plugin,
    lightning_arguments,
    lightning_strategy,
    trainer_arguments,
)
from autotune.study.stored_facts import adapter_config, hidden_size
from autotune.study.summary import what_is_trained
from autotune.trial.multinode import RDZV_PORT

__all__ = ["FORMATS", "DEFAULT_FILENAMES", "export_config", "export_files", "deepspeed_companion", "in_code"]

FORMATS = ("json", "yaml", "deepspeed", "hf", "accelerate", "lightning", "peft", "bnb", "launch", "torchtitan")
DEFAULT_FILENAMES = {
    "json": "autotune.json",
    "yaml": "autotune.yaml",
    "deepspeed": "ds_config.json",
    "hf": "training_args.json",
    "accelerate": "accelerate_config.yaml",
    "lightning": "lightning_trainer.yaml",
    "peft": "adapter_config.json",
    "bnb": "quantization_config.json",
    "launch": "launch.sh",
    "torchtitan": "torchtitan.toml",
}


def export_config(
    config: TrialConfig,
    workload: Workload,
    *,
    fmt: str,
    device_type: str = "cuda",
    summary: dict[str, Any] | None = None,
    deepspeed_file: str | None = None,
) -> str:
    """The text of the file in format ``fmt`` for training ``workload`` with ``config``.

    ``summary`` (study name, tokens/s, peak memory, ...) is context: keys in json/yaml and
    header comments in the YAML formats; the formats other libraries load ignore it.
    ``deepspeed_file``: where the DeepSpeed config of an Accelerate ZeRO export is (see
    :func:`export_files`; by default the companion of ``accelerate_config.yaml``).
    """
    exporter = _EXPORTERS.get(fmt)
    if exporter is None:
        raise ConfigError(f"--format {fmt} is not known; use one of {', '.join(FORMATS)}")
    for lever in FORMAT_ORDER:  # a format that cannot carry a lever's values must not drop them
        refusal = lever.format_refusal(config, fmt, device_type)
        if refusal is not None:
            raise ConfigError(refusal)
    if fmt == "accelerate":
        return _accelerate(
            config,
            workload,
            device_type=device_type,
            summary=summary or {},
            deepspeed_file=deepspeed_file or str(deepspeed_companion(Path(DEFAULT_FILENAMES[fmt]))),
        )
    return exporter(config, workload, device_type=device_type, summary=summary or {})


def export_files(
    config: TrialConfig,
    workload: Workload,
    path: Path,
    *,
    fmt: str,
    device_type: str = "cuda",
    summary: dict[str, Any] | None = None,
) -> list[tuple[Path, str]]:
    """Every file of the export written to ``path``, as (path, text): one file, except an Accelerate
    ZeRO config's two: the YAML and, beside it, the DeepSpeed config its ``deepspeed_config_file``
    names (YAML keys alone cannot give DeepSpeed the bucket sizes the trials ran with)."""
    if fmt == "accelerate" and config.uses_deepspeed:
        companion = deepspeed_companion(path)
        return [
            (
                path,
                export_config(
                    config, workload, fmt=fmt, device_type=device_type, summary=summary, deepspeed_file=str(companion)
                ),
            ),
            (
                companion,
                _dump_json(
                    accelerate_deepspeed_plugin(
                        config, workload, device_type=device_type, hidden_size=hidden_size(workload)
                    )["hf_ds_config"]
                ),
            ),
        ]
    return [(path, export_config(config, workload, fmt=fmt, device_type=device_type, summary=summary))]


def deepspeed_companion(path: Path) -> Path:
    """The DeepSpeed config beside an Accelerate YAML.

    ``accelerate_config.yaml`` -> ``accelerate_config.deepspeed.json``.
    """
    return path.with_name(f"{path.stem}.deepspeed.json")


# -- plain records --------------------------------------------------------------------------
def _record(config: TrialConfig, workload: Workload, summary: dict[str, Any]) -> dict[str, Any]:
    from autotune.version import __version__

    data = {
        "autotune": __version__,
        "workload": workload.to_dict(),
        "config": config.to_dict(),
        "grad_accum_steps": config.grad_accum_steps(workload),
        "trains": what_is_trained(config, workload),
    }
    clash = sorted(set(data) & set(summary))
    if clash:
        raise ValueError(f"summary keys {clash} would overwrite the exported config")
    return {**data, **summary}


def _json(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    return _dump_json(_record(config, workload, summary))


def _yaml(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    return _header(config, workload, summary) + _dump_yaml(_record(config, workload, summary))


# -- DeepSpeed and Hugging Face TrainingArguments -------------------------------------------
def _deepspeed(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    return _dump_json(deepspeed_config(config, workload, device_type=device_type, hidden_size=hidden_size(workload)))


def _hf(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    """Keyword arguments of ``transformers.TrainingArguments``; LoRA lives in the peft export."""
    return _dump_json(
        trainer_arguments(
            config,
            workload,
            device_type=device_type,
            hidden_size=hidden_size(workload),
            wrap_classes=layer_classes(workload) if config.uses_fsdp else None,
        )
    )


# -- Accelerate -----------------------------------------------------------------------------
def _accelerate(
    config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any], deepspeed_file: str
) -> str:
    """A config as ``accelerate config`` writes it (see accelerate's ``ClusterConfig``); a ZeRO config
    names its DeepSpeed config file (``deepspeed_file``), as ``accelerate config`` does when asked for one."""
    cpu = device_type == "cpu"
    if config.uses_deepspeed:
        distributed = "DEEPSPEED"
    elif config.uses_fsdp:
        distributed = "FSDP"
    elif workload.nproc > 1:
        distributed = "MULTI_CPU" if cpu else "MULTI_GPU"
    else:
        distributed = "NO"
    data: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed,
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": accelerate_arguments(config, workload)["mixed_precision"],
        "num_machines": workload.nodes,
        "num_processes": workload.nproc,  # over all machines: accelerate launch starts nproc // nodes on each
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": cpu,
    }
    if workload.nodes > 1:
        # The first node's address is the job's, so it is given on the command line (see the header);
        # so is --rdzv_backend c10d: accelerate launch reads rdzv_backend and same_network from its
        # flags alone (their defaults are not None, so the file's values never replace them).
        data["main_process_port"] = RDZV_PORT
    if not cpu:
        data["gpu_ids"] = "all"
    for lever in LEVERS:
        data.update(lever.accelerate_config(config))
    if config.uses_deepspeed:
        # Only these two keys beside a file: Accelerate refuses accumulation, stage or offload keys that
        # the file would override (the file says them; the script's Accelerator reads them from it).
        data["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file, "zero3_init_flag": config.zero_stage == 3}
        if workload.nodes > 1:  # torchrun on each node, as for the other types (not pdsh and a hostfile)
            data["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        del data["mixed_precision"]  # likewise: the file's bf16/fp16 blocks say it
    if config.uses_fsdp:
        data["fsdp_config"] = _accelerate_fsdp(config, workload)
    if config.fsdp == "hybrid":
        # FSDP2's HSDP in Accelerate: a (dp_replicate, dp_shard) mesh from its ParallelismConfig, as `accelerate
        # config` writes it (FSDP1's fsdp_sharding_strategy HYBRID_SHARD is deprecated under fsdp_version 2).
        prefix = "parallelism_config_"
        data["parallelism_config"] = {
            f"{prefix}dp_replicate_size": config.replicate_degree(workload),
            f"{prefix}dp_shard_size": config.shard_degree(workload),
            f"{prefix}tp_size": 1,
            f"{prefix}cp_size": 1,
        }
    launch = _nodes_lines(workload)
    if workload.nodes > 1:  # the same command on every node: a c10d rendezvous on the first, as the trials met
        launch.append(
            f"start it once on each of the {workload.nodes} nodes: accelerate launch --config_file THIS_FILE "
            "--rdzv_backend c10d --main_process_ip FIRST_NODE TRAIN_SCRIPT (in a SLURM job: srun --nodes "
            f"{workload.nodes} --ntasks-per-node 1 accelerate launch ..., FIRST_NODE from "
            'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
        )
    return _header(config, workload, summary, launch=launch) + _dump_yaml(data)


def _accelerate_fsdp(config: TrialConfig, workload: Workload) -> dict[str, Any]:
    """FSDP2 as ``accelerate config`` writes it: one unit per decoder layer, as the trial wrapped."""
    return {
        "fsdp_version": 2,
        "fsdp_reshard_after_forward": config.fsdp in ("full", "hybrid"),
        "fsdp_offload_params": config.offload == "optimizer+params",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": ",".join(layer_classes(workload)),
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
    }


# -- Lightning ------------------------------------------------------------------------------
def _lightning(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    """``trainer:`` arguments of ``lightning.pytorch.Trainer``, as LightningCLI reads them."""
    trainer = {
        "accelerator": "cpu" if device_type == "cpu" else "gpu",
        "devices": workload.ranks_per_node,  # Lightning's devices are each node's
        **({"num_nodes": workload.nodes} if workload.nodes > 1 else {}),
        **lightning_arguments(config, workload),
        "strategy": lightning_strategy(config, workload, hidden_size=hidden_size(workload)),
    }
    return _header(config, workload, summary) + _dump_yaml({"trainer": trainer})


# -- the launch script --------------------------------------------------------------------------
def _launch(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    """A bash script that starts the user's training script (its arguments) with the trials' ranks:
    python for one rank; torchrun on one node; over several, ``srun`` placing one torchrun per node of
    the SLURM job and a c10d rendezvous on its first node (the command the multi-node trials ran, see
    :func:`autotune.trial.multinode.multinode_command`), with DeepSpeed's hostfile for a ZeRO config."""
    nodes, per_node = workload.nodes, workload.ranks_per_node
    if nodes > 1:
        ranks = f"{workload.nproc} ranks over {nodes} nodes, {per_node} on each"
    else:
        ranks = f"{workload.nproc} rank{'s' if workload.nproc > 1 else ''} on one machine"
    lines = ["#!/bin/bash", *_header(config, workload, summary, launch=[]).splitlines()]
    lines += [
        f"# Starts TRAIN_SCRIPT [ARGS...] with the trials' ranks: {ranks}.",
        "# Run: sbatch THIS_SCRIPT train.py ARGS... (or bash THIS_SCRIPT train.py ARGS... "
        + ("inside such a SLURM job)" if nodes > 1 else "here)"),
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        # A core for each of the node's ranks, as the trials' worker jobs asked (raise it for DataLoader workers).
        f"#SBATCH --cpus-per-task={per_node}",
    ]
    if device_type == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    lines += [
        "set -euo pipefail",
        'if [ "$#" -eq 0 ]; then',
        f'  echo "usage: $0 TRAIN_SCRIPT [ARGS...]: starts it with {ranks}" >&2',
        "  exit 2",
        "fi",
    ]
    if nodes == 1:
        if workload.nproc == 1 and not config.uses_deepspeed:
            return "\n".join([*lines, 'exec "${PYTHON:-python}" "$@"']) + "\n"
        # DeepSpeed finds its one rank's process group from torchrun's variables too.
        return "\n".join([*lines, f'exec torchrun --standalone --nproc-per-node={per_node} "$@"']) + "\n"
    lines += [
        f"NODES={nodes}",
        'if [ "${SLURM_JOB_NUM_NODES:-}" != "$NODES" ]; then',
        '  echo "$0: this config trains over $NODES nodes: run it in a SLURM job of $NODES nodes '
        '(sbatch $0 TRAIN_SCRIPT ...); SLURM_JOB_NUM_NODES here: ${SLURM_JOB_NUM_NODES:-unset}" >&2',
        "  exit 2",
        "fi",
        'HOSTLIST=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'mapfile -t HOSTS <<<"$HOSTLIST"',
        "MASTER_ADDR=${HOSTS[0]}",
        f"MASTER_PORT=${{MASTER_PORT:-{RDZV_PORT}}}",
    ]
    if config.uses_deepspeed:
        lines += [
            "# DeepSpeed's hostfile: a line per node, HOST slots=RANKS (deepspeed --hostfile reads it; the",
            "# torchrun below does not need it)",
            "HOSTFILE=${HOSTFILE:-hostfile}",
            f'printf \'%s slots={per_node}\\n\' "${{HOSTS[@]}}" >"$HOSTFILE"',
        ]
    lines += [
        "# Each node's torchrun gets the job's CPUs there (the fewest, where nodes differ): srun does not inherit",
        "# sbatch's --cpus-per-task (SLURM 22.05+), and one CPU per task would bind all of a node's ranks to one.",
        "CPUS=$(tr , '\\n' <<<\"$SLURM_JOB_CPUS_PER_NODE\" | sed 's/(x[0-9]*)//' | sort -n | head -1)",
        "# One torchrun per node; they meet at a c10d rendezvous on the first node, as the trials' ranks did.",
        f'exec srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --cpus-per-task="$CPUS" \\',
        "  --kill-on-bad-exit=1 \\",
        f"  torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d \\",
        '  --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="autotune-$SLURM_JOB_ID" "$@"',
    ]
    return "\n".join(lines) + "\n"


# -- PEFT -----------------------------------------------------------------------------------
def _peft(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    """adapter_config.json as ``LoraConfig.save_pretrained`` writes it."""
    if not config.uses_lora:
        raise ConfigError(
            "--format peft: this config trains all weights (no LoRA), so there is no "
            "adapter config; tune with --space lora to search LoRA configs"
        )
    # The same LoraConfig the trials applied, as the study stored it at tune time (else worked out now).
    return json.dumps(adapter_config(config, workload), indent=2, sort_keys=True, default=str) + "\n"


def _bnb(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    """``BitsAndBytesConfig`` keyword arguments (``BitsAndBytesConfig(**json.load(f))``) for ``from_pretrained``."""
    if not config.quantizes_base:
        raise ConfigError(
            "--format bnb: this config holds its base unquantized (--quantize-base off), so there is no "
            "quantization config; tune with --space lean to search quantized bases"
        )
    return _dump_json(bitsandbytes_config(config))


# -- torchtitan ----------------------------------------------------------------------------
def _torchtitan(config: TrialConfig, workload: Workload, *, device_type: str, summary: dict[str, Any]) -> str:
    """torchtitan's TOML job config (:mod:`autotune.output.torchtitan`)."""
    tables = torchtitan_config(config, workload, device_type=device_type)
    launch = [
        *torchtitan_launch(workload, DEFAULT_FILENAMES["torchtitan"]),
        "add your model's name and flavor to [model], as torchtitan's own train configs give them "
        "(torchtitan trains its own model definitions)",
    ]
    return _header(config, workload, summary, launch=launch, in_job_code=False) + dump_toml(tables)


# -- shared helpers -------------------------------------------------------------------------
def _header(
    config: TrialConfig,
    workload: Workload,
    summary: dict[str, Any],
    *,
    launch: list[str] | None = None,
    in_job_code: bool = True,
) -> str:
    """Comment lines for YAML and TOML formats: what is trained, and the knobs no key carries (``launch``:
    how the job starts over its nodes, by default :func:`_nodes_lines`; ``in_job_code``: what a job built on
    Transformers applies in its code, which a framework that trains its own models, torchtitan, does not)."""
    trains = what_is_trained(config, workload)
    lines = [
        f"autotune export: {workload.model}, {config.describe()}",
        f"trains: {trains['note']}",
        f"micro batch: {config.micro_batch} per rank (the DataLoader's batch_size), "
        f"gradient accumulation: {config.grad_accum_steps(workload)}, global batch: {workload.global_batch}",
        *(_nodes_lines(workload) if launch is None else launch),
    ]
    if in_job_code:
        lines += _job_code_lines(config, workload, trains)
    lines += [f"{key}: {value}" for key, value in summary.items()]
    return "".join(f"# {' '.join(str(line).split())}\n" for line in lines)


def _job_code_lines(config: TrialConfig, workload: Workload, trains: dict[str, Any]) -> list[str]:
    """Header lines on what a job built on Transformers applies for each lever: how it is turned on, LoRA's
    adapters, the quantized base, and what no library's config carries."""
    lines = [line for lever in HEADER_ORDER for line in lever.header_lines(config)]
    if config.uses_lora:
        lora = trains["lora"]
        targets = lora.get("targets_note") or (",".join(lora["targets"]) if lora["targets"] else "default")
        lines.append(
            f"LoRA: rank {lora['rank']}, alpha {lora['alpha']}, targets {targets} "
            "(adapter config: autotune export --format peft)"
        )
    else:
        lines.append("LoRA: off (all weights trained)")
    lines += quantization_lines(config)
    return lines + in_code(config, workload)


def _nodes_lines(workload: Workload) -> list[str]:
    """A header line for a config over several nodes (none for one)."""
    if workload.nodes == 1:
        return []
    return [
        f"nodes: {workload.nodes}, {workload.ranks_per_node} ranks on each ({workload.nproc} in all); "
        "autotune export --format launch writes the script that starts them under SLURM"
    ]


def in_code(config: TrialConfig, workload: Workload | None = None) -> list[str]:
    """What the job must apply in its own code because no library's config carries it, a line each: each lever's
    (:meth:`autotune.levers.base.Lever.in_code`), the layout's between how the model is loaded and what wraps
    its step."""
    lines = [line for lever in IN_CODE_BEFORE_LAYOUT for line in lever.in_code(config)]
    if config.uses_fsdp:
        units = (", ".join(layer_classes(workload)) if workload is not None else "") or "decoder layer"
        lines.append(
            f"fsdp: one unit per {units}, then the root (the hf and accelerate exports say so; "
            "in Lightning: FSDPStrategy(auto_wrap_policy={those classes}))"
        )
    return lines + [line for lever in IN_CODE_AFTER_LAYOUT for line in lever.in_code(config)]


def _dump_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2) + "\n"


def _dump_yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


_EXPORTERS: dict[str, Callable[..., str]] = {
    "json": _json,
    "yaml": _yaml,
    "deepspeed": _deepspeed,
    "hf": _hf,
    "accelerate": _accelerate,
    "lightning": _lightning,
    "peft": _peft,
    "bnb": _bnb,
    "launch": _launch,
    "torchtitan": _torchtitan,
}
