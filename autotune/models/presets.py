"""Built-in model presets: Hugging Face configs built with random weights, no download.

The ``-tiny`` presets train in well under a second a step on a laptop CPU and are what the
tests use; the others are real architectures' shapes for real hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Preset", "PRESETS"]

_TINY_VOCAB = 2048


@dataclass(frozen=True)
class Preset:
    model_type: str               # transformers' model_type, for AutoConfig.for_model
    task: str                     # the task it trains by default
    summary: str
    config: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "gpt2-tiny": Preset("gpt2", "causal-lm", "GPT-2 shape, 2 layers, 128 wide (~0.8M params)", dict(
        n_layer=2, n_embd=128, n_head=4, n_positions=1024, vocab_size=_TINY_VOCAB,
        bos_token_id=0, eos_token_id=0)),
    "gpt2-deep-tiny": Preset("gpt2", "causal-lm", "GPT-2 shape, 6 layers, 128 wide, 512-token vocabulary: "
                             "activations dominate its memory, as in real LLM training", dict(
        n_layer=6, n_embd=128, n_head=4, n_positions=1024, vocab_size=512, bos_token_id=0, eos_token_id=0)),
    "llama-tiny": Preset("llama", "causal-lm", "Llama shape (RoPE, GQA, SwiGLU), 2 layers, 128 wide", dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, vocab_size=_TINY_VOCAB,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "llama-tiny-32k": Preset("llama", "causal-lm", "llama-tiny with Llama-2's 32k vocabulary: its logits dominate "
                             "its memory, as a 128k vocabulary's do in Llama-3 training", dict(
        hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, vocab_size=32000,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)),
    "bert-tiny": Preset("bert", "seq-cls", "BERT encoder + classification head, 2 layers, 128 wide", dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=512, vocab_size=_TINY_VOCAB, num_labels=2, pad_token_id=0)),
    "bert-mlm-tiny": Preset("bert", "masked-lm", "BERT encoder + masked-LM head, 2 layers, 128 wide", dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=512, vocab_size=_TINY_VOCAB, pad_token_id=0)),
    "gpt2": Preset("gpt2", "causal-lm", "GPT-2 small (124M)", dict(
        n_layer=12, n_embd=768, n_head=12, bos_token_id=50256, eos_token_id=50256)),
    "gpt2-medium": Preset("gpt2", "causal-lm", "GPT-2 medium (355M)", dict(n_layer=24, n_embd=1024, n_head=16)),
    "gpt2-large": Preset("gpt2", "causal-lm", "GPT-2 large (774M)", dict(n_layer=36, n_embd=1280, n_head=20)),
    "gpt2-xl": Preset("gpt2", "causal-lm", "GPT-2 XL (1.5B)", dict(n_layer=48, n_embd=1600, n_head=25)),
    "bert-base": Preset("bert", "seq-cls", "BERT base (110M) with a 2-class head", dict(num_labels=2)),
    "tinyllama-1.1b": Preset("llama", "causal-lm", "TinyLlama 1.1B shape", dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, vocab_size=32000, pad_token_id=0)),
    "llama2-7b": Preset("llama", "causal-lm", "Llama-2 7B shape", dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, vocab_size=32000, pad_token_id=0)),
}
