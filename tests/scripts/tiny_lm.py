"""The small causal LM the plain, DDP, DeepSpeed and Accelerate test scripts train, in plain PyTorch: the
shapes of their former 2-layer Llama (vocabulary 1000, hidden 128, MLP 256, 4 heads), built without
importing Transformers (about 3 CPU-s more per process than ``import torch``, in every script a test
starts). A Llama-like block: RMSNorm, causal attention (``scaled_dot_product_attention``), a SwiGLU MLP.

``model(input_ids=ids, labels=ids).loss`` is the next-token cross-entropy, as a Transformers causal LM's;
``model.config.hidden_size`` is where Accelerate reads its "auto" DeepSpeed bucket sizes from. The
scripts import it as a sibling (``python tests/scripts/SCRIPT.py`` puts that folder on ``sys.path``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLM", "TinyLMConfig", "TinyLMOutput"]


@dataclass
class TinyLMConfig:
    vocab_size: int = 1000
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    rms_norm_eps: float = 1e-6


@dataclass
class TinyLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Block(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        hidden, self.heads = config.hidden_size, config.num_attention_heads
        self.attention_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.gate = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, hidden // self.heads).transpose(1, 2)
            for t in self.qkv(self.attention_norm(x)).chunk(3, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, hidden))
        normed = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(normed)) * self.up(normed))


class TinyLM(nn.Module):
    def __init__(self, config: TinyLMConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TinyLMConfig()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TinyLMOutput:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:  # token t predicts token t + 1
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1))
        return TinyLMOutput(loss, logits)
