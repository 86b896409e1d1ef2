"""The cuda backend equals the reference oracle; graph capture; errors without host sync."""
from __future__ import annotations

import os

import pytest
import torch

from ddtree.tree import accept, build_trees
from ddtree.tree.samples import random_topk
from test_tree import assert_trees_equal, deepest_path, path_posterior

pytestmark = pytest.mark.cuda

# (batch, D, K, budget) covering every frontier width (32 * M slots, M = 1..32) and the edges.
CUDA_SHAPES = [
    (512, 1, 1, 1), (512, 3, 1, 7), (256, 1, 16, 16), (512, 4, 2, 40), (512, 16, 8, 32),
    (512, 16, 16, 64), (256, 16, 32, 100), (128, 16, 64, 256), (64, 24, 128, 500),
    (16, 32, 256, 1024), (8, 16, 1024, 1024), (512, 2, 2, 30),
    (4, 32, 1024, 1024),  # log-probs staged as float (as double they would not fit shared memory)
]
TREES = int(os.environ.get("DDTREE_TREE_CUDA_TREES", "10240"))


def cuda_shapes():
    """Enough shapes, cycling CUDA_SHAPES, to cover TREES trees."""
    total, out = 0, []
    while total < TREES:
        shape = CUDA_SHAPES[len(out) % len(CUDA_SHAPES)]
        out.append(shape)
        total += shape[0]
    return out


@pytest.mark.parametrize("kernel", ["auto", "block", "warp"])
def test_cuda_build_matches_reference_on_many_trees(kernel):
    gen = torch.Generator().manual_seed(2024)
    checked = 0
    for i, (batch, depth, topk, budget) in enumerate(cuda_shapes()):
        ties = i % 3 == 2
        lp, ids = random_topk(batch, depth, topk, ties=ties, temperature=0.5 + (i % 4), generator=gen)
        want = build_trees(lp, ids, budget, "cpu")  # equals "reference" (tests/test_tree.py)
        got = build_trees(lp.cuda(), ids.cuda(), budget, "cuda", cuda_kernel=kernel)
        assert_trees_equal(got, want)
        sample = slice(0, min(batch, 24))  # and straight against the Python oracle
        assert_trees_equal(build_trees(lp[sample], ids[sample], budget, "reference"),
                           build_trees(lp[sample].cuda(), ids[sample].cuda(), budget, "cuda", cuda_kernel=kernel))
        checked += batch
    assert checked >= TREES


def test_cuda_per_request_budgets_and_int64_ids():
    gen = torch.Generator().manual_seed(5)
    lp, ids = random_topk(100, 12, 16, generator=gen)
    budgets = torch.randint(16, 300, (100,), generator=gen).tolist()
    want = build_trees(lp, ids.long(), budgets, "reference")
    assert_trees_equal(build_trees(lp.cuda(), ids.long().cuda(), budgets, "cuda"), want)


@pytest.mark.parametrize("ties", [False, True])
def test_cuda_accept_matches_reference(ties):
    gen = torch.Generator().manual_seed(9)
    lp, ids = random_topk(32, 10, 8, ties=ties, temperature=0.3, generator=gen)
    trees = build_trees(lp.cuda(), ids.cuda(), 128, "cuda")
    cpu_trees = build_trees(lp, ids, 128, "cpu")
    for stop_depth in (0, 3, None):  # leave at the root, stop midway, follow the deepest path
        rows = []
        for b in range(32):
            path = deepest_path(cpu_trees, b)
            rows.append(path_posterior(cpu_trees, b, path if stop_depth is None else path[: stop_depth + 1], -3))
        post = torch.stack(rows)
        want = accept(cpu_trees, post, "reference")
        got = accept(trees, post.cuda(), "cuda")
        for field in ("path", "length", "bonus", "keep"):
            assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), field


def test_cuda_graph_capture_replays_build_and_accept():
    gen = torch.Generator().manual_seed(1)
    lp, ids = random_topk(64, 16, 64, generator=gen)
    static_lp, static_ids = lp.cuda(), ids.cuda()
    static_post = torch.zeros(64, 65, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (load the kernels) outside capture
        accept(build_trees(static_lp, static_ids, 64, "cuda"), static_post, "cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        trees = build_trees(static_lp, static_ids, 64, "cuda", check=False)
        accepted = accept(trees, static_post, "cuda", check=False)
    for seed in range(3):
        lp, ids = random_topk(64, 16, 64, generator=torch.Generator().manual_seed(100 + seed))
        static_lp.copy_(lp)
        static_ids.copy_(ids)
        want = build_trees(lp, ids, 64, "cpu")
        post = torch.stack([path_posterior(want, b, deepest_path(want, b), 1) for b in range(64)])
        static_post.copy_(post)
        graph.replay()
        torch.cuda.synchronize()
        assert_trees_equal(trees, want)
        assert torch.equal(accepted.path.cpu(), accept(want, post, "reference").path)


@pytest.mark.parametrize("kernel", ["block", "warp"])
def test_cuda_bad_values_reported_by_status_and_raised_when_checked(kernel):
    lp, ids = random_topk(4, 3, 4, generator=torch.Generator().manual_seed(0))
    lp[2, 1, 3] = float("nan")
    lp[3, 0, 0] = -50.0  # row not descending
    lp, ids = lp.cuda(), ids.cuda()
    with pytest.raises(ValueError, match=r"top_logprobs\[2\] contains NaN"):
        build_trees(lp, ids, 8, "cuda", cuda_kernel=kernel)
    trees = build_trees(lp, ids, 8, "cuda", check=False, cuda_kernel=kernel)
    assert trees.status.tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="cpu backend needs CPU tensors"):
        build_trees(lp, ids, 8, "cpu")


def test_cuda_warp_kernel_and_block_kernel_agree():
    """cuda_kernel="warp" (the sequential loop, also the block kernel's fallback) on its own."""
    gen = torch.Generator().manual_seed(11)
    for ties, shape in [(False, (256, 16, 64, 64)), (True, (128, 16, 32, 100)), (False, (64, 16, 256, 256))]:
        batch, depth, topk, budget = shape
        lp, ids = random_topk(batch, depth, topk, ties=ties, generator=gen)
        want = build_trees(lp, ids, budget, "cpu")
        assert_trees_equal(build_trees(lp.cuda(), ids.cuda(), budget, "cuda", cuda_kernel="warp"), want)
        assert_trees_equal(build_trees(lp.cuda(), ids.cuda(), budget, "cuda", cuda_kernel="block"), want)


@pytest.mark.parametrize("kernel", ["block", "warp"])
def test_cuda_exact_ties_and_signed_zeros(kernel):
    """Few distinct values, +0.0 next to -0.0 (equal scores, different bits): both kernels must
    treat them as one score and break the tie by rank path, across lanes and frontier rows
    (budgets past 32 slots), and past the reachable node count."""
    gen = torch.Generator().manual_seed(17)
    values = torch.tensor([0.0, -0.0, -0.0, -0.5, -1.0])
    for batch, depth, topk, budget in [(64, 8, 2, 40), (64, 16, 8, 100), (32, 16, 64, 300), (8, 16, 128, 1024),
                                       (64, 3, 2, 64)]:
        pick = torch.randint(0, len(values), (batch, depth, topk), generator=gen)
        lp = values[pick].sort(dim=-1, descending=True).values.contiguous()
        ids = torch.randint(0, 50000, (batch, depth, topk), generator=gen, dtype=torch.int32)
        want = build_trees(lp, ids, budget, "cpu")
        assert_trees_equal(build_trees(lp.cuda(), ids.cuda(), budget, "cuda", cuda_kernel=kernel), want)
