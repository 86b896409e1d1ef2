# Issue 39: one Kimi-K2 TP8 rank (synthetic, random weights at the real shapes) on this GPU, with
# the synthetic Kimi-K2.5-DFlash drafter, in process: the verify graph alone against its floor,
# then ar / chain / ddtree steps traced. KIMI_ARGS adds bench_kimi_rank arguments.
set -u
out=$RESULTS/kimi
if [ -z "${KIMI_SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_synthetic_models.py 2>&1 | tee "$out/cuda_tests.txt" | tail -5
fi
python3 benchmarks/bench_kimi_rank.py --out "$out/kimi_rank_step.txt" ${KIMI_ARGS:-}
# the seed's kernel tables at the Kimi-K2.5-DFlash draft depth (block 8: D = 7), budgets 8-64, and the
# verify attention at the rank's shapes (8 heads, prefix 512-8192): issue 39's "three tables"
if [ -z "${KIMI_SKIP_TABLES:-}" ]; then
  python3 benchmarks/bench_tree.py --quick --depth 7 --batches 1,4,16,64 --budgets 8,16,32,64 --out "$out/tree_kimi"
  python3 benchmarks/bench_verify_attn.py --shapes 1x1x8x512,1x17x8x512,4x17x8x512,16x17x8x512,64x9x8x512,1x65x8x8192 \
    --text "$out/verify_attn_kimi.txt" > /dev/null
fi
