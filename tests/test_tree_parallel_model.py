"""The Python model of the CUDA block build (tests/tree_parallel_model.py) equals the oracle.

The model takes the kernel's steps (pool levels, histogram thresholds, ranking, verification,
fallback) with the same float64 operations; here it meets random, tie-heavy and adversarial
inputs (zeros, positive log-probs, tiny values, huge values) across shapes, and a deliberately
broken pool must be caught by the verification (falling back, so the trees stay exact).
"""
from __future__ import annotations

import collections
import random
import zlib

import numpy as np
import pytest
import torch

import tree_parallel_model as parallel_model

from ddtree.tree import reference
from ddtree.tree.samples import random_topk

KINDS = ("rand", "ties", "zeros", "pos", "tiny", "big", "fewvals", "quarter")


def make_case(rng: random.Random, kind: str):
    depth = rng.choice([1, 2, 3, 4, 8, 16, 16, 24, 32])
    budget = rng.choice([1, 2, 3, 5, 8, 16, 33, 64, 64, 100, 256, 257])
    topk = rng.randint(1, min(budget, 64))
    if rng.random() < 0.3:
        topk = min(budget, rng.choice([1, 2, 16, 64, 128, 256]))
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    lp, ids = random_topk(1, depth, topk, ties=kind == "ties", temperature=rng.choice([0.3, 1.0, 4.0]),
                          generator=gen)
    lp = lp[0]
    if kind == "zeros":
        lp[:, : rng.randint(1, topk)] = 0.0
    elif kind == "pos":
        lp = lp + rng.choice([0.5, 3.0, 1e-7])
    elif kind == "tiny":
        lp[:, 0] = -1e-9
    elif kind == "big":
        lp = lp * 1e6
    elif kind == "fewvals":
        vals = torch.tensor([0.0, -0.125, -0.5, -1.0, -3.0])
        lp = vals[torch.randint(len(vals), lp.shape, generator=gen)]
    elif kind == "quarter":
        lp = torch.round(lp * 4) / 4
    lp = lp.sort(dim=-1, descending=True).values.float()
    return lp.numpy(), ids[0].numpy(), budget


@pytest.mark.parametrize("kind", KINDS)
def test_model_matches_reference(kind):
    rng = random.Random(zlib.crc32(kind.encode()))  # hash(str) changes per process
    paths = collections.Counter()
    for _ in range(40):
        lp, ids, budget = make_case(rng, kind)
        got, path = parallel_model.build_tree_parallel(lp, ids, budget)
        paths[path] += 1
        assert got == reference.build_tree(lp, ids, budget), (kind, lp.shape, budget, path)
    if kind in ("rand", "big", "quarter", "tiny"):  # tiny: inexact sums, the chain path
        assert paths["fast"] >= 30, paths  # the fast path is the common one on drafter-like rows


def test_model_fast_on_benchmark_shapes():
    """The benchmark's inputs (D 16, K = budget 64 and 256) take the fast path."""
    for budget in (64, 256):
        lp, ids = random_topk(8, 16, budget, generator=torch.Generator().manual_seed(budget))
        for b in range(8):
            got, path = parallel_model.build_tree_parallel(lp[b].numpy(), ids[b].numpy(), budget)
            assert path == "fast"
            assert got == reference.build_tree(lp[b].numpy(), ids[b].numpy(), budget)


def test_dead_children_take_no_pool_slots():
    """Budget 512 on drafter-like rows: with the rise taken before a tight level is written, a
    request fits 3,072 pool slots (writing the dead children first needed up to ~6,100)."""
    budget = 512
    lp, ids = random_topk(2, 16, budget, generator=torch.Generator().manual_seed(5))
    for b in range(2):
        stats = {}
        got, path = parallel_model.build_tree_parallel(lp[b].numpy(), ids[b].numpy(), budget, capacity=3072,
                                                       stats=stats)
        assert path == "fast" and stats["pool"] <= 3072
        assert got == reference.build_tree(lp[b].numpy(), ids[b].numpy(), budget)


def test_verification_catches_a_broken_pool():
    """With the pool's product bound halved (so it misses nodes of the true tree), the
    verification rejects those trees and the fallback keeps them exact."""
    rng = random.Random(3)
    caught = 0
    for _ in range(30):
        lp, ids, budget = make_case(rng, "rand")
        got, path = parallel_model.build_tree_parallel(lp, ids, budget, product_bound=max(1, budget // 2))
        assert got == reference.build_tree(lp, ids, budget)
        caught += path.startswith("fallback:verify")
    assert caught >= 5


def test_exact_inputs():
    assert parallel_model.exact_inputs([[0.0, -0.5], [-1.25, -3.0]])
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    assert parallel_model.exact_inputs([[f32(-0.1), -0.25]])  # float32 values: exact sums
    assert not parallel_model.exact_inputs([[-0.1, -0.25]])  # a float64 -0.1 is not
    assert not parallel_model.exact_inputs([[float(torch.tensor(-1e-9)), -20.0]] * 16)
