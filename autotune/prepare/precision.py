"""Which type each weight is held in, per precision, as the recipes users run hold them.

* fp32, tf32, fp16, bf16 (mixed): fp32 weights; autocast computes in 16 bits. With LoRA the frozen
  base is 16-bit and the adapters fp32, as PEFT recipes load it (``from_pretrained(dtype=torch.bfloat16)``:
  PEFT keeps adapters in fp32). Keeping the base in fp32 would count bytes no user pays.
* bf16-true: every parameter in bf16, adapters included, so gradients and Adam states are bf16 too
  (Lightning's ``bf16-true``). Buffers keep their type, as ``from_pretrained(dtype=...)`` leaves
  them (e.g. rotary frequencies stay fp32).

DeepSpeed's fp16/bf16 modes cast the model themselves: nothing here applies under ZeRO.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from autotune.config.knobs import TrialConfig

__all__ = ["hold_weights"]


def hold_weights(model: torch.nn.Module, config: TrialConfig) -> None:
    """Cast ``model``'s parameters (in place) to the types ``config``'s precision holds them in."""
    import torch

    if config.uses_deepspeed or config.sixteen_bit is None:
        return
    dtype = getattr(torch, config.sixteen_bit)
    for param in model.parameters():
        if param.is_floating_point() and (config.true_16_bit or not param.requires_grad and config.uses_lora):
            # .data, not Module.to(): also works on the estimator's fake parameters, and keeps them
            # the same Parameter objects (tied weights stay tied).
            param.data = param.data.to(dtype)
