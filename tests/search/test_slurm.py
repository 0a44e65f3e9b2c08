"""Workers as SLURM jobs, on a real one-node cluster (.ci/slurm.sh starts it and prints
AUTOTUNE_TEST_SLURM_PARTITION; the cluster tests skip without it outside CI), and the bad input
refused before anything is submitted (no cluster needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import commands
import optuna
import pytest
import yaml
from commands import autotune
from optuna.trial import TrialState
from slurm_jobs import sbatch_waited

from autotune.search.slurm import SlurmResources, batch_script
from autotune.study.records import ANSWER_ATTR
from autotune.study.stale import LOST_ATTR, RETRY_ATTR
from autotune.study.storage import open_storage

PARTITION = os.environ.get("AUTOTUNE_TEST_SLURM_PARTITION")
# In a parallel run (pytest -n) no other test's job runs on the one-node cluster meanwhile: it has two CPUs.
pytestmark = pytest.mark.one_at_a_time("slurm")
needs_cluster = pytest.mark.skipif(
    not PARTITION and not os.environ.get("CI"),
    reason="no SLURM cluster: .ci/run starts one (.ci/slurm.sh) and sets AUTOTUNE_TEST_SLURM_PARTITION",
)

# gpt2-tiny at seq 32: every config fits in 1 GiB; mb=16 runs clearly fastest, ahead of mb=8 by ~25%.
SPACE = """\
description: ten configs of a tiny model, all fit
n_trials: 8
knobs:
  micro_batch: [1, 2, 4, 8, 16]
  precision: [fp32]
  fused_optimizer: [false, true]
"""
ARGS = ("--model", "builtin:gpt2-tiny", "--seq-len", "32", "--memory-budget", "1GiB", "--space", "space.yaml")
# Tests that count trials measure every config: the stop on evidence would end them when it is sure. (Fused AdamW,
# not checkpointing: checkpointing where every config fits only adds a recompute, and is never measured.)
MEASURE_ALL = "--measure-all"


def refusal(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc.stderr


def test_bad_input_is_refused_in_one_line_before_anything_is_submitted(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE)
    journal = f"journal://{tmp_path}/study.log"
    tune = ("tune", "--study", "s", *ARGS)
    no_sbatch = tmp_path / "bin"  # a PATH with Python and without SLURM's commands
    no_sbatch.mkdir()
    (no_sbatch / "python").symlink_to(sys.executable)
    env = dict(os.environ, PATH=str(no_sbatch))
    assert "sbatch is not found on PATH" in refusal(
        autotune(*tune, "--executor", "slurm", "--storage", journal, cwd=tmp_path, env=env)
    )
    for storage in ((), ("--storage", f"sqlite:///{tmp_path}/x.db")):
        message = refusal(autotune(*tune, "--executor", "slurm", *storage, cwd=tmp_path))
        assert "SQLite file" in message and "journal:///" in message and "postgresql://" in message
    assert "add --executor slurm, or drop --nodes" in refusal(autotune(*tune, "--nodes", "2", cwd=tmp_path))
    assert "--partition is a SLURM job's option" in refusal(autotune(*tune, "--partition", "gpu", cwd=tmp_path))
    assert "--executor 'pbs' is not known" in refusal(autotune(*tune, "--executor", "pbs", cwd=tmp_path))
    bad_option = ("--executor", "slurm", "--storage", journal, "--slurm-option", "mem")
    assert "write KEY=VALUE" in refusal(autotune(*tune, *bad_option, cwd=tmp_path))
    assert not (tmp_path / "autotune-slurm").exists() and not (tmp_path / "study.log").exists()  # nothing written


# -- the node count: part of the study's question (no cluster needed) --------------------------------
_TWO_NODE_JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[017-018]", "SLURM_JOB_NUM_NODES": "2"}
TWO_NODES = {"model": "builtin:gpt2-tiny", "seq_len": 32, "global_batch": 8, "nproc": 4, "nodes": 2}


class _Replayed:
    """Trials answered from a table of tokens/s per micro batch: what the 2-node ranks would have measured."""

    tokens = {1: 50.0, 2: 90.0}

    def run(self, workload, config, *, measure_steps, **_):
        from autotune.trial.result import TrialResult, TrialStatus

        tokens = self.tokens[config.micro_batch]
        return TrialResult(
            config=config, status=TrialStatus.OK, tokens_per_s=tokens, peak_memory_bytes=2**20, measured_steps=2
        )

    def estimate(self, workload, config):
        return None

    def probe(self, precisions):
        return None


def test_a_study_tuned_in_a_two_node_job_exports_for_two_nodes(tmp_path, monkeypatch):
    """The node count is the workload's, so the study's question: show, export and the JSON output say it."""
    from autotune.config.workload import Workload
    from autotune.search.presets import load_space
    from autotune.search.tuner import tune

    (tmp_path / "space.yaml").write_text("knobs:\n  micro_batch: [1, 2]\n  precision: [fp32]\n")
    for name, value in _TWO_NODE_JOB.items():
        monkeypatch.setenv(name, value)
    storage = f"sqlite:///{tmp_path}/db.sqlite"
    summary = tune(
        study="two-nodes",
        workload=Workload(**TWO_NODES, device="cpu"),
        space=load_space(tmp_path / "space.yaml"),
        memory_budget_bytes=2**30,
        storage=storage,
        estimate=False,
        backend=_Replayed(),
        srun=True,  # a SLURM worker: its trials span the job's nodes
    )
    assert summary.best is not None and summary.best.config.micro_batch == 2
    for name in _TWO_NODE_JOB:
        monkeypatch.delenv(name)
    shown = json.loads(autotune("show", "--study", "two-nodes", "--storage", storage, "--json", cwd=tmp_path).stdout)
    assert shown["workload"]["nodes"] == 2 and shown["workload"]["nproc"] == 4
    text = autotune("show", "--study", "two-nodes", "--storage", storage, cwd=tmp_path).stdout
    assert "4 rank(s) over 2 nodes (2 each)" in text
    export = ("export", "--study", "two-nodes", "--storage", storage, "--format")
    accelerate = autotune(*export, "accelerate", cwd=tmp_path)
    assert accelerate.returncode == 0, accelerate.stderr
    deepspeed = autotune(*export, "deepspeed", cwd=tmp_path)  # a file with no room to say it: stderr does
    assert "nodes: 2, 2 ranks on each: autotune export --study two-nodes --format launch" in deepspeed.stderr
    from accelerate.commands.config.config_args import ClusterConfig

    (tmp_path / "accelerate.yaml").write_text(accelerate.stdout)
    loaded = ClusterConfig.from_yaml_file(str(tmp_path / "accelerate.yaml"))
    assert (loaded.num_machines, loaded.num_processes) == (2, 4)
    lightning = autotune(*export, "lightning", cwd=tmp_path)
    trainer = yaml.safe_load(lightning.stdout)["trainer"]
    assert (trainer["num_nodes"], trainer["devices"]) == (2, 2)
    launch = autotune(*export, "launch", "-o", "launch.sh", cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr
    script = tmp_path / "launch.sh"
    assert os.access(script, os.X_OK) and "torchrun --nnodes=2 --nproc-per-node=2" in script.read_text()


_RANKS = """\
import sys, torch.distributed as dist
dist.init_process_group("gloo")
open(f"rank-{dist.get_rank()}.txt", "w").write(f"{dist.get_rank()} of {dist.get_world_size()} {sys.argv[1:]}")
"""


@needs_cluster
@pytest.mark.slow
def test_a_one_node_launch_export_runs_as_a_batch_job(tmp_path):
    """sbatch takes the script's #SBATCH lines, and the job starts the trials' ranks."""
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.output.exporters import export_config

    assert PARTITION, "CI must start the test cluster (.ci/slurm.sh) and set AUTOTUNE_TEST_SLURM_PARTITION"
    workload = Workload(model="builtin:gpt2-tiny", global_batch=8, nproc=2)
    script = export_config(TrialConfig(micro_batch=2), workload, fmt="launch", device_type="cpu")
    (tmp_path / "launch.sh").write_text(script)
    (tmp_path / "train.py").write_text(_RANKS)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    job = sbatch_waited(
        [f"--partition={PARTITION}", "--output=job.out", "launch.sh", "train.py", "--x"],
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    log = tmp_path / "job.out"
    assert job.returncode == 0, (job.stderr, log.read_text()[-3000:] if log.exists() else "")
    assert [(tmp_path / f"rank-{r}.txt").read_text() for r in (0, 1)] == [f"{r} of 2 ['--x']" for r in (0, 1)]


def test_a_worker_in_a_job_of_another_node_count_is_refused_in_one_line_before_the_study_is_touched(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE)
    journal = tmp_path / "study.log"
    spec = {
        "study": "s",
        "workload": dict(TWO_NODES, nproc=2),
        "space": "space.yaml",
        "memory_budget_bytes": 2**30,
        "storage": f"journal://{journal}",
        "srun": True,
        "worker": 1,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(_TWO_NODE_JOB, SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="gpu-a017")  # --slurm-option nodes=1
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "worker"],
        input=json.dumps(spec),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(
        "autotune: worker 1: error: --nodes 2: this worker's SLURM job 4242 spans 1 node(s), and the study's "
        "trials span 2; submit its workers with --nodes 2"
    ), proc.stderr
    assert not journal.exists()


def test_workers_for_another_node_count_than_the_studys_are_refused_before_any_is_submitted(tmp_path):
    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload
    from autotune.search.presets import load_space
    from autotune.search.tuner import question
    from autotune.study.storage import create_study

    (tmp_path / "space.yaml").write_text(SPACE)
    storage = f"journal://{tmp_path}/study.log"
    device = DeviceInfo("cpu", "cpu", 1, None, bf16=True, fp16_deepspeed=False)
    two = Workload(**dict(TWO_NODES, nproc=2))
    meta = question(
        workload=two, space=load_space(tmp_path / "space.yaml"), device=device, memory_budget_bytes=2**30, headroom=0.1
    )
    create_study(open_storage(storage), "s", meta)
    bin_dir = tmp_path / "bin"  # an sbatch that says when it is asked to submit
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path / 'submitted'}\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    tune = ("tune", "--study", "s", *ARGS, "--global-batch", "8", "--nproc", "2", "--storage", storage)
    message = refusal(autotune(*tune, "--executor", "slurm", "--nodes", "1", cwd=tmp_path, env=env))
    assert message == (
        "autotune: error: --study s answers another question (--nodes differs: stored 2, now 1); "
        "use a new --study name, or the same flags as before\n"
    )
    assert not (tmp_path / "submitted").exists() and not (tmp_path / "autotune-slurm").exists()


def test_one_node_keeps_the_find_name_it_had_before_nodes_and_two_nodes_ask_another_question():
    from autotune.config.device import DeviceInfo
    from autotune.config.workload import Workload
    from autotune.search.space import SearchSpace
    from autotune.search.tuner import question
    from autotune.study.storage import find_study_name

    device = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 4, 80 * 2**30, bf16=True, fp16_deepspeed=True)
    space = SearchSpace.from_dict({"name": "mine", "micro_batch": [1, 2], "precision": ["bf16"]})

    def name(**workload):
        meta = question(
            workload=Workload(model="builtin:gpt2-tiny", global_batch=32, **workload),
            space=space,
            device=device,
            memory_budget_bytes=80 * 2**30,
            headroom=0.1,
        )
        return find_study_name(meta, space.name)

    # The name main (7982f1d) gave this question before the workload had nodes: one node leaves it as it was.
    assert name(nproc=4) == name(nproc=4, nodes=1) == "find-gpt2-tiny-mine-8fe51386a4"
    assert name(nproc=4, nodes=2) != name(nproc=4)


def test_the_batch_script_holds_one_trials_resources_and_the_sites_options(tmp_path):
    resources = SlurmResources(
        nproc=4,
        gpus_per_node=4,
        partition="gpu",
        account="proj",
        time="01:00:00",
        qos="high",
        constraint="a100",
        options=(("mem", "64G"), ("exclusive", "")),
    )
    spec = tmp_path / "worker-1.json"
    script = batch_script(spec_file=spec, log_dir=tmp_path, name="autotune-x", resources=resources)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for option in (
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",  # a core per rank
        "--gpus-per-node=4",
        "--partition=gpu",
        "--account=proj",
        "--time=01:00:00",
        "--qos=high",
        "--constraint=a100",
        "--signal=B:USR1@120",
        "--requeue",
        "--mem=64G",
        "--exclusive=",
    ):
        assert f"#SBATCH {option}" in lines, (option, script)
    assert lines[-1].startswith("exec ") and lines[-1].endswith(f"-m autotune worker < {tmp_path}/worker-1.json")


def test_the_executor_asked_for_becomes_one_trials_job_resources_or_none_for_the_local_one():
    from autotune.search.slurm import Executor

    assert Executor().resources(nproc=4) is None
    asked = Executor(
        name="slurm",
        nodes=2,
        gpus_per_node=2,
        partition="gpu",
        time="1:00:00",
        signal="B:USR2@60",
        options=("mem=64G", "exclusive="),
    )
    resources = asked.resources(nproc=4)
    assert resources == SlurmResources(
        nodes=2,
        nproc=4,
        gpus_per_node=2,
        partition="gpu",
        time="1:00:00",
        signal="B:USR2@60",
        options=(("mem", "64G"), ("exclusive", "")),
    )
    assert Executor(name="slurm").resources(nproc=1) == SlurmResources()  # the default signal kept


@pytest.mark.parametrize(
    "executor, message",
    [
        ({"nodes": 2}, "--nodes 2: the local executor runs a trial's ranks on this machine only"),
        ({"partition": "gpu"}, "--partition is a SLURM job's option: add --executor slurm, or drop --partition"),
        ({"options": ("mem=1G",)}, "--slurm-option is a SLURM job's option"),
        ({"name": "pbs"}, "--executor 'pbs' is not known; use local or slurm"),
        ({"name": "slurm", "options": ("mem",)}, "--slurm-option 'mem': write KEY=VALUE"),
    ],
)
def test_an_executor_that_cannot_run_is_refused_naming_its_flag(executor, message):
    from autotune.errors import ConfigError
    from autotune.search.slurm import Executor

    with pytest.raises(ConfigError) as refused:
        Executor(**executor).resources(nproc=2)
    assert str(refused.value).startswith(message)


def test_a_script_trial_across_nodes_is_refused_before_the_executor_is_looked_at():
    from autotune.errors import ConfigError
    from autotune.search.slurm import Executor

    with pytest.raises(ConfigError, match="^--nodes 2: a script trial runs your command on one node only"):
        Executor(name="pbs", nodes=2).resources(nproc=2, command=["python", "train.py"])


def test_a_workers_spec_is_the_tuners_arguments_with_the_nodes_in_the_question_and_srun_for_several_ranks():
    from autotune.config.workload import Workload
    from autotune.search.slurm import worker_spec

    workload = Workload(model="builtin:gpt2-tiny", seq_len=32, nproc=4)
    spec = worker_spec(
        workload=workload,
        nodes=2,
        space="space.yaml",
        memory_budget_bytes=2**30,
        timeout_s=None,
        trial_timeout_s=60.0,
        measure_steps=2,
        command=None,
        n_trials=4,
        storage="journal:///shared/study.log",
    )
    assert spec == {
        "workload": workload.replace(nodes=2).to_dict(),
        "space": "space.yaml",
        "memory_budget_bytes": 2**30,
        "timeout_s": None,
        "trial_timeout_s": 60.0,
        "measure_steps": 2,
        "command": None,
        "n_trials": 4,
        "storage": "journal:///shared/study.log",
        "srun": True,
    }
    assert json.loads(json.dumps(spec)) == spec  # what the jobs read: JSON
    one_rank = worker_spec(
        workload=Workload(model="builtin:gpt2-tiny"),
        nodes=1,
        space="default",
        memory_budget_bytes=None,
        timeout_s=None,
        trial_timeout_s=60.0,
        measure_steps=2,
        command=("python", "train.py"),
    )
    assert one_rank["srun"] is False and one_rank["command"] == ["python", "train.py"]


def study_trials(storage: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=open_storage(storage)).trials


# Both studies measure every config (--n-trials 6: the whole space), so both see the fastest: with 8 of
# SPACE's 10 a study may leave it out. The micro batch is clear: mb=16 read 11,850 tokens/s in a local
# run, mb=4 6,720. Checkpointing at mb=16 is not always: it cost 20% there (9,440 tokens/s; re-runs +10% to
# +28%), and a CI run saw the local study, beside another worker's test, answer mb=16 with it. Without
# checkpointing in the space, the test runs beside the other worker's: what compares two answers is the
# micro batch (76% apart), and the rest of the config only where both studies said their re-runs left no doubt.
CLEAR_WINNER_SPACE = """\
description: six configs of a tiny model, all fit, one micro batch clearly fastest
knobs:
  micro_batch: [1, 4, 16]
  precision: [fp32]
  fused_optimizer: [false, true]
"""


@needs_cluster
@pytest.mark.slow
def test_two_slurm_workers_tune_a_study_as_a_local_run_does(tmp_path):
    assert PARTITION, "CI must start the test cluster (.ci/slurm.sh) and set AUTOTUNE_TEST_SLURM_PARTITION"
    (tmp_path / "space.yaml").write_text(CLEAR_WINNER_SPACE)
    storage = f"journal://{tmp_path}/shared/study.log"
    # Without the estimator, as the scancel test: every config fits (1 GiB) and --measure-all measures each, so it
    # changes nothing compared here; each worker's start would pay the device probe and the estimate server's imports
    # (find_on_slurm's test keeps the estimator in a SLURM worker).
    command = ["tune", "--study", "slurm", *ARGS, MEASURE_ALL, "--no-estimate"]
    command += ["--steps", "2", "--json"]
    slurm = [*command, "--executor", "slurm", "--workers", "2", "--n-trials", "6", "--storage", storage]
    slurm += ["--partition", PARTITION]
    tune = commands.start(*slurm, cwd=tmp_path)
    running: set[str] = set()
    while tune.poll() is None:  # squeue lists the worker jobs while they run
        listed = subprocess.run(["squeue", "--noheader", "--me", "--format=%j %i %T"], capture_output=True, text=True)
        rows = [line.split() for line in listed.stdout.splitlines() if line.startswith("autotune-slurm ")]
        running |= {job for _, job, state in rows if state == "RUNNING"}
        time.sleep(0.5)
    stdout, stderr = tune.communicate()
    assert tune.returncode == 0, stderr
    assert "submitted SLURM job(s) " in stderr and "worker jobs: all ended" in stderr
    result = json.loads(stdout)
    submitted = {str(j["job"]) for j in result["worker_jobs"]}
    assert len(submitted) == 2 and running == submitted, (running, submitted)  # both jobs ran as workers

    every = study_trials(storage, "slurm")
    assert not [t for t in every if t.state is TrialState.RUNNING]
    trials = [t for t in every if ANSWER_ATTR not in t.user_attrs]
    configs = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials]
    assert len(configs) == 6 and len(set(configs)) == 6  # every config, once
    # Every trial was measured by one of the two jobs. Whether both took some is the machine's timing: a job
    # that starts late on a busy node may find the six taken (a CI run saw one job measure all six). That both
    # measure when both run is shown where it is not left to timing: the scancel test below waits for worker
    # 2's trial, and its retry is measured by the other job.
    jobs = {t.user_attrs["worker"]["slurm_job"] for t in trials}
    assert jobs and jobs <= submitted, (jobs, submitted)
    show = autotune("show", "--study", "slurm", "--storage", storage, cwd=tmp_path)
    assert show.returncode == 0 and "workers: SLURM jobs " in show.stdout, show.stderr

    local = autotune(*command, "--n-trials", "6", "--storage", f"sqlite:///{tmp_path}/local.db", cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    here = json.loads(local.stdout)
    # The same answer, from the same kind of study: its question, what it measured, what it confirmed.
    for key in ("workload", "space", "device", "memory_budget_bytes", "n_trials"):
        assert result[key] == here[key], key
    assert result["best"]["config"]["micro_batch"] == here["best"]["config"]["micro_batch"] == 16
    # The whole answer is the same wherever both studies said their re-runs left no doubt.
    certain = [(answer["best"]["certainty"] or "").startswith("clearly faster") for answer in (result, here)]
    if all(certain):
        assert result["best"]["config"] == here["best"]["config"]
    assert {t["status"] for t in result["trials"]} == {t["status"] for t in here["trials"]} == {"ok"}


@needs_cluster
@pytest.mark.slow
def test_scancel_of_one_worker_mid_trial_loses_its_trial_to_the_other(tmp_path):
    assert PARTITION, "CI must start the test cluster (.ci/slurm.sh) and set AUTOTUNE_TEST_SLURM_PARTITION"
    # --n-trials 6 of a space of six: the study is done only once the lost config is measured again. With six of
    # SPACE's ten, the other worker could end the study on its own five before the loss was found, and owe no retry.
    (tmp_path / "space.yaml").write_text(CLEAR_WINNER_SPACE)
    storage = f"journal://{tmp_path}/shared/study.log"
    # Without the estimator: what is tested is the lost trial, and each worker's start pays the device
    # probe and the estimate server's imports otherwise (find_on_slurm keeps the estimator in a SLURM worker).
    command = ["tune", "--study", "cancel", *ARGS, MEASURE_ALL, "--no-estimate"]
    command += ["--steps", "8", "--json"]
    command += ["--executor", "slurm", "--workers", "2", "--n-trials", "6", "--storage", storage]
    tune = commands.start(*command, cwd=tmp_path)
    cancelled = None
    try:
        deadline = time.monotonic() + 300
        while cancelled is None and tune.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
            try:
                trials = study_trials(storage, "cancel")
            except KeyError:  # not created yet
                continue
            for trial in trials:
                worker = trial.user_attrs.get("worker") or {}
                # worker 2's job: worker 1 confirms the answer, and must live for show to have one
                job = f"slurm_job:{worker.get('slurm_job')}"
                if trial.state is TrialState.RUNNING and "config" in trial.user_attrs and job in trial_jobs(storage):
                    time.sleep(1.0)  # inside its trial
                    subprocess.run(["scancel", worker["slurm_job"]], check=True)
                    cancelled = (trial.number, worker["slurm_job"])
                    break
        assert cancelled is not None, "worker 2 never started a trial"
        stdout, stderr = tune.communicate(timeout=600)
    finally:
        if tune.poll() is None:
            tune.kill()
            tune.communicate()
    assert tune.returncode == 0, stderr
    every = study_trials(storage, "cancel")
    assert not [t for t in every if t.state is TrialState.RUNNING]
    trials = [t for t in every if ANSWER_ATTR not in t.user_attrs]
    lost = [t for t in trials if LOST_ATTR in t.user_attrs]
    assert [t.number for t in lost] == [cancelled[0]], [(t.number, t.user_attrs) for t in lost]
    assert lost[0].state is TrialState.FAIL and lost[0].user_attrs["status"] == "interrupted"
    assert f"SLURM job {cancelled[1]}" in lost[0].user_attrs[LOST_ATTR]
    retries = [t for t in trials if t.user_attrs.get(RETRY_ATTR) == cancelled[0]]
    assert len(retries) == 1 and retries[0].user_attrs["status"] == "ok"
    assert retries[0].user_attrs["worker"]["slurm_job"] != cancelled[1]  # measured by the other worker
    measured = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials if LOST_ATTR not in t.user_attrs]
    assert len(measured) == 6 and len(set(measured)) == 6
    assert json.loads(stdout)["best"] is not None


def trial_jobs(storage: str) -> set[str]:
    """The study attributes of worker 2's job (worker 1 confirms: it is the one kept alive)."""
    attrs = optuna.load_study(study_name="cancel", storage=open_storage(storage)).user_attrs
    return {key for key, value in attrs.items() if key.startswith("slurm_job:") and value.get("worker") == 2}


@needs_cluster
@pytest.mark.slow
def test_the_pre_termination_signal_records_the_trial_as_interrupted_and_requeues_the_worker(tmp_path):
    assert PARTITION, "CI must start the test cluster (.ci/slurm.sh) and set AUTOTUNE_TEST_SLURM_PARTITION"
    (tmp_path / "space.yaml").write_text(SPACE)
    storage = f"journal://{tmp_path}/shared/study.log"
    # Without the estimator, as in the scancel test above: the requeued worker starts twice.
    command = ["tune", "--study", "signal", *ARGS, "--no-estimate"]
    command += ["--steps", "8", "--json"]
    command += ["--executor", "slurm", "--workers", "1", "--n-trials", "3", "--storage", storage]
    command += ["--signal", "B:USR1@60"]
    tune = commands.start(*command, cwd=tmp_path)
    signalled = None
    try:
        deadline = time.monotonic() + 300
        while signalled is None and tune.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
            try:
                trials = study_trials(storage, "signal")
            except KeyError:
                continue
            running = [t for t in trials if t.state is TrialState.RUNNING and "config" in t.user_attrs]
            if running:
                time.sleep(1.0)
                job = running[0].user_attrs["worker"]["slurm_job"]
                # What SLURM sends --signal's seconds before the time limit, sent now to the batch shell.
                subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
                signalled = (running[0].number, job)
        assert signalled is not None, "the worker never started a trial"
        number, job = signalled
        shown = ["scontrol", "show", "job", job]
        while "Restarts=1" not in subprocess.run(shown, capture_output=True, text=True).stdout:
            time.sleep(0.3)
        # The node refuses to launch a job again in the second its last run was killed in (slurmctld.log:
        # "Killing non-startable batch JobId=N: Job credential revoked"; the job then ends for good).
        time.sleep(1.1)
        # A requeued job waits two minutes before it may start again: let it start now.
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
        stdout, stderr = tune.communicate(timeout=600)
    finally:
        if tune.poll() is None:
            tune.kill()
            tune.communicate()
    assert tune.returncode == 0, stderr
    every = study_trials(storage, "signal")
    assert not [t for t in every if t.state is TrialState.RUNNING]
    trials = {t.number: t for t in every if ANSWER_ATTR not in t.user_attrs}
    interrupted = trials[number]
    assert interrupted.state is TrialState.FAIL and interrupted.user_attrs["status"] == "interrupted"
    assert LOST_ATTR not in interrupted.user_attrs  # its worker said so itself: not lost
    retries = [t for t in trials.values() if t.user_attrs.get(RETRY_ATTR) == number]
    assert len(retries) == 1 and retries[0].user_attrs["status"] == "ok"
    assert retries[0].user_attrs["worker"]["slurm_job"] == job  # the same job, requeued
    result = json.loads(stdout)
    assert [(j["job"], j["restarts"]) for j in result["worker_jobs"]] == [(job, 1)]
    assert result["best"] is not None
    assert "requeued 1x" in autotune("show", "--study", "signal", "--storage", storage, cwd=tmp_path).stdout


DDP_SPACE = """\
description: DDP on two ranks
n_trials: 1
knobs:
  micro_batch: [2]
  precision: [fp32]
  checkpointing: [false]
"""


@needs_cluster
@pytest.mark.slow
def test_a_two_rank_trial_runs_through_srun_inside_the_workers_allocation(tmp_path):
    assert PARTITION, "CI must start the test cluster (.ci/slurm.sh) and set AUTOTUNE_TEST_SLURM_PARTITION"
    (tmp_path / "space.yaml").write_text(DDP_SPACE)
    storage = f"journal://{tmp_path}/shared/study.log"
    command = ["tune", "--study", "ranks", *ARGS, "--global-batch", "8"]
    # Without the estimator: one trial of a fixed config, whose two ranks are what is tested (the device
    # probe of a 2-rank study also times a collective between two more processes).
    command += ["--nproc", "2", "--steps", "2", "--no-confirm", "--no-estimate", "--json"]
    command += ["--executor", "slurm", "--workers", "1"]
    command += ["--storage", storage]
    tune = commands.start(*command, cwd=tmp_path)
    steps: set[str] = set()
    while tune.poll() is None:  # the trial is a job step of its own: srun inside the worker's job
        listed = subprocess.run(
            ["squeue", "--steps", "--me", "--noheader", "--format=%i %j"], capture_output=True, text=True
        )
        steps |= {
            line.split()[0] for line in listed.stdout.splitlines() if not line.split()[0].endswith(("batch", "extern"))
        }
        time.sleep(0.3)
    stdout, stderr = tune.communicate()
    assert tune.returncode == 0, stderr
    (trial,) = study_trials(storage, "ranks")
    job = trial.user_attrs["worker"]["slurm_job"]
    assert f"{job}.0" in steps, steps
    result = trial.user_attrs["result"]
    assert trial.user_attrs["status"] == "ok" and result["world_size"] == 2, result
    assert len(result["peak_memory_per_rank"]) == 2 and all(p > 0 for p in result["peak_memory_per_rank"])
    assert not list((tmp_path / "autotune-slurm" / "trials").iterdir())  # the trial's shared folder is gone


@needs_cluster
@pytest.mark.slow
def test_find_on_slurm_keeps_its_answer_where_a_local_find_asks_again(tmp_path):
    assert PARTITION, "CI must start the test cluster (.ci/slurm.sh) and set AUTOTUNE_TEST_SLURM_PARTITION"
    # A clear winner: one re-run confirms it. Candidates within 30% of the top one are re-run in turns,
    # two or three rounds each, and SPACE's micro batches 8 and 16 read within 2% of each other in a run here.
    (tmp_path / "space.yaml").write_text(CLEAR_WINNER_SPACE)
    storage = f"journal://{tmp_path}/shared/study.log"
    find = ("find", *ARGS, "--steps", "2", "--n-trials", "4", "--storage", storage, "--json")
    slurm = autotune(*find, "--executor", "slurm", "--workers", "2", cwd=tmp_path)
    assert slurm.returncode == 0, slurm.stderr
    answer = json.loads(slurm.stdout)
    assert answer["study"].startswith("find-gpt2-tiny-space-") and len(answer["worker_jobs"]) == 2
    measured = len([t for t in study_trials(storage, answer["study"]) if ANSWER_ATTR not in t.user_attrs])
    # At most the 4 asked: the evidence may settle the search sooner (one winner is clear; on a loaded machine
    # three trials have sufficed). What is tested is below: the local find measures none of them again.
    assert 1 <= measured <= 4
    # The workers named the study where they ran; asked here, the same question finds it and its answer.
    local = autotune(*find, cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    again = json.loads(local.stdout)
    assert again["study"] == answer["study"] and again["best"]["config"] == answer["best"]["config"]
    assert len([t for t in study_trials(storage, answer["study"]) if ANSWER_ATTR not in t.user_attrs]) == measured
