#!/usr/bin/env bash
# One device call on the H200: install the carried wheels (.whl, see docs/ARCHITECTURE.md
# "GPU runs"), build the extension there, then run the named parts in order:
#   bash benchmarks/device/h200.sh PART [PART...]      # parts: benchmarks/device/parts/PART.sh
# Each part writes its files under $RESULTS/PART/. After every part, $RESULTS is packed into
# $OUT/results.tar (the device returns at most 8 files), so a call cut at its time limit still
# returns what the finished parts wrote. Parts see REPO_COMMIT and DEVICE_NAME. TIMEOUT_<part>=S
# caps one part's wall time (e.g. TIMEOUT_attention=90 for a short call).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export RESULTS=/tmp/results PYTHONUNBUFFERED=1
# The device's copy of .git can lag the working tree (seen 2026-11-29): pass REPO_COMMIT=<hash> in the call.
export REPO_COMMIT=${REPO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export DEVICE_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
mkdir -p "$RESULTS"
start=$SECONDS
DDTREE_BUILD_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . > "$RESULTS/build.txt" 2>&1 \
  || { tail -40 "$RESULTS/build.txt"; tar -C "$RESULTS" -cf "$OUT/results.tar" .; exit 1; }
echo "build: $((SECONDS - start)) s; $(python3 -c 'import ddtree.native as n; print(n.build_info())')"
for part in "$@"; do
  t=$SECONDS
  mkdir -p "$RESULTS/$part"
  echo "=== $part"
  limit_var="TIMEOUT_$part"
  timeout "${!limit_var:-3600}" bash "benchmarks/device/parts/$part.sh" 2>&1 | tee "$RESULTS/$part/console.txt"
  echo "=== $part: exit ${PIPESTATUS[0]} after $((SECONDS - t)) s"
  tar -C "$RESULTS" -cf "$OUT/results.tar" .
done
