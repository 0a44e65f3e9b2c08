"""bench/memory_history.py's reading of a CUDA allocator snapshot: the live blocks at the allocated peak, replayed
from the history, grouped by the frames that allocated them. The snapshots here are made by hand in the structure
``torch.cuda.memory._snapshot()`` returns (segments of blocks, per-device traces of events, frames innermost first)."""

from __future__ import annotations

from types import ModuleType

import pytest
from bench_modules import bench_module

SITE = "/usr/lib/python3.12/site-packages"
REPO = "/srv/checkout"  # where a checkout might live: the rules read the path inside it


@pytest.fixture(scope="module")
def history() -> ModuleType:
    return bench_module("memory_history")


def frame(filename: str, name: str, line: int = 1) -> dict:
    return {"filename": filename, "line": line, "name": name}


# The trial's main thread, outermost last: the child's entry under the fork server.
MAIN = [
    frame(f"{REPO}/autotune/trial/child.py", "_train"),
    frame(f"{REPO}/autotune/trial/child.py", "_run"),
    frame(f"{REPO}/autotune/trial/child.py", "main"),
    frame(f"{REPO}/autotune/trial/server.py", "_run_trial_child"),
]
STEP = [frame(f"{REPO}/autotune/trial/engine.py", "_step"), frame(f"{REPO}/autotune/trial/measure.py", "timed")]
LINEAR = [
    frame(f"{SITE}/torch/nn/modules/linear.py", "forward"),
    frame(f"{SITE}/torch/nn/modules/module.py", "_call_impl"),
]
LLAMA = [frame(f"{SITE}/transformers/models/llama/modeling_llama.py", "forward")]

BUILD = [
    frame(f"{SITE}/torch/nn/modules/module.py", "to"),
    frame(f"{REPO}/autotune/trial/engine.py", "build_engine"),
] + MAIN
ACTIVATION = LINEAR + LLAMA + STEP + MAIN
LOSS = [frame(f"{REPO}/autotune/levers/loss.py", "__call__")] + LLAMA + STEP + MAIN
OPTIMIZER = [frame(f"{SITE}/torch/optim/adamw.py", "_init_group"), frame(f"{SITE}/torch/optim/optimizer.py", "wrapper")]
OPTIMIZER += STEP + MAIN
IN_BACKWARD = [frame(f"{SITE}/bitsandbytes/optim/optimizer.py", "init_state")]
IN_BACKWARD += [frame(f"{REPO}/autotune/levers/optimizer.py", "_step_one")]  # a hook, on autograd's thread
RECOMPUTE = LINEAR + LLAMA + [frame(f"{SITE}/torch/utils/checkpoint.py", "unpack_hook")]
OFFLOAD = [frame(f"{REPO}/autotune/levers/activation_offload.py", "unpack")]
MAIN_BACKWARD = [frame(f"{SITE}/torch/autograd/graph.py", "_engine_run_backward")]
MAIN_BACKWARD += [
    frame(f"{SITE}/torch/autograd/__init__.py", "backward"),
    frame(f"{SITE}/torch/_tensor.py", "backward"),
]
MAIN_BACKWARD += STEP + MAIN


def test_each_allocation_goes_to_its_group(history):
    assert history.group_of(BUILD) == "build"
    assert history.group_of(ACTIVATION) == "forward"
    assert history.group_of(LOSS) == "loss"
    assert history.group_of(OPTIMIZER) == "optimizer"
    assert history.group_of(IN_BACKWARD) == "optimizer"
    assert history.group_of(RECOMPUTE) == "recompute"
    assert history.group_of(OFFLOAD) == "offload"
    assert history.group_of(MAIN_BACKWARD) == "backward"  # a CPU's backward runs on the calling thread
    assert history.group_of([]) == "backward"  # autograd's CUDA thread: no Python frame
    assert history.group_of([frame(f"{REPO}/autotune/trial/child.py", "_run")]) == "other"
    assert set(history.GROUPS) >= {"build", "optimizer", "forward", "loss", "backward", "other"}


def alloc(addr: int, size: int, frames: list) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames}


def free(addr: int, size: int) -> dict:
    # Recorded with context="alloc": a free carries no frames; the allocator's own free follows.
    return {"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": []}


def done(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size, "stream": 0, "frames": []}


def block(addr: int, size: int, frames: list, state: str = "active_allocated") -> dict:
    return {"address": addr, "size": size + 12, "requested_size": size, "state": state, "frames": frames}


def snapshot(trace: list, blocks: list) -> dict:
    segment = {
        "device": 0,
        "address": 0,
        "total_size": 2**30,
        "stream": 0,
        "segment_type": "large",
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": 0,
        "blocks": blocks,
    }
    return {"segments": [segment], "device_traces": [trace]}


def one_step() -> list:
    """Build (100 of parameters), a step: the forward keeps 30 and the loss 10, the backward makes 100 of gradients
    and frees the activations as it goes, the optimizer makes 200 of state; the gradients are let go of after it."""
    return [
        {"action": "segment_alloc", "addr": 0, "size": 2**30, "stream": 0, "frames": []},
        alloc(1000, 100, BUILD),
        alloc(2000, 30, ACTIVATION),
        alloc(3000, 10, LOSS),
        alloc(4000, 60, []),  # gradients, on autograd's thread
        free(3000, 10),
        done(3000, 10),
        alloc(4100, 40, []),
        free(2000, 30),
        alloc(5000, 200, OPTIMIZER),  # the peak: 100 + 60 + 40 + 200 = 400
        free(4000, 60),
        free(4100, 40),
    ]


def test_the_peak_is_replayed_from_the_history_and_split_by_group(history):
    end = [block(1000, 100, BUILD), block(5000, 200, OPTIMIZER), block(4000, 60, [], state="inactive")]
    parts = history.peak_parts(snapshot(one_step(), end))
    assert parts["peak_bytes"] == 400
    assert parts["parts"]["build"] == 100 and parts["parts"]["optimizer"] == 200 and parts["parts"]["backward"] == 100
    assert sum(parts["parts"].values()) == parts["peak_bytes"]
    assert parts["reached_by"] == "optimizer" and parts["peak_index"] == 9 and parts["blocks"] == 4


def test_a_history_that_began_late_counts_what_was_live_before_it(history):
    """A ring buffer that wrapped: the build's allocation is gone from the history (the block, live at the end,
    still holds its frames), and so is the forward's (freed inside the history: its frames are not known)."""
    trace = one_step()[3:]  # from the loss's allocation on
    end = [block(1000, 100, BUILD), block(5000, 200, OPTIMIZER)]
    parts = history.peak_parts(snapshot(trace, end))
    assert parts["start_bytes"] == 130  # the build's 100 (live to the end) and the forward's 30 (freed later)
    assert parts["peak_bytes"] == 400
    assert parts["parts"]["build"] == 100 and parts["parts"]["before the history"] == 0  # the 30 went before the peak
    # The forward's block still live at the peak: counted, its frames unknown.
    trace = [alloc(3000, 10, LOSS), alloc(4000, 60, []), free(2000, 30)]
    end = [block(1000, 100, BUILD), block(3000, 10, LOSS), block(4000, 60, [])]
    early = history.peak_parts(snapshot(trace, end))
    assert early["peak_bytes"] == 200 and early["reached_by"] == "backward"
    assert early["parts"]["before the history"] == 30 and early["parts"]["loss"] == 10


def test_the_snapshot_is_written_within_its_cap_around_the_peak(history, tmp_path):
    deep = LINEAR * 30 + ACTIVATION  # a deep stack: cut at the child's entry, and to its innermost frames
    trace = []
    for i in range(3000):
        trace.append(alloc(10_000 + i * 1000, 512, deep if i % 2 else OPTIMIZER))
    trace += [free(10_000 + i * 1000, 512) for i in range(3000)]
    snap = snapshot(trace, [block(1000, 100, BUILD)])
    parts = history.peak_parts(snap)
    path = tmp_path / "t4.pickle.gz"
    said = history.write_snapshot(snap, path, peak_index=parts["peak_index"], keep_frames=8)
    assert "every event" in said and path.stat().st_size < 15 * 2**20
    back = history.read_snapshot(path)
    assert len(back["device_traces"][0]) == len(trace)
    assert all(len(e["frames"]) <= 8 for e in back["device_traces"][0])
    assert history.peak_parts(back)["peak_bytes"] == parts["peak_bytes"]
    # Over its cap: a window of the history, the peak inside it.
    said = history.write_snapshot(snap, path, peak_index=parts["peak_index"], cap_bytes=20_000, keep_frames=8)
    assert "events " in said and " of 6,000" in said, said
    window = history.read_snapshot(path)["device_traces"][0]
    assert 1000 <= len(window) < len(trace)
    assert any(e["action"] == "alloc" and e["addr"] == trace[parts["peak_index"]]["addr"] for e in window)
