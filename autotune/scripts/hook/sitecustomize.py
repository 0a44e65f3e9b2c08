"""Python imports this at the start of every process of a script trial, or of ``autotune run``
(its folder leads ``PYTHONPATH``): it hands the config in ``AUTOTUNE_CONFIG`` to the script's
frameworks, installs autotune's measurement in a trial, then runs the ``sitecustomize`` this one
shadows, if the environment has one."""

import os
import sys


def _load() -> None:
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
