"""What a model is fed in a trial and what its forward gives back: synthetic batches per task
(random token ids, images and labels; their values change neither speed nor memory), a
factory's own ``make_batch``, and the loss.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from autotune.errors import ConfigError

__all__ = [
    "synthetic_batch",
    "factory_batch",
    "loss_of",
    "model_attr",
    "throughput_unit",
    "MakeBatch",
    "MASKED_FRACTION",
]

MASKED_FRACTION = 0.15  # BERT's share of masked positions

# A factory's batch maker: ``make_batch(micro_batch, device)`` returns forward's keyword arguments.
MakeBatch = Callable[[int, torch.device], dict[str, Any]]


def throughput_unit(task: str, *, own_batch: bool) -> str:
    """What a trial's figure counts: tokens for text, images for image-cls, and whole samples for a
    factory's own batch (autotune cannot tell what one of its samples holds)."""
    if own_batch:
        return "samples/s"
    return "images/s" if task == "image-cls" else "tokens/s"


def synthetic_batch(
    model: torch.nn.Module,
    *,
    task: str,
    micro_batch: int,
    seq_len: int,
    device: torch.device,
    target_len: int | None = None,
    image_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Random inputs and labels of the task's shapes. ``target_len``: an encoder-decoder's decoder
    tokens (default ``seq_len``); ``image_size``: image-cls pixels per side (required there)."""
    if task == "image-cls":
        assert image_size is not None, "image-cls batches need image_size"
        channels = model_attr(model, "num_channels") or 3
        pixels = torch.randn((micro_batch, channels, image_size, image_size), device=device)
        labels = torch.randint(0, model_attr(model, "num_labels") or 2, (micro_batch,), device=device)
        return {"pixel_values": pixels, "labels": labels}
    vocab = model_attr(model, "vocab_size")
    if vocab is None:
        raise ConfigError(
            "the model has no vocab_size (in model.config or on the module); "
            "a factory's model must say how many token ids it embeds, or return "
            "(model, make_batch) to feed it its own inputs"
        )
    input_ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    if task == "seq2seq-lm":  # the model shifts the labels right into its decoder's inputs
        return {
            "input_ids": input_ids,
            "labels": torch.randint(0, vocab, (micro_batch, target_len or seq_len), device=device),
        }
    if task == "causal-lm":
        labels = input_ids
    elif task == "masked-lm":  # 15% of positions are predicted, the rest ignored (-100)
        masked = torch.rand((micro_batch, seq_len), device=device) < MASKED_FRACTION
        labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
    else:
        labels = torch.randint(0, model_attr(model, "num_labels") or 2, (micro_batch,), device=device)
    return {"input_ids": input_ids, "labels": labels}


def factory_batch(
    make_batch: MakeBatch, model: torch.nn.Module, *, micro_batch: int, device: torch.device, source: str
) -> dict[str, Any]:
    """A factory's ``make_batch(micro_batch, device)``, checked against the model's forward before a
    step runs, so that a mismatch is said in one line naming the factory."""
    batch = make_batch(micro_batch, device)
    if not isinstance(batch, dict) or not all(isinstance(k, str) for k in batch):
        raise ConfigError(
            f"--model {source}: make_batch returned {type(batch).__name__}, not a dict of the "
            "keyword arguments of the model's forward"
        )
    try:
        inspect.signature(model.forward).bind(**batch)
    except TypeError as exc:
        raise ConfigError(
            f"--model {source}: the model's forward cannot take make_batch's "
            f"{sorted(batch)} ({exc}); return forward's keyword arguments"
        ) from None
    except ValueError:  # no signature to read (a C function): the step itself will say
        pass
    return batch


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
    raise ConfigError(
        "the model's forward returned no loss: return a scalar tensor, a dict with 'loss', or an object with .loss"
    )
