#!/usr/bin/env bash
# Replay every strategy on the five committed grids (bench/README.md quotes the results):
# one budget per grid in results/search_<grid>.{txt,json}, then a sweep of budgets per grid
# (driver, TPE, DeepSpeed-style), also on the grid's full fine-tuning slice, in results/search_sweep.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
run() {  # grid budget
    python bench/search.py --grid "bench/data/$1.jsonl" --memory-budget "$2" --seeds 5 > "bench/results/search_$1.txt"
    python bench/search.py --grid "bench/data/$1.jsonl" --memory-budget "$2" --seeds 5 --json > "bench/results/search_$1.json"
    cat "bench/results/search_$1.txt"
}
run gpt2-deep-tiny 84MiB
run llama-tiny 100MiB
run llama-tiny-zero2rank 40MiB
run llama-gqa 160MiB
run qwen-narrow 128MiB

sweep() {  # grid space budgets...
    local grid=$1 space=$2; shift 2
    for budget in "$@"; do
        python bench/search.py --grid "bench/data/$grid.jsonl" --space "bench/data/$space.yaml" \
                --memory-budget "$budget" --seeds 5 --json |
            python -c "
import json, sys
report = json.load(sys.stdin)
for name in ('driver', 'tpe', 'deepspeed'):
    r = report['strategies'][name]
    cost = f\"{r['cost_fraction']:.1%}\" if r['cost_fraction'] is not None else '-'
    trials = f\"{r['trials_to_2pct']:g}\" if r['trials_to_2pct'] is not None else '-'
    print(f'$space $budget {name}: trials to 2% {trials}, cost {cost}, found {r[\"found_ratio\"]:.0%}, '
          f'{r[\"trials_run\"]:g} trials and {r[\"estimates\"]:g} estimates run, '
          f'answer {r[\"quality\"]:.3f} of the optimum (worst seed {r[\"worst_quality\"]:.3f})')
"
    done
}
{
    echo "# bash bench/search_all.sh: driver, TPE and the DeepSpeed-style heuristic over a range of budgets"
    sweep gpt2-deep-tiny gpt2-deep-tiny 40MiB 64MiB 84MiB 128MiB 256MiB
    sweep llama-tiny llama-tiny 48MiB 64MiB 100MiB 160MiB 256MiB
    sweep llama-tiny-zero2rank llama-tiny-zero2rank 16MiB 24MiB 32MiB 40MiB 48MiB 64MiB
    # The full fine-tuning slice (LoRA off): the knobs DeepSpeed's autotuner searches, and checkpointing.
    sweep llama-tiny-zero2rank llama-tiny-zero2rank-full 16MiB 24MiB 32MiB 40MiB 48MiB 64MiB
    # A GQA Llama no test uses, the default space's knobs on one CPU rank: fp32, bf16 and fp16.
    sweep llama-gqa llama-gqa 100MiB 128MiB 160MiB 212MiB 300MiB 512MiB
    # A narrow Qwen2 whose steps disagree with the device probe: bf16 at ~0.9-1.0x fp32 where the probe's
    # matmuls say 4.2x, fp16 at ~0.1x where they say 0.012x.
    sweep qwen-narrow qwen-narrow 64MiB 128MiB 160MiB 256MiB 512MiB
} > bench/results/search_sweep.txt
cat bench/results/search_sweep.txt
