"""A plain Accelerate job, as `accelerate launch --config_file` runs one: `Accelerator()` and nothing
of autotune's in its training, its own AdamW and DataLoader (micro batch 2) on a 2-layer GPT-2. It
counts its own peak of live tensor bytes with autotune's CPU tracker and says what DeepSpeed ran
with. Argument: optimizer steps. Used by the accelerate export's test and bench/zero_buckets.py."""

import json
import sys

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from autotune.trial.memory import LiveBytesTracker

with LiveBytesTracker(None) as tracker:
    accelerator = Accelerator()
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    samples = int(sys.argv[1]) * accelerator.gradient_accumulation_steps * 2
    data = torch.utils.data.DataLoader(torch.randint(0, 1000, (samples, 64)), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for batch in data:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()
zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
print(
    "RESULT "
    + json.dumps(
        {
            "peak_bytes": tracker.peak_bytes,
            "stage": model.zero_optimization_stage(),
            "bf16": model.bfloat16_enabled(),
            # None: not in the config, so DeepSpeed's own default
            "reduce": zero.get("reduce_bucket_size"),
            "allgather": zero.get("allgather_bucket_size"),
        }
    )
)
