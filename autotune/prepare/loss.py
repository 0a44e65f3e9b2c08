"""The loss: the model's own (``standard``), or a causal LM's cross-entropy in chunks (``chunked``).

A causal LM's step peaks at its logits: micro batch x sequence x vocabulary numbers, kept in
fp32 for the loss and again as their gradient (with a 128k vocabulary that outgrows all the
activations of the layers below). ``chunked`` never makes them whole: the LM head and the
cross-entropy run on K slices of the tokens, each under non-reentrant activation checkpointing,
so only one slice's logits exist at a time, in the forward and again in the backward (which
recomputes them: one more LM-head matmul per step). The loss is the same number.

Applied to the model in place (:func:`chunk_loss`), so trials, the estimator and a user's own job
train the same way: ``model(input_ids=..., labels=...)`` still returns ``.loss``; its ``.logits``
then hold the final hidden states, since no full logits are made.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from autotune.config.knobs import DEFAULT_LOSS_CHUNKS
from autotune.errors import ConfigError
from autotune.models.sources import parse_model_source

if TYPE_CHECKING:
    import torch

    from autotune.config.workload import Workload

__all__ = ["chunk_loss", "chunked_loss_refusal", "DEFAULT_LOSS_CHUNKS"]

_IGNORE = -100  # label of positions without a target (the last one, after the shift), as transformers


def chunked_loss_refusal(workload: Workload, task: str) -> str | None:
    """Why ``--loss chunked`` cannot apply to this workload, or None when it can (known before a trial)."""
    if task != "causal-lm":
        return f"--loss chunked is a causal LM's loss (LM head + cross-entropy); --task {task} keeps its own"
    if parse_model_source(workload.model).kind == "factory":
        return (
            f"--loss chunked: the model from --model {workload.model} is a factory's, whose LM head and "
            "loss autotune does not know; it applies to Hugging Face causal LMs"
        )
    return None


def chunk_loss(model: torch.nn.Module, chunks: int = DEFAULT_LOSS_CHUNKS, *, source: str = "the model") -> None:
    """Make ``model`` (a Hugging Face causal LM, or PEFT's wrapper of one) compute its loss in
    ``chunks`` slices of tokens, each recomputed in the backward; see the module's docstring."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    head = getattr(base, "lm_head", None)
    if head is None or not hasattr(type(base), "loss_function"):
        raise ConfigError(
            f"--loss chunked: {source} has no lm_head and loss_function (a Hugging Face causal "
            "LM has both); use --loss standard"
        )
    _ChunkedCrossEntropy(head, chunks).install(base)


class _ChunkedCrossEntropy:
    """The model's ``loss_function``: called with the head's output, which the head now passes
    through unchanged (the hidden states), it runs the head itself, a slice at a time."""

    def __init__(self, head: torch.nn.Module, chunks: int) -> None:
        self.head, self.chunks = head, chunks
        self._head_forward = head.forward
        self._in_loss = False

    def install(self, model: torch.nn.Module) -> None:
        # The head stays the same module (its weights, tying and hooks, e.g. ZeRO-3's gathering,
        # unchanged); only outside the loss does it hand its input through.
        self.head.forward = self._forward
        model.loss_function = self  # type: ignore[assignment]  # Module.__setattr__ is typed for tensors and modules

    def _forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._head_forward(hidden, *args, **kwargs) if self._in_loss else hidden

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        self._in_loss = True
        try:
            yield
        finally:
            self._in_loss = False

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = _IGNORE,
        shift_labels: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        import torch
        from torch.utils.checkpoint import checkpoint

        hidden = logits  # see _forward: the head passed the hidden states through
        if shift_labels is None:  # tokens < n predict n, as transformers' ForCausalLMLoss
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = shift_labels.reshape(-1).to(hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for part, part_targets in zip(hidden.chunk(self.chunks), targets.chunk(self.chunks), strict=True):
            total = total + checkpoint(self._summed_loss, part, part_targets, ignore_index, use_reentrant=False)
        if num_items_in_batch is not None:
            count = num_items_in_batch.to(total.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
        else:
            count = (targets != ignore_index).sum()
        return total / count

    def _summed_loss(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        import torch

        with self._computing():
            logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
