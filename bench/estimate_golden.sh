#!/usr/bin/env bash
# Golden outputs of `autotune estimate --json` over varied configs, to show a refactor of the estimator
# changes nothing it predicts.
#
#     bench/estimate_golden.sh record DIR          # one DIR/NAME.json per config below
#     bench/estimate_golden.sh diff BEFORE AFTER   # compares them, leaving out timings
#
# Run from the repository root with the environment that runs autotune. The timings left out of the
# comparison are the wall-clock ones (`seconds`) and a CPU step time measured by the device probe
# (`step_time`, `step_time_on` where it says so); everything else must be equal.
set -euo pipefail

record() {
    local out=$1
    mkdir -p "$out"
    local mixtral="$out/_models/mixtral"
    mkdir -p "$mixtral"
    # A tiny mixture of experts (grouped expert matmuls), as tests/estimate/test_estimator_moe.py makes it.
    python -c "
import sys
from transformers import MixtralConfig
MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=512,
              max_position_embeddings=512).save_pretrained(sys.argv[1])
" "$mixtral"
    # name | arguments of `autotune estimate`
    local cases=(
        "gpt2-tiny-default|--model builtin:gpt2-tiny"
        "gpt2-deep-ckpt-bf16|--model builtin:gpt2-deep-tiny --micro-batch 8 --checkpointing on --precision bf16"
        "gpt2-deep-every2-chunked|--model builtin:gpt2-deep-tiny --micro-batch 8 --checkpointing every-2 --loss chunked:4"
        "llama-lora|--model builtin:llama-tiny --micro-batch 4 --precision bf16 --lora-rank 8"
        "llama-qlora-nf4|--model builtin:llama-tiny --micro-batch 4 --lora-rank 16 --quantize-base nf4"
        "llama-qlora-int8|--model builtin:llama-tiny --micro-batch 4 --lora-rank 16 --quantize-base int8"
        "llama-ddp2|--model builtin:llama-tiny --nproc 2 --micro-batch 4"
        "llama-zero2-ckpt|--model builtin:llama-tiny --nproc 2 --micro-batch 4 --precision bf16 --zero-stage 2 --checkpointing on"
        "llama-zero3|--model builtin:llama-tiny --nproc 2 --micro-batch 4 --precision bf16 --zero-stage 3"
        "llama-zero2-offload|--model builtin:llama-tiny --micro-batch 4 --precision bf16 --zero-stage 2 --offload optimizer"
        "llama-fsdp-full|--model builtin:llama-tiny --nproc 2 --micro-batch 4 --precision bf16 --fsdp full"
        "llama-fsdp-offload|--model builtin:llama-tiny --nproc 2 --micro-batch 4 --fsdp full --offload optimizer+params"
        "llama-tp2-sp|--model builtin:llama-tiny --nproc 2 --micro-batch 4 --tp 2 --sequence-parallel on"
        "llama-pp2-1f1b|--model builtin:llama-tiny --nproc 2 --global-batch 8 --micro-batch 2 --pp 2"
        "llama-pp2-interleaved|--model builtin:llama-tiny --nproc 2 --global-batch 8 --micro-batch 2 --pp 2 --pp-schedule interleaved-1f1b"
        "llama-adafactor-in-backward|--model builtin:llama-tiny --micro-batch 16 --optimizer adafactor --optimizer-in-backward on"
        "bert-seq-cls|--model builtin:bert-tiny --micro-batch 4 --attention eager --fused-optimizer on"
        "t5-seq2seq|--model builtin:t5-tiny --micro-batch 4 --precision bf16-true"
        "vit-image-cls|--model builtin:vit-tiny --micro-batch 4"
        "mixtral-moe-bf16|--model $mixtral --seq-len 128 --global-batch 8 --micro-batch 4 --precision bf16"
        "gpu-a100-llama-bf16|--model builtin:llama-tiny --gpu A100-80GB --micro-batch 4 --precision bf16 --memory-budget 1GiB"
        "gpu-a100-llama-offload-8bit|--model builtin:llama-tiny --gpu A100-80GB --micro-batch 4 --precision bf16 --checkpointing on --activation-offload on --optimizer adamw-8bit"
        "gpu-a100-qlora-nf4|--model builtin:llama-tiny --gpu A100-80GB --micro-batch 4 --precision bf16 --lora-rank 8 --quantize-base nf4"
        "gpu-v100-bert|--model builtin:bert-tiny --gpu V100-16GB --micro-batch 4 --precision fp16"
        "gpu-h100-zero3|--model builtin:llama-tiny --gpu H100-80GB --nproc 2 --micro-batch 4 --precision bf16 --zero-stage 3"
        "gpu-h100-fsdp|--model builtin:llama-tiny --gpu H100-80GB --nproc 2 --micro-batch 4 --precision bf16 --fsdp grad-op"
        "gpu-h100-pp2|--model builtin:llama-tiny --gpu H100-80GB --nproc 2 --global-batch 8 --micro-batch 2 --pp 2 --precision bf16"
    )
    local case name args
    for case in "${cases[@]}"; do
        name=${case%%|*}
        args=${case#*|}
        local rc=0
        # shellcheck disable=SC2086  # the arguments split on spaces on purpose
        python -m autotune estimate --json $args >"$out/$name.json" 2>"$out/$name.err" || rc=$?
        if [ "$rc" -ne 0 ]; then
            echo "$name: exit $rc (see $out/$name.err)"  # a refusal is a result too: its words are compared
        else
            echo "$name: ok"
        fi
    done
}

compare() {
    python - "$1" "$2" <<'EOF'
import json, pathlib, sys

def comparable(path: pathlib.Path) -> list[object]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            rows.append(line)  # a refusal's message: compared as it is
            continue
        row.pop("seconds", None)  # wall-clock
        if "measured by the device probe" in (row.get("step_time_on") or ""):
            row.pop("step_time", None)  # timed against this machine's probe: a timing
            row.pop("step_time_on", None)
        rows.append(row)
    return rows

before, after = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
names = sorted({p.name for p in before.glob("*.json")} | {p.name for p in after.glob("*.json")})
differ = 0
for name in names:
    a, b = before / name, after / name
    if not (a.exists() and b.exists()):
        print(f"{name}: only in {'before' if a.exists() else 'after'}")
        differ += 1
    elif not a.read_text().strip() and not b.read_text().strip():  # refused or failed: the same words?
        same = a.with_suffix(".err").read_text() == b.with_suffix(".err").read_text()
        print(f"{name}: {'same refusal' if same else 'DIFFERS (refusal)'}")
        differ += not same
    elif comparable(a) != comparable(b):
        print(f"{name}: DIFFERS")
        differ += 1
    else:
        print(f"{name}: same")
print(f"{len(names) - differ} of {len(names)} the same")
sys.exit(1 if differ else 0)
EOF
}

case ${1:-} in
    record) record "${2:?record DIR}" ;;
    diff) compare "${2:?diff BEFORE AFTER}" "${3:?diff BEFORE AFTER}" ;;
    *) echo "usage: $0 record DIR | diff BEFORE AFTER" >&2; exit 2 ;;
esac
