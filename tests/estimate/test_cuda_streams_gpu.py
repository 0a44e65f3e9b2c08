"""The allocator model's streams against PyTorch's own caching allocator on a real GPU.

Marked ``gpu``: skipped on machines without CUDA. Each case runs in a fresh process so that no earlier
allocation of the test session sits in the pools being read.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.estimate.cuda_allocator import replay

pytestmark = pytest.mark.gpu

M = 2**20

# (label, size in MiB, stream: 0 default, 1 a side stream, "free") in order: what the child does and the model replays.
CASES = {
    "side stream's block not reused by the default stream": [("a", 40, 1), ("a", 0, 1), ("b", 40, 0)],
    "side stream reuses its own block": [("a", 40, 1), ("a", 0, 1), ("b", 40, 1)],
    "default stream reuses its own block": [("a", 40, 0), ("a", 0, 0), ("b", 40, 0)],
    "gradient made on the side stream, activations after it": [
        ("g", 30, 1),
        ("x", 50, 0),
        ("g", 0, 0),
        ("x", 0, 0),
        ("y", 30, 0),
        ("h", 30, 1),
    ],
}

_CHILD = """
import json, sys, torch
steps = json.loads(sys.argv[1])
side = torch.cuda.Stream()
live = {}
for label, mib, stream in steps:
    if mib == 0:
        del live[label]
        continue
    with torch.cuda.stream(side if stream else torch.cuda.current_stream()):
        live[label] = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
print(json.dumps(torch.cuda.max_memory_reserved()))
"""


@pytest.mark.parametrize("name", list(CASES))
def test_the_replay_reads_the_reserved_peak_cuda_reaches_with_two_streams(name: str) -> None:
    steps = CASES[name]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(steps)], capture_output=True, text=True, check=True, timeout=120
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    events = [(label, mib * M, stream) if stream else (label, mib * M) for label, mib, stream in steps]
    assert replay(events).peak_reserved_bytes == measured, (name, measured / M)
