"""Python imports this at the start of every process of a script trial, or of ``autotune run``
(its folder leads ``PYTHONPATH``): it hands the config in ``AUTOTUNE_CONFIG`` to the script's
frameworks, installs autotune's measurement in a trial, then runs the ``sitecustomize`` this one
shadows, if the environment has one."""

import os
import sys


def _load() -> None:
    tuner = os.environ.get("AUTOTUNE_PARENT_PID")
    if tuner and tuner.isdigit() and os.getppid() != int(tuner):
        # A process the command started (torchrun's ranks): it dies with the one that started it, as
        # the command itself dies with the tuner (set before its exec: autotune.trial.runner).
        from autotune.trial.lifeline import die_with_parent

        die_with_parent()
    config = os.environ.get("AUTOTUNE_CONFIG")
    if config:
        from autotune.scripts.frameworks import install_from

        install_from(config)
    spec = os.environ.get("AUTOTUNE_SCRIPT_SPEC")
    if spec:
        from autotune.scripts.measure import install

        install(spec)
    here = os.path.dirname(os.path.abspath(__file__))
    from importlib.machinery import PathFinder

    shadowed = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if shadowed is not None and shadowed.loader is not None:
        from importlib.util import module_from_spec

        shadowed.loader.exec_module(module_from_spec(shadowed))


_load()
