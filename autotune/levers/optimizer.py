"""The optimizer a config trains with, built the same way in trials, in the estimator's trace and in users' loops.

``adamw`` is PyTorch's. ``adamw-8bit`` keeps Adam's two moments in 8 bits with a scale per block of
values: torchao's ``AdamW8bit`` (pure PyTorch, so it runs on a CPU too), else bitsandbytes'. ``adafactor``
is Transformers' own, as the Trainer's ``optim="adafactor"`` builds it (a fixed learning rate; factored
second moments: a row and a column vector per matrix, no first moment).

With ``optimizer_in_backward`` each parameter is stepped by its own optimizer in a hook that runs as
soon as its gradient is accumulated, and the gradient is freed right after (torchtune's
``optimizer_in_bwd``; PyTorch's tutorial "How to save memory by fusing the optimizer step into the
backward pass"): the whole gradient buffer never exists at once.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from autotune.errors import ConfigError
from autotune.levers.base import Axis, Flag, Lever, ModelFacts, a_bool, one_of
from autotune.levers.fsdp import fsdp_flag
from autotune.levers.zero import zero_flag

if TYPE_CHECKING:
    import torch

    from autotune.config.device import DeviceInfo
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload

__all__ = [
    "OptimizerFields",
    "OptimizerLever",
    "OPTIMIZERS",
    "EIGHT_BIT_REFUSAL",
    "eight_bit_library",
    "in_backward_refusal",
    "build_optimizer",
    "import_optimizer_module",
    "optimizer_library",
    "optimizer_line",
    "parameter_groups",
    "StepInBackward",
    "become_update_twin",
    "update_twin",
]

# adamw: PyTorch's; adamw-8bit: Adam's moments in 8 bits (torchao or bitsandbytes); adafactor: Transformers'
# (factored second moments, no first). They change the maths, like precision: searched where a space lists them.
OPTIMIZERS = ("adamw", "adamw-8bit", "adafactor")


@dataclass(frozen=True, kw_only=True)
class OptimizerFields:
    fused_optimizer: bool = field(
        default=False,
        metadata={
            "help": "AdamW with fused=True (one kernel over all parameters) instead of PyTorch's default "
            "(foreach on CUDA, a loop over the tensors on a CPU). Same maths."
        },
    )
    optimizer: str = field(
        default="adamw",
        metadata={
            "help": "adamw (PyTorch's), adamw-8bit (Adam's moments in 8 bits: torchao, or bitsandbytes) or "
            "adafactor (Transformers': factored second moments, no first). Changes the maths, like precision."
        },
    )
    optimizer_in_backward: bool = field(
        default=False,
        metadata={
            "help": "Step each parameter inside the backward as soon as its gradient is made, and free the "
            "gradient: no whole gradient buffer. One rank, no accumulation, no fp16 loss scaling."
        },
    )


def _sharded_refusal(config: TrialConfig) -> str | None:
    """Why another optimizer than PyTorch's AdamW, or one stepped in the backward, cannot run on the config's
    sharded or split model (None: the model is whole on each rank, or the optimizer is AdamW)."""
    if config.optimizer == "adamw" and not config.optimizer_in_backward:
        return None
    sharding = zero_flag(config) or fsdp_flag(config) or (config.split_flags() if config.model_parallel > 1 else None)
    if sharding is None:
        return None
    what = f"--optimizer {config.optimizer}" if config.optimizer != "adamw" else "--optimizer-in-backward on"
    why = (
        "DeepSpeed builds and steps its own optimizer over its partitions"
        if config.uses_deepspeed
        else "it steps sharded parameters (DTensors), which autotune does not measure yet"
    )
    return f"{what} with {sharding}: {why}; use --optimizer adamw without it, or drop the sharding"


def eight_bit_library() -> str | None:
    """The installed package that provides 8-bit AdamW: torchao (runs on a CPU and CUDA), else
    bitsandbytes; None when neither is installed."""
    for package in ("torchao", "bitsandbytes"):
        if importlib.util.find_spec(package) is not None:
            return package
    return None


EIGHT_BIT_REFUSAL = (
    "--optimizer adamw-8bit needs torchao (pip install torchao; it runs on a CPU too) or bitsandbytes (CUDA), "
    "and neither is installed; install one, or use adamw or adafactor"
)


def in_backward_refusal(config: TrialConfig, workload: Workload) -> str | None:
    """Why ``config`` cannot step its optimizer inside the backward for ``workload`` (None: it can)."""
    accum = config.grad_accum_steps(workload)
    if accum > 1:
        return (
            f"--optimizer-in-backward on with {accum} accumulation steps (--global-batch {workload.global_batch} / "
            f"--micro-batch {config.micro_batch}): each micro batch's backward would step the weights; "
            f"use --micro-batch {workload.global_batch // workload.nproc} (no accumulation), or turn it off"
        )
    if workload.nproc > 1:
        return (
            f"--optimizer-in-backward on with --nproc {workload.nproc}: the step would run before DDP has "
            "averaged the gradient over the ranks; use --nproc 1, or turn it off"
        )
    if config.scales_loss:
        return (
            "--optimizer-in-backward on with --precision fp16: loss scaling unscales and checks the whole "
            "gradient before stepping; use bf16 or fp32, or turn it off"
        )
    return None


class OptimizerLever(Lever):
    """Built by the trial's engine (and a user's loop) with :func:`build_optimizer`, not applied to the model."""

    name = "optimizer"
    fields = ("fused_optimizer", "optimizer", "optimizer_in_backward")
    flags = (
        Flag.on_off("fused_optimizer", "--fused-optimizer"),
        Flag("optimizer", ("--optimizer",), str, "adamw"),
        Flag.on_off("optimizer_in_backward", "--optimizer-in-backward"),
    )
    # optimizer and optimizer_in_backward are tuner parameters only where a space moves them (they came later)
    axes = (
        Axis("fused_optimizer", "a list of true/false", False, a_bool, added_later=True),
        Axis(
            "optimizer",
            f"a list of {', '.join(OPTIMIZERS)} (they change the maths, like precision)",
            "adamw",
            one_of(OPTIMIZERS),
            moved_only=True,
            added_later=True,
        ),
        Axis(
            "optimizer_in_backward",
            "a list of true/false (true: one rank, no accumulation, no fp16)",
            False,
            a_bool,
            moved_only=True,
            added_later=True,
        ),
    )

    def check(self, config: TrialConfig) -> None:
        if not isinstance(config.fused_optimizer, bool):
            raise ConfigError(f"--fused-optimizer {config.fused_optimizer!r} must be on or off")
        if config.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer {config.optimizer!r} is not known; use one of {', '.join(OPTIMIZERS)}")
        if not isinstance(config.optimizer_in_backward, bool):
            raise ConfigError(f"--optimizer-in-backward {config.optimizer_in_backward!r} must be on or off")

    def conflict(self, config: TrialConfig) -> str | None:
        if config.fused_optimizer and config.uses_deepspeed:
            return (
                "--fused-optimizer on with --zero-stage: DeepSpeed picks its own Adam kernel (fused on "
                "CUDA); use --fused-optimizer off with ZeRO"
            )
        if config.fused_optimizer and config.optimizer != "adamw":
            return (
                f"--fused-optimizer on with --optimizer {config.optimizer}: fused is PyTorch AdamW's kernel; "
                "use --fused-optimizer off"
            )
        return None

    def refusal(self, config: TrialConfig, workload: Workload, device: DeviceInfo) -> str | None:
        sharded = _sharded_refusal(config)
        if sharded is not None:
            return sharded
        if config.optimizer_in_backward:
            refusal = in_backward_refusal(config, workload)
            if refusal is not None:
                return refusal
        if config.optimizer == "adamw-8bit" and eight_bit_library() is None:
            return EIGHT_BIT_REFUSAL
        return None

    def runnable(
        self, key: str, values: tuple[Any, ...], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> tuple[Any, ...]:
        if "adamw-8bit" not in values or eight_bit_library() is not None:
            return values
        if values == ("adamw-8bit",):
            raise ConfigError(f"knobs.optimizer [adamw-8bit]: {EIGHT_BIT_REFUSAL}")
        return tuple(value for value in values if value != "adamw-8bit")

    def dropped(
        self, space: Mapping[str, tuple[Any, ...]], workload: Workload, device: DeviceInfo, facts: ModelFacts
    ) -> list[str]:
        return [EIGHT_BIT_REFUSAL] if "adamw-8bit" in space["optimizer"] and eight_bit_library() is None else []

    def labels(self, config: TrialConfig) -> list[str]:
        labels = [] if config.optimizer == "adamw" else [config.optimizer]
        if config.fused_optimizer:
            labels.append("fused-adam")
        if config.optimizer_in_backward:
            labels.append("step-in-bwd")
        return labels

    def trainer_arguments(self, config: TrialConfig) -> dict[str, Any]:
        if config.optimizer_in_backward:
            raise ConfigError(
                "--format hf: this config steps the optimizer inside backward, which the Trainer has no argument "
                "for; export --format json and build it in your loop with "
                "autotune.prepare.optimizer.build_optimizer(params, config, lr=...), or pick a config without it"
            )
        if config.uses_deepspeed:
            return {}  # DeepSpeed's optimizer block says it
        if config.optimizer == "adamw-8bit":  # the Trainer's names for the two libraries' AdamW8bit
            return {"optim": "adamw_torch_8bit" if eight_bit_library() == "torchao" else "adamw_bnb_8bit"}
        if config.optimizer == "adafactor":  # the Trainer's Adafactor: a fixed learning rate, as the trials ran
            return {"optim": "adafactor"}
        # What the trials ran (Transformers 5's default is the fused one).
        return {"optim": "adamw_torch_fused" if config.fused_optimizer else "adamw_torch"}

    def torchtitan_keys(self, config: TrialConfig, workload: Workload) -> dict[str, dict[str, Any]]:
        if config.optimizer != "adamw":
            raise ConfigError(
                f"--format torchtitan: this config steps with --optimizer {config.optimizer}, and torchtitan's "
                "optimizers are PyTorch's Adam and AdamW; pick an adamw config, or export --format json"
            )
        # PyTorch's AdamW as the trials built it: fused, or its default (foreach on CUDA); stepped in the backward,
        # one parameter at a time, with early_step_in_backward.
        keys: dict[str, Any] = {"name": "AdamW", "implementation": "fused" if config.fused_optimizer else "foreach"}
        if config.optimizer_in_backward:
            keys["early_step_in_backward"] = True
        return {"optimizer": keys}

    def header_lines(self, config: TrialConfig) -> list[str]:
        return [f"optimizer: {optimizer_line(config)}"]

    def in_code(self, config: TrialConfig) -> list[str]:
        if not config.fused_optimizer:
            return []
        return ["optimizer: torch.optim.AdamW(..., fused=True) (the hf export sets optim adamw_torch_fused)"]


def _class_and_arguments(config: TrialConfig) -> tuple[str, str]:
    """The class that steps ``config``'s parameters and the arguments beyond ``(params, lr=LR)`` it is built with."""
    if config.optimizer == "adamw-8bit":
        return ("torchao" if eight_bit_library() == "torchao" else "bitsandbytes") + ".optim.AdamW8bit", ""
    if config.optimizer == "adafactor":
        return "transformers.optimization.Adafactor", ", scale_parameter=False, relative_step=False, warmup_init=False"
    return "torch.optim.AdamW", ", fused=True" if config.fused_optimizer else ""


def import_optimizer_module(config: TrialConfig) -> None:
    """Import the module of ``config``'s optimizer class (Transformers' Adafactor pulls in PEFT and bitsandbytes:
    1.4 s of a forked trace on a 2-core CPU), quietly: what a server that forks trials or estimates does once,
    where every fork would import it again. Building the optimizer says what is missing."""
    if config.uses_deepspeed:
        return
    with contextlib.suppress(ImportError):
        importlib.import_module(_class_and_arguments(config)[0].rpartition(".")[0])


def optimizer_library(config: TrialConfig) -> str:
    """Which class steps ``config``'s parameters, as the trial result names it."""
    if config.uses_deepspeed:
        return "DeepSpeed's Adam (its config's optimizer block)"
    name, arguments = _class_and_arguments(config)
    name += " (fused)" if config.fused_optimizer else ""
    return name + (", stepped inside backward" if config.optimizer_in_backward else "")


def optimizer_line(config: TrialConfig) -> str:
    """The optimizer as a training loop (or a LightningModule's ``configure_optimizers``) constructs it."""
    if config.uses_deepspeed:
        return "DeepSpeed's, from its config (the optimizer block of the DeepSpeed JSON)"
    name, arguments = _class_and_arguments(config)
    made = f"{name}(params, lr=LR{arguments})"
    if config.optimizer_in_backward:
        return (
            f"{made}, one per parameter, stepped inside backward: "
            "autotune.prepare.optimizer.build_optimizer(params, config, lr=LR) builds them and their hooks"
        )
    return made


def build_optimizer(params: Iterable[torch.nn.Parameter], config: TrialConfig, *, lr: float) -> Any:
    """``config``'s optimizer over ``params`` (an optimizer, or :class:`StepInBackward` holding one per
    parameter). Weight decay is 0, as in the trials; a user's loop sets its own."""
    params = list(params)
    if config.optimizer_in_backward:
        return StepInBackward(params, lambda p: _one_optimizer([p], config, lr=lr))
    return _one_optimizer(params, config, lr=lr)


def parameter_groups(params: list[torch.nn.Parameter]) -> list[Any]:
    """``params`` as the optimizer's groups: tensor-parallel layers' DTensors apart from the whole (plain)
    weights beside them, since a foreach or fused step runs over one group's tensors at once and cannot mix
    the two kinds. One group where there is one kind."""
    from torch.distributed.tensor import DTensor

    split = [p for p in params if isinstance(p, DTensor)]
    whole = [p for p in params if not isinstance(p, DTensor)]
    return [{"params": split}, {"params": whole}] if split and whole else params


def update_twin(config: TrialConfig) -> TrialConfig | None:
    """The config whose step is ``config``'s up to the update: unfused AdamW's twin is fused AdamW. Both make the
    same moments by the same code and run the same forwards and backwards; only the update's kernel differs.
    (Not the other way: fused AdamW keeps each parameter's step count on the device, where the unfused update
    cannot read it.) None where ``config`` has no such twin: another optimizer, fused already, stepped inside
    backward (its updates are the backward's), or under ZeRO (DeepSpeed keeps its own Adam)."""
    if config.optimizer != "adamw" or config.optimizer_in_backward or config.fused_optimizer:
        return None
    try:
        return config.replace(fused_optimizer=True)
    except ConfigError:
        return None


def become_update_twin(optimizer: Any, twin: TrialConfig) -> None:
    """Make ``optimizer``, built for the config whose :func:`update_twin` is ``twin``, step as ``twin``'s steps
    from here on: its groups fused, as :func:`_one_optimizer` builds them."""
    assert twin.fused_optimizer
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, None


def _one_optimizer(params: list[torch.nn.Parameter], config: TrialConfig, *, lr: float) -> Any:
    import torch

    if config.optimizer == "adamw":
        # fused=None leaves PyTorch's default (foreach on CUDA, a per-tensor loop on a CPU)
        fused = True if config.fused_optimizer else None
        return torch.optim.AdamW(parameter_groups(params), lr=lr, weight_decay=0.0, fused=fused)
    if config.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # The Trainer's optim="adafactor": a fixed learning rate, not Adafactor's relative step.
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    library = eight_bit_library()
    if library == "torchao":
        return _torchao_adamw_8bit()(params, lr=lr, weight_decay=0.0)
    if library == "bitsandbytes":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=0.0)
    raise ConfigError(EIGHT_BIT_REFUSAL)


def _torchao_adamw_8bit() -> type:
    """torchao's AdamW8bit, stepping eagerly where a dispatch mode is active. torchao compiles its
    per-parameter step with ``fullgraph=True``, and TorchDynamo does not compile under a dispatch mode:
    the CPU trial's memory tracker and the estimator's fake tensors are both one. The maths is the same
    function, uncompiled; on CUDA trials (no mode) it compiles as in users' jobs."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode
    from torchao.optim import AdamW8bit
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    with _disable_current_modes():  # its 256-value code tables, made (and cached) from real values
        get_qmap_signed(), get_qmap_unsigned()

    class AdamW8bitUnderDispatchModes(AdamW8bit):  # type: ignore[misc]
        def step(self, closure: Any = None) -> Any:
            if _get_current_dispatch_mode() is None:
                return super().step(closure)
            with _compile_is_the_function():
                return super().step(closure)

    return AdamW8bitUnderDispatchModes


@contextlib.contextmanager
def _compile_is_the_function() -> Iterator[None]:
    import torch

    compile_ = torch.compile
    torch.compile = lambda model=None, **_: model
    try:
        yield
    finally:
        torch.compile = compile_


class StepInBackward:
    """One optimizer per parameter, each stepped (and its gradient freed) by a post-accumulate-grad hook
    as soon as the backward has made that gradient.

    It reads as one optimizer: ``state`` and ``param_groups`` are all of theirs, and ``step()`` steps the
    parameters that still hold a gradient (none after a backward; the estimator sets gradients by hand to
    make the state), so a training loop's ``optimizer.step(); optimizer.zero_grad()`` stays as it was.
    """

    def __init__(self, params: list[torch.nn.Parameter], make: Any) -> None:
        self.optimizers = {p: make(p) for p in params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._step_one)

    def _step_one(self, param: torch.nn.Parameter) -> None:
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for optimizer in self.optimizers.values() for p, s in optimizer.state.items()}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def step(self, closure: Any = None) -> None:
        for param in self.optimizers:
            if param.grad is not None:
                self._step_one(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)
