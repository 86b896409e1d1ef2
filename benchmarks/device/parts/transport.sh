# Issue 3: the zero-copy transport on the GPU. The CUDA transport tests (two processes, side
# streams, per-slot events, deferred reads, the native per-step ops of ddtree._C; the CPU ones run
# on any box), then the cuda_ipc hand-off benchmark (unary vs bidi stream, read=deferred|sync) with
# the native per-step calls, then the same benchmark through torch (DDTREE_TRANSPORT_NATIVE=0) as
# the A/B. About 2 minutes. TRANSPORT_TEST_ARGS (default "-m cuda"; "" = every transport test),
# TRANSPORT_BENCH_ARGS (default "--kinds cuda_ipc --rounds 5"; e.g. "--kinds cuda_ipc,shm,inline" for all),
# TRANSPORT_BENCH_TIMEOUT and TRANSPORT_AB=0 (skip the torch run) trim or widen a call.
# Writes $RESULTS/transport/{pytest.txt,transport.txt,transport.json,transport_torch.txt,transport_torch.json}.
set -u
out=$RESULTS/transport
mkdir -p "$out"
t=$SECONDS
timeout 60 python3 -m pytest -q -rs ${TRANSPORT_TEST_ARGS--m cuda} tests/test_transport*.py > "$out/pytest.txt" 2>&1
rc_tests=$?
tail -8 "$out/pytest.txt"
echo "transport tests: exit $rc_tests after $((SECONDS - t)) s"
bench_args=${TRANSPORT_BENCH_ARGS---kinds cuda_ipc --rounds 5}
t=$SECONDS
timeout ${TRANSPORT_BENCH_TIMEOUT:-75} python3 benchmarks/bench_transport.py --device cuda:0 --out "$out/transport.txt" $bench_args
rc_bench=$?
echo "transport bench (native per-step calls): exit $rc_bench after $((SECONDS - t)) s"
if [ "${TRANSPORT_AB:-1}" != 0 ]; then
  t=$SECONDS
  DDTREE_TRANSPORT_NATIVE=0 timeout ${TRANSPORT_BENCH_TIMEOUT:-75} python3 benchmarks/bench_transport.py --device cuda:0 \
    --out "$out/transport_torch.txt" $bench_args > /dev/null
  echo "transport bench (torch per-step calls, DDTREE_TRANSPORT_NATIVE=0): exit $? after $((SECONDS - t)) s"
  grep -E "^(topk|features) .*deferred|within 1.2x" "$out/transport_torch.txt" | sed 's/^/  torch: /'
fi
summary=$(tail -1 "$out/pytest.txt")
for f in "$out/transport.txt" "$out/transport_torch.txt"; do
  [ -f "$f" ] && echo "# device run: commit ${REPO_COMMIT:-unknown}, ${DEVICE_NAME:-unknown}; same call: pytest -q ${TRANSPORT_TEST_ARGS--m cuda} tests/test_transport*.py -> ${summary} (exit $rc_tests)" >> "$f"
done
[ "$rc_tests" -ne 0 ] && exit "$rc_tests"
exit "$rc_bench"
