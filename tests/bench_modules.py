"""A bench script's module, imported as a test reads it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def bench_module(name: str) -> ModuleType:
    """``bench/NAME.py``, imported with bench/ on the path while it loads (its imports of its siblings), and off it
    after, so that no other test imports a bench file by a name it means for something else."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
