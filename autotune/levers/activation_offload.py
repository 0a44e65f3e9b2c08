"""Activation offload: the tensors the forward saves for the backward wait in pinned host memory.

Inside :func:`offload_activations`, every tensor autograd saves (an activation a layer keeps for its
backward) is copied to pinned host memory as it is saved, so the device copy is freed as soon as the
forward no longer uses it; the backward copies each back when its node runs, and drops it after. The
device then holds, beside the model states, the forward's working set and, in the backward, one node's
unpacked inputs at a time. With activation checkpointing only the checkpoints' inputs are saved (the
checkpointed layers' own tensors are recomputed), so only those move.

What stays where it is: parameters and views of them (they are on the device anyway), tensors already
off the offloaded device, and small ones (under ``min_bytes``, not worth a copy). This is
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` less its copies of the weights; torchtune's
``OffloadActivations`` is the same idea with copies overlapped on side streams.

The trial's engine runs its forward inside it on CUDA, the estimator's trace too (its host copies left
out of the device's bytes), and a user's loop the same way::

    with offload_activations():
        loss = model(**batch).loss
    loss.backward()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, a_bool

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "ActivationOffloadFields",
    "ActivationOffloadLever",
    "offload_activations",
    "offload_device_refusal",
    "ActivationOffload",
    "MIN_OFFLOAD_BYTES",
]


@dataclass(frozen=True, kw_only=True)
class ActivationOffloadFields:
    activation_offload: bool = field(
        default=False,
        metadata={
            "help": "Move the tensors the forward saves for the backward to pinned host memory and bring each "
            "back when the backward needs it (CUDA only). With checkpointing, only the checkpoints' inputs move."
        },
    )


def offload_device_refusal(device_type: str) -> str | None:
    """Why ``--activation-offload on`` means nothing on a device of ``device_type`` (None: it can run)."""
    if device_type != "cuda":
        return (
            f"--activation-offload on moves saved activations from a CUDA GPU to host memory; on a {device_type} "
            "device they are in host memory already; use --activation-offload off"
        )
    return None


class ActivationOffloadLever(Lever):
    """Applied by the trial's engine around each step (saved-tensor hooks), not to the model."""

    name = "activation_offload"
    fields = ("activation_offload",)
    flags = (Flag.on_off("activation_offload", "--activation-offload"),)
    axes = (
        Axis(
            "activation_offload",
            "a list of true/false (true: CUDA only; left out on a CPU device)",
            False,
            a_bool,
            moved_only=True,  # on a CPU device the knob stays at off: no parameter, as in spaces without it
            added_later=True,
        ),
    )

    def check(self, config: TrialConfig) -> None:
        if not isinstance(config.activation_offload, bool):
            raise ConfigError(f"--activation-offload {config.activation_offload!r} must be on or off")

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        return offload_device_refusal(device.type) if config.activation_offload else None

    def on_refusal(self, key: str, device: DeviceInfo) -> str | None:
        return offload_device_refusal(device.type)

    def labels(self, config: TrialConfig) -> list[str]:
        return ["act-offload"] if config.activation_offload else []

    def in_code(self, config: TrialConfig) -> list[str]:
        if not config.activation_offload:
            return []
        return [
            "activation offload: no library's config has it; run the forward (not the backward) inside "
            "`autotune.prepare.offload.offload_activations()`: a plain loop or a LightningModule's training_step "
            "`with offload_activations(): loss = model(**batch).loss`; the hf Trainer has no argument for it: "
            "subclass Trainer with compute_loss_context_manager returning super()'s ExitStack after "
            "stack.enter_context(offload_activations())"
        ]

    def saves_with_more_checkpointing(self, config: TrialConfig) -> bool:
        """Whether checkpointing more layers moves less to the host here: with checkpointing, only the
        checkpoints' inputs are offloaded, fewer bytes than every saved activation."""
        return config.activation_offload


MIN_OFFLOAD_BYTES = 1024  # torchtune's default: smaller saved tensors stay on the device


class ActivationOffload:
    """Saved-tensor hooks that keep ``device_type``'s saved activations in host memory between forward and
    backward. ``host``: a context under which the host copies are made (the estimator's tracker leaves them
    out of the device's bytes); ``pin_memory``: page-locked host copies (faster copies; CUDA only)."""

    def __init__(
        self,
        *,
        device_type: str = "cuda",
        pin_memory: bool = True,
        min_bytes: int = MIN_OFFLOAD_BYTES,
        host: Callable[[], ContextManager[Any]] | None = None,
    ) -> None:
        self.device_type = device_type
        self.pin_memory = pin_memory
        self.min_bytes = min_bytes
        self.host = host or contextlib.nullcontext

    def stays(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is saved as it is: off the offloaded device, small, or a parameter (or a view of one)."""
        import torch

        if tensor.device.type != self.device_type or tensor.is_sparse:
            return True
        if tensor.numel() * tensor.element_size() < self.min_bytes:
            return True
        return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)

    def pack(self, tensor: torch.Tensor) -> Any:
        if self.stays(tensor):
            return tensor
        import torch

        with self.host():
            copy = torch.empty(
                tensor.size(),
                dtype=tensor.dtype,
                layout=tensor.layout,
                device="cpu",
                pin_memory=self.pin_memory,
            )
            copy.copy_(tensor)
        return (tensor.device, copy)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        import torch

        device, copy = packed
        # A new device tensor even where the host is the traced device (the estimator's CPU trace of a CUDA
        # step): what the backward holds while this node runs. Ordered on the current stream.
        back = torch.empty(copy.size(), dtype=copy.dtype, layout=copy.layout, device=device)
        return back.copy_(copy, non_blocking=self.pin_memory)

    def hooks(self) -> ContextManager[Any]:
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def offload_activations(*, pin_memory: bool = True, min_bytes: int = MIN_OFFLOAD_BYTES) -> ContextManager[Any]:
    """Run a forward inside this: what it saves for the backward waits in (pinned) host memory. CUDA tensors
    only; the backward runs outside it, as usual."""
    return ActivationOffload(pin_memory=pin_memory, min_bytes=min_bytes).hooks()
