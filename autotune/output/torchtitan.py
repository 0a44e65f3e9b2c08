"""The torchtitan export: a config as torchtitan's TOML job config (``--job.config_file``), the format of its
0.2 releases (``torchtitan/config/job_config.py``; 0.3 reads Python config functions instead, whose
``--section.key`` flags take the same names).

The batch and the data-parallel layout are written here; every other key is a lever's
(:meth:`autotune.levers.base.Lever.torchtitan_keys`), and a lever whose values torchtitan has no key for refuses the
export rather than drop them. torchtitan trains its own model definitions: the ``[model]`` table names none, and the
header says to add the model's ``name`` and ``flavor`` as torchtitan's own configs give them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from autotune.errors import ConfigError
from autotune.levers import FORMAT_ORDER
from autotune.trial.multinode import RDZV_PORT

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = ["torchtitan_config", "torchtitan_launch", "dump_toml"]

# The tables in the order torchtitan's own train configs list them.
_SECTIONS = ("model", "optimizer", "training", "parallelism", "activation_checkpoint", "compile")


def torchtitan_config(config: TrialConfig, workload: Workload, *, device_type: str) -> dict[str, dict[str, Any]]:
    """The job config's tables for training ``workload`` with ``config``: a table name, its keys."""
    if device_type != "cuda":
        raise ConfigError(
            f"--format torchtitan: torchtitan trains on GPUs, and this config was measured on a {device_type}; "
            "export --format json or launch instead"
        )
    config.grad_accum_steps(workload)  # refuses a micro batch that does not divide the global batch
    data_parallel = config.data_parallel(workload)
    tables: dict[str, dict[str, Any]] = {
        "training": {
            "local_batch_size": config.micro_batch,  # accumulation: global // (local x data-parallel ranks)
            "global_batch_size": workload.global_batch,
            "seq_len": workload.seq_len,
        },
        # Data parallel without FSDP replicates (DDP); torchtitan's default shard degree, -1, would take every rank.
        "parallelism": {"data_parallel_replicate_degree": data_parallel, "data_parallel_shard_degree": 1},
    }
    for lever in FORMAT_ORDER:
        for table, keys in lever.torchtitan_keys(config, workload).items():
            tables.setdefault(table, {}).update(keys)
    ordered = [name for name in _SECTIONS if name in tables] + [name for name in tables if name not in _SECTIONS]
    return {name: tables[name] for name in ordered}


def torchtitan_launch(workload: Workload, file_name: str) -> list[str]:
    """Header lines: how torchtitan 0.2 starts with this file, on one node or on each of several."""
    per_node = workload.ranks_per_node
    if workload.nodes == 1:
        return [f"run: CONFIG_FILE=./{file_name} NGPU={per_node} ./run_train.sh (torchtitan 0.2's launcher)"]
    return [
        f"run on each of the {workload.nodes} nodes: torchrun --nnodes {workload.nodes} --nproc_per_node {per_node} "
        f"--rdzv_backend c10d --rdzv_endpoint FIRST_NODE:{RDZV_PORT} -m torchtitan.train --job.config_file "
        f"{file_name} (in a SLURM job: srun --nodes {workload.nodes} --ntasks-per-node 1 torchrun ...)"
    ]


def dump_toml(tables: dict[str, dict[str, Any]]) -> str:
    """TOML for tables of strings, numbers, booleans and lists of them (all a job config here holds)."""
    out: list[str] = []
    for name, keys in tables.items():
        out.append(f"\n[{name}]")
        out += [f"{key} = {_toml_value(value)}" for key, value in keys.items()]
    return "\n".join(out).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML value for {value!r}")
