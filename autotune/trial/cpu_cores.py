"""Which CPU cores a trial computes on: the ones that are free when it starts.

PyTorch's CPU ops run as OpenMP parallel regions, one thread per core, and each region waits for
its slowest thread: with one core of two taken by another process, every region waits for the
thread that is not running, and a trial ran 25-40x slower than on the quiet machine
(``bench/find_noisy.py``). So a CPU trial (and the device probe) measures how busy each core is
for a moment, pins itself to the least busy ones, as many as are free in all, and runs that many
threads; its result records them.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["free_cores", "pick_free_cores", "rank_cores", "use_cores", "use_rank_cores"]

SAMPLE_S = 0.25  # long enough to see a spinning process, short beside a trial


def free_cores(sample_s: float = SAMPLE_S) -> list[int] | None:
    """The cores this process may use that nobody else is using now (at least one: the least busy);
    None where the system cannot pin a process to cores (macOS).

    Sampled while nothing of autotune computes (the caller holds :func:`autotune.search.workers.cpu_turn`),
    so whatever keeps a core busy is someone else's.
    """
    import psutil

    if not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    percents = psutil.cpu_percent(interval=sample_s, percpu=True)
    return pick_free_cores({c: percents[c] / 100 if c < len(percents) else 0.0 for c in allowed})


def pick_free_cores(busy: dict[int, float]) -> list[int]:
    """From each core's busy fraction (0-1): the least busy cores, as many as their idle time adds up to.

    Summing idle time rather than thresholding each core counts a process that hops between two
    cores in the sample (half of each busy) as the one core it takes.
    """
    idle = sum(1.0 - min(max(b, 0.0), 1.0) for b in busy.values())
    count = max(1, min(len(busy), int(idle + 0.5)))
    return sorted(sorted(busy, key=lambda c: (busy[c], c))[:count])


def rank_cores(cores: list[int], rank: int, nproc: int) -> tuple[list[int], int]:
    """Rank ``rank``'s cores and thread count: its own slice of ``cores`` where there is a core per
    rank; else all of them, shared, one thread each."""
    per_rank = len(cores) // nproc
    if per_rank == 0:
        return list(cores), 1
    return cores[rank * per_rank : (rank + 1) * per_rank], per_rank


def use_cores(cores: list[int], threads: int, torch: Any) -> None:
    """Pin this process to ``cores`` and run ``threads`` threads in torch's pool.

    Before any parallel region of the trial: OpenMP's threads inherit the affinity of the thread
    that starts them.
    """
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def use_rank_cores(cores: list[int], rank: int, nproc: int, torch: Any) -> dict[str, Any]:
    """Pin this process, rank ``rank`` of ``nproc``, to its slice of ``cores`` (:func:`rank_cores`);
    return what is in effect, as a trial's result records it (``cpu_cores``, ``cpu_threads``)."""
    mine, threads = rank_cores(cores, rank, nproc)
    use_cores(mine, threads, torch)
    return {"cpu_cores": sorted(os.sched_getaffinity(0)), "cpu_threads": torch.get_num_threads()}
