"""The loss: the model's own (``standard``), or a causal LM's cross-entropy in chunks (``chunked``).

A causal LM's step peaks at its logits: micro batch x sequence x vocabulary numbers, kept in
fp32 for the loss and again as their gradient (with a 128k vocabulary that outgrows all the
activations of the layers below). ``chunked`` never makes them whole: the LM head and the
cross-entropy run on K slices of the tokens, each under non-reentrant activation checkpointing,
so only one slice's logits exist at a time, in the forward and again in the backward (which
recomputes them: one more LM-head matmul per step). The loss is the same number.

``chunked-kept`` slices the same way but recomputes nothing: each slice's 16-bit logits are kept for
the backward with one log-sum-exp per token, and the backward forms the softmax from them. That is
what torchtune's ``CEWithChunkedOutputLoss`` keeps under ``torch.compile`` (its model makes the
slices' logits, its compiled upcast + cross-entropy saves its 16-bit input and the per-token
statistics; see :class:`_CrossEntropyOfKeptLogits`): no extra matmul, the whole logits in 16 bits
held from the forward to the start of the backward, never the fp32 upcast of more than one slice.
Under activation offload they stay on the device (the backward needs them first).

``plain`` is the loss of a plain training loop, ``logits = model(x); loss = F.cross_entropy(logits.flatten(0, 1),
y.flatten())`` (KempnerForge's ``scripts/train.py``): the cross-entropy on the whole logits in the type the model
made them, with no fp32 upcast (bf16 log-probabilities under bf16-true, where Transformers' ``ForCausalLMLoss``
calls ``logits.float()``), and the logits held by the loop's variable until its next forward replaces them, through
the backward and the optimizer step (torchtitan ``del``s its ``pred`` before the backward for that reason).

Applied to the model in place (:func:`chunk_loss`, :func:`plain_loss`), so trials, the estimator and a user's own job
train the same way: ``model(input_ids=..., labels=...)`` still returns ``.loss``; its ``.logits``
then hold the final hidden states, since no full logits are made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, ModelFacts

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "LossFields",
    "LossLever",
    "LOSSES",
    "DEFAULT_LOSS_CHUNKS",
    "is_loss",
    "chunk_loss",
    "chunked_loss_refusal",
    "plain_loss",
]

LOSSES = ("standard", "chunked", "chunked-kept", "plain")  # the chunked ones also as chunked:K, chunked-kept:K
DEFAULT_LOSS_CHUNKS = 8

_IGNORE = -100  # label of positions without a target (the last one, after the shift), as transformers


def is_loss(value: Any) -> bool:
    """standard, chunked, chunked-kept, plain, or chunked:K / chunked-kept:K with K >= 2."""
    if value in LOSSES:
        return True
    kind, _, chunks = value.partition(":") if isinstance(value, str) else ("", "", "")
    return kind in ("chunked", "chunked-kept") and chunks.isdigit() and int(chunks) >= 2


@dataclass(frozen=True, kw_only=True)
class LossFields:
    loss: str = field(
        default="standard",
        metadata={
            "help": "standard (the model's own), or chunked (chunked:K): a causal LM's head and "
            f"cross-entropy over K slices of the tokens (default {DEFAULT_LOSS_CHUNKS}), each "
            "recomputed in backward, so the full logits never exist. Same loss, less memory. "
            "chunked-kept (chunked-kept:K) keeps each slice's 16-bit logits for the backward instead "
            "of recomputing the head (torchtune's compiled chunked cross-entropy): no extra matmul, "
            "more memory than chunked, less than standard. plain: a plain loop's F.cross_entropy on the "
            "logits in their own type (no fp32 upcast), the logits held until the next forward."
        },
    )

    @property
    def loss_chunks(self) -> int | None:
        """Slices of tokens the chunked loss works on; None for the standard and the plain loss."""
        if self.loss in ("standard", "plain"):
            return None
        _, _, chunks = self.loss.partition(":")
        return int(chunks) if chunks else DEFAULT_LOSS_CHUNKS

    @property
    def loss_keeps_logits(self) -> bool:
        """The chunked loss keeps each slice's logits for the backward (chunked-kept) instead of
        recomputing the LM head there (chunked)."""
        return self.loss.partition(":")[0] == "chunked-kept"


def chunked_loss_refusal(facts: ModelFacts, loss: str = "chunked") -> str | None:
    """Why ``--loss chunked`` (or another of a causal LM's losses, ``loss``) cannot apply to the workload's model,
    or None when it can (known before a trial)."""
    if facts.task != "causal-lm":
        return f"--loss {loss} is a causal LM's loss (LM head + cross-entropy); --task {facts.task} keeps its own"
    if facts.is_factory:
        return (
            f"--loss {loss}: the model from --model {facts.model} is a factory's, whose LM head and "
            "loss autotune does not know; it applies to Hugging Face causal LMs"
        )
    return None


class LossLever(Lever):
    name = "loss"
    fields = ("loss",)
    flags = (Flag("loss", ("--loss",), str, "standard"),)
    axes = (
        Axis(
            "loss",
            "a list of standard, chunked, chunked-kept, plain, chunked:K or chunked-kept:K (K slices of 2 or more)",
            "standard",
            lambda v: v if is_loss(v) else None,
            added_later=True,
        ),
    )

    def check(self, config: TrialConfig) -> None:
        if not is_loss(config.loss):
            raise ConfigError(
                f"--loss {config.loss!r} is not known; use standard, chunked, chunked-kept, plain, or chunked:K / "
                "chunked-kept:K with K slices of 2 or more (e.g. chunked:16)"
            )

    def needs_model_facts(self, config: TrialConfig) -> bool:
        return config.loss != "standard"

    def model_refusal(self, config: TrialConfig, facts: ModelFacts) -> str | None:
        return None if config.loss == "standard" else chunked_loss_refusal(facts, config.loss)

    def runnable(
        self, key: str, values: tuple[Any, ...], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> tuple[Any, ...]:
        refusal = chunked_loss_refusal(facts) if any(value != "standard" for value in values) else None
        if refusal is None:
            return values
        if "standard" not in values:
            raise ConfigError(f"knobs.loss {list(values)}: {refusal}; add standard")
        return ("standard",)

    def dropped(
        self, space: Mapping[str, tuple[Any, ...]], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> list[str]:
        chunked = [value for value in space["loss"] if value != "standard"]
        refusal = chunked_loss_refusal(facts) if chunked else None
        return [] if refusal is None else [f"loss {', '.join(chunked)}: {refusal}"]

    def apply(self, model: torch.nn.Module, config: TrialConfig, *, source: str) -> torch.nn.Module:
        if config.loss_chunks is not None:
            chunk_loss(model, config.loss_chunks, keep_logits=config.loss_keeps_logits, source=source)
        elif config.loss == "plain":
            plain_loss(model, source=source)
        return model

    def stage_refusal(self, config: TrialConfig) -> str | None:
        if config.loss != "standard":
            return f"--loss {config.loss} replaces the head the last stage runs; use standard"
        return None

    def labels(self, config: TrialConfig) -> list[str]:
        if config.loss == "standard":
            return []
        if config.loss == "plain":
            return ["plain-loss"]
        chunks = config.loss.partition(":")[2]
        label = "chunked-kept-loss" if config.loss_keeps_logits else "chunked-loss"
        return [label + (f":{chunks}" if chunks else "")]

    def maths_note(self, config: TrialConfig) -> str | None:
        return "the cross-entropy in the logits' own type (no fp32 upcast)" if config.loss == "plain" else None

    def in_code(self, config: TrialConfig) -> list[str]:
        if config.loss == "plain":
            return [
                "loss: plain, a loop's own logits = model(input_ids); loss = F.cross_entropy(logits.flatten(0, 1), "
                "labels.flatten()) (no upcast; the logits held until the next forward)"
            ]
        if config.loss_chunks is None:
            return []
        kind = "chunked-kept" if config.loss_keeps_logits else "chunked"
        return [
            f"loss: {kind} in {config.loss_chunks} slices, which no library flag sets: after building the model, "
            f'`model = autotune.prepare(model, loss="{kind}:{config.loss_chunks}")` '
            "(same loss; outputs.logits then hold the hidden states)"
        ]


def chunk_loss(
    model: torch.nn.Module,
    chunks: int = DEFAULT_LOSS_CHUNKS,
    *,
    keep_logits: bool = False,
    source: str = "the model",
) -> None:
    """Make ``model`` (a Hugging Face causal LM, or PEFT's wrapper of one) compute its loss in
    ``chunks`` slices of tokens, each recomputed in the backward, or with ``keep_logits`` each
    slice's logits kept for it; see the module's docstring."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    head = getattr(base, "lm_head", None)
    if head is None or not hasattr(type(base), "loss_function"):
        raise ConfigError(
            f"--loss chunked: {source} has no lm_head and loss_function (a Hugging Face causal "
            "LM has both); use --loss standard"
        )
    _ChunkedCrossEntropy(head, chunks, keep_logits=keep_logits).install(base)


def plain_loss(model: torch.nn.Module, *, source: str = "the model") -> None:
    """Make ``model`` (a Hugging Face causal LM, or PEFT's wrapper of one) compute its loss as a plain loop does;
    see the module's docstring."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    if not hasattr(type(base), "loss_function"):
        raise ConfigError(
            f"--loss plain: {source} has no loss_function (a Hugging Face causal LM has one); use --loss standard"
        )
    base.loss_function = _PlainCrossEntropy()


class _PlainCrossEntropy:
    """The model's ``loss_function``: ``F.cross_entropy`` on the logits as they come, which it holds (as a loop's
    ``logits`` variable) until the next call replaces them."""

    def __init__(self) -> None:
        self.held: Any = None

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

        self.held = logits
        targets = _next_token_targets(labels, shift_labels, ignore_index, logits.device)
        flat = logits.reshape(-1, logits.shape[-1])
        if num_items_in_batch is None:
            return torch.nn.functional.cross_entropy(flat, targets, ignore_index=ignore_index)
        total = torch.nn.functional.cross_entropy(flat, targets, ignore_index=ignore_index, reduction="sum")
        return total / _on_device(num_items_in_batch, total.device)


class _ChunkedCrossEntropy:
    """The model's ``loss_function``: called with the head's output, which the head now passes
    through unchanged (the hidden states), it runs the head itself, a slice at a time."""

    def __init__(self, head: torch.nn.Module, chunks: int, *, keep_logits: bool = False) -> None:
        self.head, self.chunks, self.keep_logits = head, chunks, keep_logits
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
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = _next_token_targets(labels, shift_labels, ignore_index, hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for part, part_targets in zip(hidden.chunk(self.chunks), targets.chunk(self.chunks), strict=True):
            if self.keep_logits:
                total = total + self._kept_loss(part, part_targets, ignore_index)
            else:
                total = total + checkpoint(self._summed_loss, part, part_targets, ignore_index, use_reentrant=False)
        count = (targets != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
        return total / _on_device(count, total.device)

    def _kept_loss(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        import torch

        # What the slice keeps stays on the device under activation offload: the backward needs it first,
        # so a copy to the host and back would overlap nothing (torchtune's offload leaves its LM head
        # out, and computes its loss outside, for the same reason). Inner saved-tensor hooks win.
        with self._computing(), torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            logits = self.head(hidden)
            return _CrossEntropyOfKeptLogits.apply(logits, targets, ignore_index)

    def _summed_loss(self, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        import torch

        with self._computing():
            logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def _next_token_targets(labels: Any, shift_labels: Any, ignore_index: int, device: Any) -> Any:
    """The flat targets of a causal LM's positions: the given shifted labels, else tokens < n predict n (as
    Transformers' ForCausalLMLoss shifts them, the last position ignored)."""
    import torch

    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1).to(device)


def _on_device(count: Any, device: Any) -> Any:
    """The items a summed loss is divided by (Transformers' num_items_in_batch: a tensor or a number) where the
    loss is."""
    import torch

    return count.to(device) if torch.is_tensor(count) else count


def _as_is(tensor: Any) -> Any:
    return tensor


def _kept_logits_function() -> type:
    import torch

    class CrossEntropyOfKeptLogits(torch.autograd.Function):
        """Summed cross-entropy of one slice's logits, computed in fp32, that keeps for the backward the
        logits as they came (16-bit under bf16) and one log-sum-exp per token, and forms the softmax
        from them there: what Inductor's partition of ``cross_entropy(logits.float())`` saves (its
        16-bit input and per-row statistics), where eager autograd would keep the fp32 log-softmax.
        The fp32 work runs on blocks of rows (:data:`_FP32_BLOCK_BYTES`), so no fp32 copy of the whole
        slice is made: a fused kernel makes none either."""

        @staticmethod
        def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
            valid = targets != ignore_index
            picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1).float()
            log_sum_exp = torch.cat([torch.logsumexp(block.float(), dim=-1) for block in _row_blocks(logits)])
            ctx.save_for_backward(logits, targets, log_sum_exp)
            ctx.ignore_index = ignore_index
            return ((log_sum_exp - picked) * valid).sum()

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            logits, targets, log_sum_exp = ctx.saved_tensors
            scale = grad_output * (targets != ctx.ignore_index)
            grad = torch.empty_like(logits)
            start = 0
            for block in _row_blocks(logits):
                rows = slice(start, start + block.shape[0])
                start = rows.stop
                softmax = block.float().sub_(log_sum_exp[rows].unsqueeze(-1)).exp_()
                picked = targets[rows].clamp(min=0).unsqueeze(-1)
                softmax.scatter_add_(-1, picked, -torch.ones_like(softmax[:, :1]))
                grad[rows] = softmax.mul_(scale[rows].unsqueeze(-1))
            return grad, None, None

    return CrossEntropyOfKeptLogits


# The kept-logits loss's fp32 work at a time: a block of rows of at most this many fp32 bytes (one row at
# the least), so its temporaries stay small beside the kept 16-bit logits (a 128k vocabulary: 130 rows).
_FP32_BLOCK_BYTES = 64 * 2**20


def _row_blocks(logits: Any) -> Any:
    rows = max(1, _FP32_BLOCK_BYTES // (4 * logits.shape[-1]))
    return logits.split(rows)


class _CrossEntropyOfKeptLogits:
    """Built on first use: this module is imported without torch (the CLI's fast paths)."""

    _function: Any = None

    @classmethod
    def apply(cls, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        if cls._function is None:
            cls._function = _kept_logits_function()
        return cls._function.apply(logits, targets, ignore_index)
