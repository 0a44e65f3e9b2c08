#!/usr/bin/env bash
# A real `autotune find` on this machine's CPU, recorded for the README.
# Usage: bash bench/find_cpu.sh   (writes bench/results/find_cpu.txt; about 3 minutes on 2 cores)
set -euo pipefail
out="$(cd "$(dirname "$0")" && pwd)/results/find_cpu.txt"
work="$(mktemp -d)"
cd "$work"
cmd=(autotune find --model builtin:gpt2-deep-tiny --memory-budget 84MiB --space quick)
{
  echo "\$ ${cmd[*]}"
  "${cmd[@]}" 2>&1
  echo
  echo "\$ ${cmd[*]}   # the same question again: answered from the study"
  start=$(date +%s.%N)
  "${cmd[@]}" 2>&1 | tail -n 4
  echo "($(python -c "print(f'{$(date +%s.%N) - $start:.1f}')") s)"
} | tee "$out"
rm -rf "$work"
