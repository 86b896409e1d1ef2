# Issue 3: the zero-copy transport on the GPU. Every transport test (the CUDA IPC ones run here:
# two processes, side streams, per-slot events, deferred reads), then the hand-off benchmark
# (cuda_ipc vs shm vs inline, unary vs bidi stream, read=deferred|sync). About 2-3 minutes.
# TRANSPORT_TEST_ARGS (e.g. "-m cuda"), TRANSPORT_BENCH_ARGS (e.g. "--kinds cuda_ipc,inline") and
# TRANSPORT_BENCH_TIMEOUT trim a short call. Writes $RESULTS/transport/{pytest.txt,transport.txt,transport.json}.
set -u
out=$RESULTS/transport
mkdir -p "$out"
t=$SECONDS
timeout 120 python3 -m pytest -q -rs ${TRANSPORT_TEST_ARGS:-} tests/test_transport*.py > "$out/pytest.txt" 2>&1
rc_tests=$?
tail -8 "$out/pytest.txt"
echo "transport tests: exit $rc_tests after $((SECONDS - t)) s"
t=$SECONDS
timeout ${TRANSPORT_BENCH_TIMEOUT:-150} python3 benchmarks/bench_transport.py --device cuda:0 --out "$out/transport.txt" ${TRANSPORT_BENCH_ARGS:-}
rc_bench=$?
echo "transport bench: exit $rc_bench after $((SECONDS - t)) s"
if [ -f "$out/transport.txt" ]; then
  summary=$(tail -1 "$out/pytest.txt")
  echo "# device run: commit ${REPO_COMMIT:-unknown}, ${DEVICE_NAME:-unknown}; same call: pytest -q tests/test_transport*.py -> ${summary} (exit $rc_tests)" >> "$out/transport.txt"
fi
[ "$rc_tests" -ne 0 ] && exit "$rc_tests"
exit "$rc_bench"
