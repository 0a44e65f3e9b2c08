"""llm-foundry's Triton attention rate, from its own sequence sweeps, as a share of the card's FlashAttention-2 rate.

    python bench/llm_foundry_attention.py

llm-foundry's benchmark (the F rows of ``bench/plan_published.py``) ran MPT's ``attn_impl: triton``, a
FlashAttention-1-era Triton kernel; the step-time model times ``--attention sdpa`` at FlashAttention-2's rate
(``autotune/estimate/gpu_rates.py`` ATTENTION_SHARE). llm-foundry's tables also hold sequence sweeps: the same model
on the same 8 cards from 512 to 64k tokens (``bench/data/published/llm_foundry_sequence_sweeps.json``, copied from
llm-foundry at commit beb8dee). Per token, a step's work is the same at every sequence length but attention's,
which grows with the sequence, so the seconds per token per GPU fall on a line in the sequence: the slope is
attention's time per token per token of sequence, the intercept the rest.

Each sweep is fitted (least squares) from 8,192 tokens up, over the points with the activation checkpointing of
its shortest one there (a sweep switches it on where memory runs out, which moves the line); the points that
are themselves rows of ``plan_published.py`` are left out. The slope's FLOPs are those the model traces for
the same attention: PyTorch's flop counter for ``_scaled_dot_product_flash_attention`` and its backward
(``torch.utils.flop_counter``: two s x s x head_dim matmuls a head forward, five backward), at
``_CAUSAL_WORK`` (causal: half), the forward once more under checkpointing, per layer; the rate is those
FLOPs over the slope, and the share that rate over the card's FlashAttention-2 rate as ``card_profile``
has it (its bf16 matmul rate times ``attention_efficiency``). A card's share is the median of its 1b and 7b
sweeps (head_dim 128, as the 760m, 7b and 13b; the 125m and 350m have 64, the 3b 80): the other sizes are
printed beside them, not used. Nothing is fitted to the F rows' own throughput.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from autotune.config.gpus import gpu_spec
from autotune.estimate.step_costs import _CAUSAL_WORK
from autotune.estimate.step_time import card_profile

PUBLISHED = Path(__file__).parent / "data" / "published"
SWEEPS = PUBLISHED / "llm_foundry_sequence_sweeps.json"
CARDS = {"h100_80gb": "H100-80GB", "a100_80gb": "A100-80GB", "a100_40gb": "A100-40GB"}
USED = ("1b", "7b")  # the sizes whose sweeps give a card's share
FROM_SEQ = 8192


@dataclass(frozen=True)
class Point:
    model: str  # llm-foundry's size: "7b"
    card: str  # autotune's card: "H100-80GB"
    seq: int
    micro_batch: int
    accumulation: int
    checkpointing: bool
    tokens_per_gpu: float  # Throughput (T/s/GPU)
    table: str


@dataclass(frozen=True)
class SweepLine:
    model: str
    card: str
    seqs: tuple[int, ...]
    left_out: tuple[int, ...]  # sequence lengths of the points that are bench rows
    checkpointing: bool
    slope: float  # seconds per token per GPU, per token of sequence
    intercept: float  # seconds per token per GPU
    r2: float
    flops_per_token_per_seq: float  # attention's traced FLOPs per token, per token of sequence
    rate: float  # attention FLOP/s, traced FLOPs
    fa2_rate: float  # the card's FlashAttention-2 rate, as the model has it
    share: float  # rate / fa2_rate

    def describe(self) -> str:
        out = f" ({', '.join(map(str, self.left_out))} left out: a bench row)" if self.left_out else ""
        return (
            f"MPT-{self.model} {self.card} seq {', '.join(map(str, self.seqs))}{' ckpt' if self.checkpointing else ''}"
            f"{out}: slope {self.slope:.4g} s, intercept {self.intercept * 1e6:.2f} us a token per GPU, r^2 "
            f"{self.r2:.4f}; {self.flops_per_token_per_seq / 1e6:.3g} MFLOP a token per token of sequence: "
            f"{self.rate / 1e12:.1f} TFLOP/s, {self.share:.1%} of FlashAttention-2's {self.fa2_rate / 1e12:.0f}"
        )


def points(path: Path = SWEEPS) -> list[Point]:
    """Every published row of the sweeps' file, by its columns' names."""
    document = json.loads(path.read_text())
    out = []
    for table in document["tables"]:
        columns = table["columns"]
        for cells in table["rows"]:
            row = dict(zip(columns, cells, strict=True))
            out.append(
                Point(
                    model=row["Model"],
                    card=CARDS[row["GPU"]],
                    seq=int(row["SeqLen (T)"]),
                    micro_batch=int(row["MicroBatchSize"]),
                    accumulation=int(row["GradAccum"]),
                    checkpointing=row["Activation Checkpointing"] == "True",
                    tokens_per_gpu=float(row["Throughput (T/s/GPU)"]),
                    table=table["path"],
                )
            )
    return out


def attention_flops_per_token_per_seq(model: str, checkpointing: bool) -> float:
    """Attention's FLOPs per token of a step, per token of sequence, as the model traces MPT-``model`` (its GPT-2
    config in bench/data/published/): the flop counter's forward and backward of one causal flash SDPA call."""
    config = json.loads((PUBLISHED / f"mpt-{model}.json").read_text())
    heads, layers = config["n_head"], config["n_layer"]
    head_dim = config["n_embd"] // heads
    seq = 1024  # the counts are quadratic in it: per token, per token of sequence, it divides out
    shape = (1, heads, seq, head_dim)
    forward = sdpa_flop_count(shape, shape, shape)
    backward = sdpa_backward_flop_count(shape, shape, shape, shape)
    per_layer = (forward * (2 if checkpointing else 1) + backward) * _CAUSAL_WORK
    return float(layers * per_layer / seq / seq)


def fa2_rate(card: str) -> float:
    """The card's fused-attention FLOP/s in the step-time model (FlashAttention-2's share of its peak)."""
    profile = card_profile(gpu_spec(card))
    assert profile.attention_efficiency is not None
    return profile.matmul_flops["bfloat16"] * profile.attention_efficiency


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """The least-squares line through the points, and its r^2 (a line's: the correlation's square)."""
    slope, intercept = statistics.linear_regression(xs, ys)
    return slope, intercept, statistics.correlation(xs, ys) ** 2


def sweep_lines(exclude: Iterable[tuple[str, str, int, int, int]] = ()) -> list[SweepLine]:
    """One line per (model, card) sweep with two points or more from FROM_SEQ up; ``exclude``: the (model,
    card, seq, micro batch, accumulation) of bench rows, whose points are left out."""
    excluded = set(exclude)
    by_sweep: dict[tuple[str, str], list[Point]] = {}
    for p in points():
        if p.seq >= FROM_SEQ:
            by_sweep.setdefault((p.model, p.card), []).append(p)
    lines = []
    for (model, card), sweep in by_sweep.items():
        checkpointing = min(sweep, key=lambda p: p.seq).checkpointing
        same = sorted(
            {
                (p.seq, p.micro_batch, p.accumulation, p.tokens_per_gpu)
                for p in sweep
                if p.checkpointing == checkpointing
            }
        )
        kept = [s for s in same if (model, card, *s[:3]) not in excluded]
        if len(kept) < 2:
            continue
        slope, intercept, r2 = _fit([float(s[0]) for s in kept], [1 / s[3] for s in kept])
        flops = attention_flops_per_token_per_seq(model, checkpointing)
        rate, fa2 = flops / slope, fa2_rate(card)
        lines.append(
            SweepLine(
                model=model,
                card=card,
                seqs=tuple(s[0] for s in kept),
                left_out=tuple(s[0] for s in same if s not in kept),
                checkpointing=checkpointing,
                slope=slope,
                intercept=intercept,
                r2=r2,
                flops_per_token_per_seq=flops,
                rate=rate,
                fa2_rate=fa2,
                share=rate / fa2,
            )
        )
    return sorted(lines, key=lambda line: (line.card, USED.index(line.model) if line.model in USED else 9, line.model))


def card_shares(exclude: Iterable[tuple[str, str, int, int, int]] = ()) -> dict[str, float]:
    """Each card's Triton attention rate as a share of its FlashAttention-2 rate: the median of its 1b and 7b
    sweeps' shares."""
    return _median_shares(sweep_lines(exclude))


def _median_shares(lines: list[SweepLine]) -> dict[str, float]:
    by_card: dict[str, list[float]] = {}
    for line in lines:
        if line.model in USED:
            by_card.setdefault(line.card, []).append(line.share)
    return {card: statistics.median(shares) for card, shares in by_card.items()}


def report(exclude: Iterable[tuple[str, str, int, int, int]] = ()) -> dict[str, Any]:
    """The lines and the shares, with and without the points that are bench rows."""
    lines = sweep_lines(exclude)
    return {
        "source": json.loads(SWEEPS.read_text())["source"],
        "from_seq": FROM_SEQ,
        "used": list(USED),
        "lines": [line.__dict__ for line in lines],
        "shares": _median_shares(lines),
        "shares_with_bench_rows": card_shares(),
    }


def main() -> None:
    from plan_published import MPT_POINTS  # bench/plan_published.py: its F rows (imported here only: it imports this)

    for title, exclude in (("without the points that are bench rows", MPT_POINTS), ("with them", ())):
        print(f"Sweeps from {FROM_SEQ} tokens, {title}:")
        for line in sweep_lines(exclude):
            print(f"- {'' if line.model in USED else '(not used) '}{line.describe()}")
        shares = card_shares(exclude)
        print(
            "Share of FlashAttention-2's rate (median of 1b and 7b): "
            + ", ".join(f"{c} {s:.1%}" for c, s in shares.items())
        )
        print()


if __name__ == "__main__":
    main()
