# Issue 39: one Kimi-K2 TP8 rank (synthetic, random weights at the real shapes) on this GPU, with
# the synthetic Kimi-K2.5-DFlash drafter, in process: the verify graph alone against its floor,
# then ar / chain / ddtree steps traced. KIMI_ARGS adds bench_kimi_rank arguments.
set -u
out=$RESULTS/kimi
if [ -z "${KIMI_SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_synthetic_models.py 2>&1 | tee "$out/cuda_tests.txt" | tail -5
fi
python3 benchmarks/bench_kimi_rank.py --out "$out/kimi_rank_step.txt" ${KIMI_ARGS:-}
