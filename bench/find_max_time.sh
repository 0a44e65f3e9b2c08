#!/usr/bin/env bash
# `autotune find --max-time 60s` on the README's quick-start model with the default space (180 configs,
# far more than 60 s of trials): the wall time of the whole command, each run in a fresh folder (a new
# study), with the machine's load beside it. The goal: a confirmed answer in <= 75 s.
# Usage: bash bench/find_max_time.sh [RUNS]   (writes bench/results/find_max_time_cpu.txt)
set -euo pipefail
out="$(cd "$(dirname "$0")" && pwd)/results/find_max_time_cpu.txt"
runs=${1:-3}
cmd=(autotune find --model builtin:gpt2-deep-tiny --memory-budget 84MiB --max-time 60s)
{
  echo "# bash bench/find_max_time.sh $runs   ($(date -u +%Y-%m-%d), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
  for run in $(seq "$runs"); do
    work="$(mktemp -d)"
    echo
    echo "## run $run: load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "\$ ${cmd[*]}"
    start=$(date +%s.%N)
    (cd "$work" && "${cmd[@]}" 2>&1 | grep -v '^not searched')
    echo "(wall: $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')") s)"
    rm -rf "$work"
  done
} | tee "$out"
