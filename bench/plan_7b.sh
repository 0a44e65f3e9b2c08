#!/usr/bin/env bash
# `find --plan` for a 7B Llama on 8 H100s as a user types it: the default space (816 families), then the
# sharding space (66), each timed whole (imports, the estimate server, every trace), on this machine's CPU.
# Usage: bash bench/plan_7b.sh [OUT]   (writes OUT, by default bench/results/plan_7b_cpu.txt; minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/results/plan_7b_cpu.txt}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
args=(--plan --gpu H100-80GB --nproc 8 --model builtin:llama2-7b --seq-len 4096 --global-batch 64)
{
  echo "# bash bench/plan_7b.sh $* ($(git rev-parse --short HEAD)); 1-minute load average at the start: $(cut -d' ' -f1 /proc/loadavg)"
  echo "# CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores"
  for space in default sharding; do
    start=$(date +%s.%N)
    python -m autotune find "${args[@]}" --space "$space" > "$work/$space.txt" 2> "$work/$space.err"
    wall=$(python -c "print(f'{$(date +%s.%N) - $start:.1f}')")
    echo
    echo "\$ autotune find ${args[*]} --space $space"
    echo "$wall s wall"
    cat "$work/$space.txt"
  done
} > "$out"
cat "$out"
