# Issue 6: tree-verify MLA attention on the H200: the GPU tests of both kernels (the wgmma kernel's
# whole file; the Triton kernel's split/merge and decode/chain cases), the decode table (the
# dispatcher's kernel against the Triton one, eager and CUDA-graph replay) and the grid
# (kernels.txt rows: the dispatcher's kernel, its mask overhead, the Triton kernel, the matmul and
# copy ceilings, the torch reference). ATTN_GRID_SECONDS (default 150) bounds the grid.
set -u
out=$RESULTS/attention
mkdir -p "$out"
t0=$SECONDS
t=tests/test_verify_attn.py
timeout 150 python3 -m pytest -v -rs -p no:cacheprovider --durations=5 tests/test_verify_attn_wgmma.py \
  $t::test_fused_merge_matches_separate_merge $t::test_fused_merge_counters_reset_across_calls \
  $t::test_row_that_sees_nothing_gives_zero_and_minus_inf $t::test_launch_config_one_wave_one_row_block \
  $t::test_matches_float64_reference $t::test_split_counts_and_tiles_agree_with_reference \
  $t::test_dispatcher_uses_kernel_on_cuda_and_reference_elsewhere $t::test_merge_splits_matches_float64 \
  -k "not tree and not 8-16-prefixes" > "$out/tests.txt" 2>&1
rc_tests=$?
grep -cE " PASSED" "$out/tests.txt" | sed 's/^/tests passed: /'
grep -E "FAILED|ERROR|passed|failed" "$out/tests.txt" | tail -12
echo "tests: rc $rc_tests after $((SECONDS - t0)) s"
t1=$SECONDS
timeout 120 python3 benchmarks/bench_verify_attn.py --decode --seconds 60 --text "$out/verify_attn_decode.txt" \
  > "$out/decode_console.txt" 2>&1
rc_decode=$?
tail -3 "$out/decode_console.txt"
echo "decode: rc $rc_decode after $((SECONDS - t1)) s"
t2=$SECONDS
grid=${ATTN_GRID_SECONDS:-150}
timeout $((grid + 90)) python3 benchmarks/bench_verify_attn.py --seconds "$grid" --out "$out" > "$out/grid_console.txt" 2>&1
rc_grid=$?
tail -3 "$out/grid_console.txt"
echo "grid: rc $rc_grid after $((SECONDS - t2)) s; part total $((SECONDS - t0)) s"
[ $rc_tests -eq 0 ] && [ $rc_decode -eq 0 ] && [ $rc_grid -eq 0 ]
