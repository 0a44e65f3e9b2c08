"""`autotune find --space full` on a 32k-vocabulary Llama under a budget the standard loss cannot
meet at the larger micro batches, then the export applied to a model as a user's job applies it
(``autotune.prepare``) and trained for a few steps.

    python bench/find_full.py [--work DIR] [--out bench/results/find_full_cpu.json]

The find runs as a user runs it (a subprocess, default settings but ``--n-trials``); asking again
with the same ``--work`` directory answers from its study without a trial.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

FIND = [
    "find",
    "--model",
    "builtin:llama-tiny-32k",
    "--seq-len",
    "64",
    "--global-batch",
    "8",
    "--space",
    "full",
    "--memory-budget",
    "210MiB",
    "--n-trials",
    "24",
    "--export",
    "json",
    "-o",
    "autotune.json",
    "--json",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("find-full"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/find_full_cpu.json"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "autotune", *FIND], cwd=args.work, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"find failed ({proc.returncode}): {proc.stderr[-2000:]}")
    found = json.loads(proc.stdout)
    trained = _train_the_export(args.work / "autotune.json")
    trials = found["trials"]
    row = {
        "command": "autotune " + " ".join(FIND),
        "seconds": round(time.monotonic() - started, 1),
        "best": found["best"]["describe"],
        "best_tokens_per_s": found["best"]["tokens_per_s"],
        "best_peak_bytes": found["best"]["peak_memory_bytes"],
        "memory_limit_bytes": found["memory_limit_bytes"],
        "trials": len([t for t in trials if t["status"] not in ("skipped",)]),
        "skipped_by_the_estimator": len([t for t in trials if t["status"] == "skipped"]),
        "fitting_standard_loss": sorted(
            {t["describe"] for t in trials if t["fits"] and t["config"]["loss"] == "standard"}
        ),
        "export_trained": trained,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row, indent=1))


def _train_the_export(export: Path) -> dict:
    """A user's job: the model (random weights here), autotune.prepare with the export, AdamW,
    the exported micro batch and precision; three optimizer steps."""
    import torch

    import autotune
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.models.sources import build_model

    data = json.loads(export.read_text())
    config, workload = TrialConfig.from_dict(data["config"]), Workload.from_dict(data["workload"])
    model = autotune.prepare(build_model(workload, task="causal-lm", device=torch.device("cpu")), export)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=config.fused_optimizer or None
    )
    dtype = getattr(torch, config.autocast_type) if config.autocast_type else None
    losses = []
    for _ in range(3):
        for _ in range(data["grad_accum_steps"]):
            ids = torch.randint(0, 32000, (config.micro_batch, workload.seq_len))
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(input_ids=ids, labels=ids).loss / data["grad_accum_steps"]
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item() * data["grad_accum_steps"], 4))
    return {
        "config": config.describe(),
        "losses": losses,
        "loss_function": type(getattr(model, "get_base_model", lambda: model)().loss_function).__name__,
    }


if __name__ == "__main__":
    main()
