"""What a published measurement ran that autotune's own knobs do not describe, so the estimator can
rebuild it: libraries as older releases behaved, or a library's way of doing what a knob does.

The estimator traces the libraries installed here, the way autotune applies its knobs. A figure
published years ago ran older releases, or another integration, and where those kept different
tensors the trace does what they did:

* ``pytorch1_step``: PyTorch 1.x's step defaults. AdamW went tensor by tensor (not foreach) on
  CUDA too, and ``zero_grad()`` zeroed gradients in place (``set_to_none=False``), so they stayed
  allocated through the next forward.
* ``bnb_4bit_keeps_input``: bitsandbytes before 0.43.2. ``MatMul4Bit.forward`` kept its input for
  the backward (``ctx.tensors = (A, B)``, bitsandbytes 0.41.1 ``autograd/_functions.py`` line 523),
  though the backward only reads the weight. It was dropped in 0.43.2 (commit 9e75374, #1270, "fix
  QLoRA mem bug: delete useless buffered activation"). The input of every 4-bit layer whose input
  needs a gradient stays referenced from its autograd node until the graph is freed.
* ``lightning_bnb``: an NF4 base quantized as Lightning's ``BitsandbytesPrecision(mode)`` does
  (LitGPT's ``--quantize bnb.nf4`` / ``bnb.nf4-dq``), not as Transformers' ``BitsAndBytesConfig``:
  see :func:`autotune.prepare.quantize.as_lightning_quantizes`.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Iterator

__all__ = ["AS_INSTALLED", "MeasuredWith"]


@dataclass(frozen=True)
class MeasuredWith:
    pytorch1_step: bool = False
    bnb_4bit_keeps_input: bool = False
    lightning_bnb: str | None = None  # "nf4" or "nf4-dq"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> MeasuredWith:
        return cls(**(data or {}))

    @contextlib.contextmanager
    def in_effect(self) -> Iterator[None]:
        """The trace builds and steps as the measurement did (``pytorch1_step`` is the estimator's to
        apply to the optimizer it builds)."""
        with contextlib.ExitStack() as stack:
            if self.lightning_bnb is not None:
                from autotune.prepare.quantize import as_lightning_quantizes

                stack.enter_context(as_lightning_quantizes(self.lightning_bnb))
            if self.bnb_4bit_keeps_input:
                stack.enter_context(_bnb_4bit_keeping_input())
            yield


AS_INSTALLED = MeasuredWith()  # the libraries installed here, autotune's own way


@contextlib.contextmanager
def _bnb_4bit_keeping_input() -> Iterator[None]:
    from bitsandbytes.autograd import _functions

    matmul = _functions.MatMul4Bit
    forward = matmul.forward  # the staticmethod's function

    def keeping_input(ctx: Any, A: Any, B: Any, out: Any = None, bias: Any = None, quant_state: Any = None) -> Any:
        output = forward(ctx, A, B, out, bias, quant_state)
        held = getattr(ctx, "tensors", None)
        if held is not None and held[1] is not None:  # kept for the backward: so was A, before 0.43.2
            ctx.tensors = (A, held[1])
        return output

    matmul.forward = staticmethod(keeping_input)
    try:
        yield
    finally:
        matmul.forward = staticmethod(forward)
