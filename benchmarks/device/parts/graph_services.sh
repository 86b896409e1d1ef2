# Issue 37: bench_service through the three services (`up`) and in process (`verify`), ddtree /
# chain / ar at concurrency 1, 16, 64, tracing off and on (step attribution). Run before `graphs`,
# whose summary takes ar's concurrency-1 tok/s through the services from the `up` run.
set -u
out=$RESULTS/graph_services
for stack in ${GRAPH_SERVICE_STACKS:-up verify}; do
  timeout ${SERVICE_TIMEOUT:-240} python3 benchmarks/bench_service.py --target services/ddtree/bundled/target \
    --drafter services/ddtree/bundled/drafter --stack "$stack" --up-arg=--device=cuda --verify-arg=--max-running=64 \
    --concurrency 1,16,64 --modes ddtree,chain,ar --max-tokens 64 --repeats 1 --min-requests 16 \
    --out "/tmp/service_$stack" 2>&1 | tail -30
  for f in service_baseline trace_report tracing_cost; do
    cp "/tmp/service_$stack/$f.txt" "$out/${f}_$stack.txt" 2>/dev/null
  done
done
