"""A trial's CUDA allocator history (``AUTOTUNE_CUDA_MEMORY_HISTORY``, see ``autotune.trial.memory``), read part by
part: which blocks were live at the allocated peak, grouped by the Python frames that allocated them.

The snapshot is ``torch.cuda.memory._snapshot()``'s dict: ``segments`` (the allocator's state when it was taken: each
segment's ``blocks``, each with ``address``, ``size``, ``requested_size``, ``state`` and the ``frames`` of the block's
allocation) and ``device_traces`` (per device, the history in time order: ``action`` alloc / free_requested /
free_completed / segment_alloc / segment_free / oom / snapshot, with ``addr``, ``size`` (the requested bytes),
``stream`` and an allocation's ``frames``, innermost first). ``max_memory_allocated`` counts a block from its
allocation to its free request: so does the replay here, in requested bytes (a little under the allocator's rounded
blocks).

The live blocks at the peak go to the first group whose test their frames pass, in this order (the frames are the
allocating thread's Python frames; autograd runs a CUDA backward on a thread of its own, whose allocations carry no
Python frame unless Python code ran there: a hook, checkpointing's recomputation, a custom Function's backward):

* ``optimizer``: under the optimizer's code (torch.optim, bitsandbytes, torchao, Transformers' Adafactor, autotune's
  step inside the backward): its state, and the step's temporaries when the peak falls in a step;
* ``build``: under ``build_engine``: parameters, buffers, the batch (a quantized base's weights too);
* ``offload``: activation offload's copies brought back for the backward;
* ``recompute``: checkpointing's recomputation (torch/utils/checkpoint.py), in the backward;
* ``loss``: under the loss code (autotune's chunked losses, Transformers' loss, cross_entropy): logits' slices and
  the loss (the whole model's logits come from its LM head, in ``forward``);
* ``backward``: under ``Tensor.backward``, or on autograd's own thread (no frame of the trial's main thread):
  gradients and the backward's buffers;
* ``forward``: the rest of a training step (the forward): activations kept for the backward and its temporaries;
* ``other``: anything else; ``before the history``: blocks allocated before the history's first event (a ring
  buffer that wrapped), whose frames are not known.

Under ``torch.compile`` the compiled graph's frames stand for the model's and the loss's code: a compiled forward's
allocations group as ``forward``, its backward's as ``backward``.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Any

GROUPS = ("build", "optimizer", "forward", "loss", "recompute", "offload", "backward", "other", "before the history")
_OPTIMIZER = ("/torch/optim/", "/bitsandbytes/optim/", "/torchao/optim/", "/transformers/optimization.py")
_LOSS_FILES = ("/autotune/levers/loss.py", "/transformers/loss/")
_MAIN_THREAD = ("/autotune/trial/child.py", "/autotune/trial/engine.py")


def group_of(frames: list[dict[str, Any]]) -> str:
    """The group of an allocation made under ``frames`` (innermost first), by the rules of the module's docstring."""
    at = [(str(f.get("filename", "")), str(f.get("name", ""))) for f in frames]

    def under(*files: str, name: str | None = None) -> bool:
        return any(any(part in file for part in files) and (name is None or fn == name) for file, fn in at)

    if under(*_OPTIMIZER) or under("/autotune/levers/optimizer.py", name="_step_one"):
        return "optimizer"
    if under("/autotune/trial/engine.py", name="build_engine"):
        return "build"
    if under("/autotune/levers/activation_offload.py"):
        return "offload"
    if under("/torch/utils/checkpoint.py"):
        return "recompute"
    if under(*_LOSS_FILES) or under("/torch/nn/functional.py", name="cross_entropy"):
        return "loss"
    main_thread = under(*_MAIN_THREAD)
    if not main_thread or under("/torch/_tensor.py", name="backward") or under("/torch/autograd/", name="backward"):
        return "backward"
    if under("/autotune/trial/engine.py"):
        return "forward"
    return "other"


def _busiest(traces: list[list[dict[str, Any]]]) -> int:
    """The device the trial ran on: the one with the longest history (0 where none has one)."""
    return max(range(len(traces)), key=lambda i: len(traces[i])) if traces else 0


def _trace(snapshot: dict[str, Any], device: int | None) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces") or []
    device = _busiest(traces) if device is None else device
    return list(traces[device]) if device < len(traces) else []


def _start_state(snapshot: dict[str, Any], trace: list[dict[str, Any]]) -> dict[int, tuple[int, str]]:
    """The blocks live before the history's first event, each (requested bytes, group): those whose first event is
    a free (allocated before it began: frames unknown), and those live at the end that no event touched."""
    first: dict[int, str] = {}
    touched: set[int] = set()
    for entry in trace:
        if entry.get("action") in ("alloc", "free_requested"):
            first.setdefault(entry["addr"], entry["action"])
            touched.add(entry["addr"])
    live = {addr: (0, "before the history") for addr, action in first.items() if action == "free_requested"}
    for entry in trace:
        if entry.get("action") == "free_requested" and entry["addr"] in live and not live[entry["addr"]][0]:
            live[entry["addr"]] = (int(entry["size"]), "before the history")
    for segment in snapshot.get("segments") or []:
        for block in segment.get("blocks") or []:
            if block.get("state") == "active_allocated" and block["address"] not in touched:
                size = int(block.get("requested_size", block["size"]))
                live[block["address"]] = (size, group_of(block.get("frames") or []))
    return live


def peak_parts(snapshot: dict[str, Any], device: int | None = None) -> dict[str, Any]:
    """The allocated peak of the history, replayed, and its parts: the live blocks' bytes by group (``GROUPS``).

    Returns ``peak_bytes``, ``parts`` (group -> bytes, every group, summing to the peak), ``peak_index`` (the event
    that reached it; -1: the history never rose above its start), ``reached_by`` (that allocation's group),
    ``events`` (the history's length) and ``blocks`` (live at the peak)."""
    trace = _trace(snapshot, device)
    live = _start_state(snapshot, trace)
    start = total = peak = sum(size for size, _ in live.values())
    peak_index = -1
    sizes: dict[int, int] = {addr: size for addr, (size, _) in live.items()}
    for index, entry in enumerate(trace):  # first pass: where the peak is
        action = entry.get("action")
        if action == "alloc":
            sizes[entry["addr"]] = int(entry["size"])
            total += int(entry["size"])
        elif action == "free_requested":
            total -= sizes.pop(entry["addr"], int(entry["size"]))
        if total > peak:
            peak, peak_index = total, index
    made: dict[int, int] = {}  # address -> the index of the alloc that made what lives there at the peak
    for index, entry in enumerate(trace[: peak_index + 1]):  # second pass: what was live there
        action = entry.get("action")
        if action == "alloc":
            made[entry["addr"]] = index
        elif action == "free_requested":
            live.pop(entry["addr"], None)
            made.pop(entry["addr"], None)
    for addr, index in made.items():  # grouped once each: the frames are read for the live blocks alone
        live[addr] = (int(trace[index]["size"]), group_of(trace[index].get("frames") or []))
    reached_by = live[trace[peak_index]["addr"]][1] if peak_index >= 0 else None
    parts = dict.fromkeys(GROUPS, 0)
    for size, group in live.values():
        parts[group] += size
    return {
        "peak_bytes": peak,
        "start_bytes": start,
        "parts": parts,
        "peak_index": peak_index,
        "reached_by": reached_by,
        "events": len(trace),
        "blocks": len(live),
    }


def _cut(frames: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """``frames`` without what lies outside the trial's own code (the fork server, the child's entry: the same in
    every stack), at most ``keep`` of them, innermost first."""
    for index, frame in enumerate(frames):
        if "/autotune/trial/child.py" in str(frame.get("filename", "")):
            frames = frames[: index + 1]
            break
    return [dict(frame) for frame in frames[:keep]]


def write_snapshot(
    snapshot: dict[str, Any], path: Path, *, peak_index: int, cap_bytes: int = 15 * 2**20, keep_frames: int = 32
) -> str:
    """``snapshot`` gzipped at ``path``, within ``cap_bytes`` (what a lent machine's results may bring back): each
    stack cut to the trial's own frames (at most ``keep_frames``), and where that is still too large, only a window
    of the history around ``peak_index`` (three quarters before it). pytorch.org/memory_viz opens it gunzipped.
    Returns what was kept, in words."""
    traces = snapshot.get("device_traces") or []
    device = _busiest(traces)
    trace = [
        {**e, "frames": _cut(e.get("frames") or [], keep_frames)} if e.get("frames") else e
        for e in (traces[device] if traces else [])
    ]
    segments = [
        {**s, "blocks": [{**b, "frames": _cut(b.get("frames") or [], keep_frames)} for b in s.get("blocks") or []]}
        for s in snapshot.get("segments") or []
    ]

    def dump(first: int, last: int) -> int:
        kept = [list(t) if i != device else trace[first:last] for i, t in enumerate(traces)] or [[]]
        data = gzip.compress(pickle.dumps({"segments": segments, "device_traces": kept}, protocol=4), compresslevel=6)
        path.write_bytes(data)
        return len(data)

    window = len(trace)
    while True:
        first = max(0, min(peak_index - window * 3 // 4, len(trace) - window))
        written = dump(first, first + window)
        if written <= cap_bytes or window <= 1000:
            break
        window = max(1000, int(window * cap_bytes / written * 0.8))
    kept = "every event" if window >= len(trace) else f"events {first:,}-{first + window:,} of {len(trace):,}"
    return f"{path.name} ({written / 2**20:.1f} MiB: {kept}, stacks cut to the trial's own {keep_frames} frames)"


def read_snapshot(path: Path) -> dict[str, Any]:
    """A snapshot as ``torch.cuda.memory._dump_snapshot`` wrote it (or as :func:`write_snapshot` did: gzipped)."""
    data = path.read_bytes()
    return pickle.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)  # noqa: S301 - our own file
