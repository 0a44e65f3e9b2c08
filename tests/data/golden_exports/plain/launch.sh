#!/bin/bash
# autotune export: builtin:gpt2-tiny, mb=8 bf16 ckpt
# trains: all weights trained in bf16 mixed precision
# micro batch: 8 per rank (the DataLoader's batch_size), gradient accumulation: 2, global batch: 16
# activation checkpointing: on: model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
# optimizer: torch.optim.AdamW(params, lr=LR)
# LoRA: off (all weights trained)
# study: plain
# tokens_per_s: 8928.0
# samples_per_s: 139.5
# peak_memory_bytes: 25165824
# memory_budget_bytes: 1073741824
# Starts TRAIN_SCRIPT [ARGS...] with the trials' ranks: 1 rank on one machine.
# Run: sbatch THIS_SCRIPT train.py ARGS... (or bash THIS_SCRIPT train.py ARGS... here)
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: $0 TRAIN_SCRIPT [ARGS...]: starts it with 1 rank on one machine" >&2
  exit 2
fi
exec "${PYTHON:-python}" "$@"
