"""What LitGPT's own LoRA Llama keeps for the backward, against Transformers' Llama with PEFT's LoRA as
autotune builds it: the gpu_published L rows rebuild the first as the second.

    git -C <litgpt clone> archive 8641822 lit_gpt | tar -x -C ../litgpt-8641822
    python bench/litgpt_activations.py --litgpt ../litgpt-8641822

LitGPT's resource tables were measured at commit 8641822 (tutorials/resource-tables.md). Both models
are built at a small Llama shape (the 7B's FFN/hidden ratio, 11008/4096), LoRA r8 alpha 16 on q and v
(LitGPT's lora_dropout 0.05, fused qkv; PEFT's dropout 0.0 as autotune sets it), bf16, one forward of
one sample on this CPU. Every tensor autograd saves is collected (``saved_tensors_hooks``), each
storage once, parameters left out; "per layer" is the bytes without a vocabulary-sized dimension
(the LM head's and the loss's), per token, per layer, in units of the hidden size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

C, HEADS, FFN, LAYERS, T, VOCAB = 512, 4, 1376, 2, 512, 32000


def _saved(model: torch.nn.Module, step: Callable[[], Any]) -> dict[int, tuple[int, tuple[int, ...]]]:
    held: dict[int, tuple[int, tuple[int, ...]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        held[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return {ptr: what for ptr, what in held.items() if ptr not in params}


def litgpt(source: Path) -> dict[int, tuple[int, tuple[int, ...]]]:
    sys.path.insert(0, str(source))
    from lit_gpt.lora import GPT, Config, mark_only_lora_as_trainable
    from lit_gpt.utils import chunked_cross_entropy

    config = Config(
        n_layer=LAYERS, n_embd=C, n_head=HEADS, n_query_groups=HEADS, intermediate_size=FFN, vocab_size=VOCAB,
        padded_vocab_size=VOCAB, bias=False, _norm_class="RMSNorm", _mlp_class="LLaMAMLP", rotary_percentage=1.0,
        parallel_residual=False, block_size=4096, r=8, alpha=16, dropout=0.05, to_query=True, to_value=True,
    )  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)  # bf16-true: Fabric's init_module makes the model in bf16
    model = GPT(config)
    torch.set_default_dtype(torch.float32)
    mark_only_lora_as_trainable(model)
    model.max_seq_length = T
    x, y = torch.randint(0, VOCAB, (1, T)), torch.randint(0, VOCAB, (1, T))

    def step() -> Any:  # finetune/lora.py's train step
        logits = model(x, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]
        return chunked_cross_entropy(logits, y[..., 1:]), logits

    return _saved(model, step)


def transformers_peft() -> dict[int, tuple[int, tuple[int, ...]]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=C, num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=FFN,
        num_hidden_layers=LAYERS, vocab_size=VOCAB, attn_implementation="sdpa",
    )  # fmt: skip
    model = get_peft_model(
        LlamaForCausalLM(config).to(torch.bfloat16),
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    x = torch.randint(0, VOCAB, (1, T))
    return _saved(model, lambda: model(input_ids=x, labels=x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--litgpt", type=Path, required=True, help="lit_gpt/ of LitGPT's commit 8641822, extracted")
    parser.add_argument("--out", type=Path, default=Path("bench/results/litgpt_activations.txt"))
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = [
        f"Llama shape: hidden {C}, FFN {FFN}, {LAYERS} layers, {HEADS} heads, vocab {VOCAB}; one sample of {T} tokens, "
        "bf16, LoRA r8 on q and v",
        "",
        "| model | saved for the backward | per layer (hidden-size bytes a token) | head and loss |",
        "|---|---|---|---|",
    ]
    for name, saved in (
        ("LitGPT 8641822 (lit_gpt.lora)", litgpt(args.litgpt)),
        ("Transformers + PEFT", transformers_peft()),
    ):
        total = sum(nbytes for nbytes, _ in saved.values())
        body = sum(nbytes for nbytes, shape in saved.values() if VOCAB not in shape)
        lines.append(
            f"| {name} | {total / 2**20:.1f} MiB | {body / (T * LAYERS * C):.2f} | {(total - body) / 2**20:.1f} MiB |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.write_text(f"$ python bench/litgpt_activations.py --litgpt <lit_gpt of 8641822>\n\n{table}\n")


if __name__ == "__main__":
    main()
