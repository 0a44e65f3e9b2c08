"""A plain PyTorch training loop: it never imports autotune, and reads the trial's config from the
JSON file AUTOTUNE_CONFIG names (micro batch, accumulation, precision). Argument: optimizer steps.
It says at its end what it
trained with."""

import json
import os
import sys
import time

import torch
from tiny_lm import TinyLM

settings = json.load(open(os.environ["AUTOTUNE_CONFIG"]))
micro, accum = settings["config"]["micro_batch"], settings["grad_accum_steps"]
seq_len = settings["workload"]["seq_len"]
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(settings["config"]["precision"])
model = TinyLM()  # vocabulary 1000, hidden 128, 2 layers (tiny_lm.py)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
print(f"pid {os.getpid()}", flush=True)
for _step in range(int(sys.argv[1])):
    for _ in range(accum):
        ids = torch.randint(0, 1000, (micro, seq_len))
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss / accum
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if os.environ.get("HANG_AFTER_FIRST_STEP"):
        time.sleep(3600)
print(f"trained with micro_batch={micro} grad_accum_steps={accum} precision={settings['config']['precision']}")
