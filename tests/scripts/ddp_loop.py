"""A plain DDP loop under torchrun: it never imports autotune; AUTOTUNE_CONFIG says micro batch and accumulation."""

import json
import os
import sys

import torch
import torch.distributed as dist
from tiny_lm import TinyLM

dist.init_process_group("gloo")
settings = json.load(open(os.environ["AUTOTUNE_CONFIG"]))
micro, accum = settings["config"]["micro_batch"], settings["grad_accum_steps"]
model = torch.nn.parallel.DistributedDataParallel(TinyLM())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _step in range(int(sys.argv[1])):
    for _ in range(accum):
        ids = torch.randint(0, 1000, (micro, 64))
        (model(input_ids=ids, labels=ids).loss / accum).backward()
    optimizer.step()
    optimizer.zero_grad()
