"""Custom model factories for the tests, reached through the public ``--model module:function``.

Each misbehaves in one way a user's model can: these are the faults the runner must classify.
"""

from __future__ import annotations

import ctypes
import subprocess
import time

import torch

VOCAB = 64


class TinyLM(torch.nn.Module):
    """A minimal causal LM: embedding + linear head, loss from cross-entropy."""

    vocab_size = VOCAB

    def __init__(self, poison: float = 1.0) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)
        self.poison = poison

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.embed(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss * self.poison}


def tiny(seq_len: int) -> torch.nn.Module:
    return TinyLM()


def nan_loss() -> torch.nn.Module:
    return TinyLM(poison=float("nan"))


def hang(**_: object) -> torch.nn.Module:
    time.sleep(3600)
    raise AssertionError("unreachable")


def segfault() -> torch.nn.Module:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    raise AssertionError("unreachable")


def broken() -> torch.nn.Module:
    raise ValueError("factory exploded on purpose")


def orphan_then_oom() -> torch.nn.Module:
    """Leaves a grandchild process behind, then runs out of memory while building."""
    subprocess.Popen(["sleep", "317"])
    return torch.nn.Linear(4096, 4096 * 8)  # 512 MiB of weights: far over a small budget
