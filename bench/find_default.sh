#!/usr/bin/env bash
# A whole `autotune find --space default` on each of the four models of bench/peers.py (its budgets), on this
# machine's CPU: the wall time of each, start-up included, and its answer. A quicker check than peers.py (no peers).
# Usage: bash bench/find_default.sh   (writes bench/results/find_default_cpu.txt; 5-8 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/find_default_cpu.txt
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
{
  echo "# bash bench/find_default.sh ($(git rev-parse --short HEAD)); 1-minute load average at the start: $(cut -d' ' -f1 /proc/loadavg)"
  while read -r name model budget; do
    start=$(date +%s.%N)
    python -m autotune find --model "$model" --seq-len 128 --global-batch 16 --memory-budget "$budget" \
      --space default --storage "sqlite:///$work/$name.db" --json > "$work/$name.json" 2> "$work/$name.err"
    wall=$(python -c "print(f'{$(date +%s.%N) - $start:.0f}')")
    python - "$work/$name.json" "$name" "$wall" <<'PY'
import json, sys
result, name, wall = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
ran = [t for t in result["trials"] if t["status"] != "skipped"]
best = result["best"]
print(f"{name}: {wall} s, {len(ran)} trials; answer {best['describe']} at {best['tokens_per_s']:,.0f} tokens/s")
print(f"  stopped: {result.get('stopped')}")
PY
  done <<'MODELS'
llama-gqa-3l bench/data/peers/llama-gqa-3l/config.json 160MiB
bert-cls bench/data/peers/bert-cls/config.json 160MiB
wide-vocab bench/data/peers/wide-vocab/config.json 320MiB
gpt2-deep-tiny builtin:gpt2-deep-tiny 84MiB
MODELS
} | tee "$out"
