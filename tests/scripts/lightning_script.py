"""A Lightning script, as people write them: it never imports autotune. Its Trainer asks for 32-bit
precision and no accumulation (a script trial overrides both); its DataLoader takes the micro batch
from the JSON file AUTOTUNE_CONFIG names. Argument: optimizer steps. It says at its end what it trained with."""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from transformers import GPT2Config, GPT2LMHeadModel

micro = json.load(open(os.environ["AUTOTUNE_CONFIG"]))["config"]["micro_batch"]


class LanguageModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64))

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


data = torch.utils.data.DataLoader(torch.randint(0, 1000, (4096, 64)), batch_size=micro)
trainer = pl.Trainer(
    max_steps=int(sys.argv[1]),
    accelerator="cpu",
    devices=1,
    precision="32-true",
    accumulate_grad_batches=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(LanguageModel(), data)
print(
    f"trained with micro_batch={micro} precision={trainer.precision} "
    f"accumulate_grad_batches={trainer.accumulate_grad_batches} steps={trainer.global_step}"
)
