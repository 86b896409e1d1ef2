# Issue 38: FP8 / INT4 weights kept quantized. The CUDA tests of the kernels and of the models
# that use them, then bench_quantized_moe (MoE at Kimi-K2 TP8-rank shapes: bf16 grouped GEMM,
# FP8 and INT4 fused MoE side by side; the dense FP8 linears of one layer; resident bytes).
set -u
out=$RESULTS/quantized
if [ -z "${QUANT_SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_quant_gemm.py tests/test_quantized_weights.py \
    tests/test_quantized_logits.py tests/test_target_bf16.py tests/test_runner_cuda.py \
    2>&1 | tee "$out/cuda_tests.txt" | tail -25
fi
python3 benchmarks/bench_quantized_moe.py ${QUANT_BENCH_ARGS:-} --out "$out/quantized_moe.txt"
