"""Best-first draft trees (DDTree) and the accept walk: reference, C++ and CUDA backends.

    trees = build_trees(top_logprobs, top_ids, budget=64)      # [Bt, D, K] -> Trees
    visible = visibility_matrix(trees)                          # ancestor-only attention
    accepted = accept(trees, posterior)                         # posterior [Bt, N + 1]
"""
from ddtree.tree.ops import BACKENDS, accept, build_trees
from ddtree.tree.structures import Accepted, Trees, position_offsets, visibility_matrix

__all__ = ["BACKENDS", "Accepted", "Trees", "accept", "build_trees", "position_offsets",
           "visibility_matrix"]
