"""`autotune find --nproc 2` on a 16-layer Llama with the sharding space, then its export trained
by a user's job under torchrun (2 gloo ranks).

    python bench/find_sharded.py [--work DIR] [--out bench/results/find_sharded_cpu.json]

Two questions about ``bench/data/llama-deep16.json`` (28.9M parameters, 110 MiB of fp32 weights):

* full fine-tuning under 320 MiB a rank (``--space sharding``): DDP needs the whole model, its
  gradients and Adam states on each rank, which does not fit;
* LoRA under 96 MiB a rank (``bench/spaces/sharding_lora.yaml``), less than the model's own fp32
  weights: only a config that shards the frozen base can fit. (Full fine-tuning cannot fit there
  on 2 ranks: sharded fp32 gradients and Adam states alone are 8 bytes a parameter.)

Each find runs as a user runs it (a subprocess); the answer is exported as JSON and applied to a
model by a job under torchrun: ``autotune.prepare`` for FSDP (Accelerate and Lightning do not run
FSDP on a CPU), DeepSpeed's own engine with the ``deepspeed`` export for ZeRO.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

MODEL = str(Path("bench/data/llama-deep16.json").resolve())
COMMON = [
    "find",
    "--model",
    MODEL,
    "--seq-len",
    "16",
    "--global-batch",
    "4",
    "--nproc",
    "2",
    "--steps",
    "2",
    "--n-trials",
    "12",
    "--export",
    "json",
    "-o",
    "autotune.json",
    "--json",
]
QUESTIONS = {
    "full fine-tuning": ["--space", "sharding", "--memory-budget", "320MiB"],
    "lora": ["--space", str(Path("bench/spaces/sharding_lora.yaml").resolve()), "--memory-budget", "96MiB"],
}

# A user's job: the model, the export applied, three optimizer steps on each of 2 ranks.
_JOB = textwrap.dedent("""
    import json, math, sys
    import torch, torch.distributed as dist
    import autotune
    from autotune.config.knobs import TrialConfig
    from autotune.config.workload import Workload
    from autotune.models.sources import build_model

    dist.init_process_group("gloo")
    data = json.load(open(sys.argv[1]))
    config, workload = TrialConfig.from_dict(data["config"]), Workload.from_dict(data["workload"])
    model = autotune.prepare(build_model(workload, task="causal-lm", device=torch.device("cpu")), sys.argv[1])
    params = [p for p in model.parameters() if p.requires_grad]
    if config.uses_deepspeed:
        import deepspeed
        from autotune.output.exporters import export_config
        ds = json.loads(export_config(config, workload, fmt="deepspeed", device_type="cpu"))
        model, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-4)
    dtype = getattr(torch, config.autocast_type) if config.autocast_type and not config.uses_deepspeed else None
    losses = []
    for _ in range(3):
        for _ in range(data["grad_accum_steps"]):
            ids = torch.randint(0, 1000, (config.micro_batch, workload.seq_len))
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = model(input_ids=ids, labels=ids).loss
            if config.uses_deepspeed:
                model.backward(loss)
                model.step()
            else:
                (loss / data["grad_accum_steps"]).backward()
        if not config.uses_deepspeed:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"config": config.describe(), "losses": losses,
                                      "finite": all(map(math.isfinite, losses)), "wrapper": type(model).__name__}))
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("find-sharded"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/find_sharded_cpu.json"))
    args = parser.parse_args()
    rows = []
    for name, flags in QUESTIONS.items():
        work = args.work / name.replace(" ", "-")
        work.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        command = [*COMMON, *flags]
        proc = subprocess.run([sys.executable, "-m", "autotune", *command], cwd=work, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name}: find failed ({proc.returncode}): {proc.stderr[-2000:]}")
        found = json.loads(proc.stdout)
        trials = [t for t in found["trials"] if t["status"] != "skipped"]
        row = {
            "question": name,
            # The paths as the repository names them (the find ran in its own folder, given absolute ones).
            "command": "autotune " + " ".join(command).replace(f"{Path.cwd()}/", ""),
            "seconds": round(time.monotonic() - started, 1),
            "best": found["best"]["describe"],
            "best_tokens_per_s": found["best"]["tokens_per_s"],
            "best_peak_bytes": found["best"]["peak_memory_bytes"],
            "memory_limit_bytes": found["memory_limit_bytes"],
            "model_fp32_weights_bytes": _fp32_weights_bytes(),
            "trials": {
                t["describe"]: {"status": t["status"], "fits": t["fits"], "peak_bytes": t["peak_memory_bytes"]}
                for t in trials
            },
            "skipped_by_the_estimator": len(found["trials"]) - len(trials),
            "export_trained": _train(work / "autotune.json", work),
        }
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python bench/find_sharded.py", "rows": rows}, indent=1) + "\n")


def _fp32_weights_bytes() -> int:
    from autotune.config.workload import Workload
    from autotune.models.sources import meta_model

    return 4 * sum(p.numel() for p in meta_model(Workload(model=MODEL, seq_len=16), "causal-lm").parameters())


def _train(export: Path, work: Path) -> dict:
    (work / "job.py").write_text(_JOB)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "job.py", str(export.resolve())],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    return json.loads(line.removeprefix("RESULT ")) if line else {"failed": proc.stderr[-1500:]}


if __name__ == "__main__":
    main()
