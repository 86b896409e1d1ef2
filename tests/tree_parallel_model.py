"""A plain-Python model of the CUDA block build (`block_build_kernel` in csrc/tree/tree_cuda.cu).

It takes the same steps as the kernel, with the same float64 operations, bins and checks, so
that the algorithm can be tested against the oracle (ddtree.tree.reference) on a machine
without a GPU (tests/test_tree_parallel_model.py). It is not used by the backends.

Scores. When every log-prob of a request is a multiple of 2**-q with D * max|lp| < 2**(53-q)
("exact inputs": every partial sum is exactly representable), the contract's float64 score of a
rank path is the exact sum of its log-probs, whatever the operation order, so a child's score is
score(parent) + lp[d-1][j] and a parent's children above tau are found by binary search.
Otherwise the pool replays the contract's sibling chain (score - lp[r] + lp[r+1]) per parent.

1. Pool. Level by level (depth d = 1..D), every live parent p (score >= tau) gets the children
   (p, j) with score >= tau (up to the first one below) and (j + 1) * prod(p) <= budget, where
   prod is the product of (rank + 1) along the path (a node needs all the paths it dominates
   before it, so a tree of `budget` nodes never holds a larger product). The children of one
   parent are a prefix of its row, written to consecutive slots.
2. Threshold. tau starts at -inf; when more than 2 * budget pool nodes are live after a level
   (and once at the end, when more than budget are), tau rises to the lower edge (less a
   rounding margin) of the histogram bins that hold the top >= budget live nodes. The bins (256) are laid over [min, max] of the
   live scores at the first rise and stay; later nodes are added to them as they are written.
   When the pool is over half full, a level whose children would cause a rise takes it before
   they are written: they join the bins, and only those above the new tau are written (dead
   children take no pool slots, which are never reclaimed).
3. Selection. The live nodes are put in the contract's total order (score, then rank path; the
   kernel sorts); the first `budget` are the tree, node index = rank + 1.
4. Verification (a proof that the heap algorithm pops exactly these nodes in this order): every
   node's generator (elder sibling, or the parent for rank 0) is in the tree and ranks before it;
   every offer of a tree node (next sibling, first child) that is not in the tree pops after the
   last tree node; if the tree has fewer than `budget` nodes, no such offer exists.
Anything else (pool overflow, too many tied candidates, a failed verification) falls back to
the exact sequential algorithm (in the kernel: the one-warp loop, run by warp 0).
"""
from __future__ import annotations

import math

import numpy as np

from ddtree.tree import reference

BINS = 256            # histogram bins of one threshold step (= threads of the block)
TIGHTEN_FACTOR = 2    # tighten when more than TIGHTEN_FACTOR * budget nodes are live
CANDIDATE_FACTOR = 4  # more than CANDIDATE_FACTOR * budget candidates at the end: fall back


def exact_inputs(lp: list[list[float]]) -> bool:
    """True when every partial sum of log-probs along a path is exactly representable."""
    depth = len(lp)
    big = max(abs(v) for row in lp for v in row)
    if big == 0.0:
        return True
    _, e = math.frexp(depth * big)  # depth * big < 2**e (exact: depth <= 32, big a float32)
    q = 53 - e
    return all(math.ldexp(v, q) == math.floor(math.ldexp(v, q)) for row in lp for v in row)


def _before(sa, pa, ra, da, sb, pb, rb, db, prefix, rank) -> bool:
    """The contract's order: higher score first, then the smaller rank path (tree_common.h)."""
    if sa != sb:
        return sa > sb
    return _rank_path_less(pa, ra, da, pb, rb, db, prefix, rank)


def _rank_path_less(pa, ra, da, pb, rb, db, parent, rank) -> bool:
    """rank_path_less of tree_common.h, over pool slots."""
    a_parent, a_rank, b_parent, b_rank = pa, ra, pb, rb
    for _ in range(da - db):
        a_rank, a_parent = rank[a_parent], parent[a_parent]
    for _ in range(db - da):
        b_rank, b_parent = rank[b_parent], parent[b_parent]
    if a_parent == b_parent and a_rank == b_rank:
        return da < db
    while a_parent != b_parent:
        a_rank, a_parent = rank[a_parent], parent[a_parent]
        b_rank, b_parent = rank[b_parent], parent[b_parent]
    return a_rank < b_rank


class _Grid:
    """The threshold's histogram: BINS bins over [min, max] of the live scores at the first rise,
    fixed from then on; later pool nodes are added as they are written."""

    def __init__(self, scores):
        self.mn = min(scores)
        self.scale = BINS / (max(scores) - self.mn)
        self.hist = [0] * BINS
        for s in scores:
            self.add(s)

    def bin_of(self, s):
        t = (s - self.mn) * self.scale
        return BINS - 1 if t >= BINS else (int(t) if t > 0.0 else 0)

    def add(self, s):
        self.hist[self.bin_of(s)] += 1

    def floor(self, cut):
        """bin_floor of the kernel: below every score whose bin is >= cut (rounding covered)."""
        width = cut / self.scale
        return (self.mn + width) - 2.0 ** -40 * (abs(self.mn) + width)

    def rise(self, budget, tau):
        """(tau, live): the top bins holding >= budget nodes, tau their lower edge (kept at a cut
        in bin 0, which also holds the scores below the grid's min)."""
        suffix = 0
        for k in range(BINS - 1, -1, -1):
            suffix += self.hist[k]
            if suffix >= budget:
                return (max(tau, self.floor(k)) if k > 0 else tau), suffix
        raise AssertionError("a rise needs more than budget live nodes")


def _rise(score, live_slots, budget, grid, tau, new_scores=()):
    """A rise: new_scores (not yet in the grid: a level's children before they are written) join
    it, or the grid is laid over the live scores and them. Returns (tau, live slots >= tau, grid,
    counted), counted being the nodes in the kept bins (the kernel's `live`; the slots >= tau may
    include a sliver of the bin below), or None when there is no grid (all those scores equal)."""
    if grid is None:
        scores = [score[s] for s in live_slots] + list(new_scores)
        if not max(scores) - min(scores) > 0.0:
            return None
        grid = _Grid(scores)
    else:
        for sc in new_scores:
            grid.add(sc)
    tau, counted = grid.rise(budget, tau)
    return tau, [s for s in live_slots if score[s] >= tau], grid, counted


def build_tree_parallel(logprobs, ids, budget: int, capacity: int = 4096, product_bound: int | None = None,
                        stats: dict | None = None):
    """Returns (ReferenceTree, path) with path in {"fast", "fallback:<why>"}. `capacity`: pool
    slots; `product_bound` (default: budget) exists to test that the verification catches a pool
    that misses nodes; `stats`, when given, gets the pool slots used ("pool")."""
    bound = budget if product_bound is None else product_bound
    lp = np.asarray(logprobs, dtype=np.float32).astype(np.float64).tolist()
    depth_limit, topk = len(lp), len(lp[0])
    fallback = lambda why: (reference.build_tree(logprobs, ids, budget), "fallback:" + why)  # noqa: E731
    exact = exact_inputs(lp)
    # Pool slot 0 is the root.
    score, prefix, rank, depth, prod = [0.0], [-1], [0], [0], [1]
    tau = -math.inf
    grid = None
    live: list[int] = []
    counted = 0  # the kernel's count of live nodes (the bins' count after a rise)
    lo, hi = 0, 1
    for d in range(1, depth_limit + 1):
        row = lp[d - 1]

        def children_above(tau):
            """Per live parent of the last level: the scores of its children that go in the pool."""
            out = []
            for p in range(lo, hi):
                if not (p == 0 or score[p] >= tau):
                    continue
                base = score[p]
                limit = min(topk, bound // prod[p])
                kids = []
                if exact:  # binary search in the kernel: the first j with base + row[j] < tau
                    while len(kids) < limit and base + row[len(kids)] >= tau:
                        kids.append(base + row[len(kids)])
                else:  # the contract's sibling chain, up to the first score below tau
                    sc = base + row[0]
                    while len(kids) < limit and sc >= tau:
                        kids.append(sc)
                        c = len(kids)
                        if c < limit:
                            sc = (sc - row[c - 1]) + row[c]
                out.append((p, kids))
            return out

        children = children_above(tau)
        total = sum(len(kids) for _, kids in children)
        # When the pool is tight, the rise these children would cause once written is taken
        # before they take pool slots; otherwise it follows their writing.
        risen = False
        if total and counted + total > TIGHTEN_FACTOR * budget and len(score) + total > capacity // 2:
            t = _rise(score, live, budget, grid, tau, [sc for _, kids in children for sc in kids])
            if t is not None:
                tau, live, grid, counted = t
                children = children_above(tau)
                total = sum(len(kids) for _, kids in children)
                risen = True
        if len(score) + total > capacity:
            return fallback("overflow")
        if total == 0:
            break
        lo = len(score)
        for p, kids in children:
            for j, sc in enumerate(kids):
                if grid is not None and not risen:
                    grid.add(sc)
                score.append(sc)
                prefix.append(p)
                rank.append(j)
                depth.append(d)
                prod.append((j + 1) * prod[p])
        hi = len(score)
        live.extend(range(lo, hi))
        if not risen:
            counted += total
        if not risen and counted > TIGHTEN_FACTOR * budget:
            t = _rise(score, live, budget, grid, tau)
            if t is not None:
                tau, live, grid, counted = t
    if stats is not None:
        stats["pool"] = len(score)
    if counted > budget:
        t = _rise(score, live, budget, grid, tau)
        if t is not None:
            tau, live, grid, counted = t
    m = len(live)
    if m > CANDIDATE_FACTOR * budget:  # m >= counted: the one test of the bound
        return fallback("candidates")
    # Rank by counting.
    order = {}
    for i in live:
        order[i] = sum(_before(score[j], prefix[j], rank[j], depth[j], score[i], prefix[i], rank[i], depth[i],
                               prefix, rank) for j in live if j != i)
    n = min(m, budget)
    index = {0: 0}
    by_rank = [0] * n
    for s, r in order.items():
        if r < budget:
            index[s] = r + 1
            by_rank[r] = s
    # Verification.
    has_next, has_child = set(), set()
    for s in by_rank:
        gen = s - 1 if rank[s] > 0 else prefix[s]
        if gen != 0 and (gen not in index or index[gen] >= index[s]):
            return fallback("verify-order")
        if gen == 0 and not (rank[s] == 0 and depth[s] == 1):
            return fallback("verify-order")
        (has_next if rank[s] > 0 else has_child).add(gen)
    last = by_rank[n - 1]
    for g in by_rank:
        d, r = depth[g], rank[g]
        offers = []
        if r + 1 < topk and g not in has_next:
            offers.append(((score[g] - lp[d - 1][r]) + lp[d - 1][r + 1], prefix[g], r + 1, d))
        if d < depth_limit and g not in has_child:
            offers.append((score[g] + lp[d][0], g, 0, d + 1))
        for so, po, ro, do in offers:
            if n < budget or not _before(score[last], prefix[last], rank[last], depth[last], so, po, ro, do,
                                         prefix, rank):
                return fallback("verify-offer")
    tokens = [int(ids[depth[s] - 1][rank[s]]) for s in by_rank]
    depths = [depth[s] for s in by_rank]
    parents = [-1] + [index[prefix[s]] for s in by_rank]
    return reference.ReferenceTree(tokens, depths, parents), "fast"
