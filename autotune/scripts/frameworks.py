"""Inside each process of a script trial: the trial's config handed to the script's framework
through what that framework already reads, so the script runs unchanged.

- Transformers' ``Trainer``: every ``TrainingArguments`` the script builds gets the trial's values
  (micro batch, accumulation, bf16/fp16, activation checkpointing, optim, torch_compile, DeepSpeed)
  before its own checks run: the keyword arguments the ``hf`` export writes
  (:func:`autotune.prepare.training_args.trainer_arguments`).
- Lightning: every ``Trainer`` the script builds gets the trial's precision and gradient
  accumulation (:func:`autotune.prepare.training_args.lightning_arguments`) over the script's own,
  and on CUDA a ZeRO config's ``DeepSpeedStrategy`` (Lightning runs DeepSpeed on CUDA only).
  Its micro batch is the script's DataLoader's: the script reads it from ``AUTOTUNE_CONFIG``.
- Accelerate: every ``Accelerator`` gets the trial's mixed precision and gradient accumulation
  (:func:`autotune.prepare.training_args.accelerate_arguments`) over the script's own and its
  ``ACCELERATE_*`` environment, and a ZeRO config's ``DeepSpeedPlugin``; the micro batch is the
  script's DataLoader's, as for Lightning.
- Any loop: each ``DataLoader``'s batch size is noted, so that a script that batches otherwise
  than the injected micro batch is reported instead of measured as the wrong config.
- DeepSpeed: each engine the script builds (itself, or through its framework) is counted, so that
  a ZeRO config trained without DeepSpeed is reported instead of measured as ZeRO.

Nothing is imported early: each hook waits for the script to import its framework.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable

__all__ = ["FrameworkHooks", "install_from", "installed"]

_INSTALLED: FrameworkHooks | None = None


def install_from(config_path: str) -> FrameworkHooks:
    """Hand the frameworks what the ``AUTOTUNE_CONFIG`` file at ``config_path`` says (once a process)."""
    import json

    global _INSTALLED
    if _INSTALLED is None:
        with open(config_path) as file:
            given = json.load(file).get("frameworks") or {}
        _INSTALLED = FrameworkHooks(
            given.get("transformers") or {}, given.get("lightning") or {}, given.get("accelerate") or {}
        )
        _INSTALLED.install()
    return _INSTALLED


def installed() -> FrameworkHooks | None:
    """The hooks this process installed, if any."""
    return _INSTALLED


class FrameworkHooks:
    """What the script's frameworks were given and what the script asked of them."""

    def __init__(
        self, trainer_args: dict[str, Any], lightning_args: dict[str, Any], accelerate_args: dict[str, Any]
    ) -> None:
        self.trainer_args = trainer_args
        self.lightning_args = lightning_args
        self.accelerate_args = accelerate_args
        self.trainer_args_applied = False  # a TrainingArguments was built with them
        self.lightning_args_applied = False  # a Lightning Trainer was built with them
        self.loader_batches: list[int] = []  # DataLoader batch sizes, in order of creation
        self.deepspeed_engines = 0  # DeepSpeed engines built (a ZeRO config needs one)

    def install(self) -> None:
        after_import(
            "transformers.training_args",
            lambda module: _wrap(module.TrainingArguments, "__post_init__", before=self._training_arguments),
        )
        for package in ("lightning.pytorch", "pytorch_lightning"):  # the unified package and the old name
            after_import(
                f"{package}.trainer.trainer",
                lambda module: _wrap(module.Trainer, "__init__", before=self._lightning_trainer),
            )
        after_import(
            "accelerate.accelerator", lambda module: _wrap(module.Accelerator, "__init__", before=self._accelerator)
        )
        after_import(
            "torch.utils.data.dataloader", lambda module: _wrap(module.DataLoader, "__init__", after=self._data_loader)
        )
        after_import(
            "deepspeed.runtime.engine",
            lambda module: _wrap(module.DeepSpeedEngine, "__init__", after=self._deepspeed_engine),
        )

    def _training_arguments(self, arguments: Any, kwargs: dict[str, Any]) -> None:
        for name, value in self.trainer_args.items():  # before TrainingArguments checks its own values
            setattr(arguments, name, value)
        self.trainer_args_applied = True

    def _lightning_trainer(self, trainer: Any, kwargs: dict[str, Any]) -> None:
        kwargs.update(self.lightning_args)  # over the script's own and PL_TRAINER_* defaults
        strategy = kwargs.get("strategy")
        if isinstance(strategy, dict):  # LightningCLI's class_path form (a ZeRO config's DeepSpeedStrategy)
            import importlib

            module, _, name = strategy["class_path"].rpartition(".")
            kwargs["strategy"] = getattr(importlib.import_module(module), name)(**strategy["init_args"])
        self.lightning_args_applied = True

    def _accelerator(self, accelerator: Any, kwargs: dict[str, Any]) -> None:
        if self.trainer_args_applied or self.lightning_args_applied:
            return  # a Trainer (or Lightning) builds its own Accelerator from the arguments it was given
        overrides = dict(self.accelerate_args)
        if "gradient_accumulation_plugin" in kwargs:  # Accelerate takes one or the other
            kwargs["gradient_accumulation_plugin"].num_steps = overrides.pop("gradient_accumulation_steps")
        plugin = overrides.pop("deepspeed_plugin", None)
        if plugin is not None:  # ZeRO: the plugin `accelerate launch` builds from the accelerate export
            from accelerate.utils import DeepSpeedPlugin

            kwargs.pop("deepspeed_plugins", None)  # Accelerate takes one or the other
            kwargs["deepspeed_plugin"] = DeepSpeedPlugin(**plugin)
        kwargs.update(overrides)

    def _data_loader(self, loader: Any) -> None:
        if loader.batch_size is not None:  # None: the script batches with its own sampler
            self.loader_batches.append(loader.batch_size)

    def _deepspeed_engine(self, engine: Any) -> None:
        self.deepspeed_engines += 1

    def ignored_zero(self, zero_stage: int | None) -> str | None:
        """Why a ZeRO config was not what the measured steps trained, or None."""
        if zero_stage is not None and not self.deepspeed_engines:
            if self.lightning_args_applied and "strategy" not in self.lightning_args:
                return (
                    f"the script trained without DeepSpeed: --zero-stage {zero_stage} was not applied; "
                    "Lightning runs DeepSpeed on CUDA GPUs only (its DeepSpeedStrategy is given on CUDA)"
                )
            return (
                f"the script trained without DeepSpeed: --zero-stage {zero_stage} was not applied; let a "
                "Transformers Trainer take it from its arguments or an Accelerator from its plugin (through "
                "accelerator.prepare), or build the engine with deepspeed.initialize at the stage "
                "autotune.current_config().zero_stage names"
            )
        return None

    def ignored_micro_batch(self, micro_batch: int) -> str | None:
        """Why the measured steps were not of ``micro_batch`` samples per micro-step, or None."""
        if self.loader_batches and micro_batch not in self.loader_batches:
            sizes = ", ".join(str(size) for size in dict.fromkeys(self.loader_batches))
            return (
                f"the script ignored the injected micro batch: its DataLoader batches {sizes} samples, the "
                f"config's micro batch is {micro_batch}; read it from AUTOTUNE_CONFIG "
                "(autotune.current_config().micro_batch) or let the Trainer batch"
            )
        return None


def _wrap(
    cls: type,
    method: str,
    *,
    before: Callable[[Any, dict[str, Any]], None] | None = None,
    after: Callable[[Any], None] | None = None,
) -> None:
    """Replace ``cls.method`` with one that calls ``before(instance, kwargs)`` (which may change the
    keyword arguments) and ``after(instance)`` around the original. Arguments the script passed by
    position are handed over by name, so ``before`` overrides them too (``Accelerator(True, False,
    "no")``). ``functools.wraps`` keeps the original's signature visible: Lightning reads its
    Trainer's to apply PL_TRAINER_* defaults."""
    import functools
    import inspect

    original = getattr(cls, method)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            if args:
                args, kwargs = _by_name(signature, self, args, kwargs)
            before(self, kwargs)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self)
        return result

    setattr(cls, method, wrapped)


def _by_name(
    signature: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every positional argument moved to ``kwargs`` by its name; left
    as they are where a parameter cannot be named (positional-only, ``*args``)."""
    import inspect

    kinds = [parameter.kind for parameter in list(signature.parameters.values())[1:]]  # after the instance
    if inspect.Parameter.POSITIONAL_ONLY in kinds or inspect.Parameter.VAR_POSITIONAL in kinds:
        return args, kwargs
    bound = signature.bind(instance, *args, **kwargs)
    named: dict[str, Any] = {}
    for name, value in list(bound.arguments.items())[1:]:
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return (), named


def after_import(name: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(module)`` once module ``name`` has been imported (now, if it already is)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader of one module to run a callback after it executes."""

    def __init__(self, name: str, callback: Callable[[Any], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once
        spec = None
        for finder in sys.meta_path:  # as the import system asks them (an editable install has its own)
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback = spec.loader, self.callback
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            callback(module)

        loader.exec_module = exec_module  # this spec's own loader object: no other module is touched
        return spec
