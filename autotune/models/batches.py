"""What a model is fed in a trial and what its forward gives back: synthetic batches per task
(random token ids and labels; their values change neither speed nor memory) and the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from autotune.errors import ConfigError

__all__ = ["synthetic_batch", "loss_of", "model_attr", "MASKED_FRACTION"]

MASKED_FRACTION = 0.15  # BERT's share of masked positions


def synthetic_batch(model: torch.nn.Module, *, task: str, micro_batch: int, seq_len: int,
                     device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens and labels; their values change neither speed nor memory."""
    vocab = model_attr(model, "vocab_size")
    if vocab is None:
        raise ConfigError("the model has no vocab_size (in model.config or on the module); "
                          "a factory's model must say how many token ids it embeds")
    input_ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    if task == "causal-lm":
        labels = input_ids
    elif task == "masked-lm":  # 15% of positions are predicted, the rest ignored (-100)
        masked = torch.rand((micro_batch, seq_len), device=device) < MASKED_FRACTION
        labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
    else:
        labels = torch.randint(0, model_attr(model, "num_labels") or 2, (micro_batch,), device=device)
    return {"input_ids": input_ids, "labels": labels}


def model_attr(model: torch.nn.Module, name: str) -> Any:
    for owner in (getattr(model, "config", None), model):
        value = getattr(owner, name, None)
        if isinstance(value, int):
            return value
    return None


def loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise ConfigError("the model's forward returned no loss: return a scalar tensor, a dict with "
                      "'loss', or an object with .loss")
