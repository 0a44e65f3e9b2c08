#!/usr/bin/env bash
# Run it first on a lent GPU machine: autotune's predictions against real trials of the same configs on
# that card (bench/gpu_check.py says which), well inside 10 minutes.
# Usage: bash bench/gpu_check.sh              (writes bench/results/gpu_check_<card>.txt)
#        bash bench/gpu_check.sh --rehearse   (on a CPU: the same steps on a tiny model, and what it would measure)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/gpu_check.py "$@"
