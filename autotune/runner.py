"""Running one trial in a fresh process (torchrun for several ranks) with a real timeout.

A fresh process per trial means nothing leaks from one trial into the next: no cached
allocator blocks, no half-freed optimizer, no CUDA context in a bad state after an OOM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autotune.child import LAUNCH_TIME_ENV
from autotune.device import DeviceInfo, detect_device
from autotune.errors import WorkloadError
from autotune.failures import classify_exit, describe_exit
from autotune.lifeline import PARENT_PID_ENV
from autotune.knobs import TrialConfig
from autotune.models import resolve_task
from autotune.result import PhaseTimings, TrialResult, TrialStatus
from autotune.workload import Workload

__all__ = ["run_trial", "DEFAULT_TRIAL_TIMEOUT_S"]

DEFAULT_TRIAL_TIMEOUT_S = 600.0
_STDERR_TAIL_LINES = 12
_STATUS_PRECEDENCE = [TrialStatus.OOM, TrialStatus.NAN, TrialStatus.ERROR, TrialStatus.CRASHED,
                      TrialStatus.TIMEOUT, TrialStatus.OK]


def run_trial(workload: Workload, config: TrialConfig, *, memory_budget_bytes: int | None = None,
              timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S, warmup_steps: int = 1, measure_steps: int = 3,
              device: DeviceInfo | None = None, env: dict[str, str] | None = None) -> TrialResult:
    """Measure ``config`` on ``workload`` in a fresh process and say what happened.

    Raises ConfigError/WorkloadError (before starting anything) for a config that cannot run;
    every failure after the start is a TrialResult with its status instead.
    """
    device = device or detect_device(workload.device)
    if device.type == "cuda" and workload.nproc > device.count:  # CPU ranks share the host's cores
        raise WorkloadError(f"--nproc {workload.nproc} needs {workload.nproc} GPUs; {device.count} visible here "
                            f"(use --nproc {device.count} or less, or --device cpu)")
    config.validate_for(workload, device)
    task = resolve_task(workload)
    spec = {
        "workload": workload.to_dict(),
        "config": config.to_dict(),
        "task": task,
        "device_type": device.type,
        "memory_budget_bytes": memory_budget_bytes,
        "warmup_steps": warmup_steps,
        "measure_steps": measure_steps,
    }
    with tempfile.TemporaryDirectory(prefix="autotune-trial-") as tmp:
        work = Path(tmp)
        (work / "spec.json").write_text(json.dumps(spec))
        command = _command(workload.nproc, work / "spec.json", work)
        returncode, timed_out = _run_process_group(command, work, timeout_s=timeout_s, env=env)
        records = _read_rank_records(work, workload.nproc)
        stderr_tail = _tail(work / "stderr.log")
    return _combine(config, records, returncode=returncode, timed_out=timed_out, timeout_s=timeout_s,
                    stderr_tail=stderr_tail, world_size=workload.nproc,
                    memory_budget_bytes=memory_budget_bytes)


def _command(nproc: int, spec: Path, out_dir: Path) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "autotune.child", str(spec), str(out_dir)]
    return [sys.executable, "-m", "autotune.lifeline", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}",
            "--max-restarts=0", "--module", "autotune.child", str(spec), str(out_dir)]


def _run_process_group(command: list[str], work: Path, *, timeout_s: float,
                       env: dict[str, str] | None) -> tuple[int, bool]:
    """Run ``command`` in its own session; on timeout (or Ctrl-C) kill it and all its descendants."""
    child_env = dict(os.environ if env is None else env)
    child_env[LAUNCH_TIME_ENV] = repr(time.time())
    child_env[PARENT_PID_ENV] = str(os.getpid())  # the trial dies with us, even on kill -9
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(work / "stdout.log", "wb") as out, open(work / "stderr.log", "wb") as err:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=child_env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            return proc.wait(), True
        except BaseException:
            _kill_tree(proc)
            proc.wait()
            raise
        finally:
            _kill_group(proc.pid)  # anything the trial left behind in its group


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the trial, its process group and every descendant (torchrun's ranks have their own)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _kill_group(proc.pid)
    for child in descendants:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(descendants, timeout=5)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_rank_records(work: Path, nproc: int) -> list[dict[str, Any] | None]:
    records: list[dict[str, Any] | None] = []
    for rank in range(nproc):
        path = work / f"rank{rank}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = None
        if not _is_record(record):  # garbage in the result file counts as no result at all
            record = None
        records.append(record)
    return records


def _is_record(record: Any) -> bool:
    return isinstance(record, dict) and record.get("status") in {s.value for s in TrialStatus} \
        and isinstance(record.get("config"), dict)


def _combine(config: TrialConfig, records: list[dict[str, Any] | None], *, returncode: int, timed_out: bool,
             timeout_s: float, stderr_tail: str, world_size: int,
             memory_budget_bytes: int | None) -> TrialResult:
    """One TrialResult from every rank's record: the worst status, rank 0's timings, the largest peaks."""
    written = [r for r in records if r is not None]
    statuses = [TrialStatus(r["status"]) for r in written]
    if timed_out:
        status = TrialStatus.TIMEOUT
        error = f"killed after --trial-timeout {timeout_s:g} s\n{stderr_tail}".rstrip()
    elif len(written) < len(records) and not any(s is not TrialStatus.OK for s in statuses):
        # A rank died without a word: classify from the signal it (or torchrun) exited with.
        status = classify_exit(returncode, timed_out=False)
        error = f"trial process {describe_exit(returncode)}\n{stderr_tail}".rstrip()
    else:  # every rank wrote, or one that wrote failed first and torchrun stopped the others
        status = min(statuses, key=_STATUS_PRECEDENCE.index)
        failed = next(r for r in written if r["status"] == status.value)
        error = failed.get("error") if status is not TrialStatus.OK else None
    base = records[0] or (written[0] if written else {})
    peaks = [r.get("peak_memory_bytes") for r in written if r.get("peak_memory_bytes") is not None]
    fields: dict[str, Any] = {k: base.get(k) for k in (
        "tokens_per_s", "samples_per_s", "step_time_median_s", "step_time_iqr_s", "grad_accum_steps",
        "trainable_params", "total_params", "final_loss", "device")}
    return TrialResult(
        config=config,
        status=status,
        measured_steps=base.get("measured_steps") or 0,
        peak_memory_bytes=max(peaks) if peaks else None,
        peak_allocated_bytes=_max_of(written, "peak_allocated_bytes"),
        build_peak_bytes=_max_of(written, "build_peak_bytes"),
        peak_reserved_bytes=_max_of(written, "peak_reserved_bytes"),
        peak_memory_per_rank=[r.get("peak_memory_bytes") if r else None for r in records] if world_size > 1 else None,
        optimizer_state_bytes=_max_of(written, "optimizer_state_bytes"),
        world_size=world_size,
        memory_budget_bytes=memory_budget_bytes,
        phases=PhaseTimings(**(base.get("phases") or {})),
        error=error,
        exit_code=returncode,
        **fields,
    )


def _max_of(records: list[dict[str, Any]], key: str) -> int | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_STDERR_TAIL_LINES:])
