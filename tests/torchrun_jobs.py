"""A user's job under torchrun on CPU ranks, as the export tests run one: ``job.py`` in a folder, each rank
writing what it found to ``result-RANK.json`` there (one file per rank: two ranks' printed lines interleave)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_job(folder: Path, *args: str, ranks: int = 2) -> list[Any]:
    """Run ``folder/job.py ARGS`` under torchrun with ``ranks`` ranks, in ``folder``; every rank's result."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "job.py", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((folder / f"result-{rank}.json").read_text()) for rank in range(ranks)]
