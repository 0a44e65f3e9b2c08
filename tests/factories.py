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


def slow_tiny() -> torch.nn.Module:
    """Takes 3 s to build (a trial of a real model takes longer), so a test can stop one midway."""
    time.sleep(3)
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


class FaultyLM(TinyLM):
    """Misbehaves according to its micro batch, so one study meets every fault a trial can have."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        fault = FAULTS.get(input_ids.shape[0])
        if fault == "nan":
            self.poison = float("nan")
        elif fault == "segfault":
            ctypes.string_at(0)
        elif fault == "hang":
            time.sleep(3600)
        elif fault == "oom":
            torch.empty(2**30, dtype=torch.uint8).fill_(0)  # 1 GiB of live tensor: over any test budget
        elif fault == "garbage":
            import os
            import sys

            with open(os.path.join(sys.argv[2], "rank0.json"), "w") as out:  # the trial's result file
                out.write('["this", "is", "not", "a", "result"]')
            print("}{ garbage on stdout too", flush=True)
            os._exit(0)
        elif fault == "exception":
            raise RuntimeError("the model's forward exploded on purpose")
        return super().forward(input_ids, labels)


# OOM last: a config with a larger micro batch than one that ran out of memory is never tried.
FAULTS = {1: None, 2: "nan", 4: "segfault", 8: "hang", 16: "garbage", 32: "exception", 64: "oom"}


def faulty() -> torch.nn.Module:
    return FaultyLM()


class MlpLM(TinyLM):
    """TinyLM with a hidden linear layer: LoRA's fallback adapts it (not the head). Like every model
    here it has no activation_checkpointing_enable(): checkpointing configs cannot run on it."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(32, 32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(torch.relu(self.hidden(self.embed(input_ids))))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def mlp() -> torch.nn.Module:
    return MlpLM()


def checkpointable() -> torch.nn.Module:
    """A factory's model that can checkpoint (a no-op here: it has no layers worth recomputing)."""
    model = TinyLM()
    model.gradient_checkpointing_enable = lambda **_: None
    return model


class TinyConvNet(torch.nn.Module):
    """A ResNet-style image classifier without torchvision: a stem, two residual blocks, a linear head."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU()
        )
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Conv2d(width, width, 3, padding=1),
                torch.nn.BatchNorm2d(width),
                torch.nn.ReLU(),
                torch.nn.Conv2d(width, width, 3, padding=1),
            )
            for _ in range(2)
        )
        self.head = torch.nn.Linear(width, classes)

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return torch.nn.functional.cross_entropy(self.head(x.mean(dim=(2, 3))), targets)


def convnet():
    """(model, make_batch): the trial feeds it images, not token ids."""

    def make_batch(micro_batch: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            "images": torch.randn(micro_batch, 3, 32, 32, device=device),
            "targets": torch.randint(0, 10, (micro_batch,), device=device),
        }

    return TinyConvNet(), make_batch


def convnet_fed_tokens():
    """A make_batch whose keys the model's forward does not take."""

    def make_batch(micro_batch: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.zeros(micro_batch, 8, dtype=torch.long, device=device)}

    return TinyConvNet(), make_batch
