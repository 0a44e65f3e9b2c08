"""nvidia-smi's readings of the first lent GPU, for the GPU benchmarks: one reading now, or readings taken in the
background while something runs (``--query-gpu`` fields, as numbers). Nothing where nvidia-smi is not there."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any


def read_now(fields: list[str]) -> list[float] | None:
    """One reading of ``fields`` (e.g. ``["memory.used"]``); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", *_query(fields)], capture_output=True, text=True)
    rows = _rows(done.stdout)
    return rows[0] if rows else None


class Readings:
    """``fields`` read every ``every_ms`` while the ``with`` block runs; ``rows`` holds them after it (none where
    nvidia-smi is not there, or ``enabled`` is false)."""

    def __init__(self, fields: list[str], every_ms: int, *, enabled: bool = True) -> None:
        self.fields, self.every_ms = fields, every_ms
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.rows: list[list[float]] = []
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Readings:
        if self.enabled:
            self._process = subprocess.Popen(
                ["nvidia-smi", *_query(self.fields), "-lms", str(self.every_ms)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._process is None:
            return
        self._process.terminate()
        out, _ = self._process.communicate(timeout=10)
        self.rows = _rows(out)

    def column(self, field: str) -> list[float]:
        return [row[self.fields.index(field)] for row in self.rows]


def _query(fields: list[str]) -> list[str]:
    return [f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def _rows(out: str) -> list[list[float]]:
    rows = []
    for line in out.splitlines():
        try:
            rows.append([float(v) for v in line.split(",")])
        except ValueError:  # a line cut short by the terminate, or "[N/A]"
            continue
    return rows
