"""What a launcher tells each rank of a one-node process group, for the processes autotune starts
itself: a forked trial's ranks, a one-rank DeepSpeed or FSDP trial, a one-process script under ZeRO."""

from __future__ import annotations

import socket

__all__ = ["free_port", "one_node_ranks"]


def free_port() -> int:
    """A TCP port free on this host now (the group's rendezvous; taken again within moments)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_node_ranks(nproc: int) -> list[dict[str, str]]:
    """The environment torchrun gives each of ``nproc`` ranks on one node, one rendezvous port for all."""
    port = str(free_port())
    return [
        {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        for r in range(nproc)
    ]
