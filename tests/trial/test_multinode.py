"""Multi-node ranks (--nodes 2 --nproc 4): srun places one torchrun per node, a c10d rendezvous on
the first node joins them. Checked against the environment of a 2-node allocation (the variables and
their form as this machine's real one-node allocation set them, `srun env`, with a second node), the
host-list syntax against SLURM's own `scontrol show hostnames`, and a real 2-rank launch through srun
and torchrun inside an allocation of the one-node test cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from slurm_jobs import sbatch_waited

from autotune.errors import ConfigError
from autotune.trial.multinode import cpus_per_node, expand_nodelist, multinode_command, node_ranks

# What SLURM sets in a batch job holding two nodes (names and forms as recorded from `srun env` on the
# one-node test cluster: SLURM_JOB_NODELIST=vm, SLURM_JOB_NUM_NODES=1, ...), for gpu-a017 and gpu-a018.
TWO_NODES = {
    "SLURM_CLUSTER_NAME": "autotune-ci",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_NAME": "autotune-llama",
    "SLURM_JOB_NODELIST": "gpu-a[017-018]",
    "SLURM_NODELIST": "gpu-a[017-018]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_JOB_CPUS_PER_NODE": "4(x2)",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_SUBMIT_HOST": "login1",
    "SLURM_TOPOLOGY_ADDR": "gpu-a017",
}
CLUSTER = bool(os.environ.get("AUTOTUNE_TEST_SLURM_PARTITION"))


def test_four_ranks_over_two_nodes_of_a_recorded_allocation():
    nodes = node_ranks(TWO_NODES, nproc=4)
    assert [(n.host, n.node_rank, n.ranks) for n in nodes] == [("gpu-a017", 0, (0, 1)), ("gpu-a018", 1, (2, 3))]
    command = multinode_command(TWO_NODES, nproc=4, argv=["train.py", "--x"], python="python3")
    assert command == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=4",  # the job's CPUs on each node (SLURM_JOB_CPUS_PER_NODE), for the node's two ranks
        "--kill-on-bad-exit=1",
        "python3",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu-a017:29500",  # the first node, which the submitting host (login1) is not
        "--rdzv-id=autotune-4242",
        "train.py",
        "--x",
    ]


def test_an_allocation_that_does_not_fit_the_ranks_is_refused():
    with pytest.raises(ConfigError, match="--nproc 3 does not divide over the 2 nodes"):
        node_ranks(TWO_NODES, nproc=3)
    with pytest.raises(ConfigError, match="no SLURM_JOB_NODELIST"):
        node_ranks({}, nproc=2)
    with pytest.raises(ConfigError, match="names 2 nodes and SLURM_JOB_NUM_NODES says 3"):
        node_ranks(dict(TWO_NODES, SLURM_JOB_NUM_NODES="3"), nproc=4)


@pytest.mark.parametrize(
    ("env", "cpus"),
    [
        ({"SLURM_JOB_CPUS_PER_NODE": "4(x2)"}, 4),
        ({"SLURM_JOB_CPUS_PER_NODE": "72(x2),36"}, 36),  # nodes of two sizes: what every node can give
        ({"SLURM_JOB_CPUS_PER_NODE": "8,16"}, 8),
        ({"SLURM_CPUS_ON_NODE": "6"}, 6),
        ({}, None),
    ],
)
def test_each_nodes_task_gets_the_cpus_the_job_holds_there(env, cpus):
    assert cpus_per_node(env) == cpus
    command = multinode_command({**TWO_NODES, "SLURM_JOB_CPUS_PER_NODE": "", **env}, nproc=4, argv=["t.py"])
    assert [a for a in command if a.startswith("--cpus-per-task")] == ([f"--cpus-per-task={cpus}"] if cpus else [])


def test_a_cpu_count_slurm_never_writes_is_refused():
    with pytest.raises(ConfigError, match="SLURM_JOB_CPUS_PER_NODE '4x2': cannot read '4x2'"):
        cpus_per_node({"SLURM_JOB_CPUS_PER_NODE": "4x2"})


LISTS = ["vm", "gpu-a[017-018]", "n[1-3,7],login1", "rack1-n[08-11]", "a[09-10],b[1,3]"]


def test_host_lists_expand_as_slurm_writes_them():
    assert expand_nodelist("n[1-3,7],login1") == ["n1", "n2", "n3", "n7", "login1"]
    assert expand_nodelist("gpu-a[098-101]") == ["gpu-a098", "gpu-a099", "gpu-a100", "gpu-a101"]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's scontrol is not installed")
@pytest.mark.parametrize("nodelist", LISTS)
def test_host_lists_expand_as_scontrol_expands_them(nodelist):
    slurm = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    assert expand_nodelist(nodelist) == slurm.stdout.split()


PROBE = """\
import json, os, socket, sys
import torch.distributed as dist
dist.init_process_group("gloo")
seen = [None] * dist.get_world_size()
dist.all_gather_object(seen, (dist.get_rank(), int(os.environ["LOCAL_RANK"]), socket.gethostname()))
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(seen))
dist.destroy_process_group()
"""
LAUNCH = """\
import os, subprocess, sys
from autotune.trial.multinode import multinode_command
sys.exit(subprocess.call(multinode_command(os.environ, nproc=2, argv=sys.argv[1:], port=int(os.environ["PORT"]))))
"""


@pytest.mark.skipif(not CLUSTER and not os.environ.get("CI"), reason="no SLURM cluster: .ci/run starts one")
@pytest.mark.one_at_a_time("slurm")  # in a parallel run, not beside another job on the one-node cluster
@pytest.mark.slow
def test_two_ranks_start_through_srun_and_torchrun_inside_an_allocation(tmp_path):
    from autotune.trial.rendezvous import free_port

    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "launch.py").write_text(LAUNCH)
    out = tmp_path / "ranks.json"
    env = dict(os.environ, PORT=str(free_port()))
    job = sbatch_waited(
        ["--nodes=1", "--cpus-per-task=2", f"--output={tmp_path}/job.out", "--wrap",
         f"{sys.executable} {tmp_path}/launch.py {tmp_path}/probe.py {out}"],
        timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert job.returncode == 0, (job.stderr, (tmp_path / "job.out").read_text())
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    assert sorted(map(tuple, json.loads(out.read_text()))) == [(0, 0, host), (1, 1, host)]
