#!/usr/bin/env bash
# The driver of another commit against this tree's, on this tree's grids at search_all.sh's budgets: the
# cost to a config within 2% of the best (trials, estimates and the estimator's start, over the grid's
# trial-seconds) per budget, side by side, and each answer over the optimum. The other commit's own
# bench/search.py replays it (its accounting of estimates as it was then), from a worktree given these grids.
# Usage: bash bench/search_against.sh REV   (writes bench/results/search_against_REV.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$(git rev-parse --short "$1")
out="bench/results/search_against_$rev.txt"
base="$(mktemp -d)"
git worktree add -q --detach "$base/tree" "$rev"
trap 'git worktree remove --force "$base/tree"; rm -rf "$base"' EXIT
rm -rf "$base/tree/bench/data"
cp -r bench/data "$base/tree/bench/data"

replay() {  # tree grid space budget -> "cost quality"
    (cd "$1" && PYTHONPATH="$1" python bench/search.py --grid "bench/data/$2.jsonl" --space "bench/data/$3.yaml" \
        --memory-budget "$4" --seeds 1 --strategies driver --json 2>/dev/null) |
        python -c "
import json, sys
r = json.load(sys.stdin)['strategies']['driver']
print(f\"{r['cost_fraction']:.1%}\" if r['cost_fraction'] is not None else '-', f\"{r['quality']:.3f}\")"
}
{
    echo "# bash bench/search_against.sh $1: cost to within 2% (answer/optimum), the driver of $rev -> this tree's ($(git rev-parse --short HEAD)$(git diff --quiet HEAD -- autotune || echo ', modified'))"
    while read -r grid space budgets; do
        for budget in $budgets; do
            read -r old_cost old_q <<<"$(replay "$base/tree" "$grid" "$space" "$budget")"
            read -r new_cost new_q <<<"$(replay "$PWD" "$grid" "$space" "$budget")"
            verdict=$(python -c "
o, n = '$old_cost', '$new_cost'
f = lambda s: float(s.rstrip('%')) if s != '-' else float('inf')
print('lower' if f(n) < f(o) else 'higher' if f(n) > f(o) else 'same')")
            echo "$space $budget: $old_cost ($old_q) -> $new_cost ($new_q) $verdict"
        done
    done <<'GRIDS'
gpt2-deep-tiny gpt2-deep-tiny 40MiB 64MiB 84MiB 128MiB 256MiB
llama-tiny llama-tiny 48MiB 64MiB 100MiB 160MiB 256MiB
llama-tiny-zero2rank llama-tiny-zero2rank 16MiB 24MiB 32MiB 40MiB 48MiB 64MiB
llama-tiny-zero2rank llama-tiny-zero2rank-full 16MiB 24MiB 32MiB 40MiB 48MiB 64MiB
llama-gqa llama-gqa 100MiB 128MiB 160MiB 212MiB 300MiB 512MiB
qwen-narrow qwen-narrow 64MiB 128MiB 160MiB 256MiB 512MiB
GRIDS
} | tee "$out"
