"""Multi-node trials on two real SLURM nodes: .ci/slurm-two-nodes.sh runs two slurmd daemons on this machine
(a cluster of its own beside the one-node one, which binds each task to its CPUs as real clusters do) and
prints AUTOTUNE_TEST_SLURM2_CONF; these tests skip without it outside CI.

What they show: srun places one torchrun on each node and the c10d rendezvous joins them; each node's
torchrun gets the job's CPUs there (a plain srun, as the trials' command was before, binds a node's ranks
to one core on this cluster: the first test shows both); and a real ``tune --executor slurm --nodes 2`` of
``--fsdp hybrid`` measures a trial whose ranks ran on both nodes, sharded within each and replicated across them."""

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
from slurm_jobs import sbatch_waited

from autotune.study.storage import open_storage

CONF = os.environ.get("AUTOTUNE_TEST_SLURM2_CONF")
PARTITION = os.environ.get("AUTOTUNE_TEST_SLURM2_PARTITION", "two")
pytestmark = [
    pytest.mark.skipif(
        not CONF and not os.environ.get("CI"),
        reason="no two-node SLURM cluster: .ci/run starts one (.ci/slurm-two-nodes.sh) and sets "
        "AUTOTUNE_TEST_SLURM2_CONF",
    ),
    pytest.mark.one_at_a_time("slurm"),  # in a parallel run, not beside the one-node cluster's jobs: the same CPUs
]


def cluster_env(**extra: str) -> dict[str, str]:
    assert CONF, "CI must start the two-node cluster (.ci/slurm-two-nodes.sh) and set AUTOTUNE_TEST_SLURM2_CONF"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
    return {**env, "SLURM_CONF": CONF, **extra}


def slurm(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, env=cluster_env(), check=True).stdout


def node_cpus() -> int:
    """The CPUs of each of the cluster's nodes (the same on both)."""
    return int(slurm("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%c").split()[0])


def _on_both_nodes(tmp_path: Path, python_args: str) -> subprocess.CompletedProcess[str]:
    """``python python_args`` as one task on each of the cluster's two nodes, holding every CPU there (a job that
    launches the ranks itself), waited for; its output in ``tmp_path/job.out``."""
    cpus = node_cpus()
    return sbatch_waited(
        [f"--partition={PARTITION}", "--nodes=2", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
         f"--output={tmp_path}/job.out", "--wrap", f"{sys.executable} {python_args}"],
        timeout=300, env=cluster_env(PYTHONPATH=os.getcwd()), cwd=tmp_path,
    )  # fmt: skip


# Each rank says who it is, where (SLURM's node name: the two nodes share this host's name) and on which CPUs.
PROBE = """\
import json, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
me = (dist.get_rank(), int(os.environ["LOCAL_RANK"]), os.environ["SLURMD_NODENAME"], sorted(os.sched_getaffinity(0)))
seen = [None] * dist.get_world_size()
dist.all_gather_object(seen, me)
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(seen))
dist.destroy_process_group()
"""
# In the job: the trials' command; then, for the contrast, what a plain srun (no --cpus-per-task) binds to.
LAUNCH = """\
import os, subprocess, sys
from autotune.trial.multinode import multinode_command
from autotune.trial.rendezvous import free_port
code = subprocess.call(multinode_command(os.environ, nproc=4, argv=sys.argv[1:], port=free_port()))
plain = ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", sys.executable, "-c",
         "import os; print(os.environ['SLURMD_NODENAME'], len(os.sched_getaffinity(0)))"]
print("PLAIN", subprocess.run(plain, capture_output=True, text=True).stdout.split())
sys.exit(code)
"""


@pytest.mark.slow
def test_four_ranks_start_on_two_real_nodes_each_nodes_on_the_cpus_the_job_holds_there(tmp_path: Path) -> None:
    nodes = slurm("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N").split()
    assert len(set(nodes)) == 2, nodes
    cpus = node_cpus()
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "launch.py").write_text(LAUNCH)
    out = tmp_path / "ranks.json"
    job = _on_both_nodes(tmp_path, f"{tmp_path}/launch.py {tmp_path}/probe.py {out}")
    said = (tmp_path / "job.out").read_text()
    assert job.returncode == 0, (job.stderr, said)
    ranks = sorted(map(tuple, json.loads(out.read_text())))
    # Two ranks on each node, local ranks 0 and 1, consecutive global ranks: torchrun's layout over two nodes.
    by_node: dict[str, list[tuple[int, int]]] = {}
    for rank, local, node, _ in ranks:
        by_node.setdefault(node, []).append((rank, local))
    assert sorted(by_node) == sorted(nodes), ranks
    assert sorted(by_node.values()) == [[(0, 0), (1, 1)], [(2, 0), (3, 1)]], ranks
    # Each rank may run on every CPU the job holds on its node, not on the one core a plain srun gives.
    assert all(len(affinity) == cpus for *_, affinity in ranks), ranks
    plain = next(line for line in said.splitlines() if line.startswith("PLAIN"))
    if cpus > 1:  # the contrast: this cluster binds, and srun without --cpus-per-task asks for one CPU a task
        assert plain.count("'1'") == 2, plain


SPACE = """\
description: hybrid sharding over two nodes
n_trials: 1
knobs:
  micro_batch: [2]
  precision: [fp32]
  checkpointing: [false]
  zero_stage: []
  fsdp: [hybrid]
"""


@pytest.mark.slow
def test_a_tune_on_two_nodes_measures_a_hybrid_trial_sharded_within_each_node(tmp_path: Path) -> None:
    """A real ``tune --executor slurm --nodes 2`` of --fsdp hybrid on 2 nodes x 2 ranks, no --shard-group: its trial's
    ranks ran on both nodes, each node's two ranks hold a 2-way shard (Adam states of half the model each), and the
    two nodes are the replicas whose gradients are all-reduced."""
    (tmp_path / "space.yaml").write_text(SPACE)
    storage = f"journal://{tmp_path}/shared/study.log"
    command = ["tune", "--study", "two", "--model", "builtin:llama-tiny"]
    command += ["--seq-len", "32", "--global-batch", "8", "--memory-budget", "1GiB", "--space", "space.yaml"]
    command += ["--nproc", "4", "--nodes", "2", "--steps", "2", "--no-confirm", "--no-estimate", "--json"]
    command += ["--executor", "slurm", "--workers", "1", "--partition", PARTITION, "--storage", storage]
    env = cluster_env(PYTHONPATH=os.getcwd())
    tune = commands.start(*command, cwd=tmp_path, env=env)
    steps: dict[str, str] = {}
    deadline = time.monotonic() + 600
    while tune.poll() is None and time.monotonic() < deadline:  # the trial's step, and the nodes it runs on
        listed = subprocess.run(["squeue", "--steps", "--me", "--noheader", "--format=%i %N"],
                                capture_output=True, text=True, env=env)  # fmt: skip
        for line in listed.stdout.splitlines():
            step, _, where = line.strip().partition(" ")
            if not step.endswith(("batch", "extern")):
                steps[step] = where
        time.sleep(0.3)
    stdout, stderr = tune.communicate(timeout=60)
    assert tune.returncode == 0, stderr
    (trial,) = optuna.load_study(study_name="two", storage=open_storage(storage)).trials
    job = trial.user_attrs["worker"]["slurm_job"]
    nodes = slurm("scontrol", "show", "hostnames", steps[f"{job}.0"]).split()
    assert sorted(nodes) == sorted(slurm("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N").split()), steps
    result = trial.user_attrs["result"]
    assert trial.user_attrs["status"] == "ok" and trial.user_attrs["config"]["fsdp"] == "hybrid", result
    assert result["world_size"] == 4 and len(result["peak_memory_per_rank"]) == 4, result
    assert all(p > 0 for p in result["peak_memory_per_rank"])
    assert result["optimizer_state_bytes"] == 2 * 4 * result["total_params"] // 2  # fp32 Adam's moments, 2-way
    shown = json.loads(stdout)
    assert shown["workload"]["nodes"] == 2 and shown["workload"]["nproc"] == 4


@pytest.mark.slow
def test_the_two_node_launch_export_trains_over_two_real_nodes(tmp_path: Path) -> None:
    """``export --format launch`` of a 2x2 config, submitted as it says (sbatch launch.sh train.py): its
    #SBATCH lines hold the job, srun starts a torchrun on each node, the rendezvous joins four ranks, and
    each rank may run on the CPUs its #SBATCH line asked for on its node."""
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.output.exporters import export_config

    workload = Workload(model="builtin:gpt2-tiny", seq_len=32, global_batch=8, nproc=4, nodes=2)
    script = tmp_path / "launch.sh"
    script.write_text(export_config(TrialConfig(micro_batch=2), workload, fmt="launch", device_type="cpu"))
    (tmp_path / "train.py").write_text(PROBE)
    out = tmp_path / "ranks.json"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # this Python's torchrun
    job = sbatch_waited(
        [f"--partition={PARTITION}", f"--output={tmp_path}/job.out", str(script), "train.py", str(out)],
        timeout=300, env=cluster_env(PATH=path), cwd=tmp_path,
    )  # fmt: skip
    assert job.returncode == 0, (job.stderr, (tmp_path / "job.out").read_text())
    ranks = json.loads(out.read_text())
    nodes = slurm("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N").split()
    assert sorted(rank for rank, *_ in ranks) == [0, 1, 2, 3]
    assert sorted(node for _, _, node, _ in ranks) == sorted(nodes * 2)  # two ranks on each node
    assert all(len(affinity) == workload.ranks_per_node for *_, affinity in ranks), ranks
