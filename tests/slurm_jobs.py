"""A batch job submitted and waited for, as ``sbatch --wait`` does, without its wait.

sbatch's ``--wait`` asks the controller whether the job has ended at intervals that grow to 10 s (SLURM's
``sbatch.c``, ``_job_wait``): a job of three seconds was waited on for ten. :func:`sbatch_waited` asks every
quarter second instead, and answers as ``sbatch --wait`` does: the job's exit code as the return code.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any

# JobState values of a job that has ended for good (squeue's and scontrol's words; COMPLETING has not: its
# processes are still being cleaned up, and its output may not be all written).
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE"}  # fmt: skip
_POLL_S = 0.25


def sbatch_waited(
    args: list[str], *, timeout: float, cwd: Any = None, env: Any = None
) -> subprocess.CompletedProcess[str]:
    """``sbatch --wait ARGS`` (without ``--wait``): the job's exit code as ``returncode``, sbatch's and the
    controller's words as ``stdout`` and ``stderr``. Raises ``subprocess.TimeoutExpired`` (the job cancelled)
    where it has not ended after ``timeout`` seconds."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env
    )
    if submitted.returncode != 0:
        return submitted
    job = submitted.stdout.strip().split(";")[0]  # --parsable: the job id, then ";cluster" where there are several
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(
            ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=60, env=env
        ).stdout
        state = re.search(r"\bJobState=(\S+)", shown)
        if state is not None and state.group(1) in _ENDED:
            code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
            returncode = int(code.group(1)) or int(code.group(2)) if code is not None else 1
            return subprocess.CompletedProcess(args, returncode, submitted.stdout, f"{submitted.stderr}{shown}")
        time.sleep(_POLL_S)
    subprocess.run(["scancel", job], capture_output=True, timeout=60, env=env)
    raise subprocess.TimeoutExpired(["sbatch", *args], timeout)
