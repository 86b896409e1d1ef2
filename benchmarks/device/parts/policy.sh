# Issue 43: the tree budget policies side by side in process on the bundled pair (ddtree with the
# cost-aware choice, ddtree with the share rule, chain). The CUDA tests of the paths the policy
# touches are the cuda_tests part.
set -u
out=$RESULTS/policy
python3 benchmarks/bench_budget_policy.py --device cuda --concurrency ${POLICY_CONCURRENCY:-1,4,16,64} \
  --max-tokens ${POLICY_MAX_TOKENS:-128} --repeats ${POLICY_REPEATS:-3} --out "$out/budget_policy.txt"
