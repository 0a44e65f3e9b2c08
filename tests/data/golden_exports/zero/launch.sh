#!/bin/bash
# autotune export: builtin:gpt2-tiny, mb=4 bf16 zero3
# trains: all weights trained in bf16 mixed precision
# micro batch: 4 per rank (the DataLoader's batch_size), gradient accumulation: 2, global batch: 16
# activation checkpointing: off
# optimizer: DeepSpeed's, from its config (the optimizer block of the DeepSpeed JSON)
# LoRA: off (all weights trained)
# study: zero
# tokens_per_s: 7440.0
# samples_per_s: 116.25
# peak_memory_bytes: 16777216
# memory_budget_bytes: 1073741824
# Starts TRAIN_SCRIPT [ARGS...] with the trials' ranks: 2 ranks on one machine.
# Run: sbatch THIS_SCRIPT train.py ARGS... (or bash THIS_SCRIPT train.py ARGS... here)
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: $0 TRAIN_SCRIPT [ARGS...]: starts it with 2 ranks on one machine" >&2
  exit 2
fi
exec torchrun --standalone --nproc-per-node=2 "$@"
