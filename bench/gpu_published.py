"""Published GPU memory measurements rebuilt and predicted on this CPU, each in its own metric.

    python bench/gpu_published.py [--rows H1,T1] [--out bench/results/gpu_published.json]

Every published row in ``ROWS`` below that autotune's knobs can express is rebuilt as a
workload and config (the models from their configs in ``bench/data/published/``, random
weights), estimated for its card with ``--gpu``, and compared with the published figure in the
metric its source used:

* torchtune's "peak memory active" and LitGPT's / PEFT's ``max_memory_allocated``: against the
  predicted peak allocated (live tensors);
* the Transformers docs' nvidia-smi readings: against the predicted device figure (reserved +
  the CUDA context).

Rows it cannot express are listed with the reason. The table goes to stdout last, the figures to
``--out`` (and ``.txt`` beside it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from autotune.config.knobs import TrialConfig
from autotune.config.workload import Workload
from autotune.estimate.estimator import predict_memory
from autotune.estimate.measured_with import AS_INSTALLED, MeasuredWith

DATA = Path(__file__).parent / "data" / "published"
GiB, GB, MiB = 2**30, 10**9, 2**20
# PyTorch 1.x: AdamW stepped tensor by tensor, zero_grad() kept the gradients.
_PYTORCH1 = MeasuredWith(pytorch1_step=True)


@dataclass(frozen=True)
class Row:
    key: str
    what: str
    workload: Workload
    config: TrialConfig
    metric: str  # "allocated" (peak allocated / active) or "device" (nvidia-smi)
    published_bytes: int
    published_text: str
    # What it ran beyond autotune's knobs (PyTorch 1.x's step, an older bitsandbytes, Lightning's quantization).
    measured_with: MeasuredWith = AS_INSTALLED
    notes: list[str] = field(default_factory=list)


def _model(name: str) -> str:
    return str(DATA / f"{name}.json")


def _bert(mb: int, precision: str, checkpointing: bool, optimizer: str = "adamw") -> tuple[Workload, TrialConfig]:
    # The Trainer's batch of 4: micro batch 4, or 1 with 4 accumulation steps.
    workload = Workload(model=_model("bert-large"), task="seq-cls", seq_len=512, global_batch=4, gpu="V100-16GB")
    return workload, TrialConfig(
        micro_batch=mb, precision=precision, checkpointing=checkpointing, attention="eager", optimizer=optimizer
    )


def _torchtune(**levers: object) -> tuple[Workload, TrialConfig]:
    # torchtune's sweep from T4 on: pure bf16, every layer checkpointed, compiled, chunked cross-entropy (8 chunks):
    # torchtune's CEWithChunkedOutputLoss, whose compiled upcast + cross-entropy keeps each chunk's bf16 logits
    # for the backward and recomputes nothing: autotune's chunked-kept (its chunked recomputes the LM head).
    workload = Workload(model=_model("llama-3.2-3b"), task="causal-lm", seq_len=4096, global_batch=2, gpu="A100-80GB")
    # Its AdamW is fused (torchtune's AdamW configs set fused: True; the sweep's unpacked baseline, 25.5 GiB
    # beside 24 GiB of model states, leaves no room for foreach AdamW's 6 GiB temporary); 8-bit AdamW is not.
    base = TrialConfig(micro_batch=2, precision="bf16-true", checkpointing=True, loss="chunked-kept", compile=True)
    fused = levers.get("optimizer", "adamw") == "adamw"
    return workload, base.replace(fused_optimizer=fused, **levers)


def _litgpt_lora(model: str, mb: int, quantize_base: str = "off") -> tuple[Workload, TrialConfig]:
    # LitGPT's LoRA defaults: r 8, alpha 16 on the query and value projections; bf16-true.
    workload = Workload(model=_model(model), task="causal-lm", seq_len=1304, global_batch=mb, gpu="A100-40GB")
    return workload, TrialConfig(
        micro_batch=mb,
        precision="bf16-true",
        lora_rank=8,
        lora_alpha=16,
        lora_targets=("q_proj", "v_proj"),
        quantize_base=quantize_base,
    )


def _peft_t0(**lora: object) -> tuple[Workload, TrialConfig]:
    workload = Workload(
        model=_model("t5-3b"), task="seq2seq-lm", seq_len=64, target_len=4, global_batch=8, gpu="A100-80GB"
    )
    return workload, TrialConfig(micro_batch=8, precision="fp32", **lora)  # type: ignore[arg-type]


_BERT_NOTE = (
    "Trainer of early 2022 on PyTorch 1.x: eager attention, Transformers' own AdamW (tensor by tensor), "
    "model.zero_grad() keeping the gradients; nvidia-smi includes the 1,343 MiB the same page measured "
    "for the context"
)
_LITGPT_NOTE = (
    "LitGPT's own Llama (flash SDPA, LM head in 128-token chunks) rebuilt as Transformers' Llama with PEFT "
    "(standard loss, fp32 logits): the peak is the longest Alpaca sample, 1,304 tokens. At a small Llama shape "
    "both keep the same bytes a layer for the backward (bench/litgpt_activations.py: 40.3 and 40.8 "
    "hidden-size bytes a token a layer; LitGPT's head and loss keep bf16 log-probabilities, half of "
    "Transformers' fp32). What LitGPT holds beyond the prediction (1.5 GB at 7B mb1, 2.9 GB at mb2, "
    "2.4 GB at 13B: per sample) is not explained here"
)
_ADAFACTOR_NOTE = (
    "the Trainer's optim=adafactor (scale_parameter, relative_step and warmup_init off, no first moment): "
    "Transformers' Adafactor, as autotune builds it"
)
_EIGHT_BIT_NOTE = (
    "bitsandbytes' Adam8bit (the docs' optimizers=(bnb.optim.Adam8bit(...), None)) traced as torchao's AdamW8bit: "
    "the same state bytes (uint8 moments, an fp32 scale per block of 256; tensors under 4,096 values keep "
    "32-bit moments in both), step temporaries of the eager torchao step where bitsandbytes runs one kernel"
)
# torchtune's llama3_2/3B_lora_single_device: rank 64, alpha 128, on q, v and the output projection and the MLP.
_TORCHTUNE_LORA: dict[str, object] = {
    "lora_rank": 64,
    "lora_alpha": 128,
    "lora_targets": ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
_NF4_NOTE = (
    "NF4 rebuilt as bitsandbytes' Linear4bit with double-quantized scales (0.516 bytes a weight); torchtune's "
    "torchao NF4 tensor also quantizes its scales (block 64, scaler block 256)"
)
_LITGPT_NF4_NOTE = (
    "LitGPT's --quantize bnb.nf4 / bnb.nf4-dq through Lightning's BitsandbytesPrecision: every Linear quantized "
    "(the LM head too), fp32 scales for nf4 and quantized ones for nf4-dq, each weight quantized from float16 "
    "(so each 4-bit matmul dequantizes to float16, then casts to bf16); and bitsandbytes 0.41.1, whose MatMul4Bit "
    "kept each 4-bit layer's input for the backward (dropped in 0.43.2): all traced (MeasuredWith). Not traced: "
    "LitGPT's LoRA dropout 0.05 keeps its output and mask where PEFT's dropout 0 keeps the qkv input itself, "
    "which 0.41.1's 4-bit qkv layer then keeps besides (2 bytes x hidden a token a layer: 0.33 GB at 7B, "
    "0.52 GB at 13B)"
)
_TORCHTUNE_NOTE = (
    "torchtune's own Llama (packed: flex attention with a block-causal mask, kept as flash keeps it) rebuilt as "
    "Transformers' Llama; fused AdamW; torch.compile predicted as eager (every layer is checkpointed, so compile's "
    "share is the recomputed layer; the savings compare rows that all compile). torchtune's chunked "
    "cross-entropy (CEWithChunkedOutputLoss, its upcast + cross-entropy compiled) keeps its 8 chunks' bf16 logits "
    "(1.96 GiB here) and a log-sum-exp per token for the backward, as Inductor partitions it: rebuilt as "
    "autotune's --loss chunked-kept, which keeps the same (its fp32 work, on blocks of 64 MiB of rows made and "
    "freed in the forward and again in the backward, is a temporary Inductor's fused kernel does not make)"
)
_PEFT_NOTE = (
    "twitter_complaints tweets with their prompt, padded to the longest in the batch: not published, "
    "taken as 64 source and 4 target tokens (each source token x2 adds about 8% here); "
    "T0_3B's shape as the published table gives it; PyTorch 1.13: "
    "AdamW tensor by tensor, zero_grad() keeping the gradients"
)

ROWS: list[Row] = [
    Row(
        "H1",
        "BERT-L mb4 fp32",
        *_bert(4, "fp32", False),
        "device",
        14_949 * MiB,
        "14,949 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE],
    ),
    Row(
        "H2",
        "BERT-L mb1 x4 fp32",
        *_bert(1, "fp32", False),
        "device",
        8_681 * MiB,
        "8,681 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE],
    ),
    Row(
        "H3",
        "BERT-L mb1 x4 fp32 ckpt",
        *_bert(1, "fp32", True),
        "device",
        6_775 * MiB,
        "6,775 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE],
    ),
    Row(
        "H4",
        "BERT-L mb4 fp16",
        *_bert(4, "fp16", False),
        "device",
        13_939 * MiB,
        "13,939 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE],
    ),
    Row(
        "H5",
        "BERT-L mb1 x4 fp16 ckpt",
        *_bert(1, "fp16", True),
        "device",
        7_275 * MiB,
        "7,275 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE],
    ),
    Row(
        "T1",
        "Llama-3.2-3B pure bf16, seq 4096 mb2",
        Workload(model=_model("llama-3.2-3b"), task="causal-lm", seq_len=4096, global_batch=2, gpu="A100-80GB"),
        TrialConfig(micro_batch=2, precision="bf16-true"),
        "allocated",
        int(60.0 * GiB),
        "60.0 GiB (active)",
        notes=[
            "torchtune's own Llama (packed: flex attention with a block-causal mask, kept as flash keeps it) "
            "rebuilt as Transformers' Llama with causal SDPA; both upcast the logits to fp32 for the loss"
        ],
    ),
    Row(
        "L1",
        "Llama-2-7B LoRA r8 q,v bf16-true mb1",
        *_litgpt_lora("llama-2-7b", 1),
        "allocated",
        int(21.30 * GB),
        "21.30 GB (allocated)",
        notes=[_LITGPT_NOTE],
    ),
    Row(
        "L2",
        "Llama-2-7B LoRA r8 q,v bf16-true mb2",
        *_litgpt_lora("llama-2-7b", 2),
        "allocated",
        int(29.07 * GB),
        "29.07 GB (allocated)",
        notes=[_LITGPT_NOTE],
    ),
    Row(
        "L3",
        "Llama-2-13B LoRA r8 q,v bf16-true mb1",
        *_litgpt_lora("llama-2-13b", 1),
        "allocated",
        int(38.12 * GB),
        "38.12 GB (allocated)",
        notes=[_LITGPT_NOTE],
    ),
    Row(
        "P1",
        "T0-3B full fine-tuning fp32 mb8",
        *_peft_t0(),
        "allocated",
        int(47.14 * GB),
        "47.14 GB (allocated)",
        measured_with=_PYTORCH1,
        notes=[_PEFT_NOTE],
    ),
    Row(
        "P2",
        "T0-3B LoRA r8 q,v fp32 mb8",
        *_peft_t0(lora_rank=8, lora_alpha=32, lora_targets=("q", "v")),
        "allocated",
        int(14.4 * GB),
        "14.4 GB (allocated)",
        measured_with=_PYTORCH1,
        notes=[_PEFT_NOTE],
    ),
]


def _litgpt_qlora(key: str, what: str, model: str, mode: str, published_gb: float) -> Row:
    """A LitGPT resource-table row on a 4-bit base (tutorials/resource-tables.md, "Finetuning with LoRA on 1 GPU",
    micro batch 1), traced as LitGPT ran it: through Lightning's BitsandbytesPrecision(mode), on bitsandbytes
    0.41.1, whose 4-bit layers kept their input for the backward."""
    return Row(
        key,
        what,
        *_litgpt_lora(model, 1, quantize_base="nf4"),
        "allocated",
        int(published_gb * GB),
        f"{published_gb:.2f} GB (allocated)",
        measured_with=MeasuredWith(bnb_4bit_keeps_input=True, lightning_bnb=mode),
        notes=[_LITGPT_NOTE, _LITGPT_NF4_NOTE],
    )


ROWS += [
    Row(
        "H6",
        "BERT-L mb4 fp32 Adafactor",
        *_bert(4, "fp32", False, "adafactor"),
        "device",
        12_295 * MiB,
        "12,295 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE, _ADAFACTOR_NOTE],
    ),
    Row(
        "H7",
        "BERT-L mb1 x4 fp16 ckpt Adafactor",
        *_bert(1, "fp16", True, "adafactor"),
        "device",
        4_847 * MiB,
        "4,847 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE, _ADAFACTOR_NOTE],
    ),
    Row(
        "H8",
        "BERT-L mb4 fp32 8-bit Adam",
        *_bert(4, "fp32", False, "adamw-8bit"),
        "device",
        13_085 * MiB,
        "13,085 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE, _EIGHT_BIT_NOTE],
    ),
    Row(
        "H9",
        "BERT-L mb1 x4 fp16 ckpt 8-bit Adam",
        *_bert(1, "fp16", True, "adamw-8bit"),
        "device",
        5_363 * MiB,
        "5,363 MB (nvidia-smi)",
        measured_with=_PYTORCH1,
        notes=[_BERT_NOTE, _EIGHT_BIT_NOTE],
    ),
    Row(
        "T4",
        "Llama-3.2-3B pure bf16 ckpt chunked-CE compiled, fused AdamW",
        *_torchtune(),
        "allocated",
        int(24.9 * GiB),
        "24.9 GiB (active)",
        notes=[_TORCHTUNE_NOTE],
    ),
    Row(
        "T5",
        "T4 + optimizer step in backward",
        *_torchtune(optimizer_in_backward=True),
        "allocated",
        int(23.1 * GiB),
        "23.1 GiB (active)",
        notes=[_TORCHTUNE_NOTE],
    ),
    Row(
        "T5+offload",
        "T5 + activation offload",
        *_torchtune(optimizer_in_backward=True, activation_offload=True),
        "allocated",
        int(21.8 * GiB),
        "21.8 GiB (active)",
        notes=[_TORCHTUNE_NOTE],
    ),
    Row(
        "T5+8bit",
        "T5 + activation offload + 8-bit AdamW",
        *_torchtune(optimizer_in_backward=True, activation_offload=True, optimizer="adamw-8bit"),
        "allocated",
        int(17.6 * GiB),
        "17.6 GiB (active)",
        notes=[_TORCHTUNE_NOTE, _EIGHT_BIT_NOTE],
    ),
    Row(
        "T6",
        "T4 + activation offload, LoRA r64 on q,v,o and the MLP (torchtune's 3B defaults)",
        *_torchtune(activation_offload=True, **_TORCHTUNE_LORA),
        "allocated",
        int(8.5 * GiB),
        "8.5 GiB (active)",
        notes=[_TORCHTUNE_NOTE],
    ),
    Row(
        "T6+NF4",
        "T6 on an NF4 base (QLoRA)",
        *_torchtune(activation_offload=True, quantize_base="nf4", **_TORCHTUNE_LORA),
        "allocated",
        int(4.6 * GiB),
        "4.6 GiB (active)",
        notes=[_TORCHTUNE_NOTE, _NF4_NOTE],
    ),
    # LitGPT's --quantize bnb.nf4 rows, and the same table's bnb.nf4-dq rows.
    _litgpt_qlora("L3+NF4", "Llama-2-13B LoRA r8 q,v, NF4 base, bf16 compute mb1", "llama-2-13b", "nf4", 23.14),
    _litgpt_qlora("L4", "Llama-2-7B LoRA r8 q,v, NF4 base, bf16 compute mb1", "llama-2-7b", "nf4", 14.14),
    _litgpt_qlora("L4-dq", "L4 with double-quantized scales (bnb.nf4-dq)", "llama-2-7b", "nf4-dq", 13.84),
    _litgpt_qlora("L3+NF4-dq", "L3+NF4 with double-quantized scales (bnb.nf4-dq)", "llama-2-13b", "nf4-dq", 22.55),
]

# Published savings between rows that differ in one lever (each pair compiles, or neither does).
SAVINGS = [
    ("T4", "T5", "the optimizer step in backward"),
    ("T5", "T5+offload", "activation offload"),
    ("T5+offload", "T5+8bit", "8-bit AdamW"),
    ("T6", "T6+NF4", "an NF4 base under LoRA"),
    ("L3", "L3+NF4", "an NF4 base under LoRA"),
    ("L1", "L4", "an NF4 base under LoRA"),
    ("L4", "L4-dq", "double-quantized NF4 scales"),
    ("L3+NF4", "L3+NF4-dq", "double-quantized NF4 scales"),
    ("H1", "H6", "Adafactor for AdamW, fp32 mb4"),
    ("H5", "H7", "Adafactor for AdamW, fp16 mb1 x4 ckpt"),
    ("H1", "H8", "8-bit Adam for AdamW, fp32 mb4"),
    ("H5", "H9", "8-bit Adam for AdamW, fp16 mb1 x4 ckpt"),
]

NOT_EXPRESSIBLE = {
    "T2, T3": "torch.compile without checkpointing: compile's fused kernels keep 9 GiB less than the eager step "
    "(T1 -> T2), and the estimator traces the eager step. T4-T5 compile too, but checkpoint every layer, so "
    "compile's share is one recomputed layer: they are rebuilt, and their savings compared",
    "F1-F7": "throughput only (no memory figure): checked by `plan_published.py` instead",
}


def predict(row: Row) -> dict[str, object]:
    started = time.perf_counter()
    estimate = predict_memory(row.workload, row.config, timeout_s=1800, measured_with=row.measured_with)
    predicted = estimate.predicted_device_bytes if row.metric == "device" else estimate.predicted_peak_bytes
    assert predicted is not None
    error = predicted / row.published_bytes - 1
    return {
        "row": row.key,
        "what": row.what,
        "gpu": row.workload.gpu,
        "metric": row.metric,
        "published": row.published_text,
        "published_bytes": row.published_bytes,
        "predicted_bytes": predicted,
        "error": error,
        "estimate": estimate.to_dict(),
        "measured_with": row.measured_with.to_dict(),
        "notes": row.notes,
        "seconds": time.perf_counter() - started,
    }


def saving(before: dict[str, object], after: dict[str, object], what: str) -> dict[str, object]:
    """What one lever saves, published and predicted, between two rows in the same metric."""
    published = int(after["published_bytes"]) - int(before["published_bytes"])  # type: ignore[call-overload]
    predicted = int(after["predicted_bytes"]) - int(before["predicted_bytes"])  # type: ignore[call-overload]
    return {
        "from": before["row"],
        "to": after["row"],
        "lever": what,
        "published_bytes": published,
        "predicted_bytes": predicted,
        "same_sign": (published < 0) == (predicted < 0),
        "error_of_size": predicted / published - 1,
    }


def _figure(result: dict[str, object]) -> str:
    unit, name = (
        (GB, "GB")
        if "GB (" in str(result["published"])
        else ((GiB, "GiB") if "GiB" in str(result["published"]) else (MiB, "MB"))
    )
    value = int(result["predicted_bytes"]) / unit  # type: ignore[call-overload]
    return f"{value:,.0f} {name}" if name == "MB" else f"{value:.2f} {name}"


def _parts(result: dict[str, object]) -> str:
    estimate = result["estimate"]
    assert isinstance(estimate, dict)
    gib = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    states = estimate["parameters_bytes"] + estimate["gradients_bytes"] + estimate["optimizer_state_bytes"]
    text = (
        f"states {gib(states)} (not live {gib(estimate['not_live_at_peak_bytes'])}) + act "
        f"{gib(estimate['activations_bytes'])} + temp {gib(estimate['temporaries_bytes'])}"
    )
    if result["metric"] == "device":
        cuda = estimate["cuda_parts"]
        text += f" + cache {gib(cuda['allocator cache'])} + ctx {gib(cuda['CUDA context'])}"
    return text + " GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row keys (default: every expressible row)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_published.json"))
    args = parser.parse_args()
    wanted = set(args.rows.split(",")) if args.rows else None
    results = []
    for row in ROWS:
        if wanted is None or row.key in wanted:
            results.append(predict(row))
            print(
                f"{row.key}: {_figure(results[-1])} predicted, {row.published_text} published, "
                f"{results[-1]['error']:+.1%} ({results[-1]['seconds']:.0f} s)",
                flush=True,
            )
    errors = [abs(float(r["error"])) for r in results]  # type: ignore[arg-type]
    lines = [
        "| row | config | GPU | metric | published | predicted | error | predicted parts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['row']} | {r['what']} | {r['gpu']} | {r['metric']} | {r['published']} | "
            f"{_figure(r)} | {float(r['error']):+.1%} | {_parts(r)} |"
        )  # type: ignore[arg-type]
    lines.append("")
    lines.append(f"median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%} over {len(errors)} rows")
    by_key = {str(r["row"]): r for r in results}
    savings = [saving(by_key[a], by_key[b], what) for a, b, what in SAVINGS if a in by_key and b in by_key]
    if savings:
        lines += [
            "",
            "Savings of one lever (rows that differ in it alone, each in its own metric):",
            "",
            "| from | to | lever | published | predicted | same sign | error of its size |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {d['from']} | {d['to']} | {d['lever']} | {int(d['published_bytes']) / GiB:+.2f} GiB | "  # type: ignore[call-overload]
            f"{int(d['predicted_bytes']) / GiB:+.2f} GiB | {'yes' if d['same_sign'] else 'no'} | "  # type: ignore[call-overload]
            f"{float(d['error_of_size']):+.0%} |"  # type: ignore[arg-type]
            for d in savings
        ]
    lines.append("")
    lines.append("Not expressible:")
    lines += [f"- {key}: {why}" for key, why in NOT_EXPRESSIBLE.items()]
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/gpu_published.py" + (f" --rows {args.rows}" if args.rows else "")
    args.out.write_text(
        json.dumps(
            {"command": command, "rows": results, "savings": savings, "not_expressible": NOT_EXPRESSIBLE}, indent=2
        )
        + "\n"
    )
    args.out.with_suffix(".txt").write_text(f"$ {command}\n\n{table}\n")


if __name__ == "__main__":
    main()
