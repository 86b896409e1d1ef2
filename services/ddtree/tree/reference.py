"""The oracle: the published DDTree heap algorithm in plain Python (heapq), one request at a time.

Slow on purpose and written to be read: every backend must produce exactly these trees.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReferenceTree:
    tokens: list[int]   # token of node 1..n
    depths: list[int]   # depth of node 1..n
    parents: list[int]  # parent of node 0..n (root: -1)


def build_tree(logprobs: np.ndarray, ids: np.ndarray, budget: int) -> ReferenceTree:
    """Best-first tree over lp[D][K] / ids[D][K] with at most `budget` nodes besides the root."""
    lp = np.asarray(logprobs, dtype=np.float32).astype(np.float64).tolist()  # exact widening
    ids = np.asarray(ids).tolist()
    depth_limit, topk = len(lp), len(lp[0])
    # Entries (-score, rank path, parent node): ties on score fall to the tuple of ranks.
    heap = [(-lp[0][0], (0,), 0)]
    tokens: list[int] = []
    depths: list[int] = []
    parents = [-1]
    while heap and len(tokens) < budget:
        neg_score, path, parent = heapq.heappop(heap)
        score = -neg_score
        node = len(tokens) + 1
        d, r = len(path), path[-1]
        tokens.append(int(ids[d - 1][r]))
        depths.append(d)
        parents.append(parent)
        if r + 1 < topk:
            sibling = score - lp[d - 1][r] + lp[d - 1][r + 1]
            heapq.heappush(heap, (-sibling, path[:-1] + (r + 1,), parent))
        if d < depth_limit:
            heapq.heappush(heap, (-(score + lp[d][0]), path + (0,), node))
    return ReferenceTree(tokens, depths, parents)


def ancestor_mask(parents: list[int], rows: int) -> np.ndarray:
    """[rows, ceil(rows / 64)] uint64: bit j of row i set iff j is i or an ancestor of i."""
    words = (rows + 63) // 64
    mask = np.zeros((rows, words), dtype=np.uint64)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, j // 64] |= np.uint64(1) << np.uint64(j % 64)
            j = parents[j]
    return mask


@dataclass(frozen=True)
class ReferenceAccept:
    path: list[int]  # accepted nodes from the root
    bonus: int


def accept_walk(tokens, parents, num_nodes: int, posterior, max_depth: int) -> ReferenceAccept:
    """From the root, follow the child whose token is the target's token at the current node."""
    children: dict[tuple[int, int], int] = {}
    for node in range(1, num_nodes + 1):
        children.setdefault((int(parents[node]), int(tokens[node - 1])), node)  # first one wins
    path, cur = [0], 0
    while len(path) < max_depth + 1:
        nxt = children.get((cur, int(posterior[cur])))
        if nxt is None:
            break
        path.append(nxt)
        cur = nxt
    return ReferenceAccept(path, int(posterior[cur]))
