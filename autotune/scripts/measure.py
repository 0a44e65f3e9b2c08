"""Inside each process of a script trial: the budget enforced, whole optimizer steps timed, the
result written, the process ended after warm-up plus the measured steps.

Every framework's optimizer step passes through ``torch.optim.Optimizer``'s global step hook
(Trainer, Lightning, Accelerate, DeepSpeed's inner optimizer, a plain loop), so the time between
two of them is one whole training step as the user's job runs it: data, forward and backward of
every micro batch, the optimizer. A process writes a record only once it has stepped or failed,
so a launcher (torchrun's own process) writes none.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.levers import CHECKPOINTING

if TYPE_CHECKING:
    from autotune.config.knobs import TrialConfig
    from autotune.trial.spec import TrialSpec

__all__ = ["install", "SPEC_ENV"]

SPEC_ENV = "AUTOTUNE_SCRIPT_SPEC"


def install(spec_path: str) -> None:
    from autotune.trial.spec import TrialSpec

    _Measurement(TrialSpec.read(spec_path)).start()


class _Measurement:
    def __init__(self, spec: TrialSpec) -> None:
        self.spec = spec
        self.rank = int(os.environ.get("RANK", "0"))
        self.warmup = max(1, spec.warmup_steps)  # the first step's end starts the clock
        self.ends: list[float] = []
        self.optimizer_id: int | None = None
        self.tracker: Any = None
        self.device: Any = None
        self.written = False
        self.prepared = False
        self.cores: dict[str, Any] = {}  # cpu_cores and cpu_threads, where this process was pinned
        from autotune.scripts.frameworks import FrameworkHooks, installed

        # Installed before the measurement from AUTOTUNE_CONFIG (hook/sitecustomize.py); none: given nothing.
        self.frameworks = installed() or FrameworkHooks({}, {}, {})

    def start(self) -> None:
        import torch

        budget = self.spec.memory_budget_bytes
        local_rank = os.environ.get("LOCAL_RANK")
        nproc = self.spec.workload.nproc
        if self.spec.cpu_cores and (local_rank is not None or nproc == 1):  # a rank, not a launcher
            # The free cores, as a synthetic trial's (see autotune.trial.cpu_cores): one busy core had
            # made a script trial's steps 100x slower. Before the script starts a thread.
            from autotune.trial.cpu_cores import use_rank_cores

            self.cores = use_rank_cores(self.spec.cpu_cores, int(local_rank or 0), nproc, torch)
            os.environ["OMP_NUM_THREADS"] = str(self.cores["cpu_threads"])  # what frameworks read to set threads
        # On a GPU, every rank (or the one process of a command without a launcher) has its own device;
        # a launcher (RANK unset but ranks below it) and any CPU process count with the tracker.
        if self.spec.device_type == "cuda" and (local_rank is not None or "RANK" not in os.environ):
            from autotune.trial.memory import limit_cuda_memory

            self.device = torch.device("cuda", int(local_rank or 0))
            if budget is not None:
                # Capped when the process first uses CUDA: a launcher (torchrun has no LOCAL_RANK either)
                # never does, and a context of its own on the ranks' GPU would take memory the job has.
                device = self.device
                torch.cuda._lazy_call(lambda: limit_cuda_memory(budget, device))
        else:
            from autotune.trial.memory import LiveBytesTracker

            self.tracker = LiveBytesTracker(budget)
            self.tracker.__enter__()  # for the whole process: the script's own allocations are the peak
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(self._after_step)
        self._watch_prepare()
        previous = sys.excepthook

        def on_exception(kind: Any, exc: BaseException, tb: Any) -> None:
            self._failed(exc)
            previous(kind, exc, tb)

        sys.excepthook = on_exception
        atexit.register(self._at_exit)

    def _watch_prepare(self) -> None:
        """Knobs only ``autotune.prepare`` applies to a plain loop's model (LoRA, checkpointing, the
        chunked loss, ...): a script that never calls it would be measured without them."""
        from autotune.prepare import apply

        original = apply.prepare

        def prepare(*args: Any, **kwargs: Any) -> Any:
            self.prepared = True
            return original(*args, **kwargs)

        apply.prepare = prepare  # autotune.prepare(...) looks it up when called

    # -- the hooks ------------------------------------------------------------------------
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.optimizer_id is None:
            self.optimizer_id = id(optimizer)
        if id(optimizer) != self.optimizer_id:
            return  # a second optimizer (a GAN's) steps within the same training step
        if self.device is not None:
            import torch

            torch.cuda.synchronize(self.device)
        self.ends.append(time.perf_counter())
        if len(self.ends) >= self.warmup + self.spec.measure_steps:
            self._write("ok")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # the measurement is done: the rest of the script is not

    def _failed(self, exc: BaseException) -> None:
        from autotune.trial.child import error_tail
        from autotune.trial.failures import classify_exception

        self._write(classify_exception(exc).value, error=error_tail(exc))

    def _at_exit(self) -> None:
        if self.ends and not self.written:  # it stepped, then ended before the measured steps were done
            self._write(
                "error",
                error=f"the script ended after {len(self.ends)} optimizer step(s); the trial "
                f"measures {self.warmup} warm-up and {self.spec.measure_steps} timed steps "
                "(train for more steps, or lower --steps)",
            )

    # -- the record ---------------------------------------------------------------------------
    def _write(self, status: str, error: str | None = None) -> None:
        if self.written:
            return
        self.written = True
        workload, config = self.spec.workload, self.spec.config
        record: dict[str, Any] = {
            "config": config.to_dict(),
            "status": status,
            "error": error,
            "phases": {},
            "measured_steps": 0,
            "device": str(self.device or "cpu"),
            "memory_budget_bytes": self.spec.memory_budget_bytes,
            "grad_accum_steps": self.spec.grad_accum_steps,
            **self.cores,
        }
        unapplied = (
            _needs_prepare(config, trainer=self.frameworks.trainer_args_applied)
            if status == "ok" and not self.prepared
            else None
        )
        if unapplied:
            status, error = (
                "error",
                (
                    f"the script did not call autotune.prepare(model, autotune.current_config()): "
                    f"{unapplied} would not be applied"
                ),
            )
            record.update(status=status, error=error)
        ignored = (
            (self.frameworks.ignored_micro_batch(config.micro_batch) or self.frameworks.ignored_zero(config.zero_stage))
            if status == "ok"
            else None
        )
        if ignored:
            status, error = "error", ignored
            record.update(status=status, error=error)
        seconds = [b - a for a, b in zip(self.ends[self.warmup - 1 :], self.ends[self.warmup :], strict=False)]
        if status == "ok" and seconds:
            from autotune.models.batches import throughput_unit
            from autotune.trial.measure import StepTimes

            times = StepTimes(
                seconds=seconds,
                warmup_s=self.ends[self.warmup - 1] - (self.spec.launched or 0.0),
                last_loss=float("nan"),
            )
            record.update(
                step_time_median_s=times.median_s,
                step_time_iqr_s=times.iqr_s,
                step_time_spread=times.spread,
                disturbed_steps=times.disturbed_steps,
                measured_steps=len(seconds),
            )
            # What one sample holds is what --task and the lengths say (a script's model is its own).
            task = workload.task or "causal-lm"
            tokens = workload.tokens_per_sample(task)
            samples_per_s = workload.global_batch / times.median_s
            record.update(
                samples_per_s=samples_per_s,
                throughput_unit=throughput_unit(task, own_batch=False),
                tokens_per_s=samples_per_s * tokens if tokens else None,
            )
            record["phases"] = {"warmup_s": times.warmup_s, "measure_s": times.total_s}
        import torch

        from autotune.trial.child import record_peaks, write_record

        uses_cuda = self.device is not None and torch.cuda.is_initialized()
        record_peaks(record, self.device if uses_cuda else torch.device("cpu"), self.tracker)
        # The first record of a rank stands: a launcher (no RANK, so 'rank 0') that fails because a rank
        # failed writes after that rank, and must not replace its OOM with its own ChildFailedError.
        assert self.spec.out_dir is not None, "script mode's runner names the records' folder"
        write_record(Path(self.spec.out_dir) / f"rank{self.rank}.json", record, replace=False)


def _needs_prepare(knobs: TrialConfig, *, trainer: bool) -> str | None:
    """The flags of ``knobs`` that only ``autotune.prepare`` applies, in words.
    ``trainer``: a Trainer got the config's TrainingArguments, which checkpoint activations themselves."""
    flags = [
        flag
        for flag, on in (
            (f"--lora-rank {knobs.lora_rank}", knobs.uses_lora),
            (
                f"--checkpointing {CHECKPOINTING.flag_value(knobs)}",
                knobs.checkpointing and not (trainer and CHECKPOINTING.trainer_applies(knobs)),
            ),
            (f"--loss {knobs.loss}", knobs.loss != "standard"),
            (f"--attention {knobs.attention}", knobs.attention != "auto"),
            (f"--precision {knobs.precision}", knobs.true_16_bit),
            (f"--fsdp {knobs.fsdp}", knobs.uses_fsdp),
        )
        if on
    ]
    return ", ".join(flags) or None
