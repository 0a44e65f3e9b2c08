"""A plain loop that applies what no flag of its own sets through autotune's public API."""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autotune

config = autotune.current_config()
model = LlamaForCausalLM(
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000)
)
model = autotune.prepare(model, config)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
for _step in range(int(sys.argv[1])):
    ids = torch.randint(0, 1000, (config.micro_batch, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
