#!/usr/bin/env bash
# Run it first on a lent GPU machine: autotune's predictions (the estimate's and find --plan's) against real trials
# of the same configs on that card, torchtune's T4/T5/T5+8bit with the CUDA allocator's history (the peak part by
# part, the snapshots beside the results), a real find, then the gpu-marked tests: within 8 minutes
# (bench/gpu_check.py says which configs and steps).
# Usage: bash bench/gpu_check.sh              (writes bench/results/gpu_check_<card>.txt)
#        bash bench/gpu_check.sh --rehearse   (on a CPU: the same steps on a tiny model, and what it would measure)
#        python bench/gpu_check.py --predict-for H200   (anywhere, beforehand: the estimates and plans, as JSON)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/gpu_check.py "$@"
