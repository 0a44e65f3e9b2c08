"""A Transformers Trainer script, as people write them: it never imports autotune. Its own batch size
and accumulation (8 and 1) are what a script trial overrides. Argument: optimizer steps."""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, 1000, (64,))
        return {"input_ids": ids, "labels": ids}


model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=64))
args = TrainingArguments(
    output_dir="trainer-out",
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    max_steps=int(sys.argv[1]),
    learning_rate=1e-4,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    use_cpu=True,
    dataloader_num_workers=0,
)
Trainer(model=model, args=args, train_dataset=RandomTokens()).train()  # a script trial stops it inside
print(
    f"trained with per_device_train_batch_size={args.per_device_train_batch_size} "
    f"gradient_accumulation_steps={args.gradient_accumulation_steps} bf16={args.bf16}"
)
