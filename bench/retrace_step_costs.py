"""Trace each committed grid line's step again for its operator costs alone, keeping everything else.

The step-time model reads more from a trace than the grids recorded when they were estimated (e.g. which
forward operators ran inside a checkpointed layer). The costs are deterministic, so tracing them again
changes no figure a replay measured: the line's memory estimate, its measured trial and the recorded
estimate seconds (what a replay charges) stay as they were. Lines of one trace key share one trace.

    python bench/retrace_step_costs.py bench/data/llama-tiny.jsonl [more grids...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.trace import estimate_memory, trace_key


def retrace(path: Path) -> int:
    lines = [json.loads(text) for text in path.read_text().splitlines() if text.strip()]
    traced: dict[str, dict] = {}
    changed = 0
    for line in lines:
        estimate = line.get("estimate")
        if not estimate or estimate.get("step_costs") is None:
            continue
        workload, config = Workload.from_dict(line["workload"]), TrialConfig.from_dict(line["config"])
        key = trace_key(workload, config)
        if key not in traced:
            costs = estimate_memory(workload, config).step_costs
            traced[key] = costs.to_dict() if costs is not None else None
        # ZeRO's stages of one trace keep their own per-config costs fields: only the ops and marks change.
        fresh = traced[key]
        if fresh is not None and (fresh["ops"], fresh.get("layers_marked")) != (
            estimate["step_costs"]["ops"],
            estimate["step_costs"].get("layers_marked"),
        ):
            estimate["step_costs"] = {
                **estimate["step_costs"],
                "ops": fresh["ops"],
                "layers_marked": fresh["layers_marked"],
            }
            changed += 1
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(json.dumps(line) + "\n" for line in lines))
    partial.replace(path)
    return changed


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: {retrace(Path(name))} lines' step costs traced again")
