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

Rows it cannot express are listed with the reason.

The sharded and parallel runs (S1-S17: torchtitan's Llama-3-8B FSDP2 runs at seq 8192 with its max reserved,
KempnerForge's TP / FSDP runs on H200s with its max allocated and one nvidia-smi reading, OneFlow DLPerf's
Megatron-LM runs with nvidia-smi) get a table of their own, each in its metric, rebuilt in the nearest config
autotune can express, never skipped: torchtitan's selective per-op checkpointing and float8 Linear layers are
traced as ``--checkpointing selective`` and ``--float8 on``; what each rebuild leaves out (Megatron's fp16
optimizer and vocabulary-parallel layers, data-parallel copies beside tensor and pipeline parallelism)
and what its source leaves open is printed under it, with sizes where the sources give them; KempnerForge's loop is
rebuilt with the levers that run it (``--loss plain``, ``--grad-sync last``, ``--reduce-dtype fp32``). The fit
boundaries (S16, S17) print the estimate's verdict against the card beside the published one. The sources' configs
were read at the commits their reports name (torchtitan 9dec370, KempnerForge 601aba9 / 01b461a).
``bench/fsdp2_cuda_memory.md`` accounts for what FSDP2 and NCCL hold beyond the traced tensors and compares it with
these rows' errors. The reserved figures replay FSDP2's copy-in and reduce-scatter streams in pools of their own.

The tables go to stdout last, the figures to ``--out`` (and ``.txt`` beside it).
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
from autotune.errors import ConfigError
from autotune.estimate.client import predict_memory
from autotune.estimate.measured_with import AS_INSTALLED, MeasuredWith
from autotune.estimate.results import EstimateError, MemoryEstimate

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
    # The sharded and parallel rows: what the rebuild leaves out of the published run, what the source leaves
    # open, the unit printed.
    left_out: list[str] = field(default_factory=list)
    left_open: list[str] = field(default_factory=list)
    unit: str | None = None


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


# -- Sharded and parallel runs (S1-S17: published FSDP, tensor- and pipeline-parallel runs, each source named) ------
# torchtitan at 9dec370 (2024-12-26, the commit its benchmarks/llama3_h100_202412_torchtitan.md names):
# train_configs/llama3_8b.toml (seq 8192, selective_ac_option "op", AdamW without fused, so foreach),
# parallelize_llama.apply_fsdp (MixedPrecisionPolicy(param_dtype bf16, reduce_dtype fp32) from
# --training.mixed_precision_param / _reduce; every block resharded after forward except the last), train.py
# (the logged "memory" is max_reserved_gib; its loss upcasts bf16 logits with .float()). Its selective op
# checkpointing (_save_list: every other mm's output, SDPA's output, max) is traced as --checkpointing selective,
# its float8 converter (torchao's convert_to_float8_training, tensorwise) as --float8 on.
_TITAN_LEFT_OUT = [
    "the last block not resharded after forward (torchtitan keeps its bf16 parameters gathered: 0.41 GiB)",
]


_TITAN_OPEN = [
    "the card's memory: Grand Teton's H100 with 96GB HBM2e at 500 W (the 405B notes say 94GB and 95GB), predicted for "
    "autotune's H100-96GB-HBM2e, 97,871 MiB in nvidia-smi (derived): the total near which the reserved replay gives "
    "its cached segments back",
    "the figure is the largest reserved of the last logging interval (10 steps), read at step 90",
]
_COMPILE_NOTE = "torch.compile predicted as eager (its fused kernels may hold less)"
_FLOAT8_GATHER_OPEN = (
    "whether FSDP's all-gathers ran in float8 (enable_fsdp_float8_all_gather); the rebuild gathers bf16 weights "
    "and casts them after"
)
_TORCHAO_TABLE_NOTE = "torchao's float8 table: the largest reserved over all logged steps, labelled GB"
_S6_OPEN = [
    "the H100 variant, which the table does not state. Taken as torchtitan's H100-96GB-HBM2e from the same "
    "team's logs: torchao's float8 pretraining tutorial (Jun 2025: Llama-3-8B, llama3_8b.toml, compile, 8 H100s) "
    "printed 30.89 GiB as 32.51% of the card (95.0 GiB: the 96GB HBM2e H100, not the 80 GB SXM's 79.1) at 367 "
    "TFLOP/s a GPU (not the 96 GB H20's 148 peak), and its bf16 and float8 tensorwise lines (6,300 and 7,640 "
    "tokens/s) are within 2.4% and 0.6% of this table's",
    "torchtitan 0.0.2's own defaults (taken as 9dec370's: foreach AdamW, last block kept gathered)",
]
_KF_NOTE = (
    "KempnerForge at 601aba9 / 01b461a (the commits of its config_validation and mfu_scaling reports): the model "
    "cast to bf16 before fully_shard (build_parallel_model: .to(dtype=param_dtype)), so weights, gradients and "
    "fused AdamW's states in bf16; FSDP2 with MixedPrecisionPolicy(bf16, reduce fp32) on each block and the root, "
    "reshard_after_forward True (apply_fsdp2); full checkpointing; the peak is max_memory_allocated() / 1024**3 "
    "since the start (never reset), printed as 'GB' (GiB)"
)


def _kf_rebuilt() -> list[str]:
    """What a KempnerForge row's rebuild runs as KempnerForge's loop does (read at 01b461a / 601aba9)."""
    return [
        "its gradient accumulation (training/grad.py:16-40, maybe_no_sync: set_requires_gradient_sync(False) on "
        "every micro step but the last) rebuilt as --grad-sync last, and its MixedPrecisionPolicy(param_dtype="
        "bf16, reduce_dtype=fp32) on bf16 parameters (distributed/parallel.py:67-72, build_parallel_model's "
        ".to(dtype=param_dtype)) as --reduce-dtype fp32: FSDP2 keeps every unsharded gradient in fp32 between "
        "micro steps (FSDPParam.to_accumulated_grad_if_needed), traced",
        "its loss (scripts/train.py:294-297: logits = model(input_ids); F.cross_entropy(logits.view(-1, V), ...) "
        "on the bf16 logits, no upcast; `logits` alive until the next forward reassigns it) rebuilt as --loss plain",
    ]


_KF_TP_ONLY_NOTE = (
    "its tensor-parallel-only runs are FSDP2 runs too: init_distributed keeps a dp_shard mesh dimension of 1 "
    "beside tp (distributed/setup.py:153-159, 'so FSDP2 can wrap all parameters as DTensors'), and apply_fsdp2 "
    "wraps the model over it with the same policy; rebuilt as --fsdp full over one data-parallel rank"
)
_KF_LEFT_OUT = [
    "KempnerForge's own Llama (model/transformer.py; attention.py: its kv heads repeat_interleave'd before SDPA) "
    "rebuilt as Transformers' Llama of its shape (the same weights, RMSNorm in fp32, SDPA)"
]


_KF_TP_LEFT_OUT = [
    "KempnerForge's own Llama and tensor-parallel plan (SequenceParallel norms; its LM head ColwiseParallel, "
    "split by vocabulary columns with the logits gathered whole, tensor_parallel.py:157-164) rebuilt as "
    "Transformers' Llama with its tp_plan and --sequence-parallel on, whose LM head autotune splits the same way"
]


_MEGATRON_NOTE = (
    "DLPerf's Megatron-LM runs (commit 8aa4619, NGC 20.12): nvidia-smi sampled during training, an upper bound "
    "on what PyTorch held. Megatron's fp16 optimizer keeps an fp16 model, fp16 gradients, fp32 main weights, "
    "their fp32 gradients and Adam's two fp32 moments (about 20 bytes a parameter); autotune's fp16 keeps fp32 "
    "weights and gradients and casts 16-bit copies (16 bytes a parameter): 4 bytes a parameter fewer, "
    "1.9 GiB at 0.498B on one rank (divided by the tensor-parallel ranks)"
)
_MEGATRON_TP_LEFT_OUT = [
    "Megatron's GPT (learned positions, 4h GELU MLP, LayerNorm, dropout 0.1) rebuilt as a Llama of the same "
    "width, depth and parameter count (GELU-gated MLP of 8h/3, RoPE, RMSNorm, attention dropout 0.1), since "
    "Transformers' GPT-2 has no tensor-parallel plan",
    "Megatron's tensor parallelism splits the vocabulary (VocabParallelEmbedding, vocab-parallel cross-entropy: "
    "1/tp of the logits a rank); autotune leaves the embedding whole and gathers the split LM head's logits, "
    "so each rank holds all the logits",
    "Megatron's data-parallel copies beside the tensor-parallel groups (its DDP, replicated weights) dropped: "
    "autotune refuses DDP copies of tensor-parallel layers; each rank's model states are the same, "
    "less DDP's all-reduce buffers",
]
_MEGATRON_PP_LEFT_OUT = [
    "fp16 rebuilt as fp32 (autotune refuses fp16's loss scaling across pipeline stages, and a V100 has no "
    "bf16): fp32 activations and 16 bytes a parameter where Megatron keeps fp16 activations and about 20",
    "Megatron's data-parallel copies of the pipeline dropped (autotune refuses them); each rank's states are the same",
    "32 accumulation steps (global batch 512) rebuilt as one per stage, the fewest 1F1B takes: "
    "torch.distributed.pipelining's last stage keeps every micro batch's output until the step returns them "
    "merged (traced: +1.5 GiB of fp32 logits a micro batch at 0.498B, mb2), Megatron's keeps none; with one "
    "a stage the rebuild's last stage still keeps pp of them",
]


# The card torchtitan's benchmark notes name (Grand Teton's H100, 96GB HBM2e, 500 W). torchao's float8 table (S6)
# names no variant; its team's own logs of the same recipe ran on this card (_S6_OPEN says how that is known).
TITAN_CARD = "H100-96GB-HBM2e"


def _titan(
    nproc: int, mb: int, compile: bool, *, nodes: int = 1, float8: bool = False, gpu: str = TITAN_CARD
) -> tuple[Workload, TrialConfig]:
    workload = Workload(
        model=_model("llama-3-8b"),
        task="causal-lm",
        seq_len=8192,
        global_batch=mb * nproc,
        nproc=nproc,
        nodes=nodes,
        gpu=gpu,
    )
    config = TrialConfig(
        micro_batch=mb,
        precision="bf16",
        checkpointing=True,
        checkpoint_selective=True,
        fsdp="full",
        compile=compile,
        float8=float8,
    )
    return workload, config


def _kempner(
    model: str, nproc: int, mb: int, accum: int, *, tp: int = 1, compile: bool = True
) -> tuple[Workload, TrialConfig]:
    data = nproc // tp
    workload = Workload(
        model=_model(model),
        task="causal-lm",
        seq_len=4096,
        global_batch=mb * accum * data,
        nproc=nproc,
        nodes=max(1, nproc // 4),  # 4 H200s a node
        gpu="H200",
    )
    # Its loop's loss (scripts/train.py:293-297): F.cross_entropy on the bf16 logits, held in `logits` until the
    # next forward; FSDP2 on every run, over a data mesh of 1 beside TP (distributed/setup.py:153-159), reducing
    # only on the last micro step (training/grad.py:16-40), in fp32 (distributed/parallel.py:67-72).
    config = TrialConfig(
        micro_batch=mb,
        precision="bf16-true",
        checkpointing=True,
        fused_optimizer=True,
        compile=compile,
        fsdp="full",
        tp=tp,
        sequence_parallel=tp > 1,
        loss="plain",
        grad_sync="last",
        reduce_dtype="fp32",
    )
    return workload, config


def _megatron(model: str, nproc: int, mb: int, *, tp: int = 1, pp: int = 1) -> tuple[Workload, TrialConfig]:
    # A pipeline's 32 accumulation steps rebuilt as pp of them (the fewest 1F1B takes): see _MEGATRON_PP_LEFT_OUT.
    data, accum = nproc // (tp * pp), pp
    workload = Workload(
        model=_model(model),
        task="causal-lm",
        seq_len=2048,
        global_batch=mb * accum * data,
        nproc=nproc,
        gpu="V100-16GB",
    )
    config = TrialConfig(
        micro_batch=mb,
        precision="fp32" if pp > 1 else "fp16",
        checkpointing=True,
        attention="sdpa" if pp > 1 else "eager",  # Megatron's fused softmax keeps the scores; pipelines refuse eager
        tp=tp,
        pp=pp,
    )
    return workload, config


SHARDED_ROWS: list[Row] = [
    Row(
        "S1",
        "Llama-3-8B seq 8192 mb2, FSDP2 bf16 (fp32 reduce), eager",
        *_titan(8, 2, False),
        "reserved",
        int(82.4 * GiB),
        "82.4 GiB (reserved)",
        left_out=_TITAN_LEFT_OUT,
        left_open=_TITAN_OPEN,
    ),
    Row(
        "S2",
        "S1 + torch.compile",
        *_titan(8, 2, True),
        "reserved",
        int(77.0 * GiB),
        "77.0 GiB (reserved)",
        notes=[_COMPILE_NOTE],
        left_out=_TITAN_LEFT_OUT,
        left_open=_TITAN_OPEN,
    ),
    Row(
        "S3",
        "S2 + float8 Linear layers (tensorwise)",
        *_titan(8, 2, True, float8=True),
        "reserved",
        int(76.8 * GiB),
        "76.8 GiB (reserved)",
        notes=[_COMPILE_NOTE],
        left_out=_TITAN_LEFT_OUT,
        left_open=[*_TITAN_OPEN, _FLOAT8_GATHER_OPEN],
    ),
    Row(
        "S4",
        "S1 on FSDP 128 (16 nodes), eager",
        *_titan(128, 2, False, nodes=16),
        "reserved",
        int(67.0 * GiB),
        "67.0 GiB (reserved)",
        left_out=_TITAN_LEFT_OUT,
        left_open=_TITAN_OPEN,
    ),
    Row(
        "S5",
        "S4 + torch.compile",
        *_titan(128, 2, True, nodes=16),
        "reserved",
        int(62.0 * GiB),
        "62.0 GiB (reserved)",
        notes=[_COMPILE_NOTE],
        left_out=_TITAN_LEFT_OUT,
        left_open=_TITAN_OPEN,
    ),
    Row(
        "S6",
        "Llama-3-8B seq 8192 mb1, FSDP 8 bf16 + compile (torchtitan 0.0.2)",
        *_titan(8, 1, True),
        "reserved",
        int(47.65 * GiB),
        "47.65 GiB (reserved)",
        notes=[_COMPILE_NOTE, _TORCHAO_TABLE_NOTE],
        left_out=_TITAN_LEFT_OUT,
        left_open=_S6_OPEN,
    ),
    Row(
        "S6-float8",
        "S6 + float8 Linear layers (tensorwise)",
        *_titan(8, 1, True, float8=True),
        "reserved",
        int(47.77 * GiB),
        "47.77 GiB (reserved)",
        notes=[_COMPILE_NOTE, _TORCHAO_TABLE_NOTE],
        left_out=[
            *_TITAN_LEFT_OUT,
            "the table's rowwise line (47.79 GiB): autotune's --float8 is tensorwise scaling only",
        ],
        left_open=[*_S6_OPEN, _FLOAT8_GATHER_OPEN],
    ),
    Row(
        "S7-tp2",
        "Llama-3-8B seq 4096 mb4 x2, TP 2 (+SP), pure bf16, ckpt, fused AdamW, compile",
        *_kempner("llama-3-8b", 2, 4, 2, tp=2),
        "allocated",
        int(57.8 * GiB),
        '57.8 "GB" (allocated)',
        notes=[_KF_NOTE, _COMPILE_NOTE, _KF_TP_ONLY_NOTE, *_kf_rebuilt()],
        left_out=_KF_TP_LEFT_OUT,
        unit="GiB",
    ),
    Row(
        "S7-tp4",
        "same, TP 4 (+SP)",
        *_kempner("llama-3-8b", 4, 4, 2, tp=4),
        "allocated",
        int(39.4 * GiB),
        '39.4 "GB" (allocated)',
        notes=[_KF_NOTE, _COMPILE_NOTE, _KF_TP_ONLY_NOTE, *_kf_rebuilt()],
        left_out=_KF_TP_LEFT_OUT,
        unit="GiB",
    ),
    Row(
        "S7-tp2xfsdp2",
        "same, TP 2 (+SP) x FSDP 2",
        *_kempner("llama-3-8b", 4, 4, 2, tp=2),
        "allocated",
        int(45.9 * GiB),
        '45.9 "GB" (allocated)',
        notes=[_KF_NOTE, _COMPILE_NOTE, *_kf_rebuilt()],
        left_out=_KF_TP_LEFT_OUT,
        unit="GiB",
    ),
    Row(
        "S8",
        "KF-13B seq 4096 mb4 x4, FSDP 8 (2 nodes), pure bf16, ckpt, fused AdamW, eager",
        *_kempner("kempnerforge-13b", 8, 4, 4, compile=False),
        "allocated",
        int(88.5 * GiB),
        '88.5 "GB" (allocated)',
        notes=[_KF_NOTE, *_kf_rebuilt()],
        left_out=_KF_LEFT_OUT,
        unit="GiB",
    ),
    Row(
        "S9",
        "Llama-3-70B seq 4096 mb2 x4, TP 4 (+SP) x FSDP 8 (32 GPUs), pure bf16, ckpt, compile",
        *_kempner("llama-3-70b", 32, 2, 4, tp=4),
        "allocated",
        int(93.2 * GiB),
        '93.2 "GB" (allocated)',
        notes=[_KF_NOTE, _COMPILE_NOTE, *_kf_rebuilt()],
        left_out=_KF_TP_LEFT_OUT,
        unit="GiB",
    ),
    Row(
        "S10",
        "Llama-3-8B seq 4096 mb8 x4, FSDP 4, pure bf16, ckpt, fused AdamW, compile",
        *_kempner("llama-3-8b", 4, 8, 4),
        "allocated",
        int(81.0 * GiB),
        '81.0 "GB" (allocated)',
        notes=[_KF_NOTE, _COMPILE_NOTE, *_kf_rebuilt()],
        left_out=_KF_LEFT_OUT,
        unit="GiB",
    ),
    Row(
        "S11",
        "Llama-3-8B seq 4096 mb4 x4, FSDP 32 (8 nodes), pure bf16, ckpt, fused AdamW, compile",
        *_kempner("llama-3-8b", 32, 4, 4),
        "allocated",
        int(51.3 * GiB),
        '51.3 "GB" (allocated)',
        notes=[_KF_NOTE, _COMPILE_NOTE, *_kf_rebuilt()],
        left_out=_KF_LEFT_OUT,
        unit="GiB",
    ),
    Row(
        "S11-smi",
        "S11 read by nvidia-smi (KempnerPulse, mid-training, GPU 0 of a node)",
        *_kempner("llama-3-8b", 32, 4, 4),
        "device",
        73_302 * MiB,
        "73,302 MiB (nvidia-smi)",
        notes=[_KF_NOTE, _COMPILE_NOTE, *_kf_rebuilt()],
        left_out=_KF_LEFT_OUT,
        left_open=["which rank's allocated peak the report's 51.3 is (the nvidia-smi line is GPU 0's)"],
    ),
    Row(
        "S12",
        "Megatron GPT 0.498B seq 2048 mb2, DDP 8, fp16, ckpt",
        *_megatron("megatron-gpt-0.5b", 8, 2),
        "device",
        14_938 * MiB,
        "14,938 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=[
            "Megatron's GPT rebuilt as Transformers' GPT-2 of its shape (learned positions 2048, vocabulary "
            "50304, tied head, dropout 0.1, eager attention as Megatron's fused softmax keeps the scores); "
            "Megatron's own DDP (its local all-reduce buffers) rebuilt as PyTorch's DDP"
        ],
    ),
    Row(
        "S12-1gpu",
        "S12 on one GPU alone",
        *_megatron("megatron-gpt-0.5b", 1, 2),
        "device",
        14_362 * MiB,
        "14,362 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=["Megatron's GPT rebuilt as Transformers' GPT-2 of its shape (as S12)"],
    ),
    Row(
        "S13",
        "Megatron GPT 0.498B seq 2048 mb16, TP 8, fp16, ckpt",
        *_megatron("megatron-gpt-0.5b-as-llama", 8, 16, tp=8),
        "device",
        12_684 * MiB,
        "12,684 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=_MEGATRON_TP_LEFT_OUT[:2],
    ),
    Row(
        "S14-dp2tp4",
        "Megatron GPT 0.498B mb8, DP 2 x TP 4 (rebuilt as TP 4)",
        *_megatron("megatron-gpt-0.5b-as-llama", 4, 8, tp=4),
        "device",
        9_104 * MiB,
        "9,104 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=_MEGATRON_TP_LEFT_OUT,
    ),
    Row(
        "S14-dp4tp2",
        "Megatron GPT 0.498B mb4, DP 4 x TP 2 (rebuilt as TP 2)",
        *_megatron("megatron-gpt-0.5b-as-llama", 2, 4, tp=2),
        "device",
        9_642 * MiB,
        "9,642 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=_MEGATRON_TP_LEFT_OUT,
    ),
    Row(
        "S15-dp8pp4",
        "Megatron GPT 0.498B mb2 x32, DP 8 x PP 4 (rebuilt as PP 4 x4, fp32)",
        *_megatron("megatron-gpt-0.5b-as-llama-untied", 4, 2, pp=4),
        "device",
        7_130 * MiB,
        "7,130 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=[_MEGATRON_TP_LEFT_OUT[0].replace("tensor-parallel plan", "pipeline plan"), *_MEGATRON_PP_LEFT_OUT],
        left_open=[
            "which rank's memory (the largest stage's, or the first GPU's) is not stated; predicted: the largest",
            "which model each layout ran: the row names 0.498B / 1.54B for four layouts; taken as 0.498B for "
            "DP 8 x PP 4, 1.54B for the three with tensor parallelism",
            "Megatron's pipeline schedule at 8aa4619 (1F1B, PipeDream-Flush) taken as autotune's 1f1b",
        ],
    ),
    Row(
        "S15-tp8pp4",
        "Megatron GPT 1.54B mb16 x32, TP 8 x PP 4 (rebuilt x4, fp32)",
        *_megatron("megatron-gpt-1.5b-as-llama-untied", 32, 16, tp=8, pp=4),
        "device",
        14_204 * MiB,
        "14,204 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=[*_MEGATRON_TP_LEFT_OUT[:2], _MEGATRON_PP_LEFT_OUT[0], _MEGATRON_PP_LEFT_OUT[2]],
        left_open=["as S15-dp8pp4"],
    ),
    Row(
        "S15-dp2tp4pp4",
        "Megatron GPT 1.54B mb8 x32, DP 2 x TP 4 x PP 4 (rebuilt as TP 4 x PP 4 x4, fp32)",
        *_megatron("megatron-gpt-1.5b-as-llama-untied", 16, 8, tp=4, pp=4),
        "device",
        10_018 * MiB,
        "10,018 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=[*_MEGATRON_TP_LEFT_OUT, *_MEGATRON_PP_LEFT_OUT],
        left_open=["as S15-dp8pp4"],
    ),
    Row(
        "S15-dp2tp8pp2",
        "Megatron GPT 1.54B mb8 x32, DP 2 x TP 8 x PP 2 (rebuilt as TP 8 x PP 2 x2, fp32)",
        *_megatron("megatron-gpt-1.5b-as-llama-untied", 16, 8, tp=8, pp=2),
        "device",
        10_554 * MiB,
        "10,554 MiB (nvidia-smi)",
        notes=[_MEGATRON_NOTE],
        left_out=[*_MEGATRON_TP_LEFT_OUT, *_MEGATRON_PP_LEFT_OUT],
        left_open=["as S15-dp8pp4"],
    ),
]


@dataclass(frozen=True)
class FitRow:
    """A published run that fit, or ran out of memory, on its card: does the estimate say the same?"""

    key: str
    what: str
    workload: Workload
    config: TrialConfig
    fits: bool  # as published
    card_bytes: tuple[int, ...]  # the card's memory, every way the source states it
    left_out: list[str] = field(default_factory=list)
    left_open: list[str] = field(default_factory=list)


def _titan_70b(mb: int, *, selective: bool) -> tuple[Workload, TrialConfig]:
    workload = Workload(
        model=_model("llama-2-70b"),
        task="causal-lm",
        seq_len=4096,
        global_batch=mb * 64,
        nproc=64,
        nodes=8,
        gpu="A100-80GB",
    )
    config = TrialConfig(
        micro_batch=mb, precision="bf16", checkpointing=True, checkpoint_selective=selective, fsdp="full"
    )
    return workload, config


def _titan_405b(tp: int) -> tuple[Workload, TrialConfig]:
    workload = Workload(
        model=_model("llama-3.1-405b"),
        task="causal-lm",
        seq_len=8192,
        global_batch=max(2 * 128 // tp, 128),  # a Workload's global batch splits over all its ranks
        nproc=128,
        nodes=16,
        gpu=TITAN_CARD,
    )
    config = TrialConfig(
        micro_batch=2, precision="bf16", checkpointing=True, fsdp="full", tp=tp, sequence_parallel=tp > 1, compile=True
    )
    return workload, config


_A100_80 = (81_920 * MiB,)
_TITAN_405B_CARD = (94 * GiB, 95 * GiB, 96 * GiB)  # "H100 (94GB memory)", "SXM H100(95GB)", "96GB HBM2e"
FIT_ROWS: list[FitRow] = [
    FitRow(
        "S16-mb1-sac",
        "Llama-2-70B FSDP 64 seq 4096 bf16, mb1, selective per-op checkpointing",
        *_titan_70b(1, selective=True),
        fits=True,
        card_bytes=_A100_80,
    ),
    FitRow(
        "S16-mb2-full",
        "same, mb2, every layer checkpointed",
        *_titan_70b(2, selective=False),
        fits=True,
        card_bytes=_A100_80,
    ),
    FitRow(
        "S16-mb2-sac",
        "same, mb2, selective per-op checkpointing",
        *_titan_70b(2, selective=True),
        fits=False,
        card_bytes=_A100_80,
    ),
    FitRow(
        "S17-fsdp16tp8",
        "Llama-3.1-405B seq 8192 mb2, FSDP 16 x TP 8 (+SP), full checkpointing, compile",
        *_titan_405b(8),
        fits=True,
        card_bytes=_TITAN_405B_CARD,
        left_out=[
            "float8 and async TP (the published lines with them ran too; the plain line is rebuilt: autotune's "
            "--float8 refuses --tp, and it has no async TP)",
            "4 accumulation steps where the run had none (global batch 32): autotune's workload needs a global "
            "batch that splits over all 128 ranks, tensor-parallel ones included; the traced peak is a micro "
            "step's, which accumulation into sharded gradients does not change",
            _COMPILE_NOTE,
        ],
        left_open=[
            "the card's memory, stated as 94GB, 95GB and 96GB HBM2e: checked against 94, 95 and 96 GiB",
            "predicted for autotune's H100-96GB-HBM2e, whose 97,871 MiB (nvidia-smi's total, derived: 95.6 GiB) caps "
            "the reserved replay and is not one of the checks",
        ],
    ),
    FitRow(
        "S17-fsdp128",
        "Llama-3.1-405B seq 8192, FSDP 128 alone",
        *_titan_405b(1),
        fits=False,
        card_bytes=_TITAN_405B_CARD,
        left_open=[
            "the micro batch and checkpointing of the run that ran out of memory are not stated: taken as the 2D "
            "run's (mb2, full checkpointing, compile)",
            "the card's memory, as S17-fsdp16tp8",
        ],
    ),
]


def _estimate(workload: Workload, config: TrialConfig, measured_with: MeasuredWith = AS_INSTALLED) -> MemoryEstimate:
    # Every layer traced, even at 80 or 126: the depth proxy (autotune.estimate.depth_proxy) drew Llama-2-70B on
    # FSDP 64 (S16, mb2, checkpointed) at 94.85 GiB allocated where the whole model's trace gives 34.28.
    return predict_memory(workload, config, timeout_s=1800, measured_with=measured_with)


def _predicted(estimate: MemoryEstimate, metric: str) -> int | None:
    return {
        "device": estimate.predicted_device_bytes,
        "reserved": estimate.predicted_reserved_bytes,
        "allocated": estimate.predicted_peak_bytes,
    }[metric]


def predict(row: Row) -> dict[str, object]:
    started = time.perf_counter()
    result: dict[str, object] = {
        "row": row.key,
        "what": row.what,
        "gpu": row.workload.gpu,
        "metric": row.metric,
        "published": row.published_text,
        "published_bytes": row.published_bytes,
    }
    if row.unit is not None:
        result["unit"] = row.unit
    if row.left_out or row.left_open:
        result.update(
            layout=_layout(row.workload, row.config),
            left_out=row.left_out,
            left_open=row.left_open,
        )
    try:
        estimate = _estimate(row.workload, row.config, row.measured_with)
    except (ConfigError, EstimateError) as exc:
        if row.key in {r.key for r in ROWS}:
            raise
        # A sharded row autotune cannot rebuild even in its nearest form: printed with the reason.
        return {**result, "predicted_bytes": None, "error": None, "not_rebuilt": str(exc), "notes": row.notes}
    predicted = _predicted(estimate, row.metric)
    assert predicted is not None
    error = predicted / row.published_bytes - 1
    return {
        **result,
        "predicted_bytes": predicted,
        "error": error,
        "estimate": estimate.to_dict(),
        "measured_with": row.measured_with.to_dict(),
        "notes": row.notes,
        "seconds": time.perf_counter() - started,
    }


def _layout(workload: Workload, config: TrialConfig) -> str:
    """The ranks as the rebuild lays them out, e.g. ``8 ranks: fsdp-full`` or ``32 ranks, 8 nodes: tp4+sp x
    fsdp-full``."""
    parts = [config.layout] if config.model_parallel > 1 else []
    if config.uses_fsdp:
        parts.append(f"fsdp-{config.fsdp}")
    elif config.data_parallel(workload) > 1:
        parts.append("ddp")
    nodes = f", {workload.nodes} nodes" if workload.nodes > 1 else ""
    return f"{workload.nproc} ranks{nodes}: {' x '.join(parts) or 'one rank'}"


def predict_fit(row: FitRow) -> dict[str, object]:
    """The estimate's verdict against the card (the predicted device figure within its memory; and with
    ``estimate``'s default 10% headroom: reserved within 90% of it), each way the source states the card, beside
    the published one."""
    started = time.perf_counter()
    result: dict[str, object] = {
        "row": row.key,
        "what": row.what,
        "gpu": row.workload.gpu,
        "layout": _layout(row.workload, row.config),
        "card_bytes": list(row.card_bytes),
        "published_fits": row.fits,
        "left_out": row.left_out,
        "left_open": row.left_open,
    }
    try:
        estimate = _estimate(row.workload, row.config)
    except (ConfigError, EstimateError) as exc:
        return {**result, "not_rebuilt": str(exc), "agrees": None, "seconds": time.perf_counter() - started}
    reserved, device = estimate.predicted_reserved_bytes, estimate.predicted_device_bytes
    assert reserved is not None and device is not None
    fits = [device <= card for card in row.card_bytes]
    said = set(fits)
    return {
        **result,
        "predicted_peak_bytes": estimate.predicted_peak_bytes,
        "predicted_reserved_bytes": reserved,
        "predicted_device_bytes": device,
        "fits": fits,
        "fits_with_headroom": [reserved <= card * 0.9 and device <= card for card in row.card_bytes],
        "agrees": said == {row.fits},
        "undecided": len(said) > 1,
        "estimate": estimate.to_dict(),
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


def _figure(result: dict[str, object], key: str = "predicted_bytes") -> str:
    published = str(result["published"])
    if result.get("unit") == "GiB" or "GiB" in published:
        unit, name = GiB, "GiB"
    elif "MiB" in published:
        unit, name = MiB, "MiB"
    elif "GB (" in published:
        unit, name = GB, "GB"
    else:
        unit, name = MiB, "MB"
    value = int(result[key]) / unit  # type: ignore[call-overload]
    return f"{value:,.0f} {name}" if name in ("MB", "MiB") else f"{value:.2f} {name}"


def _parts(result: dict[str, object], *, sharded: bool = False) -> str:
    estimate = result["estimate"]
    assert isinstance(estimate, dict)
    gib = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    states = estimate["parameters_bytes"] + estimate["gradients_bytes"] + estimate["optimizer_state_bytes"]
    text = (
        f"states {gib(states)} (not live {gib(estimate['not_live_at_peak_bytes'])}) + act "
        f"{gib(estimate['activations_bytes'])} + temp {gib(estimate['temporaries_bytes'])}"
    )
    cuda = estimate["cuda_parts"]
    if result["metric"] in ("device", "reserved") and sharded:
        text += f" + cache {gib(cuda['allocator cache'])} + cuBLAS {gib(cuda['cuBLAS workspace'])}"
        if result["metric"] == "device":
            text += f" + ctx {gib(cuda['CUDA context'])} + NCCL {gib(cuda['NCCL buffers'])}"
    elif result["metric"] == "device":
        text += f" + cache {gib(cuda['allocator cache'])} + ctx {gib(cuda['CUDA context'])}"
    return text + " GiB"


def _sharded_table(results: list[dict[str, object]]) -> list[str]:
    lines = [
        "Sharded and parallel runs (rebuilt in their nearest expressible form; what each leaves out is listed below):",
        "",
        "| row | config | layout (rebuilt), GPU | metric | published | predicted | error | predicted parts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["predicted_bytes"] is None:
            lines.append(
                f"| {r['row']} | {r['what']} | {r['layout']}, {r['gpu']} | {r['metric']} | {r['published']} | "
                f"not rebuilt | - | {r['not_rebuilt']} |"
            )
            continue
        lines.append(
            f"| {r['row']} | {r['what']} | {r['layout']}, {r['gpu']} | {r['metric']} | {r['published']} | "
            f"{_figure(r)} | {float(r['error']):+.1%} | {_parts(r, sharded=True)} |"  # type: ignore[arg-type]
        )
    errors = [float(r["error"]) for r in results if r["error"] is not None]  # type: ignore[arg-type]
    if errors:
        lines += [
            "",
            f"median |error| {statistics.median(abs(e) for e in errors):.1%}, largest {max(abs(e) for e in errors):.1%}"
            f" over {len(errors)} rows; median signed error {statistics.median(errors):+.1%}",
        ]
    by_key = {str(r["row"]): r for r in results}
    pair = by_key.get("S11"), by_key.get("S11-smi")
    if pair[0] is not None and pair[1] is not None and pair[0]["error"] is not None and pair[1]["error"] is not None:
        published = int(pair[1]["published_bytes"]) - int(pair[0]["published_bytes"])  # type: ignore[call-overload]
        predicted = int(pair[1]["predicted_bytes"]) - int(pair[0]["predicted_bytes"])  # type: ignore[call-overload]
        lines += [
            "",
            f"S11's pair: nvidia-smi minus the allocated peak, published {published / GiB:.2f} GiB "
            f"(73,302 MiB - 51.3 GiB), predicted {predicted / GiB:.2f} GiB ({predicted / published - 1:+.0%}).",
        ]
    return lines


def _fit_table(results: list[dict[str, object]]) -> list[str]:
    lines = [
        "Fit boundaries (fits: the predicted device figure within the card's memory; the headroom column adds "
        "estimate's default: reserved within 90% of it):",
        "",
        "| row | run | layout (rebuilt), GPU | published | reserved | nvidia-smi | fits | with headroom | agrees |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdict = lambda flags: "/".join("yes" if f else "no" for f in flags)  # noqa: E731
    for r in results:
        if "not_rebuilt" in r:
            figures, agrees = f"not rebuilt: {r['not_rebuilt']} | - | - | -", "-"
        else:
            figures = (
                f"{int(r['predicted_reserved_bytes']) / GiB:.1f} GiB | "  # type: ignore[call-overload]
                f"{int(r['predicted_device_bytes']) / GiB:.1f} GiB | "  # type: ignore[call-overload]
                f"{verdict(r['fits'])} | {verdict(r['fits_with_headroom'])}"
            )
            agrees = "undecided" if r["undecided"] else ("yes" if r["agrees"] else "no")
        lines.append(
            f"| {r['row']} | {r['what']} | {r['layout']}, {r['gpu']} | "
            f"{'fits' if r['published_fits'] else 'out of memory'} | {figures} | {agrees} |"
        )
    lines += ["", "(fits: one verdict for each way the source states the card's memory, as listed below.)"]
    return lines


def _left_out(results: list[dict[str, object]]) -> list[str]:
    lines = ["", "What each sharded row's rebuild leaves out, and what its source leaves open:"]
    for r in results:
        for what, items in (("leaves out", r.get("left_out") or []), ("open", r.get("left_open") or [])):
            lines += [f"- {r['row']} {what}: {item}" for item in items]  # type: ignore[union-attr]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row keys (default: every expressible row)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_published.json"))
    args = parser.parse_args()
    wanted = set(args.rows.split(",")) if args.rows else None
    results, sharded, fits = [], [], []
    for row in ROWS + SHARDED_ROWS:
        if wanted is None or row.key in wanted:
            result = predict(row)
            (results if row in ROWS else sharded).append(result)
            if result["predicted_bytes"] is None:
                print(f"{row.key}: not rebuilt ({result['not_rebuilt']})", flush=True)
                continue
            print(
                f"{row.key}: {_figure(result)} predicted, {row.published_text} published, "
                f"{result['error']:+.1%} ({result['seconds']:.0f} s)",
                flush=True,
            )
    for fit in FIT_ROWS:
        if wanted is None or fit.key in wanted:
            fits.append(predict_fit(fit))
            verdict = (
                "not rebuilt"
                if fits[-1]["agrees"] is None
                else ("undecided" if fits[-1]["undecided"] else ("agrees" if fits[-1]["agrees"] else "disagrees"))
            )
            print(f"{fit.key}: {verdict} ({fits[-1]['seconds']:.0f} s)", flush=True)
    lines = []
    if results:
        errors = [abs(float(r["error"])) for r in results]  # type: ignore[arg-type]
        lines += [
            "| row | config | GPU | metric | published | predicted | error | predicted parts |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            lines.append(
                f"| {r['row']} | {r['what']} | {r['gpu']} | {r['metric']} | {r['published']} | "
                f"{_figure(r)} | {float(r['error']):+.1%} | {_parts(r)} |"
            )  # type: ignore[arg-type]
        lines.append("")
        lines.append(
            f"median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%} over {len(errors)} rows"
        )
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
    if sharded:
        lines += ["", *_sharded_table(sharded)]
    if fits:
        lines += ["", *_fit_table(fits)]
    if sharded or fits:
        lines += _left_out(sharded + fits)
    lines.append("")
    lines.append("Not expressible:")
    lines += [f"- {key}: {why}" for key, why in NOT_EXPRESSIBLE.items()]
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/gpu_published.py" + (f" --rows {args.rows}" if args.rows else "")
    args.out.write_text(
        json.dumps(
            {
                "command": command,
                "rows": results,
                "savings": savings,
                "sharded_rows": sharded,
                "fit_rows": fits,
                "not_expressible": NOT_EXPRESSIBLE,
            },
            indent=2,
        )
        + "\n"
    )
    args.out.with_suffix(".txt").write_text(f"$ {command}\n\n{table}\n")


if __name__ == "__main__":
    main()
