"""Running one trial in a fresh process (torchrun for several ranks) with a real timeout.

A fresh process per trial means nothing leaks from one trial into the next: no cached
allocator blocks, no half-freed optimizer, no CUDA context in a bad state after an OOM.
A trial's ranks are forked from a server that has imported the libraries already
(:mod:`autotune.trial.server`), so they skip the interpreter's start and the imports;
``AUTOTUNE_TRIAL_SERVER=off`` starts each in a new interpreter instead (several ranks: torchrun).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from autotune.config.device import DeviceInfo, detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError, WorkloadError
from autotune.models.sources import check_factory_module, resolve_task
from autotune.prepare import refusal_before_trial
from autotune.trial.child import LAUNCH_TIME_ENV
from autotune.trial.cpu_cores import free_cores
from autotune.trial.failures import classify_exit, describe_exit
from autotune.trial.fork_server import ServerGone, ServerProcess
from autotune.trial.lifeline import PARENT_PID_ENV, die_with_parent
from autotune.trial.multinode import node_ranks
from autotune.trial.result import TOKENS_PER_S, PhaseTimings, TrialResult, TrialStatus
from autotune.trial.scratch import scratch_folder, torchrun_logs_in
from autotune.trial.spec import TrialSpec

__all__ = [
    "run_trial",
    "probe_in_trial_server",
    "start_trial_server",
    "DEFAULT_TRIAL_TIMEOUT_S",
    "run_process_group",
    "read_rank_records",
    "combine_records",
    "stderr_tail_of",
]

DEFAULT_TRIAL_TIMEOUT_S = 600.0
_STDERR_TAIL_LINES = 12
_STATUS_PRECEDENCE = [
    TrialStatus.OOM,
    TrialStatus.NAN,
    TrialStatus.ERROR,
    TrialStatus.CRASHED,
    TrialStatus.TIMEOUT,
    TrialStatus.OK,
]


def run_trial(
    workload: Workload,
    config: TrialConfig,
    *,
    memory_budget_bytes: int | None = None,
    timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S,
    warmup_steps: int = 1,
    measure_steps: int = 3,
    device: DeviceInfo | None = None,
    env: dict[str, str] | None = None,
    srun: bool = False,
    outpaced_step_s: float | None = None,
    enough_measured_s: float | None = None,
) -> TrialResult:
    """Measure ``config`` on ``workload`` in a fresh process and say what happened.

    ``srun``: inside a SLURM job, start the ranks with ``srun`` and a torchrun rendezvous across the
    job's nodes (:mod:`autotune.trial.multinode`), in a folder under the current directory that every
    node sees (the submitting directory, on the shared file system).

    Raises ConfigError/WorkloadError (before starting anything) for a config that cannot run;
    every failure after the start is a TrialResult with its status instead. ``outpaced_step_s`` and
    ``enough_measured_s``: see :func:`autotune.trial.measure.time_steps`.
    """
    device = device or detect_device(workload.device)
    _refuse_where_ranks_cannot_start(workload, device, srun=srun)
    config.validate_for(workload, device)
    check_factory_module(workload)
    task = resolve_task(workload)
    refusal = refusal_before_trial(workload, config, task)
    if refusal is not None:
        raise ConfigError(refusal)
    if _SERVER.enabled() and not srun:
        _SERVER.wait_until_ready()  # its imports done before the free cores are read below
    spec = TrialSpec(
        workload=workload,
        config=config,
        task=task,
        device_type=device.type,
        memory_budget_bytes=memory_budget_bytes,
        warmup_steps=warmup_steps,
        measure_steps=measure_steps,
        outpaced_step_s=outpaced_step_s,
        enough_measured_s=enough_measured_s,
        # Measured here, under the caller's CPU turn: the trial's ranks run only on the cores free now.
        # (srun: each node's ranks on the cores SLURM gave the job there)
        cpu_cores=free_cores() if device.type == "cpu" and not srun else None,
    )
    shared = None
    if srun:
        shared = Path("autotune-slurm", "trials").absolute()
        shared.mkdir(mode=0o700, parents=True, exist_ok=True)
    with scratch_folder("trial", parent=shared) as tmp:
        work = Path(tmp)
        spec.write(work / "spec.json")
        outcome = None
        if _SERVER.enabled() and not srun:
            outcome = _SERVER.run(spec, work, timeout_s=timeout_s, env=_trial_env(env))
        if outcome is None:  # the server turned off, refusing or not starting: new interpreters (torchrun)
            command = (
                _srun_command(workload.nproc, work / "spec.json", work)
                if srun
                else _command(workload.nproc, work / "spec.json", work)
            )
            outcome = run_process_group(command, work, timeout_s=timeout_s, env=env)
        returncode, timed_out = outcome
        records = read_rank_records(work, workload.nproc)
        stderr_tail = stderr_tail_of(work / "stderr.log")
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


def _command(nproc: int, spec: Path, out_dir: Path) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "autotune.trial.child", str(spec), str(out_dir)]
    return [
        sys.executable,
        "-m",
        "autotune.trial.lifeline",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--module",
        "autotune.trial.child",
        str(spec),
        str(out_dir),
    ]


def _srun_command(nproc: int, spec: Path, out_dir: Path) -> list[str]:
    """The trial's ranks across the SLURM job's nodes: srun, one torchrun per node, a c10d rendezvous."""
    from autotune.trial.multinode import multinode_command
    from autotune.trial.rendezvous import free_port

    argv = ["--max-restarts=0", "--module", "autotune.trial.child", str(spec), str(out_dir)]
    return multinode_command(os.environ, nproc=nproc, argv=argv, port=free_port())


def _trial_env(env: dict[str, str] | None) -> dict[str, str]:
    child_env = dict(os.environ if env is None else env)
    child_env[LAUNCH_TIME_ENV] = repr(time.time())
    child_env[PARENT_PID_ENV] = str(os.getpid())  # the trial dies with us, even on kill -9
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    return child_env


def run_process_group(
    command: list[str], work: Path, *, timeout_s: float, env: dict[str, str] | None
) -> tuple[int, bool]:
    """Run ``command`` in its own session; on timeout (or Ctrl-C) kill it and all its descendants."""
    child_env = torchrun_logs_in(work, _trial_env(env))
    us = os.getpid()
    with open(work / "stdout.log", "wb") as out, open(work / "stderr.log", "wb") as err:
        # Asked between fork and exec, and kept across exec: any command (a user's own) dies with us.
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=child_env,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(us),
        )
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            return proc.wait(), True
        except BaseException:
            _kill_tree(proc.pid)
            proc.wait()
            raise
        finally:
            _kill_group(proc.pid)  # anything the trial left behind in its group


class _TrialServer:
    """The runner's handle on the trial server (``python -m autotune.trial.server``), started on first use."""

    def __init__(self) -> None:
        self._server = ServerProcess(
            "autotune.trial.server", env=lambda: dict(os.environ, **{PARENT_PID_ENV: str(os.getpid())})
        )
        self._refused = False  # it said it cannot fork safely (CUDA initialised): not asked again

    def enabled(self) -> bool:
        return not self._refused and os.environ.get("AUTOTUNE_TRIAL_SERVER", "on").lower() not in (
            "off",
            "0",
            "false",
            "no",
        )

    def run(self, spec: TrialSpec, work: Path, *, timeout_s: float, env: dict[str, str]) -> tuple[int, bool] | None:
        """Fork the trial of ``work/spec.json``: its exit code, and whether it was killed on ``timeout_s``;
        None when the server is not there to fork it."""
        request = {
            "spec": str(work / "spec.json"),
            "out": str(work),
            "env": env,
            "cwd": os.getcwd(),
            "workload": spec.workload.to_dict(),
            "nproc": spec.workload.nproc,
        }
        started = time.monotonic()
        pid = self._send(request)
        if pid is None:
            return None
        try:
            code = self._read("exit_code", timeout_s - (time.monotonic() - started))
            _kill_group(pid)  # anything the trial left behind in its group
            return code, False
        except TimeoutError:
            _kill_tree(pid)
            return self._read("exit_code", 30.0), True
        except ServerGone:  # killed from outside mid-trial: so was the trial (it dies with the server)
            return -signal.SIGKILL, False
        except BaseException:  # Ctrl-C: the trial goes, reaped by the server, which stays for the next
            _kill_tree(pid)
            try:
                self._read("exit_code", 30.0)
            except (TimeoutError, ServerGone):
                self.close()
            raise

    def probe(self, device_type: str, what: str, *, timeout_s: float) -> Any:
        """The device probe forked from the server (see :mod:`autotune.trial.device_probe`): what it measured;
        None when it failed or the server is not there to fork it."""
        try:
            pid = self._send({"probe": [device_type, what], "env": dict(os.environ)})
        except TimeoutError:  # no answer from the server: the probe runs in an interpreter of its own
            return None
        if pid is None:
            return None
        try:
            return self._reply("probe", timeout_s)["probe"]
        except ServerGone:
            return None
        except BaseException as exc:  # a timeout or Ctrl-C: the probe goes, reaped by the server
            _kill_tree(pid)
            try:
                self._reply("probe", 30.0)
            except (TimeoutError, ServerGone):
                self.close()
            if isinstance(exc, TimeoutError):
                return None
            raise

    def _send(self, request: dict[str, Any]) -> int | None:
        """Hand ``request`` to the server once it is ready: the pid (process group) of what it forked, or None
        when the server is not there to fork it (refusing, or gone)."""
        try:
            self._server.wait_ready()
            self._server.send(request)
            return self._read("pid", ServerProcess.START_TIMEOUT_S)
        except _Refused:
            self._refused = True
            self.close()
            return None
        except (BrokenPipeError, ServerGone):
            self.close()
            return None
        except BaseException:
            self.close()  # it cannot be trusted with the next request
            raise

    def _read(self, key: str, timeout_s: float) -> int:
        return int(self._reply(key, timeout_s)[key])

    def _reply(self, key: str, timeout_s: float) -> dict[str, Any]:
        reply = self._server.reply(timeout_s)
        if "error" in reply:
            raise _Refused(reply["error"])
        return reply

    def start(self, sibling: ServerProcess | None = None, *, forked: bool = False) -> None:
        """Start the server now (without waiting for its imports) if it is not running, and ``sibling`` forked
        from it (see :meth:`ServerProcess.start`)."""
        self._server.start(sibling, forked=forked)

    def wait_until_ready(self) -> None:
        """Start the server if needed and wait until it has imported everything (it says "ready").
        A server that died or refused is left for :meth:`run` to find out."""
        try:
            self._server.wait_ready()
        except (TimeoutError, ServerGone):
            self.close()

    def close(self) -> None:
        self._server.close()


class _Refused(RuntimeError):
    """The trial server cannot fork safely here (see :mod:`autotune.trial.server`)."""


_SERVER = _TrialServer()
atexit.register(_SERVER.close)


def probe_in_trial_server(device_type: str, what: str, *, timeout_s: float) -> Any:
    """The device probe's ``what`` forked from the trial server, started now if it is not running: what it
    measured, or None where it failed or the server is off or cannot fork (the caller then probes in a new
    interpreter, as trials then start in one)."""
    return _SERVER.probe(device_type, what, timeout_s=timeout_s) if _SERVER.enabled() else None


def start_trial_server(sibling: ServerProcess | None = None, *, forked: bool = False) -> None:
    """Start the trial server in the background now, so that its imports overlap the caller's own
    work (a command's model and device checks) instead of following it; the first trial then finds
    it ready. A command that stops before any trial takes it along at exit. ``sibling``: a server that
    imports the same libraries (the estimate server's), forked from it once they are imported. ``forked``:
    the server is a fork of this process, which has imported torch and Transformers already."""
    if _SERVER.enabled():
        _SERVER.start(sibling, forked=forked)
    elif sibling is not None:
        sibling.start()


def _kill_tree(pid: int) -> None:
    """SIGKILL a trial: its process group (every rank of a forked trial), the process itself (a fork
    may not have joined its group yet) and every descendant (torchrun's ranks have groups of their own)."""
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _kill_group(pid)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in descendants:
        _kill_group(child.pid)
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


def read_rank_records(work: Path, nproc: int) -> list[dict[str, Any] | None]:
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
    return (
        isinstance(record, dict)
        and record.get("status") in {s.value for s in TrialStatus}
        and isinstance(record.get("config"), dict)
    )


def _refuse_where_ranks_cannot_start(workload: Workload, device: DeviceInfo, *, srun: bool) -> None:
    """WorkloadError where the trial's ranks would not start as the workload says: on other nodes, or on more
    GPUs per node than there are."""
    nodes = len(node_ranks(os.environ, nproc=workload.nproc)) if srun else 1
    if nodes != workload.nodes:
        raise WorkloadError(
            f"--nodes {workload.nodes}: this trial would start its ranks on {nodes} node(s); "
            + (f"run it in a SLURM job of {workload.nodes} nodes" if srun else "several nodes need --executor slurm")
        )
    if device.type == "cuda" and workload.ranks_per_node > device.count:  # CPU ranks share the host's cores
        per_node = " per node" if workload.nodes > 1 else ""
        raise WorkloadError(
            f"--nproc {workload.nproc} needs {workload.ranks_per_node} GPUs{per_node}; {device.count} visible here "
            f"(use --nproc {device.count * workload.nodes} or less, or --device cpu)"
        )


def combine_records(
    config: TrialConfig,
    records: list[dict[str, Any] | None],
    *,
    returncode: int,
    timed_out: bool,
    timeout_s: float,
    stderr_tail: str,
    world_size: int,
    memory_budget_bytes: int | None,
) -> TrialResult:
    """One TrialResult from every rank's record: the worst status, rank 0's timings, the largest peaks."""
    written = [r for r in records if r is not None]
    statuses = [TrialStatus(r["status"]) for r in written]
    error: str | None
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
    peaks = [r["peak_memory_bytes"] for r in written if r.get("peak_memory_bytes") is not None]
    fields: dict[str, Any] = {
        k: base.get(k)
        for k in (
            "tokens_per_s",
            "samples_per_s",
            "throughput_unit",
            "step_time_median_s",
            "step_time_iqr_s",
            "step_time_spread",
            "disturbed_steps",
            "grad_accum_steps",
            "trainable_params",
            "total_params",
            "final_loss",
            "device",
            "cpu_threads",
            "eager_step_s",
            "compile_payoff_steps",
            "optimizer",
            "quantized_base",
        )
    }
    fields["throughput_unit"] = fields["throughput_unit"] or TOKENS_PER_S  # a trial that died before saying
    cores = sorted({c for r in written for c in r.get("cpu_cores") or []})
    return TrialResult(
        config=config,
        status=status,
        measured_steps=base.get("measured_steps") or 0,
        outpaced=bool(base.get("outpaced")),
        peak_memory_bytes=max(peaks) if peaks else None,
        peak_allocated_bytes=_max_of(written, "peak_allocated_bytes"),
        build_peak_bytes=_max_of(written, "build_peak_bytes"),
        peak_reserved_bytes=_max_of(written, "peak_reserved_bytes"),
        peak_memory_per_rank=[r.get("peak_memory_bytes") if r else None for r in records] if world_size > 1 else None,
        optimizer_state_bytes=_max_of(written, "optimizer_state_bytes"),
        world_size=world_size,
        cpu_cores=cores or None,
        memory_budget_bytes=memory_budget_bytes,
        phases=PhaseTimings(**(base.get("phases") or {})),
        error=error,
        exit_code=returncode,
        **fields,
    )


def _max_of(records: list[dict[str, Any]], key: str) -> int | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def stderr_tail_of(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-_STDERR_TAIL_LINES:])
