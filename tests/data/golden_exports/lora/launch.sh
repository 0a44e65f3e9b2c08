#!/bin/bash
# autotune export: builtin:gpt2-tiny, mb=8 bf16 lora16:all-linear nf4
# trains: LoRA r=16 adapters only, on every linear layer but the output layer or classifier (PEFT's all-linear), trained in bf16 mixed precision; the frozen base held in bf16
# micro batch: 8 per rank (the DataLoader's batch_size), gradient accumulation: 2, global batch: 16
# activation checkpointing: off
# optimizer: torch.optim.AdamW(params, lr=LR)
# LoRA: rank 16, alpha 32, targets every linear layer but the output layer or classifier (PEFT's all-linear) (adapter config: autotune export --format peft)
# quantized base (nf4): from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype='bfloat16', bnb_4bit_quant_storage='uint8')) (autotune export --format bnb writes it), or `model = autotune.prepare(model, config)` on a built model; Lightning: plugins=BitsandbytesPrecision(mode='nf4-dq', dtype=torch.bfloat16); LitGPT: --quantize bnb.nf4-dq
# quantized base: the trials held the unquantized weights (embeddings, norms, head) as the precision holds them; peft's prepare_model_for_kbit_training makes fp32 copies of them, memory the trials did not count
# study: lora
# tokens_per_s: 35712.0
# samples_per_s: 558.0
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
