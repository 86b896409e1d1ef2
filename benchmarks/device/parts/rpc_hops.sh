# Issue 43: where a per-step RPC's time goes through the three services (client call, server
# handler, the legs between), ddtree at concurrency 1 and 64 on the held-out prompts (~100 s).
set -u
out=$RESULTS/rpc_hops
python3 benchmarks/bench_rpc_hops.py --target services/ddtree/bundled/target \
  --drafter services/ddtree/bundled/drafter --levels ${HOPS_LEVELS:-1:30,64:200} --out "$out/rpc_hops.txt"
