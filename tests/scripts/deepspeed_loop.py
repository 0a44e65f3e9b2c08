"""A plain DeepSpeed loop: it never imports autotune; AUTOTUNE_CONFIG says micro batch, accumulation
and the ZeRO stage, which it builds its own engine with. One process, no launcher (autotune gives it
the one-rank group a launcher would). Argument: steps."""

import json
import os
import sys

import deepspeed
import torch
from tiny_lm import TinyLM

settings = json.load(open(os.environ["AUTOTUNE_CONFIG"]))
micro, accum = settings["config"]["micro_batch"], settings["grad_accum_steps"]
deepspeed.init_distributed(dist_backend="gloo")
model = TinyLM()
engine, _, _, _ = deepspeed.initialize(
    model=model,
    model_parameters=model.parameters(),
    config={
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "zero_optimization": {
            "stage": settings["config"]["zero_stage"] or 0,
            "reduce_bucket_size": 128 * 128,
            "allgather_bucket_size": 128 * 128,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    },
)
for _step in range(int(sys.argv[1])):
    for _ in range(accum):
        ids = torch.randint(0, 1000, (micro, 64))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
