"""bench/gpu_readings.py, the GPU benchmarks' nvidia-smi readings, against a stand-in nvidia-smi on PATH: a real
process that prints a reading every interval until it is terminated, as the card's tool does."""

from __future__ import annotations

import sys
import time

import pytest
from bench_modules import bench_module

# Prints "<n>, 300.5" (n counting up) once, or every -lms milliseconds until terminated; flushes each line.
FAKE = """#!{python}
import sys, time
every = sys.argv[sys.argv.index("-lms") + 1] if "-lms" in sys.argv else None
n = 1000
while True:
    print(f"{{n}}, 300.5", flush=True)
    if every is None:
        break
    n += 1
    time.sleep(int(every) / 1000)
"""


@pytest.fixture
def readings(tmp_path, monkeypatch):
    tool = tmp_path / "nvidia-smi"
    tool.write_text(FAKE.format(python=sys.executable))
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))  # the stand-in alone: its first line names this interpreter
    return bench_module("gpu_readings")


def test_readings_taken_while_a_block_runs_are_each_field_in_order(readings):
    assert readings.read_now(["memory.used", "power.draw"]) == [1000.0, 300.5]
    with readings.Readings(["memory.used", "power.draw"], 20) as read:
        time.sleep(0.5)
    used = read.column("memory.used")
    assert len(used) >= 3 and used == sorted(used) and used[0] == 1000.0
    assert set(read.column("power.draw")) == {300.5}


def test_without_nvidia_smi_or_when_disabled_there_are_no_readings(readings, monkeypatch, tmp_path):
    with readings.Readings(["memory.used"], 20, enabled=False) as read:
        time.sleep(0.1)
    assert read.rows == []
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert readings.read_now(["memory.used"]) is None
    with readings.Readings(["memory.used"], 20) as read:
        pass
    assert read.rows == []
