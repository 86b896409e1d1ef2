# Issue 9: ddtree vs chain vs ar through `ddtree up` on the GPU, tracing off/on, attribution.
set -u
out=$RESULTS/service
timeout ${SERVICE_TIMEOUT:-420} python3 benchmarks/bench_service.py \
  --target services/ddtree/bundled/target --drafter services/ddtree/bundled/drafter \
  --up-arg=--device=cuda --out /tmp/service ${SERVICE_ARGS:-}
rc=$?
cp /tmp/service/*.txt /tmp/service/*.json /tmp/service/*.log "$out/" 2>/dev/null
[ -f /tmp/service/service_trace.jsonl ] && gzip -c /tmp/service/service_trace.jsonl > "$out/service_trace.jsonl.gz" \
  && ls -la "$out"
exit $rc
