"""An Accelerate script, as people write them: it never imports autotune. Its Accelerator asks for no
mixed precision and no accumulation (a script trial overrides both); its DataLoader takes the micro
batch from the JSON file AUTOTUNE_CONFIG names. Argument: optimizer steps. It says at its end what it
trained with (and its ZeRO stage, under DeepSpeed)."""

import json
import os
import sys

import torch
from accelerate import Accelerator
from tiny_lm import TinyLM

micro = json.load(open(os.environ["AUTOTUNE_CONFIG"]))["config"]["micro_batch"]
accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=1, cpu=True)
model = TinyLM()  # its config.hidden_size sizes a ZeRO config's "auto" buckets
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = torch.utils.data.DataLoader(torch.randint(0, 1000, (4096, 64)), batch_size=micro)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for index, batch in enumerate(data):
    with accelerator.accumulate(model):
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    if index + 1 >= int(sys.argv[1]) * accelerator.gradient_accumulation_steps:
        break
zero = f" zero_stage={model.zero_optimization_stage()}" if hasattr(model, "zero_optimization_stage") else ""
print(
    f"trained with micro_batch={micro} mixed_precision={accelerator.mixed_precision} "
    f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}{zero}"
)
