"""Random trees in the tree issue's format for the target tests (torch only: TP workers import this)."""
from __future__ import annotations

import torch

from ddtree.models.mla_attention import pack_bitmask, unpack_bitmask


def random_trees(sizes: list[int], vocab: int, gen: torch.Generator):
    """Random parent arrays (parent < child) -> tree_tokens/depths [B, N] (-1/0 padding),
    ancestor bitmask [B, N+1, words] uint64 (padding rows empty), parents [B, N+1]."""
    b, n = len(sizes), max(sizes)
    tokens = torch.full((b, n), -1, dtype=torch.int64)
    depths = torch.zeros(b, n, dtype=torch.int64)
    parents = torch.full((b, n + 1), -1, dtype=torch.int64)
    visible = torch.zeros(b, n + 1, n + 1, dtype=torch.bool)
    for r, size in enumerate(sizes):
        depth = [0]
        visible[r, 0, 0] = True
        for i in range(1, size + 1):
            p = int(torch.randint(0, i, (1,), generator=gen))
            parents[r, i] = p
            depth.append(depth[p] + 1)
            visible[r, i] = visible[r, p]
            visible[r, i, i] = True
        tokens[r, :size] = torch.randint(0, vocab, (size,), generator=gen)
        depths[r, :size] = torch.tensor(depth[1:], dtype=torch.int64)
    return tokens, depths, pack_bitmask(visible).view(torch.uint64), parents


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def node_tokens(root, tokens, b, path):
    return [int(root[b])] + [int(tokens[b, i - 1]) for i in path[1:]]


def test_random_trees_mask_marks_exactly_the_ancestors():
    tokens, depths, mask, parents = random_trees([9, 70, 0], 50, torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 70) and mask.shape == (3, 71, 2) and mask.dtype == torch.uint64
    vis = unpack_bitmask(mask, 71)
    for b, size in enumerate((9, 70, 0)):
        for node in range(size + 1):
            expected = torch.zeros(71, dtype=torch.bool)
            expected[path_to(parents[b], node)] = True
            assert torch.equal(vis[b, node], expected)
            assert node == 0 or int(depths[b, node - 1]) == len(path_to(parents[b], node)) - 1
        assert not vis[b, size + 1 :].any() and (tokens[b, size:] == -1).all()
