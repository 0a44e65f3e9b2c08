"""What starts a trial's ranks across the nodes of a SLURM allocation: ``srun`` runs one torchrun per
node, and torchrun's c10d rendezvous on the first node joins them (``--nodes M --nproc N``: N ranks in
all, N/M on each node, numbered node by node).

Everything here is read from the allocation's environment (``SLURM_JOB_NODELIST``, ``SLURM_JOB_ID``,
``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_CPUS_PER_NODE``), so it is checked against the environment of a
recorded allocation as well as run in real ones (a SLURM worker's trials, :mod:`autotune.trial.runner`).

Each node's one srun task (its torchrun, which starts the node's ranks) is given the CPUs the job holds
on that node: since SLURM 22.05, srun no longer inherits sbatch's ``--cpus-per-task``, and a step asks
for one CPU per task by default, so on a cluster that binds tasks to their CPUs (task/affinity,
task/cgroup) every rank of a node would share one core.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Mapping

from autotune.errors import ConfigError

__all__ = ["expand_nodelist", "NodeRanks", "node_ranks", "cpus_per_node", "multinode_command", "RDZV_PORT"]

RDZV_PORT = 29500  # torchrun's default rendezvous port, on the first node of the allocation
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_CPUS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")  # SLURM_JOB_CPUS_PER_NODE's items: 72(x2),36


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded as ``scontrol show hostnames`` does:
    ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1 (zero padding kept)."""
    hosts: list[str] = []
    for part in _top_level_parts(nodelist):
        match = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)", part)
        if match is None:
            if "[" in part or "]" in part:
                raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r}: cannot read {part!r}")
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            numbers = _RANGE.match(item.strip())
            if numbers is None:
                raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r}: cannot read the range {item!r}")
            first, last = numbers.group(1), numbers.group(2) or numbers.group(1)
            width = len(first)
            hosts += [f"{prefix}{n:0{width}d}{suffix}" for n in range(int(first), int(last) + 1)]
    return hosts


def _top_level_parts(nodelist: str) -> list[str]:
    """Split on the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in nodelist.strip():
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    parts.append(current)
    return [p for p in parts if p]


@dataclass(frozen=True)
class NodeRanks:
    """One node's share of a trial: its host, its place among the nodes, and its global ranks."""

    host: str
    node_rank: int
    ranks: tuple[int, ...]


def node_ranks(env: Mapping[str, str], *, nproc: int) -> list[NodeRanks]:
    """Which ranks each node of the allocation runs: ``nproc`` in all, the same number on each node,
    numbered node by node in the order SLURM lists the nodes (torchrun's order with a static rendezvous)."""
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    if not hosts:
        raise ConfigError("--nodes: no SLURM_JOB_NODELIST here; multi-node trials run inside a SLURM allocation")
    expected = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if expected is not None and int(expected) != len(hosts):
        raise ConfigError(f"SLURM_JOB_NODELIST names {len(hosts)} nodes and SLURM_JOB_NUM_NODES says {expected}")
    if nproc % len(hosts):
        raise ConfigError(f"--nproc {nproc} does not divide over the {len(hosts)} nodes of the allocation")
    per_node = nproc // len(hosts)
    return [
        NodeRanks(host=host, node_rank=i, ranks=tuple(range(i * per_node, (i + 1) * per_node)))
        for i, host in enumerate(hosts)
    ]


def cpus_per_node(env: Mapping[str, str]) -> int | None:
    """The CPUs the job holds on each of its nodes, the fewest where they differ (``SLURM_JOB_CPUS_PER_NODE``:
    ``4(x2)``, ``72,36``): what each node's one srun task can be given, the same on every node. ``None``
    outside a job that says."""
    value = env.get("SLURM_JOB_CPUS_PER_NODE") or env.get("SLURM_CPUS_ON_NODE")
    if not value:
        return None
    counts = []
    for item in value.split(","):
        match = _CPUS.match(item.strip())
        if match is None:
            raise ConfigError(f"SLURM_JOB_CPUS_PER_NODE {value!r}: cannot read {item!r}")
        counts.append(int(match.group(1)))
    return min(counts)


def multinode_command(
    env: Mapping[str, str], *, nproc: int, argv: list[str], port: int = RDZV_PORT, python: str | None = None
) -> list[str]:
    """The command that starts ``argv`` (a Python script and its arguments) as ``nproc`` ranks across the
    allocation: ``srun`` places one torchrun on each node, which joins the others at a c10d rendezvous on
    the first node (named by the job id, so two trials of one job never meet) and starts its ranks. Each
    node's torchrun gets the job's CPUs on that node (``--cpus-per-task``), which its ranks share."""
    nodes = node_ranks(env, nproc=nproc)
    cpus = cpus_per_node(env)
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise ConfigError("--nodes: no SLURM_JOB_ID here; multi-node trials run inside a SLURM allocation")
    return [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        *([f"--cpus-per-task={cpus}"] if cpus is not None else []),  # srun does not inherit sbatch's (22.05+)
        "--kill-on-bad-exit=1",  # a rank that dies takes the trial down, not a hang in a collective
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={len(nodes)}",
        f"--nproc-per-node={len(nodes[0].ranks)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={nodes[0].host}:{port}",
        f"--rdzv-id=autotune-{job}",
        *argv,
    ]
