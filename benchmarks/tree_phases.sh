#!/usr/bin/env bash
# Where the tree build kernels spend their time: clock64 per phase (csrc/tree/tree_cuda.cu's
# DDTREE_PHASE hooks), averaged over the requests of a batch, beside the launch's event time.
# Needs nvcc and a GPU; builds a standalone harness from csrc (not the Python extension).
#   bash benchmarks/tree_phases.sh [BUDGET...]      (default 16 64 256; batch 64, D 16, K = budget)
# Phases of the block kernel: 0 staging and checks, 1 level counts and scan, 2 level writes,
# 3 threshold: the lower bound on tau (budgets >= 128) and the rises, 4 candidates, 5 rank (by bins, or the sort), 6 verification, 7 fallback loop, 8 outputs,
# 9 the pool by the work queue (queue_pool: exact sums with a bound; it replaces phases 1 and 2);
# of the warp kernel: 10 staging, 11 pop loop, 12 outputs.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
nvcc -O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr -I csrc -o "$work/tree_phases" benchmarks/tree_phases.cu
budgets=${*:-16 64 256}
PYTHONPATH=services python3 benchmarks/tree_inputs.py "$work" $budgets
for budget in $budgets; do
  for kernel in warp block; do
    "$work/tree_phases" "$work/lp_$budget.bin" "$work/ids_$budget.bin" 64 16 "$budget" "$budget" $kernel 50
  done
done
