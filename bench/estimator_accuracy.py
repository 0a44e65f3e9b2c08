"""Accuracy of the memory estimator: predicted peak against the measured one, across the knobs.

    python bench/estimator_accuracy.py [--out bench/results/estimator_accuracy_cpu.json]
    python bench/estimator_accuracy.py --set levers   # results/estimator_accuracy_levers_cpu.json
    python bench/estimator_accuracy.py --set fsdp     # results/estimator_accuracy_fsdp_cpu.json
    python bench/estimator_accuracy.py --set lean     # results/estimator_accuracy_lean_cpu.json

``--set levers``: the knobs of 2026 (true bf16, LoRA's 16-bit base, checkpointing every 2nd layer,
the chunked loss, eager attention, the fused AdamW), one rank, on the same models; a config a
model cannot take (the chunked loss on a classifier) is left out with the reason.

``--set fsdp``: FSDP2 (``--fsdp full|grad-op``) on 2 ranks under torchrun, fp32 and bf16, with
checkpointing, CPU offload and LoRA, and one rank with offload. The estimator runs FSDP's own
step on fake tensors over a fake process group of the same ranks.

``--set lean``: the levers of fine-tuning on one card (8-bit AdamW, Adafactor, the step inside
backward, alone and with bf16-true; NF4 and int8 bases under LoRA), one rank, at sequence 32 unless
``--seq-len`` says otherwise (the model states weigh more there). Each row also measures the plain
config (AdamW, stepped after the backward) of the same micro batch and precision (LoRA on the unquantized
base for a quantized one), and prints the lever's saving against it.

Each config is measured by a real trial (on a CPU: the live-bytes tracker's peak, i.e. tensor
bytes, which is what the estimator predicts; on CUDA: max_memory_allocated, with reserved
alongside) and predicted by ``predict_memory``. One-rank configs cover precision,
checkpointing and LoRA; two-rank configs run real DDP and real DeepSpeed ZeRO 1-3 under
torchrun, and one-rank ZeRO with optimizer offload (on a CPU the offloaded states stay in the
memory measured, which the estimator knows).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from autotune.config.device import detect_device
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.errors import ConfigError
from autotune.estimate.client import predict_memory
from autotune.trial.runner import run_trial

MODELS = ["builtin:gpt2-deep-tiny", "builtin:llama-tiny", "builtin:bert-tiny"]
CONFIGS = [  # (ranks, config)
    (1, TrialConfig(micro_batch=1)),
    (1, TrialConfig(micro_batch=4)),
    (1, TrialConfig(micro_batch=8, checkpointing=True)),
    (1, TrialConfig(micro_batch=4, precision="bf16")),
    (1, TrialConfig(micro_batch=4, lora_rank=8)),
    (1, TrialConfig(micro_batch=8, lora_rank=8, checkpointing=True, precision="bf16")),
    (2, TrialConfig(micro_batch=4)),
    (2, TrialConfig(micro_batch=4, precision="bf16", zero_stage=1)),
    (2, TrialConfig(micro_batch=4, zero_stage=2)),
    (2, TrialConfig(micro_batch=4, precision="bf16", zero_stage=2, checkpointing=True)),
    (2, TrialConfig(micro_batch=4, precision="bf16", zero_stage=3)),
    (1, TrialConfig(micro_batch=4, precision="bf16", zero_stage=2, offload="optimizer")),
]
LEVER_CONFIGS = [
    (1, TrialConfig(micro_batch=4, precision="bf16-true")),
    (1, TrialConfig(micro_batch=8, precision="bf16-true", lora_rank=8, checkpointing=True)),
    (1, TrialConfig(micro_batch=4, precision="bf16", lora_rank=8)),  # the frozen base in bf16
    (1, TrialConfig(micro_batch=8, checkpointing=True, checkpoint_every=2)),
    (1, TrialConfig(micro_batch=8, loss="chunked")),
    (1, TrialConfig(micro_batch=8, precision="bf16", checkpointing=True, loss="chunked:4")),
    (1, TrialConfig(micro_batch=4, attention="eager")),
    (1, TrialConfig(micro_batch=4, fused_optimizer=True)),
]
FSDP_CONFIGS = [
    (2, TrialConfig(micro_batch=4, fsdp="full")),
    (2, TrialConfig(micro_batch=4, fsdp="grad-op")),
    (2, TrialConfig(micro_batch=4, precision="bf16", fsdp="full")),
    (2, TrialConfig(micro_batch=4, precision="bf16", fsdp="grad-op")),
    (2, TrialConfig(micro_batch=8, precision="bf16", fsdp="full", checkpointing=True)),
    (2, TrialConfig(micro_batch=4, fsdp="full", offload="optimizer+params")),
    (2, TrialConfig(micro_batch=4, precision="bf16", fsdp="full", lora_rank=8)),
    (1, TrialConfig(micro_batch=4, precision="bf16", fsdp="full", offload="optimizer+params")),
]
LEAN_CONFIGS = [
    (1, TrialConfig(micro_batch=4, optimizer="adamw-8bit")),
    (1, TrialConfig(micro_batch=4, optimizer="adafactor")),
    (1, TrialConfig(micro_batch=16, optimizer_in_backward=True)),  # no accumulation: the per-rank batch
    (1, TrialConfig(micro_batch=16, optimizer="adafactor", optimizer_in_backward=True)),
    (1, TrialConfig(micro_batch=4, precision="bf16-true", optimizer="adamw-8bit")),
    (1, TrialConfig(micro_batch=16, precision="bf16", checkpointing=True, optimizer_in_backward=True)),
    # QLoRA's base: each beside LoRA on the unquantized base
    (1, TrialConfig(micro_batch=4, lora_rank=16, quantize_base="nf4")),
    (1, TrialConfig(micro_batch=4, lora_rank=16, quantize_base="int8")),
    (1, TrialConfig(micro_batch=4, precision="bf16-true", lora_rank=16, quantize_base="nf4")),
]
SETS = {"base": CONFIGS, "levers": LEVER_CONFIGS, "fsdp": FSDP_CONFIGS, "lean": LEAN_CONFIGS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="base")
    parser.add_argument("--out", type=Path, help="default: bench/results/estimator_accuracy[_levers]_cpu.json")
    parser.add_argument("--seq-len", type=int, help="default: 128 (--set lean: 32)")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (32 if args.set == "lean" else 128)
    suffix = "" if args.set == "base" else f"_{args.set}"
    args.out = args.out or Path(f"bench/results/estimator_accuracy{suffix}_cpu.json")

    device = detect_device("auto")
    rows = []
    for model in MODELS:
        for ranks, config in SETS[args.set]:
            workload = Workload(model=model, seq_len=args.seq_len, global_batch=16, nproc=ranks)
            try:
                predicted = predict_memory(workload, config)
            except ConfigError as exc:  # refused before any trial, as autotune trial refuses it
                print(f"{model} {config.describe()}: {exc}, left out")
                continue
            measured = run_trial(workload, config, warmup_steps=1, measure_steps=1)
            if not measured.ok:
                print(f"{model} {config.describe()}: trial {measured.status.value}, left out")
                continue
            reference = measured.peak_allocated_bytes or measured.peak_memory_bytes
            error = predicted.predicted_peak_bytes / reference - 1
            lean = {}
            if args.set == "lean":  # the lever's saving: the plain config of the same batch and precision
                plain = run_trial(
                    workload,
                    config.replace(optimizer="adamw", optimizer_in_backward=False, quantize_base="off"),
                    warmup_steps=1,
                    measure_steps=1,
                )
                plain_bytes = plain.peak_allocated_bytes or plain.peak_memory_bytes if plain.ok else None
                lean = {"plain_measured_bytes": plain_bytes, "optimizer": measured.optimizer}
            rows.append(
                {
                    "model": model,
                    "ranks": ranks,
                    "config": config.describe(),
                    "predicted_peak_bytes": predicted.predicted_peak_bytes,
                    "measured_allocated_bytes": reference,
                    "measured_reserved_bytes": measured.peak_reserved_bytes,
                    "relative_error": error,
                    "estimate_seconds": predicted.seconds,
                    **lean,
                }
            )
            print(
                f"{model:<24} {ranks} rank(s) {config.describe():<36} "
                f"predicted {predicted.predicted_peak_bytes / 2**20:8.1f} MiB  "
                f"measured {reference / 2**20:8.1f} MiB  error {error:+.1%}"
                + (
                    f"  saving {(1 - reference / lean['plain_measured_bytes']):+.1%} of the plain "
                    f"{lean['plain_measured_bytes'] / 2**20:.1f} MiB"
                    if lean.get("plain_measured_bytes")
                    else ""
                ),
                flush=True,
            )
    errors = [abs(r["relative_error"]) for r in rows]
    summary = {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors), "configs": len(rows)}
    print(
        f"median |error| {summary['median_abs_error']:.2%}, max |error| {summary['max_abs_error']:.2%} "
        f"over {len(rows)} configs ({device.type}: {device.name})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python bench/estimator_accuracy.py" + ("" if args.set == "base" else f" --set {args.set}"),
                "device": device.type,
                "device_name": device.name,
                "host": platform.node(),
                "seq_len": args.seq_len,
                "summary": summary,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
