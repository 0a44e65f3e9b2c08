"""``autotune worker`` (hidden): a helper of ``tune --workers N`` or a SLURM worker job, tuning the study
its spec (JSON on stdin) names."""

from __future__ import annotations

import json
import sys
from typing import Any

from autotune.cli.app import INTERRUPTED, app
from autotune.cli.servers import start_trial_server
from autotune.config.workload import Workload
from autotune.errors import AutotuneError


@app.command(hidden=True)
def worker() -> int:
    """A helper of ``autotune tune --workers N``: tunes the study its parent sends on stdin (JSON), with
    its own progress lines; started by :func:`autotune.search.workers.start_helpers`, never by hand."""
    from autotune.output.render import ConsoleProgress
    from autotune.search.tuner import tune
    from autotune.search.workers import cpu_turn
    from autotune.trial.lifeline import die_with_parent, expected_parent

    die_with_parent(expected_parent())
    with cpu_turn("cpu"):  # seconds of imports: not while another worker's trial is timed on these cores
        import torch  # noqa: F401
        import transformers  # noqa: F401
    spec = json.loads(sys.stdin.read())
    if not spec.get("command") and not spec.get("srun"):  # trials forked here, not started with srun
        # Forked from this process, which has imported what they import first, as a command's servers are.
        start_trial_server(estimate=spec.get("estimate", True))
    number = spec.pop("worker")
    confirm = spec.pop("confirm", False)  # a SLURM worker 1 confirms; a local helper never does
    spec["workload"] = Workload.from_dict(spec["workload"])
    preempted = _on_preemption(spec.pop("slurm_signal", None))
    try:
        if spec.pop("find", False):  # the find study's name depends on the device here
            from autotune.search.presets import load_space
            from autotune.search.tuner import find_name

            spec["space"] = load_space(spec["space"])
            spec["study"], spec["memory_budget_bytes"] = find_name(
                workload=spec["workload"],
                space=spec["space"],
                memory_budget_bytes=spec["memory_budget_bytes"],
                headroom=spec["headroom"],
                command=spec["command"],
            )
        with ConsoleProgress(prefix=f"[worker {number}] ") as progress:
            tune(**spec, workers=1, confirm=confirm, progress=progress, worker_number=number)
    except KeyboardInterrupt:
        if preempted:
            from autotune.search.slurm import requeue_self

            requeued = requeue_self()
            import signal

            print(
                f"autotune: worker {number}: {signal.Signals(preempted[0]).name} from SLURM before the job ends: "
                f"its trial is recorded as interrupted; {'the job is requeued' if requeued else 'requeue failed'}",
                file=sys.stderr,
            )
            return 0
        return INTERRUPTED
    except AutotuneError as exc:
        print(f"autotune: worker {number}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _on_preemption(name: str | None) -> list[int]:
    """In a SLURM job, turn the pre-termination signal its --signal asked for into an interrupt (the
    running trial is recorded as interrupted, not as an error); the list it returns gets the signal's
    number once it came."""
    import os
    import signal

    came: list[int] = []
    if not name or not os.environ.get("SLURM_JOB_ID"):
        return came
    number = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
    if number is None and name.isdigit():
        number = int(name)
    if number is None:
        return came

    def interrupt(signum: int, frame: Any) -> None:
        from autotune.search.tuner import interrupt_safely

        came.append(signum)
        interrupt_safely()

    signal.signal(number, interrupt)
    return came
