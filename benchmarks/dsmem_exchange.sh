#!/usr/bin/env bash
# Distributed shared memory between the CTAs of a cluster: per-thread pulls against bulk-copy
# pushes, at the cluster decode kernel's sizes (benchmarks/dsmem_exchange.cu says what each mode is).
# Needs nvcc and an sm_90 GPU; a standalone harness including csrc/attn/sm90.cuh.
#   bash benchmarks/dsmem_exchange.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
nvcc -O3 -arch=sm_90a -std=c++17 -I csrc -o "$work/dsmem_exchange" benchmarks/dsmem_exchange.cu
"$work/dsmem_exchange"
