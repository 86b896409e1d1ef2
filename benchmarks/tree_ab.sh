#!/usr/bin/env bash
# Side-by-side timing of the tree build kernels at two commits: the phase harness
# (benchmarks/tree_phases.cu) is built from csrc/ of REF and of the working tree, both run the
# same batches in one process each, in turn, twice, and their trees (nodes, parents, tokens,
# masks) are compared byte for byte. Needs nvcc and a GPU.
#   bash benchmarks/tree_ab.sh REF [CASE...]     CASE = BUDGET_TEMPERATURE_KERNEL (block|warp),
#                                                default 64/128/256/512/1024 at 1.0 and 256 at 0.5, block
# Prints, per case, microseconds per launch over 300 launches back to back (kernel and the gap
# between launches) for REF and for the working tree, and whether the trees are equal.
set -euo pipefail
cd "$(dirname "$0")/.."
ref=${1:?usage: tree_ab.sh REF [CASE...]}
shift
cases=${*:-64_1.0_block 128_1.0_block 256_1.0_block 256_0.5_block 512_1.0_block 1024_1.0_block}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/ref"
git archive "$ref" csrc | tar -x -C "$work/ref"
flags=(-O3 -arch=sm_90 -std=c++17 --expt-relaxed-constexpr)
nvcc "${flags[@]}" -I "$work/ref/csrc" -o "$work/ref_harness" benchmarks/tree_phases.cu &
nvcc "${flags[@]}" -I csrc -o "$work/new_harness" benchmarks/tree_phases.cu &
wait
PYTHONPATH=services python3 benchmarks/tree_inputs.py "$work" $(for c in $cases; do echo "${c%_*}"; done)
chained() { sed -n 's/.*chained \([0-9.]*\) us.*/\1/p'; }
printf "%-16s %21s  %21s  trees\n" "case (us/launch)" "$ref, two runs" "working tree, two runs"
for c in $cases; do
  data=${c%_*} kernel=${c##*_} budget=${c%%_*}
  r=() n=()
  for rep in 1 2; do
    for v in ref new; do
      t=$(TREE_PHASES_CHAINED=300 TREE_PHASES_DUMP="$work/$v.dump" "$work/${v}_harness" \
            "$work/lp_$data.bin" "$work/ids_$data.bin" 64 16 "$budget" "$budget" "$kernel" 50 | chained)
      if [ "$v" = ref ]; then r+=("$t"); else n+=("$t"); fi
    done
  done
  cmp -s "$work/ref.dump" "$work/new.dump" && same=equal || same=DIFFER
  printf "%-16s %10s %10s  %10s %10s  %s\n" "$c" "${r[@]}" "${n[@]}" "$same"
done
