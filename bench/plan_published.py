"""Published GPU throughput rebuilt and predicted with autotune's step-time model, on this CPU.

    python bench/plan_published.py [--rows F6,T1] [--grids llama-tiny,none] [--json]
                                   [--out bench/results/plan_published.json]

Part 1, published rows. Every published throughput row listed below that autotune's knobs
can express is rebuilt as a workload and config for its card (``gpu=``, models from their configs
in ``bench/data/published/``), traced on fake tensors (``predict_memory``) and timed against the
card's roofline (``predict_step_time`` with ``card_profile``). Each row prints the published
figure, the prediction and the error (predicted / published - 1): tokens/s per GPU, or
samples/s where the source printed that (the bert-large rows). Then the median and largest
|error|, and for each published sweep whether the predicted order is the published one.

* llm-foundry MPT (F1-F7): FSDP2 full shard on 8 fake ranks, micro batch and gradient
  accumulation as llm-foundry's benchmarking table gives them (global batch = mb x accum x 8).
  MPT is rebuilt as a GPT-2 config (``mpt-*.json``: learned positions, MHA, 4h GELU FFN, vocab
  50368, tied head, no dropout); GPT-2 has biases where MPT has none, and SDPA stands for MPT's
  ``attn_impl: triton`` attention, timed at the share of the card's FlashAttention-2 rate that
  llm-foundry's own sequence sweeps give it (``bench/llm_foundry_attention.py``: 52-53% on an A100,
  52% on an H100; the other sources' rows keep FlashAttention-2's rate). n_positions is the row's
  sequence (the 7b rows at 4096 and 8192 have files of their own), so the parameter count matches
  llm-foundry's NumParams.
* torchtune Llama-3.2-3B (T1-T6): one A100 80GB, packed 4096 tokens, micro batch 2, no
  accumulation, pure bf16 (``bf16-true``); each row adds one lever as torchtune's table does. T5
  (the optimizer step inside the backward), its activation-offload and 8-bit AdamW lines, T6
  (LoRA on T4's levers and activation offload) and T6's NF4 line are ``bench/gpu_published.py``'s rows.
* Transformers docs bert-large on a V100 (H1-H9: AdamW, Adafactor, bitsandbytes' 8-bit Adam):
  ``bench/gpu_published.py``'s rows reused as they are (eager attention, the PyTorch 1.x optimizer
  step), against the ``train_samples_per_second`` the docs printed.
* torchtitan Llama-3-8B (S1-S6): ``bench/gpu_published.py``'s rows as they are (FSDP2 on 8 or 128
  fake ranks, seq 8192, selective per-op checkpointing, S3 and S6-float8 with float8 Linear layers:
  their matmuls timed at the card's float8 peak), against torchtitan's TPS/GPU and torchao's
  float8 table (S6: bf16 and float8 tensorwise, the median over logged steps). All on the card
  torchtitan's notes name (``H100-96GB-HBM2e``: 2.4 TB/s, its peak and sustained matmul rate taken
  as the SXM's, likely high at its 500 W); S6's table names no H100, and its team's own logs of the
  same recipe ran on this card (``gpu_published._S6_OPEN``).

Part 2, CPU grids. Each committed grid ``bench/data/GRID.jsonl`` is predicted line by line with
the roofline measured beside it before its trials (``GRID.roofline.json``; for an older grid
without one, this machine's probed profile with the grid's 16-bit matmul speeds from
``GRID.probe.json``), and the order is compared: Spearman's rank correlation between predicted
and measured tokens/s.

Known limits: ``compile`` is traced as eager and timed with its elementwise chains fused, no more
(T2-T6); torchtune's chunked cross-entropy (T3 on) is rebuilt as autotune's, which recomputes
the LM head (no knob rebuilds torchtune's, which recomputes nothing); torchtune's and llm-foundry's
own model code is rebuilt as Transformers' Llama / GPT-2; llm-foundry's F7 rows ran FSDP "PURE"
mixed precision (bf16 gradient reduction), rebuilt as bf16 autocast with fp32 reduction;
llm-foundry's benchmark ran MPT's ``attn_impl: triton`` (the default of its submit_benchmarks.py,
a FlashAttention-1-era Triton kernel), traced here as PyTorch's flash SDPA (FlashAttention-2) and
timed at the rate llm-foundry's sequence sweeps give that kernel (one share per card, from the 1b and
7b sweeps, not from the F rows). Its H100 and A100 tables ran the same software (the image column
of scripts/train/benchmarking/h100new.md, in the branch of llm-foundry PR #543 that wrote the
tables, commit beb8dee, removed before the merge: mosaicml/pytorch:2.1.0_cu121-nightly20230827 for
both cards' rows; the README's "TODO: Update tables with torch 2.0" is older than its tables), and
its rows disagree with each other by 9%: MPT-760m at seq 2048 made 63,147 tokens/s per GPU on 8
H100s (micro batch 24, accumulation 2) and 68,551 on 16 (micro batch 24, accumulation 1), though
more steps of accumulation only save optimizer steps.
The grids' Spearman follows this machine's probe, taken anew each run: on a busy machine it moved
by up to 0.1 between runs (the probe measured 1 core in one, 2 in the other).
No GPU is needed. The table goes to stdout last, the figures to ``--out`` (and ``.txt`` beside it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpu_published  # bench/gpu_published.py: its bert-large and torchtune rows
import llm_foundry_attention  # bench/llm_foundry_attention.py: the Triton kernel's share, from llm-foundry's sweeps
from search import grid_roofline  # bench/search.py: the grids' rooflines as the replays take them

from autotune.config.gpus import gpu_spec
from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate import step_time
from autotune.estimate.client import predict_memory
from autotune.estimate.measured_with import MeasuredWith
from autotune.estimate.results import MemoryEstimate
from autotune.estimate.step_time import DeviceProfile, StepTime, card_profile, predict_step_time
from autotune.search.grid import read_grid

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = DATA / "published"


def _from_root(model: str) -> str:
    """A model file as the repository names it (results carry no path of the machine they ran on)."""
    path = Path(model).resolve()
    return str(path.relative_to(ROOT)) if Path(model).is_absolute() and path.is_relative_to(ROOT) else model


GRIDS = ("gpt2-deep-tiny", "llama-tiny", "llama-tiny-zero2rank", "llama-gqa")
MPT_GPUS = 8


@dataclass(frozen=True)
class Row:
    key: str  # "F6 125m": the source's row and, where a row holds several, its variant
    what: str
    workload: Workload
    config: TrialConfig
    published: float  # per GPU, in ``unit``
    unit: str  # "tokens/s" or "samples/s"
    published_mfu: float | None = None
    pytorch1_step: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The attention kernel the row ran, as a share of the card's FlashAttention-2 rate (None: FlashAttention-2)
    attention_share: float | None = None

    @property
    def group(self) -> str:
        return self.key.split()[0]


# -- part 1: the published rows ---------------------------------------------------------------------


def _mpt(
    size: str, seq: int, mb: int, accum: int, gpu: str, checkpointing: bool = False
) -> tuple[Workload, TrialConfig]:
    """An llm-foundry MPT run: FSDP full shard on 8 GPUs, bf16 autocast, SDPA for its flash attention."""
    name = f"mpt-{size}" + ("" if seq == 2048 else f"-seq{seq}")
    workload = Workload(
        model=str(PUBLISHED / f"{name}.json"),
        task="causal-lm",
        seq_len=seq,
        global_batch=mb * accum * MPT_GPUS,
        nproc=MPT_GPUS,
        gpu=gpu,
    )
    config = TrialConfig(micro_batch=mb, precision="bf16", checkpointing=checkpointing, fsdp="full", attention="sdpa")
    return workload, config


_MPT_NOTE = (
    "llm-foundry MPT as a GPT-2 config (biases, SDPA for its Triton attention); micro batch and accumulation from "
    "llm-foundry's benchmarking table (scripts/train/benchmarking/README.md)"
)
_PURE_NOTE = "FSDP 'PURE' mixed precision (bf16 gradient reduction) rebuilt as bf16 autocast, fp32 reduction"


# (key, size, seq, mb, accum, gpu, checkpointing, tokens/s per GPU, MFU)
MPT_TABLE = [
    ("F1 7b", "7b", 2048, 6, 1, "H100-80GB", False, 10_643, 0.464),
    ("F2 7b/4096", "7b", 4096, 16, 2, "H100-80GB", True, 8_611, 0.404),
    ("F2 7b/8192", "7b", 8192, 8, 2, "H100-80GB", True, 6_935, 0.371),
    ("F3 13b", "13b", 2048, 2, 1, "H100-80GB", False, 4_792, 0.398),
    ("F4 1b", "1b", 2048, 14, 1, "H100-80GB", False, 45_455, 0.418),
    ("F4 760m", "760m", 2048, 24, 2, "H100-80GB", False, 63_147, 0.349),
    ("F5 7b", "7b", 2048, 6, 2, "A100-80GB", False, 4_641, 0.642),
    ("F6 125m", "125m", 2048, 40, 2, "A100-80GB", False, 142_830, 0.448),
    ("F6 350m", "350m", 2048, 32, 2, "A100-80GB", False, 58_782, 0.516),
    ("F6 1b", "1b", 2048, 14, 4, "A100-80GB", False, 20_513, 0.599),
    ("F6 3b", "3b", 2048, 10, 2, "A100-80GB", False, 10_811, 0.621),
    ("F6 13b", "13b", 2048, 2, 3, "A100-80GB", False, 2_262, 0.596),
    ("F7 7b", "7b", 2048, 12, 4, "A100-40GB", True, 3_679, 0.509),
    ("F7 1b", "1b", 2048, 8, 8, "A100-40GB", False, 19_271, 0.562),
    ("F7 125m", "125m", 2048, 26, 3, "A100-40GB", False, 136_334, 0.428),
]
# The F rows as llm-foundry's sweeps list them (size, card, seq, micro batch, accumulation): left out of the
# sweeps that give the Triton kernel's share (bench/llm_foundry_attention.py).
MPT_POINTS = [(size, gpu, seq, mb, accum) for _, size, seq, mb, accum, gpu, *_ in MPT_TABLE]
# llm-foundry's attn_impl: triton, at this share of the card's FlashAttention-2 rate (from its sequence sweeps)
TRITON_SHARES = llm_foundry_attention.card_shares(exclude=MPT_POINTS)


def _mpt_rows() -> list[Row]:
    rows = []
    for key, size, seq, mb, accum, gpu, ckpt, tokens, mfu in MPT_TABLE:
        what = f"MPT-{size} seq {seq} mb{mb} x{accum} {'ckpt ' if ckpt else ''}FSDP x8"
        share = TRITON_SHARES[gpu]
        triton = (
            f"attention (MPT's attn_impl: triton) at {share:.1%} of the card's FlashAttention-2 rate, from "
            f"llm-foundry's {gpu} sequence sweeps (bench/llm_foundry_attention.py)"
        )
        notes = (_MPT_NOTE, triton) + ((_PURE_NOTE,) if key.startswith("F7") else ())
        rows.append(
            Row(
                key,
                what,
                *_mpt(size, seq, mb, accum, gpu, ckpt),
                tokens,
                "tokens/s",
                mfu,
                notes=notes,
                attention_share=share,
            )
        )
    return rows


_COMPILE_NOTE = "torch.compile traced as eager, timed with each chain of elementwise operators as one kernel"
_CHUNKED_NOTE = (
    "torchtune's chunked cross-entropy (CEWithChunkedOutputLoss: the LM head's output in 8 slices, each slice's "
    "upcast + cross-entropy compiled, which keeps the slice's bf16 logits and recomputes nothing) as autotune's "
    "--loss chunked-kept, which keeps the same (autotune's chunked would recompute each slice's LM head in the "
    "backward: one more LM-head matmul, 4% of T2's FLOPs here). Against T2's whole logits, the slices' matmuls "
    "read the LM head's weight 8 times and sum its gradient 8 times (16.5 GB each here), more traffic than the "
    "fp32 logits they never make: the model puts T3 below T2, torchtune measured it 2% above"
)
_T5_NOTE = (
    "gpu_published.py's rows as they are: T4's levers with torchtune's fused AdamW (T1-T4 here keep "
    "gpu_published's T1 foreach AdamW), the optimizer step inside the backward, activation offload (its copies "
    "timed as device memory traffic; torchtune's streams overlap the host link) and bitsandbytes' 8-bit AdamW "
    "(traced as torchao's, one kernel on CUDA)"
)


_EIGHT_BIT_TIME_NOTE = (
    "the 8-bit step timed as the one kernel bitsandbytes runs: weights, gradients and 8-bit moments read once, "
    "weights and moments written back (16 bytes a parameter in fp32, where AdamW moves 28); its launch per "
    "parameter and the Python around it are not counted"
)


def _torchtune_rows() -> list[Row]:
    """T1 as gpu_published.py rebuilds it, then torchtune's levers one by one (its README's table); T5's
    lines and T6 (with its NF4 line) as gpu_published.py rebuilds them, on T5's activation offload."""
    t1 = next(row for row in gpu_published.ROWS if row.key == "T1")
    base, note = t1.config, t1.notes[0]
    compiled = base.replace(compile=True)
    chunked = compiled.replace(loss="chunked-kept")
    checkpointed = chunked.replace(checkpointing=True)
    steps = [
        ("T1", "Llama-3.2-3B pure bf16, seq 4096 mb2", base, 7_075, ()),
        ("T2", "T1 + torch.compile", compiled, 8_998, (_COMPILE_NOTE,)),
        ("T3", "T2 + chunked cross-entropy", chunked, 9_174, (_COMPILE_NOTE, _CHUNKED_NOTE)),
        ("T4", "T3 + checkpointing every layer", checkpointed, 7_210, (_COMPILE_NOTE, _CHUNKED_NOTE)),
    ]
    rows = [
        Row(key, what, t1.workload, config, tokens, "tokens/s", notes=(note, *extra))
        for key, what, config, tokens, extra in steps
    ]
    # The rest, each with its tokens/s per GPU as torchtune's table printed it.
    published = {"T5": 7_309, "T5+offload": 7_301, "T5+8bit": 6_960, "T6": 8_210, "T6+NF4": 8_035}
    for row in gpu_published.ROWS:
        if row.key in published:
            extra = (_COMPILE_NOTE, _CHUNKED_NOTE) + ((_T5_NOTE,) if row.key.startswith("T5") else ())
            extra += (_EIGHT_BIT_TIME_NOTE,) if row.config.optimizer == "adamw-8bit" else ()
            what = row.what.replace("T4 + activation offload, LoRA", "T4 + offload + LoRA")
            rows.append(
                Row(row.key, what, row.workload, row.config, published[row.key], "tokens/s", notes=(note, *extra))
            )
    return rows


def _bert_rows() -> list[Row]:
    """gpu_published.py's H1-H9 as they are: Trainer batch 4, train_samples_per_second as the docs printed it."""
    samples = {
        "H1": 8.86,
        "H2": 7.75,
        "H3": 5.99,
        "H4": 18.64,
        "H5": 10.09,
        "H6": 7.96,
        "H7": 9.06,
        "H8": 9.15,
        "H9": 10.35,
    }
    return [
        Row(
            row.key,
            row.what,
            row.workload,
            row.config,
            samples[row.key],
            "samples/s",
            pytorch1_step=row.measured_with.pytorch1_step,
            notes=(*row.notes, *((_EIGHT_BIT_TIME_NOTE,) if row.config.optimizer == "adamw-8bit" else ())),
        )
        for row in gpu_published.ROWS
        if row.key in samples
    ]


_TITAN_CARD_NOTE = (
    "torchtitan's H100s (Grand Teton: 96GB HBM2e at 2.4 TB/s, 500 W, as its benchmark notes say) timed as autotune's "
    "H100-96GB-HBM2e: that bandwidth; its peak, which torchtitan says lies between SXM's and NVL's and does not know, "
    "taken as the SXM's, and its matmuls at the SXM's sustained rate (745 of 989 TFLOP/s bf16, measured at 700 W; "
    "likely high at 500 W)"
)
_TORCHAO_CARD_NOTE = (
    "torchao's float8 table does not say which H100; its team's logs of the same recipe (torchao's float8 pretraining "
    "tutorial) ran on 95.0 GiB H100s, torchtitan's card (gpu_published.py says how that is read)"
)


def _titan_rows() -> list[Row]:
    """gpu_published.py's torchtitan rows as they are (Llama-3-8B seq 8192, FSDP2, selective per-op
    checkpointing; S3 and S6-float8 with float8 Linear layers), against the TPS/GPU torchtitan's and torchao's
    tables printed (S6's: the median)."""
    published = {"S1": 5_762, "S2": 6_667, "S3": 8_532, "S4": 5_605, "S5": 6_514, "S6": 6_150, "S6-float8": 7_689.5}
    return [
        Row(
            row.key,
            row.what,
            row.workload,
            row.config,
            published[row.key],
            "tokens/s",
            notes=((_COMPILE_NOTE,) if row.config.compile else ())
            + (_TITAN_CARD_NOTE,)
            + ((_TORCHAO_CARD_NOTE,) if row.key.startswith("S6") else ()),
        )
        for row in gpu_published.SHARDED_ROWS
        if row.key in published
    ]


ROWS: list[Row] = _mpt_rows() + _torchtune_rows() + _bert_rows() + _titan_rows()

# Each sweep: row keys in the published order, fastest first (per GPU).
SWEEPS: dict[str, list[str]] = {
    "MPT sizes, A100 80GB (F6)": ["F6 125m", "F6 350m", "F6 1b", "F6 3b", "F6 13b"],
    "MPT sizes, H100 (F4: 760m vs 1b)": ["F4 760m", "F4 1b"],
    "MPT sizes, H100 (F1, F3, F4)": ["F4 760m", "F4 1b", "F1 7b", "F3 13b"],
    "MPT sizes, A100 40GB (F7)": ["F7 125m", "F7 1b", "F7 7b"],
    "MPT-7b seq 4096 vs 8192 (F2)": ["F2 7b/4096", "F2 7b/8192"],
    "torchtune levers (T1-T4, T6)": ["T3", "T2", "T6", "T4", "T1"],
    "bert-large V100 (H1-H5)": ["H4", "H5", "H1", "H2", "H3"],
    "bert-large V100 optimizers, fp32 mb4 (H1, H6, H8)": ["H8", "H1", "H6"],
    "bert-large V100 optimizers, fp16 mb1 x4 ckpt (H5, H7, H9)": ["H9", "H5", "H7"],
    "torchtitan levers, FSDP 8 (S1-S3)": ["S3", "S2", "S1"],
    "torchtitan levers, FSDP 128 (S4, S5)": ["S5", "S4"],
    "float8 tensorwise vs bf16, mb1 (S6)": ["S6-float8", "S6"],
}

NOT_EXPRESSIBLE = {
    "L1-L4, P1, P2": "memory only (no throughput published, L1's 2.36 min per 1k steps is on unpadded samples)",
    "S21": "torchtitan's async TP notes (FSDP 8 x TP 8): async TP has no knob, and its float8 lines cannot be "
    "rebuilt: --float8 refuses --tp (not measured)",
}


def kind_split(estimate: MemoryEstimate, profile: DeviceProfile) -> dict[str, float]:
    """Diagnostic: one micro step's device seconds per operator kind, and its host (dispatch) seconds."""
    assert estimate.step_costs is not None
    ops = estimate.step_costs.micro_step(estimate.config.micro_batch, fused=estimate.config.compile)
    split: dict[str, float] = {}
    for kind in sorted({op[0] for op in ops}):
        device, _ = step_time._phase_times([op for op in ops if op[0] == kind], profile, estimate.config, 1.0)
        # what an operator that joins a fused chain adds to (or saves of) its kernel's time: the chain's, other
        name = "other" if kind == "fused" else kind
        split[name] = split.get(name, 0.0) + device
    split["host"] = step_time._phase_times(ops, profile, estimate.config, 1.0)[1]
    return split


def predict_row(row: Row) -> dict[str, Any]:
    started = time.perf_counter()
    estimate = predict_memory(
        row.workload, row.config, timeout_s=1800, measured_with=MeasuredWith(pytorch1_step=row.pytorch1_step)
    )
    assert row.workload.gpu is not None
    profile = card_profile(gpu_spec(row.workload.gpu))
    if row.attention_share is not None and profile.attention_efficiency is not None:
        profile = dataclasses.replace(profile, attention_efficiency=profile.attention_efficiency * row.attention_share)
    timed = predict_step_time(estimate, row.workload, profile)
    assert timed is not None, f"{row.key}: the estimate has no traced step costs"
    rate = timed.tokens_per_s if row.unit == "tokens/s" else timed.samples_per_s
    assert rate is not None
    predicted = rate / row.workload.nproc
    try:
        split = kind_split(estimate, profile)
    except (AttributeError, TypeError):  # step_time's private helper changed: the split is only a diagnostic
        split = {}
    return {
        "row": row.key,
        "group": row.group,
        "what": row.what,
        "gpu": row.workload.gpu,
        "unit": row.unit,
        "published": row.published,
        "predicted": predicted,
        "error": predicted / row.published - 1,
        "published_mfu": row.published_mfu,
        "predicted_mfu": timed.mfu,
        "step": timed.to_dict(),
        "micro_step_split_s": split,
        "workload": {**row.workload.to_dict(), "model": _from_root(row.workload.model)},
        "config": row.config.to_dict(),
        "pytorch1_step": row.pytorch1_step,
        "attention_share": row.attention_share,
        "notes": list(row.notes),
        "seconds": time.perf_counter() - started,
    }


def sweep_orders(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each sweep with all its rows predicted: the predicted order against the published one."""
    predicted = {r["row"]: r["predicted"] for r in results}
    sweeps = []
    for name, published in SWEEPS.items():
        if not all(key in predicted for key in published):
            continue
        order = sorted(published, key=lambda key: -predicted[key])
        pairs = [(a, b) for i, a in enumerate(published) for b in published[i + 1 :]]
        wrong = [f"{a} vs {b}" for a, b in pairs if predicted[a] <= predicted[b]]  # a tie is not the order
        sweeps.append(
            {
                "sweep": name,
                "published_order": published,
                "predicted_order": order,
                "matches": not wrong,
                "pairs": len(pairs),
                "pairs_out_of_order": wrong,
            }
        )
    return sweeps


def _figure(value: float, unit: str) -> str:
    return f"{value:,.0f}" if unit == "tokens/s" else f"{value:.2f}"


def _parts(result: dict[str, Any]) -> str:
    step = result["step"]
    parts = [
        f"step {step['step_s']:.3f} s: compute {step['compute_s'] / step['step_s']:.0%}"
        + (
            f" (of it {step['collective_sms_s'] / step['step_s']:.0%} on the SMs NCCL holds)"
            if step.get("collective_sms_s")
            else ""
        ),
        f"update {step['update_s'] / step['step_s']:.0%}",
        f"comm {step['communication_s'] / step['step_s']:.0%}",
    ]
    split = result["micro_step_split_s"]
    device = sum(v for k, v in split.items() if k not in ("host", "collective"))
    if device:
        parts.append(
            "micro step: "
            + ", ".join(f"{k} {v / device:.0%}" for k, v in split.items() if k not in ("host", "collective") and v)
        )
        if split.get("host", 0) > device:
            parts.append(f"host-bound ({split['host'] / device:.1f}x the device)")
    return "; ".join(parts)


def published_table(results: list[dict[str, Any]], sweeps: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| row | config | GPU | unit per GPU | published | predicted | error | MFU pub / pred | predicted parts |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mfu = (
            f"{r['published_mfu']:.1%} / {r['predicted_mfu']:.1%}"
            if r["published_mfu"] and r["predicted_mfu"]
            else (f"- / {r['predicted_mfu']:.1%}" if r["predicted_mfu"] else "-")
        )
        lines.append(
            f"| {r['row']} | {r['what']} | {r['gpu']} | {r['unit']} | {_figure(r['published'], r['unit'])} | "
            f"{_figure(r['predicted'], r['unit'])} | {r['error']:+.1%} | {mfu} | {_parts(r)} |"
        )
    if results:
        errors = [abs(r["error"]) for r in results]
        worst = max(results, key=lambda r: abs(r["error"]))
        lines += [
            "",
            "MFU: llm-foundry's counts attention's whole s x s square; the predicted one counts the traced "
            "FLOPs (causal attention at half). The predicted parts: the step's shares, then one micro step's "
            "device time per operator kind (diagnostic).",
            "",
            f"median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%} ({worst['row']}) "
            f"over {len(results)} rows",
        ]
    if sweeps:
        lines += ["", "Order within each published sweep (fastest first):"]
        for s in sweeps:
            wrong = s["pairs_out_of_order"]
            verdict = "matches" if s["matches"] else f"differs ({len(wrong)} of {s['pairs']} pairs: {'; '.join(wrong)})"
            lines.append(
                f"- {s['sweep']}: {verdict}; published {' > '.join(s['published_order'])}, "
                f"predicted {' > '.join(s['predicted_order'])}"
            )
    lines += ["", "Not expressible:"] + [f"- {key}: {why}" for key, why in NOT_EXPRESSIBLE.items()]
    noted: dict[str, list[str]] = {}
    for r in results:
        for note in r["notes"]:
            noted.setdefault(note, []).append(r["row"])
    lines += ["", "Row notes:"] + [f"- {', '.join(rows)}: {note}" for note, rows in noted.items()]
    return lines


# -- part 2: the CPU grids --------------------------------------------------------------------------


def cpu_profile(grid: str) -> tuple[DeviceProfile, str]:
    """The grid's roofline as the replays take it (``search.grid_roofline``: measured beside the grid,
    or for an older grid this machine's, with the grid machine's matmul speed per precision)."""
    probe_path = DATA / f"{grid}.probe.json"
    probe = json.loads(probe_path.read_text()) if probe_path.exists() else None
    profile, how = grid_roofline(DATA / f"{grid}.jsonl", probe)
    if profile is None:
        sys.exit(f"{grid}: no roofline beside it and the CPU device probe failed")
    return DeviceProfile.from_dict(profile), how


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks, ties given their mean rank."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def predict_grid(grid: str) -> dict[str, Any]:
    started = time.perf_counter()
    profile, how = cpu_profile(grid)
    lines = []
    for line in read_grid(DATA / f"{grid}.jsonl"):
        if line["status"] != "ok" or not line.get("tokens_per_s"):
            continue
        workload = Workload.from_dict(line["workload"]).replace(device="cpu")
        config = TrialConfig.from_dict(line["config"])
        timed: StepTime | None = predict_step_time(predict_memory(workload, config, timeout_s=600), workload, profile)
        assert timed is not None and timed.tokens_per_s is not None
        lines.append(
            {
                "config": config.describe(),
                "precision": config.precision,
                "measured": line["tokens_per_s"],
                "predicted": timed.tokens_per_s,
            }
        )
    measured, predicted = [x["measured"] for x in lines], [x["predicted"] for x in lines]
    best_predicted = max(lines, key=lambda x: x["predicted"])
    precisions = sorted({x["precision"] for x in lines})
    within = {
        p: spearman(
            [x["predicted"] for x in lines if x["precision"] == p],
            [x["measured"] for x in lines if x["precision"] == p],
        )
        for p in precisions
    }
    return {
        "grid": grid,
        "profile": how,
        "roofline": profile.to_dict(),
        "lines": lines,
        "spearman": spearman(predicted, measured),
        "spearman_within_precision": within if len(precisions) > 1 else {},
        "predicted_best": best_predicted["config"],
        "predicted_best_over_measured_best": best_predicted["measured"] / max(measured),
        "measured_best": max(lines, key=lambda x: x["measured"])["config"],
        "seconds": time.perf_counter() - started,
    }


def grid_table(grids: list[dict[str, Any]]) -> list[str]:
    lines = [
        "CPU grids (each predicted with the roofline its profile column names; the order is compared):",
        "",
        "| grid | ok lines | Spearman (predicted vs measured tokens/s) | predicted best | its measured tokens/s "
        "over the grid's best | profile |",
        "|---|---|---|---|---|---|",
    ]
    for g in grids:
        within = ", ".join(f"{p} {rho:+.2f}" for p, rho in g["spearman_within_precision"].items())
        rho = f"{g['spearman']:+.2f}" + (f" (within one precision: {within})" if within else "")
        lines.append(
            f"| {g['grid']} | {len(g['lines'])} | {rho} | {g['predicted_best']} "
            f"(measured best: {g['measured_best']}) | {g['predicted_best_over_measured_best']:.0%} | "
            f"{g['profile']} |"
        )
    return lines


# -- main -------------------------------------------------------------------------------------------


def _wanted(option: str | None, names: list[str], of: Any = lambda name: name) -> list[Any]:
    if option is None:
        return names
    keys = set(option.split(","))
    return [n for n in names if of(n) in keys or (isinstance(n, Row) and n.key in keys)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated rows or groups (F6, T1, 'F2 7b/4096'); none: skip part 1")
    parser.add_argument("--grids", help=f"comma-separated grids of {', '.join(GRIDS)}; none: skip part 2")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    parser.add_argument("--out", type=Path, default=Path("bench/results/plan_published.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    log = sys.stderr if args.json else sys.stdout

    results = []
    for row in _wanted(args.rows, ROWS, lambda r: r.group):
        results.append(predict_row(row))
        r = results[-1]
        print(
            f"{row.key}: {_figure(r['predicted'], row.unit)} {row.unit} predicted, "
            f"{_figure(row.published, row.unit)} published, {r['error']:+.1%} ({r['seconds']:.0f} s)",
            file=log,
            flush=True,
        )
    sweeps = sweep_orders(results)

    grids: list[dict[str, Any]] = []
    for grid in _wanted(args.grids, list(GRIDS)):
        grids.append(predict_grid(grid))
        print(
            f"{grid}: Spearman {grids[-1]['spearman']:+.2f} over {len(grids[-1]['lines'])} lines "
            f"({grids[-1]['seconds']:.0f} s)",
            file=log,
            flush=True,
        )

    seconds = time.perf_counter() - started
    lines = published_table(results, sweeps) if results else []
    triton = llm_foundry_attention.report(MPT_POINTS) if any(r["group"].startswith("F") for r in results) else None
    if triton:
        lines += [
            "",
            "llm-foundry's Triton attention (F rows), from its sequence sweeps (seconds per token per GPU against the "
            f"sequence, least squares from {triton['from_seq']:,} tokens; python bench/llm_foundry_attention.py):",
        ]
        lines += [
            f"- {'' if line.model in llm_foundry_attention.USED else '(not used) '}{line.describe()}"
            for line in llm_foundry_attention.sweep_lines(MPT_POINTS)
        ]
        lines.append(
            "- share of FlashAttention-2's rate, the median of the 1b and 7b sweeps: "
            + ", ".join(f"{card} {share:.1%}" for card, share in triton["shares"].items())
            + " (with the points that are F rows: "
            + ", ".join(f"{card} {share:.1%}" for card, share in triton["shares_with_bench_rows"].items())
            + ")"
        )
    if grids:
        lines += ([""] if lines else []) + grid_table(grids)
    lines += ["", f"{seconds:.0f} s in all"]
    table = "\n".join(lines)
    options = [
        f"--rows '{args.rows}'" if args.rows else "",
        f"--grids {args.grids}" if args.grids else "",
        f"--out {args.out}" if args.out != parser.get_default("out") else "",
    ]
    command = " ".join(["python bench/plan_published.py", *filter(None, options)])
    errors = [abs(r["error"]) for r in results]
    summary = {
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        "sweeps": sweeps,
        "spearman": {g["grid"]: g["spearman"] for g in grids},
        "seconds": seconds,
    }
    document = {
        "command": command,
        "rows": results,
        "summary": summary,
        "grids": grids,
        "triton_attention": triton,
        "not_expressible": NOT_EXPRESSIBLE,
    }
    print(json.dumps(document, indent=2) if args.json else table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".txt").write_text(f"$ {command}\n\n{table}\n")


if __name__ == "__main__":
    main()
