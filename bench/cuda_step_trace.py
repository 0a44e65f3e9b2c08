"""On a GPU: every allocation and free of three training steps of one config, as the caching allocator saw them,
with what ``max_memory_allocated`` and ``max_memory_reserved`` read after them. The suite replays these files
without a GPU (``tests/estimate/test_cuda_traces.py``): the allocator's model against the real events, and the
estimator's reserve against the real peak.

    python bench/cuda_step_trace.py builtin:gpt2 '{"micro_batch": 4, "precision": "bf16"}' gpt2_mb4_bf16
    # writes tests/data/cuda_traces/gpt2_mb4_bf16.json.gz

The committed traces come from an NVIDIA H200 with torch 2.11.0+cu130 (seq 512, global batch = micro batch).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3  # the first makes the optimizer's state; the second and third reuse (or not) what the first cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an autotune --model (builtin:NAME or a config.json)")
    parser.add_argument("config", help="the TrialConfig's fields as JSON")
    parser.add_argument("name", help="the file's name in tests/data/cuda_traces (no suffix)")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    import torch

    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.models.sources import resolve_task
    from autotune.trial.engine import build_engine

    if not torch.cuda.is_available():
        raise SystemExit("cuda_step_trace.py: no CUDA device is visible (run it on a GPU machine)")
    fields = json.loads(args.config)
    config = TrialConfig(**fields)
    workload = Workload(model=args.model, seq_len=args.seq_len, global_batch=config.micro_batch, device="cuda")
    # From before the model is built: the trace holds every storage the process makes. No stacks: sizes only.
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)
    engine = build_engine(
        workload=workload, config=config, task=resolve_task(workload), device=torch.device("cuda"), world_size=1
    )
    for _ in range(STEPS):
        engine.step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    events = snapshot["device_traces"][torch.cuda.current_device()]
    if any(e["action"] == "alloc" and e["stream"] != 0 for e in events):
        raise SystemExit("cuda_step_trace.py: an allocation on a side stream: the file format has no stream yet")
    trace = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "config": fields,
        "seq_len": args.seq_len,
        "steps": STEPS,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        # "a": allocated, "f": freed (free_requested: the block is the allocator's again from here)
        "events": [
            ["a" if e["action"] == "alloc" else "f", e["addr"], e["size"]]
            for e in events
            if e["action"] in ("alloc", "free_requested")
        ],
    }
    out = ROOT / "tests" / "data" / "cuda_traces" / f"{args.name}.json.gz"
    with gzip.open(out, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))
    print(f"{out.relative_to(ROOT)}: {len(trace['events'])} events, reserved {trace['max_memory_reserved']:,} B")


if __name__ == "__main__":
    main()
