"""Tree build and accept: the cpu backend equals the reference oracle, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.tree import accept, build_trees, position_offsets, reference, visibility_matrix
from ddtree.tree.samples import random_topk
from ddtree.tree.structures import Trees

FIELDS = ("tokens", "depths", "parents", "num_nodes", "mask")

# (batch, D, K, budget): edge sizes, budgets past the reachable node count, the maximum budget.
SHAPES = [
    (1, 1, 1, 1), (3, 1, 1, 5), (2, 1, 4, 4), (2, 4, 1, 9), (4, 2, 2, 20), (3, 3, 1, 1),
    (4, 5, 3, 10), (4, 8, 8, 64), (2, 16, 16, 64), (2, 16, 64, 256), (1, 32, 32, 700),
    (1, 16, 1024, 1024),
]


def assert_trees_equal(got: Trees, want: Trees) -> None:
    for field in FIELDS:
        a, b = getattr(got, field).cpu(), getattr(want, field).cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, field
        assert torch.equal(a.view(torch.int64) if field == "mask" else a,
                           b.view(torch.int64) if field == "mask" else b), field


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_build_matches_reference(shape, ties):
    batch, depth, topk, budget = shape
    gen = torch.Generator().manual_seed(hash((shape, ties)) % 2**31)
    lp, ids = random_topk(batch, depth, topk, ties=ties, generator=gen)
    want = build_trees(lp, ids, budget, "reference")
    assert_trees_equal(build_trees(lp, ids, budget, "cpu"), want)
    assert_trees_equal(build_trees(lp, ids, budget, "cpu", threads=1), want)
    reachable = sum(min(topk, budget) ** d for d in range(1, depth + 1))
    assert torch.all(want.num_nodes == min(budget, reachable))


def test_all_equal_scores_give_the_lexicographic_tree():
    """With every log-prob 0 all scores tie: nodes pop in rank-path order (a prefix first)."""
    lp = torch.zeros(1, 3, 2)
    ids = torch.arange(6, dtype=torch.int32).view(1, 3, 2)
    trees = build_trees(lp, ids, 6, "cpu")
    # Pop order (0) (0,0) (0,0,0) (0,0,1) (0,1) (0,1,0): depth-first, smallest rank first.
    assert trees.depths[0].tolist() == [1, 2, 3, 3, 2, 3]
    assert trees.parents[0].tolist() == [-1, 0, 1, 2, 2, 1, 5]
    assert trees.tokens[0].tolist() == [0, 2, 4, 5, 3, 4]
    assert_trees_equal(trees, build_trees(lp, ids, 6, "reference"))


def test_per_request_budgets_and_threads():
    gen = torch.Generator().manual_seed(7)
    lp, ids = random_topk(64, 6, 8, generator=gen)
    budgets = [int(b) for b in torch.randint(8, 100, (64,), generator=gen)]
    got = build_trees(lp, ids, budgets, "cpu", threads=4)
    assert got.width == max(budgets)
    assert got.num_nodes.tolist() == budgets
    assert_trees_equal(got, build_trees(lp, ids, budgets, "reference"))


def test_mask_visibility_and_positions_follow_parents():
    gen = torch.Generator().manual_seed(3)
    lp, ids = random_topk(3, 6, 5, generator=gen)
    trees = build_trees(lp, ids, [130, 70, 2], "cpu")
    visible = visibility_matrix(trees)
    positions = position_offsets(trees)
    for b in range(3):
        n = int(trees.num_nodes[b])
        parents = trees.parents[b].tolist()
        expected = torch.zeros(trees.width + 1, trees.width + 1, dtype=torch.bool)
        for i in range(n + 1):
            j, depth = i, -1
            while j >= 0:
                expected[i, j] = True
                j, depth = parents[j], depth + 1
            assert positions[b, i] == depth
        assert torch.equal(visible[b], expected)
        assert np.array_equal(trees.mask[b].numpy(), reference.ancestor_mask(parents[: n + 1], trees.width + 1))


def deepest_path(trees: Trees, b: int) -> list[int]:
    depths = [0] + trees.depths[b].tolist()
    node = max(range(int(trees.num_nodes[b]) + 1), key=lambda i: (depths[i], -i))
    path = []
    while node >= 0:
        path.append(node)
        node = int(trees.parents[b, node])
    return path[::-1]


def path_posterior(trees: Trees, b: int, path: list[int], stop_token: int) -> torch.Tensor:
    """A posterior that follows `path` and then picks `stop_token` at its last node."""
    post = torch.randint(0, 50021, (trees.width + 1,))
    for node, nxt in zip(path, path[1:]):
        post[node] = trees.tokens[b, nxt - 1]
    post[path[-1]] = stop_token
    return post


def assert_accept_equal(trees: Trees, posterior: torch.Tensor, backend: str):
    got = accept(trees, posterior, backend)
    want = accept(trees, posterior, "reference")
    for field in ("path", "length", "bonus", "keep"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), field
    return want


@pytest.mark.parametrize("ties", [False, True])
def test_accept_paths_cpu(ties):
    gen = torch.Generator().manual_seed(11)
    lp, ids = random_topk(6, 7, 4, ties=ties, temperature=0.3, generator=gen)
    trees = build_trees(lp, ids, 60, "cpu")
    deepest = int(trees.depths.max())
    assert deepest >= 5
    depth_hits = set()
    for b in range(trees.batch):
        # The deepest path, then every prefix of it: the walk stops at each depth in turn.
        path = deepest_path(trees, b)
        for stop in range(len(path)):
            post = torch.stack([path_posterior(trees, b, path[: stop + 1], -7)] * trees.batch)
            want = assert_accept_equal(trees, post, "cpu")
            assert want.path[b, : stop + 1].tolist() == path[: stop + 1]
            assert int(want.length[b]) == stop + 1 and int(want.bonus[b]) == -7
            depth_hits.add(stop)
    assert depth_hits == set(range(deepest + 1))  # from the root only to the deepest node
    # Random posteriors: mostly leave at the root.
    assert_accept_equal(trees, torch.randint(0, 50021, (6, 61), generator=gen), "cpu")


def test_accept_with_int64_posterior_and_full_path():
    lp = torch.zeros(2, 4, 1)
    ids = torch.tensor([[5, 6, 7, 8]] * 2, dtype=torch.int64).unsqueeze(-1)
    trees = build_trees(lp, ids, 4, "cpu")
    post = torch.tensor([[5, 6, 7, 8, 99], [5, 0, 7, 8, 99]])
    got = accept(trees, post, "cpu")
    assert got.path.tolist() == [[0, 1, 2, 3, 4], [0, 1, -1, -1, -1]]
    assert got.length.tolist() == [5, 2] and got.bonus.tolist() == [99, 0]
    assert torch.equal(got.keep, got.path)


BAD_BUILDS = [
    (lambda lp, ids: (lp.double(), ids, 8), "float32"),
    (lambda lp, ids: (lp, ids.float(), 8), "int32 or int64"),
    (lambda lp, ids: (lp[0], ids[0], 8), "batch, depth, topk"),
    (lambda lp, ids: (lp, ids[:, :, :2], 8), "differs"),
    (lambda lp, ids: (lp, ids, 0), "outside 1..1024"),
    (lambda lp, ids: (lp, ids, 1025), "outside 1..1024"),
    (lambda lp, ids: (lp, ids, 3), "topk K=4"),
    (lambda lp, ids: (lp, ids, [8]), "entries for a batch of 2"),
    (lambda lp, ids: (torch.zeros(2, 33, 4), torch.zeros(2, 33, 4, dtype=torch.int32), 8), "depth D=33"),
    (lambda lp, ids: (lp[:0], ids[:0], 8), "batch 0"),
]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", range(len(BAD_BUILDS)))
def test_bad_build_input_is_a_value_error(case, backend):
    make, message = BAD_BUILDS[case]
    lp, ids = random_topk(2, 3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=message):
        build_trees(*make(lp, ids), backend)


def test_unknown_cuda_kernel_is_a_value_error():
    lp, ids = random_topk(2, 3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cuda_kernel must be one of auto, block, warp"):
        build_trees(lp, ids, 8, "cpu", cuda_kernel="grid")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("value, message", [(float("nan"), "NaN"), (float("inf"), "NaN or an infinite"),
                                            (-float("inf"), "infinite"), (5.0, "descending")])
def test_bad_logprob_values_are_value_errors(backend, value, message):
    lp, ids = random_topk(3, 3, 4, generator=torch.Generator().manual_seed(0))
    lp[1, 2, 1] = value
    with pytest.raises(ValueError, match=rf"top_logprobs\[1\].*{message}|top_logprobs\[1\] contains {message}"):
        build_trees(lp, ids, 8, backend)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bad_accept_input_is_a_value_error(backend):
    lp, ids = random_topk(2, 3, 4, generator=torch.Generator().manual_seed(0))
    trees = build_trees(lp, ids, 8, "cpu")
    with pytest.raises(ValueError, match=r"posterior must have shape \[batch, N \+ 1\] = \[2, 9\]"):
        accept(trees, torch.zeros(2, 8, dtype=torch.int32), backend)
    with pytest.raises(ValueError, match="int32 or int64"):
        accept(trees, torch.zeros(2, 9), backend)
    broken = Trees(tokens=trees.tokens, depths=trees.depths, parents=trees.parents.clone(),
                   num_nodes=trees.num_nodes, mask=trees.mask, draft_len=3)
    broken.parents[1, 4] = 4  # a node cannot be its own parent
    with pytest.raises(ValueError, match=r"trees\[1\]"):
        accept(broken, torch.zeros(2, 9, dtype=torch.int32), backend)
    with pytest.raises(ValueError, match="cuda backend needs CUDA tensors"):
        accept(trees, torch.zeros(2, 9, dtype=torch.int32), "cuda")
    with pytest.raises(ValueError, match="unknown tree backend"):
        accept(trees, torch.zeros(2, 9, dtype=torch.int32), "gpu")


def test_outputs_written_in_place_and_bad_out_rejected():
    from ddtree.tree.ops import _empty_accepted, _empty_trees

    lp, ids = random_topk(3, 4, 4, generator=torch.Generator().manual_seed(2))
    out = _empty_trees(3, 20, 4, "cpu")
    got = build_trees(lp, ids, 20, "cpu", out=out)
    assert got.tokens.data_ptr() == out.tokens.data_ptr() and got.mask.data_ptr() == out.mask.data_ptr()
    assert_trees_equal(got, build_trees(lp, ids, 20, "reference"))
    post = torch.randint(0, 50021, (3, 21))
    acc_out = _empty_accepted(3, 5, "cpu")
    acc = accept(got, post, "cpu", out=acc_out)
    assert acc.path.data_ptr() == acc_out.path.data_ptr()
    assert torch.equal(acc.path, accept(got, post, "reference").path)
    with pytest.raises(ValueError, match=r"out.mask must be \(3, 21, 1\) torch.uint64"):
        build_trees(lp, ids, 20, "cpu", out=Trees(**{**out.__dict__, "mask": torch.empty(3, 21, 1, dtype=torch.int64)}))
    with pytest.raises(ValueError, match=r"out.path must be \(3, 5\)"):
        accept(got, post, "cpu", out=_empty_accepted(3, 4, "cpu"))
