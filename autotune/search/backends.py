"""Where a search's trials and memory estimates come from: real ones on this machine (:class:`LocalBackend`),
the user's own command (:class:`ScriptBackend`), or, in the search benchmarks, a replayed grid (anything
that has :class:`TrialBackend`'s two methods)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from autotune.search.workers import cpu_turn
from autotune.trial.runner import run_trial

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.estimate.results import MemoryEstimate
    from autotune.trial.result import TrialResult

__all__ = ["EstimatesTogether", "LocalBackend", "ScriptBackend", "TrialBackend"]


class TrialBackend(Protocol):
    """Where trials and memory estimates come from."""

    def run(
        self,
        workload: Workload,
        config: TrialConfig,
        *,
        memory_budget_bytes: int,
        timeout_s: float,
        warmup_steps: int,
        measure_steps: int,
        outpaced_step_s: float | None = None,
        enough_measured_s: float | None = None,
    ) -> TrialResult: ...

    def estimate(self, workload: Workload, config: TrialConfig) -> MemoryEstimate | None: ...


@runtime_checkable
class EstimatesTogether(Protocol):
    """A backend that traces several estimates at once (one core each)."""

    def estimate_all(
        self, workload: Workload, configs: list[TrialConfig]
    ) -> dict[TrialConfig, MemoryEstimate | None]: ...


class LocalBackend:
    """Real trials in fresh processes; real estimates (None where the estimator cannot trace the model).

    On a CPU both take turns with every other trial and estimate of this machine (see
    :func:`autotune.search.workers.cpu_turn`): they compute on the cores a trial is being timed on.
    """

    def __init__(self, device_type: str, *, srun: bool = False) -> None:
        self._device_type = device_type
        self._srun = srun  # a SLURM worker: the ranks start with srun across the job's nodes
        # Where trials are forked from the trial server, the device probe is too (no interpreter to start).
        self._probe_in_trial_server = not srun

    def start(self, *, estimate: bool) -> None:
        """Start the servers the trials (and estimates) will be forked from, their imports beside the
        caller's checks before the first trial."""
        from autotune.estimate.client import start_estimate_server
        from autotune.trial.runner import start_trial_server

        if self._probe_in_trial_server:
            start_trial_server()
        if estimate:
            start_estimate_server()

    def run(self, workload: Workload, config: TrialConfig, **measure: Any) -> TrialResult:
        from autotune.estimate.client import wait_for_estimate_server

        if self._srun:  # the job's own cores (and nodes): nothing else of this machine's runs on them
            return run_trial(workload, config, srun=True, **measure)
        wait_for_estimate_server()  # its start-up imports would compute beside the trial's timed steps
        with cpu_turn(self._device_type):
            return run_trial(workload, config, **measure)

    def probe(self, precisions: list[str]) -> dict[str, float] | None:
        from autotune.trial.device_probe import probe_precisions

        with self._probe_turn():
            return probe_precisions(self._device_type, precisions, trial_server=self._probe_in_trial_server)

    def profile(
        self, *, between_ranks: bool = True, stored: Callable[[], dict[str, Any] | None] | None = None
    ) -> dict[str, Any] | None:
        """The device probe's roofline; ``stored``: what another worker of the study may have stored while
        this one waited for its turn on the cores (workers on one machine would each probe in turn)."""
        from autotune.trial.device_probe import probe_profile

        with self._probe_turn():
            already = stored() if stored is not None else None
            if already is not None:
                return already
            return probe_profile(
                self._device_type, between_ranks=between_ranks, trial_server=self._probe_in_trial_server
            )

    @contextlib.contextmanager
    def _probe_turn(self) -> Iterator[None]:
        """The device probe's turn on the cores, once the estimate server started beside it has done its
        imports: the probe computes on the cores free when it starts, as a trial does."""
        from autotune.estimate.client import wait_for_estimate_server

        wait_for_estimate_server()  # before the turn: other processes' trials need not wait on these imports
        with cpu_turn(self._device_type):
            yield

    def estimate(self, workload: Workload, config: TrialConfig) -> MemoryEstimate | None:
        from autotune.estimate.client import predict_memory
        from autotune.estimate.results import EstimateError

        try:
            with cpu_turn(self._device_type):
                return predict_memory(workload, config)
        except EstimateError:  # a model the estimator cannot trace is simply measured
            return None

    def estimate_all(self, workload: Workload, configs: list[TrialConfig]) -> dict[TrialConfig, MemoryEstimate | None]:
        """:meth:`estimate` of each of ``configs``, traced together, as many at once as there are cores; a config
        refused before any trace is left out (its own :meth:`estimate` says why)."""
        from autotune.errors import ConfigError
        from autotune.estimate.client import predict_memories
        from autotune.estimate.results import EstimateError

        try:
            with cpu_turn(self._device_type):
                answers = predict_memories(workload, configs)
        except EstimateError:  # the server failed (or took too long): each is asked on its own
            return {}
        return {
            config: None if isinstance(answer, EstimateError) else answer
            for config, answer in zip(configs, answers, strict=True)
            if not isinstance(answer, ConfigError)
        }


class ScriptBackend(LocalBackend):
    """Trials of the user's own command (:mod:`autotune.scripts`); no estimates: the model is the script's."""

    def __init__(self, device_type: str, command: list[str]) -> None:
        super().__init__(device_type)
        self._command = list(command)
        self._probe_in_trial_server = False  # script trials start the user's command, not from the server

    def run(self, workload: Workload, config: TrialConfig, **measure: Any) -> TrialResult:
        from autotune.scripts.runner import run_script_trial

        # The user's loop runs its steps to the end: its ranks have no way to agree on stopping early.
        measure.pop("outpaced_step_s", None)
        measure.pop("enough_measured_s", None)
        with cpu_turn(self._device_type):
            return run_script_trial(self._command, workload, config, **measure)

    def estimate(self, workload: Workload, config: TrialConfig) -> MemoryEstimate | None:
        return None

    def estimate_all(self, workload: Workload, configs: list[TrialConfig]) -> dict[TrialConfig, MemoryEstimate | None]:
        return dict.fromkeys(configs)
