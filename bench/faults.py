"""Faults injected into real tuning studies: how many, how many the tuner survived, trials lost.

    python bench/faults.py [--out bench/results/faults_cpu.json]

Every fault comes in through the public custom-model entry point (`--model module:function`,
tests/factories.py and tests/broken_module.py) or from outside (signals to the tuner):

* in one study, one trial each: NaN loss, segfault, hang (trial timeout), garbage instead of a
  result, an exception in forward, out of memory;
* a study whose factory raises, and one whose module cannot be imported (stop cleanly);
* SIGKILL of the tuner during a trial, then the same command again (carries on, retries it);
* SIGINT of the tuner during a trial (exit 130, the trial marked interrupted).

"Survived": the tuner ended as designed (exit 0/1, or 130 for SIGINT; no traceback) and the
fault is recorded with its status and error lines. "Trials lost": finished trials missing from
the study afterwards, or measured twice.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

from autotune.study.records import ANSWER_ATTR
from autotune.study.storage import open_storage

TESTS = Path(__file__).resolve().parent.parent / "tests"
FAULT_SPACE = (
    "n_trials: 7\npatience: 7\nknobs:\n  micro_batch: [1, 2, 4, 8, 16, 32, 64]\n"
    "  precision: [fp32]\n  checkpointing: [false]\n"
)
EXPECTED = {2: "nan", 4: "crashed", 8: "timeout", 16: "crashed", 32: "error", 64: "oom"}
COMMON = [
    "--global-batch",
    "64",
    "--seq-len",
    "8",
    "--memory-budget",
    "256MiB",
    "--trial-timeout",
    "10",
    "--no-estimate",
    "--warmup-steps",
    "0",
    "--steps",
    "1",
]
RESUME_SPACE = "n_trials: 3\nknobs:\n  micro_batch: [1, 2, 4, 8]\n  precision: [fp32]\n  checkpointing: [false]\n"


def autotune(work: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args], cwd=work, capture_output=True, text=True, timeout=900, env=_env()
    )


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
    )


def trials(work: Path, study: str) -> list[optuna.trial.FrozenTrial]:
    """The study's measured trials (the confirmed answer's own copy left out)."""
    study = optuna.load_study(study_name=study, storage=open_storage(f"sqlite:///{work}/storage/autotune.db"))
    return [t for t in study.trials if ANSWER_ATTR not in t.user_attrs]


def trial_faults(work: Path) -> list[dict]:
    (work / "faults.yaml").write_text(FAULT_SPACE)
    proc = autotune(work, "tune", "--study", "faults", "--model", "factories:faulty", "--space", "faults.yaml", *COMMON)
    recorded = {t.user_attrs["config"]["micro_batch"]: t for t in trials(work, "faults")}
    rows = []
    for micro_batch, status in EXPECTED.items():
        trial = recorded.get(micro_batch)
        got = trial.user_attrs.get("status") if trial else None
        error = (trial.user_attrs.get("result", {}).get("error") or "").strip().splitlines()[-1:] if trial else []
        rows.append(
            {
                "fault": f"trial: {status} (micro batch {micro_batch})",
                "expected_status": status,
                "recorded_status": got,
                "error": error[0] if error else None,
                "survived": proc.returncode == 0 and got == status and bool(error) and "Traceback" not in proc.stderr,
                "trials_lost": 0 if trial is not None else 1,
            }
        )
    healthy = recorded.get(1)
    for row in rows:  # the healthy trial must outlive all of them
        row["trials_lost"] += 0 if healthy is not None and healthy.user_attrs.get("status") == "ok" else 1
    return rows


def workload_fault(work: Path, name: str, model: str) -> dict:
    proc = autotune(work, "tune", "--study", name, "--model", model, "--space", "quick", *COMMON)
    recorded = trials(work, name) if proc.returncode == 1 else []
    clean = proc.returncode in (1, 2) and "Traceback" not in proc.stderr
    return {
        "fault": name,
        "exit": proc.returncode,
        "recorded_status": [t.user_attrs.get("status") for t in recorded],
        "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else None,
        "survived": clean,
        "trials_lost": 0,
    }


def signal_fault(work: Path, sig: signal.Signals) -> dict:
    (work / "resume.yaml").write_text(RESUME_SPACE)
    args = [
        sys.executable,
        "-m",
        "autotune",
        "tune",
        "--study",
        f"sig{sig.value}",
        "--space",
        "resume.yaml",
        "--memory-budget",
        "1GiB",
        "--seq-len",
        "64",
        "--no-estimate",
    ]
    proc = subprocess.Popen(args, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for_second_trial(work, f"sig{sig.value}")
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    before = [
        t for t in trials(work, f"sig{sig.value}") if t.state.is_finished() and t.user_attrs.get("status") == "ok"
    ]
    again = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=900, env=_env())
    after = trials(work, f"sig{sig.value}")
    ok_after = [t for t in after if t.user_attrs.get("status") == "ok"]
    configs = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in ok_after]
    lost = sum(1 for t in before if t.number not in {a.number for a in ok_after}) + len(configs) - len(set(configs))
    expected_exit = -signal.SIGKILL if sig is signal.SIGKILL else 130
    return {
        "fault": f"{sig.name} of the tuner during a trial",
        "exit": proc.returncode,
        "resumed_exit": again.returncode,
        "measured_after_resume": len(ok_after),
        "survived": proc.returncode == expected_exit
        and again.returncode == 0
        and len(ok_after) == 3
        and "Traceback" not in stderr,
        "trials_lost": lost,
    }


def _wait_for_second_trial(work: Path, study: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if any(t.number == 1 and t.state.name == "RUNNING" for t in trials(work, study)):
                time.sleep(2)
                return
        except Exception:  # noqa: BLE001 - the study or its database is not there yet
            pass
        time.sleep(0.3)
    raise RuntimeError("the second trial never started")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/faults_cpu.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = trial_faults(work)
        rows.append(workload_fault(work, "factory raises", "factories:broken"))
        rows.append(workload_fault(work, "module import error", "broken_module:build"))
        rows.append(signal_fault(work, signal.SIGKILL))
        rows.append(signal_fault(work, signal.SIGINT))
    for row in rows:
        print(f"{row['fault']:<45} survived={row['survived']!s:<5} trials lost={row['trials_lost']}", flush=True)
    summary = {
        "injected": len(rows),
        "survived": sum(r["survived"] for r in rows),
        "trials_lost": sum(r["trials_lost"] for r in rows),
    }
    print(
        f"faults injected {summary['injected']}, survived {summary['survived']}, trials lost {summary['trials_lost']}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"command": "python bench/faults.py", "summary": summary, "rows": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
