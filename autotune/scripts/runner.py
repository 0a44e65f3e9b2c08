"""One script trial: the user's command run unchanged in its own process group, the config in
``AUTOTUNE_CONFIG`` and the measurement hook on ``PYTHONPATH``, with a real timeout.

The result is the same TrialResult as a synthetic trial's, combined from each rank's record
(:mod:`autotune.scripts.measure`); a command that ends without any record says why in words.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from autotune.config.device import DeviceInfo, detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.scripts.current import CONFIG_ENV, write_config_file
from autotune.scripts.measure import SPEC_ENV
from autotune.trial.cpu_cores import free_cores
from autotune.trial.rendezvous import one_node_ranks
from autotune.trial.result import TrialResult, TrialStatus
from autotune.trial.runner import (
    DEFAULT_TRIAL_TIMEOUT_S,
    combine_records,
    read_rank_records,
    run_process_group,
    stderr_tail_of,
)
from autotune.trial.scratch import scratch_folder
from autotune.trial.spec import TrialSpec

__all__ = ["run_script_trial", "run_with_config", "command_with_config", "SCRIPT_NODES_REFUSAL"]

# A script trial runs the user's command where the trial runs (a SLURM worker's batch node): its ranks
# would not reach the job's other nodes, and the records they write are not on a shared folder.
SCRIPT_NODES_REFUSAL = (
    "--nodes {nodes}: a script trial runs your command on one node only (multi-node script trials are not "
    "supported yet); drop --nodes, or tune the model itself (--model, no command), whose trials span the nodes"
)

_HOOK_DIR = Path(__file__).parent / "hook"


def run_script_trial(
    command: list[str],
    workload: Workload,
    config: TrialConfig,
    *,
    memory_budget_bytes: int | None = None,
    timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
    warmup_steps: int = 1,
    measure_steps: int = 3,
    device: DeviceInfo | None = None,
) -> TrialResult:
    """Run ``command`` (e.g. ``["python", "train.py", "--epochs", "1"]``) as a trial of ``config``.

    The workload says what the command trains: its global batch, sequence length and ranks give
    the samples and tokens of one optimizer step. Raises ConfigError before starting anything for
    a command that does not exist or a config that cannot run here.
    """
    if not command:
        raise ConfigError("no command to run: write it after --, e.g. autotune trial ... -- python train.py")
    if shutil.which(command[0]) is None:
        raise ConfigError(f"the command {command[0]!r} does not exist (not a file, and not on PATH)")
    if workload.nodes > 1:
        raise ConfigError(SCRIPT_NODES_REFUSAL.format(nodes=workload.nodes))
    device = device or detect_device(workload.device)
    config.validate_for(workload, device)
    with scratch_folder("script") as tmp:
        work = Path(tmp)
        write_config_file(work / "config.json", config, workload, device_type=device.type)
        TrialSpec(
            config=config,
            workload=workload,
            device_type=device.type,
            memory_budget_bytes=memory_budget_bytes,
            warmup_steps=warmup_steps,
            measure_steps=measure_steps,
            out_dir=str(work),
            cpu_cores=free_cores() if device.type == "cpu" else None,
            launched=time.perf_counter(),
        ).write(work / "spec.json")
        env = _command_env(
            config, workload, device, {CONFIG_ENV: str(work / "config.json"), SPEC_ENV: str(work / "spec.json")}
        )
        started = time.monotonic()
        returncode, timed_out = run_process_group(command, work, timeout_s=timeout_s, env=env)
        elapsed = time.monotonic() - started
        records = read_rank_records(work, workload.nproc)
        stderr_tail = stderr_tail_of(work / "stderr.log")
    failed = _not_measured(records, config, workload, returncode, timed_out, elapsed, stderr_tail)
    if failed is not None:
        return failed.replace(memory_budget_bytes=memory_budget_bytes)
    return combine_records(
        config,
        records,
        returncode=returncode,
        timed_out=timed_out,
        timeout_s=timeout_s,
        stderr_tail=stderr_tail,
        world_size=workload.nproc,
        memory_budget_bytes=memory_budget_bytes,
    )


def _not_measured(
    records: list[dict[str, Any] | None],
    config: TrialConfig,
    workload: Workload,
    returncode: int,
    timed_out: bool,
    elapsed: float,
    stderr_tail: str,
) -> TrialResult | None:
    """The error of a command that ran without being measured as the workload says: it ended before its first
    optimizer step, or trained in fewer processes than ``--nproc``; None when its records tell what it did."""
    if not any(records) and not timed_out:
        # Nothing stepped and nothing raised in Python: the command ended on its own.
        why = (
            f"no optimizer step in {elapsed:.0f} s: the command exited with status {returncode} before "
            "its first optimizer step"
            if returncode == 0
            else f"the command exited with status {returncode} before its first optimizer step"
        )
        return TrialResult(
            config=config,
            status=TrialStatus.ERROR,
            exit_code=returncode,
            world_size=workload.nproc,
            error=f"{why}\n{stderr_tail}".rstrip(),
        )
    stepped = [record for record in records if record is not None]
    if (
        returncode == 0
        and not timed_out
        and len(stepped) < workload.nproc
        and all(record["status"] == TrialStatus.OK.value for record in stepped)
    ):
        # Every process that trained was measured, and too few of them trained: the command's ranks are not --nproc's.
        return TrialResult(
            config=config,
            status=TrialStatus.ERROR,
            exit_code=returncode,
            world_size=workload.nproc,
            error=(
                f"the command trained in {len(stepped)} process(es), --nproc says {workload.nproc}: "
                "launch that many ranks (e.g. torchrun --nproc-per-node), or pass --nproc "
                f"{len(stepped)}\n{stderr_tail}"
            ).rstrip(),
        )
    return None


def run_with_config(
    command: list[str], config: TrialConfig, workload: Workload, *, device: DeviceInfo | None = None
) -> int:
    """Run ``command`` to the end with ``config`` handed to it as a script trial hands it (the
    ``AUTOTUNE_CONFIG`` file, and the framework hooks on ``PYTHONPATH``), nothing measured or stopped:
    the user's job, trained with the config its trials measured. Returns the command's exit status."""
    import subprocess

    if not command:
        raise ConfigError(
            "no command to run: write it after --, e.g. autotune run --config autotune.json -- python train.py"
        )
    if shutil.which(command[0]) is None:
        raise ConfigError(f"the command {command[0]!r} does not exist (not a file, and not on PATH)")
    device = device or detect_device(workload.device)
    config.validate_for(workload, device)
    with scratch_folder("run") as tmp:
        path = Path(tmp) / "config.json"
        write_config_file(path, config, workload, device_type=device.type)
        env = _command_env(config, workload, device, {CONFIG_ENV: str(path)})
        return subprocess.run(command, env=env).returncode  # Ctrl-C reaches it too: same process group


def _command_env(config: TrialConfig, workload: Workload, device: DeviceInfo, paths: dict[str, str]) -> dict[str, str]:
    """The command's environment: ``paths`` (the config, the spec) and the hooks on ``PYTHONPATH``."""
    env = dict(os.environ, **paths)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_HOOK_DIR), env.get("PYTHONPATH")) if p)
    if device.type == "cpu":
        # A CPU trial on a host with GPUs (--device cpu): the script must not find one, since its memory
        # is counted by the CPU tracker (and an Accelerator told cpu=False for ZeRO would take the GPU).
        env["CUDA_VISIBLE_DEVICES"] = ""
    if config.uses_deepspeed and workload.nproc == 1 and "WORLD_SIZE" not in env:
        # DeepSpeed without a launcher's variables looks for MPI and fails; a one-process command is a
        # one-rank group (Transformers' own advice for a notebook). A launcher gives its ranks their own.
        env.update(one_node_ranks(1)[0])
    return env


def command_with_config(command: list[str], export: str) -> str:
    """The command line that trains ``command`` with the config exported to ``export`` (a json or
    yaml export): what a script-mode study hands its user."""
    import shlex

    return shlex.join(["autotune", "run", "--config", export, "--", *command])
