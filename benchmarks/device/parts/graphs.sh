# Issue 37: CUDA graphs of the verify and the draft. The CUDA tests of the runners and the model,
# then bench_step_graphs (bundled verify graph vs eager, Kimi-rank 4-layer stack, in-process engine
# at concurrency 1), whose summary takes ar's concurrency-1 tok/s through the services from the
# graph_services part when it ran first in the same call.
set -u
out=$RESULTS/graphs
if [ -z "${GRAPH_SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_runner_cuda.py tests/test_runner.py tests/test_draft_runner.py tests/test_target_bf16.py \
    tests/test_dflash.py tests/test_drafter_service.py \
    2>&1 | tee "$out/cuda_tests.txt" | tail -25
fi
service=""
[ -f "$RESULTS/graph_services/service_baseline_up.txt" ] && service="--service $RESULTS/graph_services/service_baseline_up.txt"
if [ "${GRAPH_PARTS:-bundled,kimi,engine}" != none ]; then
  python3 benchmarks/bench_step_graphs.py --parts ${GRAPH_PARTS:-bundled,kimi,engine} --iters ${GRAPH_ITERS:-30} \
    --out "$out/step_graphs.txt" $service
fi
