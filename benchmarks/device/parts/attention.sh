# Issue 6: tree-verify MLA attention, the memory-bound (decode / split-KV) path: the fused split
# merge on the GPU (tests), then the decode shapes new vs old config, eager and CUDA-graph replay,
# a few prefill grid rows (no-regression check) and the launch-config sweep. Budget <= 150 s.
set -u
out=$RESULTS/attention
mkdir -p "$out"
t0=$SECONDS
t=tests/test_verify_attn.py
# GPU tests, fused merge first (real atomics), then the decode (1 row) and chain (8 rows) shape
# cases (h 8: 64 rows, the BLOCK_M 64 split path) of the issue grid; the tree cases, the chain
# cases at h 16 (128 rows: the unchanged path) and the CPU-covered bad-input tests are left out.
timeout 60 python3 -m pytest -v -rs -p no:cacheprovider --durations=5 \
  $t::test_fused_merge_matches_separate_merge $t::test_fused_merge_counters_reset_across_calls \
  $t::test_row_that_sees_nothing_gives_zero_and_minus_inf $t::test_launch_config_one_wave_one_row_block \
  $t::test_matches_float64_reference $t::test_split_counts_and_tiles_agree_with_reference \
  -k "not tree and not 8-16-prefixes" > "$out/tests.txt" 2>&1
rc_tests=$?
grep -cE " PASSED" "$out/tests.txt" | sed 's/^/tests passed: /'
grep -E "FAILED|ERROR|passed|failed" "$out/tests.txt" | tail -12
echo "tests: rc $rc_tests after $((SECONDS - t0)) s"
# Benchmark: decode table (each section stops starting shapes/configs at its deadline; every
# line is appended to verify_attn.txt as it is measured), 4 grid rows to compare with
# kernels.txt's last run, then the launch-config sweep with what time is left (8..40 s).
t1=$SECONDS
left=$((148 - (SECONDS - t0)))
sweep=$((left - 66)); [ $sweep -lt 8 ] && sweep=8; [ $sweep -gt 40 ] && sweep=40
echo "bench: ${left} s left, sweep ${sweep} s"
timeout $left python3 benchmarks/bench_verify_attn.py --decode --seconds 38 \
  --shapes 16x64x16x8192,1x64x16x8192,16x16x8x8192,1x16x16x8192 --sweep --sweep-seconds $sweep \
  --text "$out/verify_attn.txt" > "$out/bench_console.txt" 2>&1
rc_bench=$?
tail -5 "$out/bench_console.txt"
echo "bench: rc $rc_bench after $((SECONDS - t1)) s; part total $((SECONDS - t0)) s"
[ $rc_tests -eq 0 ] && [ $rc_bench -eq 0 ]
