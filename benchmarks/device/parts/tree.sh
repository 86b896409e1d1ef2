# Issue 4: the tree-build kernels on the GPU (expected ~2-3 min, every step under `timeout`):
#   1. the cuda-marked tree tests (10,240+ trees per kernel against the cpu backend / oracle,
#      accept, graph capture, status without sync; the sidecar over cuda_ipc) -> cuda_tests.txt
#   2. bench_tree.py --quick (batches 64 and 128): selfcheck.txt (the block and the warp kernel
#      against the cpu backend on ~10k random, tie-heavy and adversarial trees each: PASS/FAIL),
#      kernels.txt (block vs warp build side by side at budgets 16..1024, accept; the `auto`
#      column is what cuda_kernel="auto" runs), tree_build_vs_sglang.txt  -> $RESULTS/tree/
#   3. compute-sanitizer memcheck and racecheck on the --smoke workload (both kernels), if time
#      is left.
#   4. benchmarks/tree_phases.sh 64 256 1024 (clock64 per phase of both kernels) -> phases.txt,
#      if time is left.
set -u
out=$RESULTS/tree
mkdir -p "$out"
rc=0
start=$SECONDS
timeout 60 python3 -m pytest -q -rs -m cuda --durations=5 tests/test_tree_cuda.py tests/test_treebuild_service.py \
  > "$out/cuda_tests.txt" 2>&1 || rc=1
tail -15 "$out/cuda_tests.txt"
echo "--- tests: $((SECONDS - start)) s"
timeout 120 python3 benchmarks/bench_tree.py --quick --out "$out" || rc=1
echo "--- bench: $((SECONDS - start)) s"
if command -v compute-sanitizer > /dev/null && [ $((SECONDS - start)) -lt 150 ]; then
  for tool in memcheck racecheck; do
    timeout 30 compute-sanitizer --tool $tool python3 benchmarks/bench_tree.py --smoke > "$out/$tool.txt" 2>&1
    echo "$tool: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|smoke ok' "$out/$tool.txt" | tr '\n' ' ')"
  done
fi
if command -v nvcc > /dev/null && [ $((SECONDS - start)) -lt 180 ]; then  # where the build's time goes
  timeout 90 bash benchmarks/tree_phases.sh 64 256 1024 > "$out/phases.txt" 2>&1 || echo "tree_phases: failed, see phases.txt"
  grep -E "event|rises|rank" "$out/phases.txt"
fi
echo "--- tree part: $((SECONDS - start)) s, exit $rc"
exit $rc
