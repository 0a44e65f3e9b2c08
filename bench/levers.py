"""Each lever against its baseline on the same model, in one run: measured peak, tokens/s, and the
estimator's prediction of the peak.

    python bench/levers.py [--rounds 3] [--out bench/results/levers_cpu.json]

Levers so far: the chunked loss (``--loss chunked`` against ``standard``), checkpointing every N-th
layer (``--checkpointing every-2``, beside ``on``), the fused AdamW (``--fused-optimizer on``) and true bf16
(``--precision bf16-true`` against mixed ``bf16``, with and without LoRA) and the attention kernel
(``--attention eager`` against ``sdpa``). Each pair runs as real
trials, interleaved (baseline, lever, baseline, lever, ...) so a busy machine slows both alike;
tokens/s is the median over the rounds with the range beside it, the peak that of the first
round (peaks do not vary between runs on a CPU: the live-bytes tracker counts tensors).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.client import predict_memory
from autotune.trial.runner import run_trial

# (lever, model, baseline, lever's config): the lever changes one knob of the baseline.
PAIRS = [
    ("chunked loss", "builtin:llama-tiny-32k", TrialConfig(micro_batch=8), TrialConfig(micro_batch=8, loss="chunked")),
    (
        "chunked loss",
        "builtin:llama-tiny-32k",
        TrialConfig(micro_batch=8, precision="bf16", checkpointing=True),
        TrialConfig(micro_batch=8, precision="bf16", checkpointing=True, loss="chunked"),
    ),
    ("chunked loss", "builtin:gpt2-deep-tiny", TrialConfig(micro_batch=8), TrialConfig(micro_batch=8, loss="chunked")),
    ("chunked loss", "builtin:llama-tiny", TrialConfig(micro_batch=8), TrialConfig(micro_batch=8, loss="chunked")),
    (
        "checkpointing every 2nd layer",
        "builtin:gpt2-deep-tiny",
        TrialConfig(micro_batch=8),
        TrialConfig(micro_batch=8, checkpointing=True, checkpoint_every=2),
    ),
    (
        "checkpointing every layer",
        "builtin:gpt2-deep-tiny",
        TrialConfig(micro_batch=8),
        TrialConfig(micro_batch=8, checkpointing=True),
    ),
    ("fused AdamW", "builtin:llama-tiny", TrialConfig(micro_batch=8), TrialConfig(micro_batch=8, fused_optimizer=True)),
    (
        "fused AdamW",
        "builtin:gpt2-deep-tiny",
        TrialConfig(micro_batch=8),
        TrialConfig(micro_batch=8, fused_optimizer=True),
    ),
    (
        "bf16-true",
        "builtin:llama-tiny",
        TrialConfig(micro_batch=8, precision="bf16"),
        TrialConfig(micro_batch=8, precision="bf16-true"),
    ),
    (
        "bf16-true",
        "builtin:gpt2-deep-tiny",
        TrialConfig(micro_batch=8, precision="bf16"),
        TrialConfig(micro_batch=8, precision="bf16-true"),
    ),
    (
        "bf16-true",
        "builtin:llama-tiny",
        TrialConfig(micro_batch=8, precision="bf16", lora_rank=8),
        TrialConfig(micro_batch=8, precision="bf16-true", lora_rank=8),
    ),
    (
        "eager attention",
        "builtin:llama-tiny",
        TrialConfig(micro_batch=8, attention="sdpa"),
        TrialConfig(micro_batch=8, attention="eager"),
    ),
    (
        "eager attention",
        "builtin:gpt2-deep-tiny",
        TrialConfig(micro_batch=8, attention="sdpa"),
        TrialConfig(micro_batch=8, attention="eager"),
    ),
]
SEQ_LEN, GLOBAL_BATCH = 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/levers_cpu.json"))
    args = parser.parse_args()

    rows = []
    for lever, model, baseline, changed in PAIRS:
        workload = Workload(model=model, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH)
        runs: dict[TrialConfig, list] = {baseline: [], changed: []}
        for _ in range(args.rounds):
            for config in (baseline, changed):
                result = run_trial(workload, config, warmup_steps=1, measure_steps=3)
                if not result.ok:
                    raise SystemExit(f"{model} {config.describe()}: {result.status.value}: {result.error}")
                runs[config].append(result)
        row = {"lever": lever, "model": model, "seq_len": SEQ_LEN, "global_batch": GLOBAL_BATCH}
        for name, config in (("baseline", baseline), ("with_lever", changed)):
            speeds = [r.tokens_per_s for r in runs[config]]
            peak = runs[config][0].peak_memory_bytes
            row[name] = {
                "config": config.describe(),
                "peak_memory_bytes": peak,
                "predicted_peak_bytes": predict_memory(workload, config).predicted_peak_bytes,
                "tokens_per_s_median": statistics.median(speeds),
                "tokens_per_s": speeds,
                "final_loss": runs[config][0].final_loss,
            }
        row["peak_ratio"] = row["with_lever"]["peak_memory_bytes"] / row["baseline"]["peak_memory_bytes"]
        row["speed_ratio"] = row["with_lever"]["tokens_per_s_median"] / row["baseline"]["tokens_per_s_median"]
        rows.append(row)
        print(_line(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "command": f"python bench/levers.py --rounds {args.rounds}",
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


def _line(row: dict) -> str:
    def side(s: dict) -> str:
        miss = s["predicted_peak_bytes"] / s["peak_memory_bytes"] - 1
        return (
            f"{s['config']}: loss {s['final_loss']:.4f}, "
            f"peak {s['peak_memory_bytes'] / 2**20:.1f} MiB (estimate {miss:+.1%}), "
            f"{s['tokens_per_s_median']:,.0f} tokens/s ({min(s['tokens_per_s']):,.0f}-{max(s['tokens_per_s']):,.0f})"
        )

    return (
        f"{row['lever']} on {row['model']}: {side(row['baseline'])} -> {side(row['with_lever'])}; "
        f"peak x{row['peak_ratio']:.2f}, speed x{row['speed_ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
