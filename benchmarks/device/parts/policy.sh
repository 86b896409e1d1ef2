# Issue 43: the tree budget policies side by side in process on the bundled pair (ddtree with the
# cost-aware choice, ddtree with the share rule, chain), then the CUDA tests of the engine paths the
# policy touches (graph buckets, cut trees, in-process GPU events).
set -u
out=$RESULTS/policy
python3 -m pytest -q -p no:cacheprovider tests/test_budget_policy.py tests/test_runner_cuda.py tests/test_engine.py \
  tests/test_glue.py 2>&1 | tee "$out/cuda_tests.txt" | tail -5
python3 benchmarks/bench_budget_policy.py --device cuda --concurrency ${POLICY_CONCURRENCY:-1,4,16,64} \
  --max-tokens ${POLICY_MAX_TOKENS:-128} --repeats ${POLICY_REPEATS:-3} --out "$out/budget_policy.txt"
