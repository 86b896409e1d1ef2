# The CUDA tests of the served paths: engine, graph runner, policy, compiled glue, and the two
# peers' services (their GPU branches: region staging, the one-copy host read, untimed replies).
set -u
out=$RESULTS/cuda_tests
python3 -m pytest -q -p no:cacheprovider tests/test_budget_policy.py tests/test_runner_cuda.py tests/test_engine.py \
  tests/test_glue.py tests/test_treebuild_service.py tests/test_drafter_service.py 2>&1 | tee "$out/cuda_tests.txt" | tail -15
