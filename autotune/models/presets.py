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
    model_type: str  # transformers' model_type, for AutoConfig.for_model
    task: str  # the task it trains by default
    summary: str
    config: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "gpt2-tiny": Preset(
        "gpt2",
        "causal-lm",
        "GPT-2 shape, 2 layers, 128 wide (~0.8M params)",
        dict(n_layer=2, n_embd=128, n_head=4, n_positions=1024, vocab_size=_TINY_VOCAB, bos_token_id=0, eos_token_id=0),
    ),
    "gpt2-deep-tiny": Preset(
        "gpt2",
        "causal-lm",
        "GPT-2 shape, 6 layers, 128 wide, 512-token vocabulary: "
        "activations dominate its memory, as in real LLM training",
        dict(n_layer=6, n_embd=128, n_head=4, n_positions=1024, vocab_size=512, bos_token_id=0, eos_token_id=0),
    ),
    "llama-tiny": Preset(
        "llama",
        "causal-lm",
        "Llama shape (RoPE, GQA, SwiGLU), 2 layers, 128 wide",
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            vocab_size=_TINY_VOCAB,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        ),
    ),
    "llama-tiny-32k": Preset(
        "llama",
        "causal-lm",
        "llama-tiny with Llama-2's 32k vocabulary: its logits dominate "
        "its memory, as a 128k vocabulary's do in Llama-3 training",
        dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            vocab_size=32000,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        ),
    ),
    "bert-tiny": Preset(
        "bert",
        "seq-cls",
        "BERT encoder + classification head, 2 layers, 128 wide",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=512,
            vocab_size=_TINY_VOCAB,
            num_labels=2,
            pad_token_id=0,
        ),
    ),
    "bert-mlm-tiny": Preset(
        "bert",
        "masked-lm",
        "BERT encoder + masked-LM head, 2 layers, 128 wide",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=512,
            vocab_size=_TINY_VOCAB,
            pad_token_id=0,
        ),
    ),
    "t5-tiny": Preset(
        "t5",
        "seq2seq-lm",
        "T5 encoder-decoder, 2+2 layers, 128 wide",
        dict(
            d_model=128,
            d_kv=32,
            d_ff=256,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            vocab_size=_TINY_VOCAB,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
    ),
    "vit-tiny": Preset(
        "vit",
        "image-cls",
        "ViT, 2 layers, 128 wide, 32 px images in 8 px patches, 10 classes",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=256,
            image_size=32,
            patch_size=8,
            num_labels=10,
        ),
    ),
    "resnet-tiny": Preset(
        "resnet",
        "image-cls",
        "ResNet, 2 stages of basic blocks, 16-32 channels, 10 classes",
        dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10),
    ),
    "gpt2": Preset(
        "gpt2",
        "causal-lm",
        "GPT-2 small (124M)",
        dict(n_layer=12, n_embd=768, n_head=12, bos_token_id=50256, eos_token_id=50256),
    ),
    "gpt2-medium": Preset("gpt2", "causal-lm", "GPT-2 medium (355M)", dict(n_layer=24, n_embd=1024, n_head=16)),
    "gpt2-large": Preset("gpt2", "causal-lm", "GPT-2 large (774M)", dict(n_layer=36, n_embd=1280, n_head=20)),
    "gpt2-xl": Preset("gpt2", "causal-lm", "GPT-2 XL (1.5B)", dict(n_layer=48, n_embd=1600, n_head=25)),
    "bert-base": Preset("bert", "seq-cls", "BERT base (110M) with a 2-class head", dict(num_labels=2)),
    "distilbert-base": Preset("distilbert", "seq-cls", "DistilBERT base (66M) with a 2-class head", dict(num_labels=2)),
    "xlm-roberta-base": Preset(
        "xlm-roberta",
        "masked-lm",
        "XLM-RoBERTa base (278M, 250k vocabulary), masked LM",
        dict(
            vocab_size=250002,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=514,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
    ),
    "xlm-roberta-large": Preset(
        "xlm-roberta",
        "masked-lm",
        "XLM-RoBERTa large (560M), masked LM",
        dict(
            vocab_size=250002,
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            max_position_embeddings=514,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
    ),
    "t5-base": Preset(
        "t5",
        "seq2seq-lm",
        "T5 base (223M), encoder-decoder",
        dict(
            d_model=768,
            d_kv=64,
            d_ff=3072,
            num_layers=12,
            num_heads=12,
            vocab_size=32128,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
    ),
    # Published with an untied LM head (582M); Transformers 5 ties it to the embeddings whatever the
    # config says, so the model a job trains with it, and this preset, has 390M.
    "mt5-base": Preset(
        "mt5",
        "seq2seq-lm",
        "mT5 base (250k vocabulary), encoder-decoder",
        dict(
            d_model=768,
            d_kv=64,
            d_ff=2048,
            num_layers=12,
            num_heads=12,
            vocab_size=250112,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),
    ),
    "vit-base": Preset("vit", "image-cls", "ViT-B/16 (86M) at 224 px, 1000 classes", dict(num_labels=1000)),
    "resnet-50": Preset(
        "resnet",
        "image-cls",
        "ResNet-50 (25.6M), 1000 classes",
        dict(
            embedding_size=64,
            hidden_sizes=[256, 512, 1024, 2048],
            depths=[3, 4, 6, 3],
            layer_type="bottleneck",
            num_labels=1000,
        ),
    ),
    "tinyllama-1.1b": Preset(
        "llama",
        "causal-lm",
        "TinyLlama 1.1B shape",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=2048,
            vocab_size=32000,
            pad_token_id=0,
        ),
    ),
    "llama2-7b": Preset(
        "llama",
        "causal-lm",
        "Llama-2 7B shape",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            vocab_size=32000,
            pad_token_id=0,
        ),
    ),
}
