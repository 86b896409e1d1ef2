"""Host cost of LatentKVCache.commit (the per-step KV compaction) over batch sizes.

    python benchmarks/bench_kv_commit.py [--device cuda] [--iters 200]

Each step reserves a 17-row tail per sequence and keeps 1..K rows of it (K=1 is ar). Median
wall time per commit, microseconds, with a synchronize after each on CUDA (what the engine's
step waits for). Side by side with an older version: put its kv_cache.py on PYTHONPATH as
kv_old.py and pass --compare kv_old.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch

from ddtree.models import kv_cache


def bench(module, batch: int, kept: int, iters: int, device: str) -> float:
    cache = module.LatentKVCache(4, 576, 4096, 64, torch.bfloat16, device)
    ids = list(range(batch))
    for s in ids:
        cache.add_sequence(s)
        cache.reserve([s], 300)
        cache.advance(s, 300)
    times = []
    for it in range(iters):
        cache.reserve(ids, 17)
        keep = torch.full((batch, 17), -1, dtype=torch.int64)
        for b in range(batch):
            n = 1 + (b + it) % kept
            keep[b, :n] = torch.arange(n) * (2 if kept > 1 else 0)
        start = time.perf_counter()
        cache.commit(ids, keep)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--compare", default=None, help="module name of another kv_cache version")
    args = p.parse_args()
    other = importlib.import_module(args.compare) if args.compare else None
    print(f"LatentKVCache.commit, median us over {args.iters} steps, device {args.device}")
    for batch, kept in [(1, 1), (16, 1), (64, 1), (16, 6), (64, 6)]:
        now = bench(kv_cache, batch, kept, args.iters, args.device)
        line = f"batch {batch:3d} kept <= {kept}: {now:9.1f} us"
        if other is not None:
            before = bench(other, batch, kept, args.iters, args.device)
            line += f"   {args.compare} {before:9.1f} us   ratio {before / now:5.1f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
