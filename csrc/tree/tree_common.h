// Shared pieces of the best-first tree build and accept walk (C++ and CUDA backends).
//
// The contract (issue 4): per request, top-k log-probs lp[D][K] (rows descending) and ids[D][K].
// A candidate is a rank path (r1..rd); the highest float64 score pops first, ties go to the
// lexicographically smallest rank path. Popped candidate n gets token ids[d-1][r_d], depth d and
// the parent node of its prefix; it then offers its next sibling (score - lp[d-1][r] +
// lp[d-1][r+1]) and its first child (score + lp[d][0]), in exactly that float64 operation order.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define DDTREE_HD __host__ __device__ __forceinline__
#else
#define DDTREE_HD inline
#endif

namespace ddtree::tree {

constexpr int kMaxBudget = 1024;
constexpr int kMaxDepth = 32;
constexpr int kMaxTopK = 1024;
constexpr int kMaxBatch = 512;

// Per-request status written by every backend (0: the outputs are valid).
enum Status : int32_t {
  kOk = 0,
  kNonFinite = 1,      // a log-prob is NaN or infinite
  kNotDescending = 2,  // a row of log-probs is not in descending order
  kBadBudget = 3,      // a per-request budget outside 1..max budget
  kBadTree = 4,        // accept: num_nodes out of range or a parent not in [0, node)
};

// Frontier candidate descriptor: parent node (11 bits), rank (10 bits), depth (6 bits).
DDTREE_HD uint32_t pack_candidate(int parent, int rank, int depth) {
  return static_cast<uint32_t>(parent) | (static_cast<uint32_t>(rank) << 11) |
         (static_cast<uint32_t>(depth) << 21);
}
DDTREE_HD int candidate_parent(uint32_t c) { return static_cast<int>(c & 0x7FFu); }
DDTREE_HD int candidate_rank(uint32_t c) { return static_cast<int>((c >> 11) & 0x3FFu); }
DDTREE_HD int candidate_depth(uint32_t c) { return static_cast<int>(c >> 21); }

// True when the rank path of candidate a = path(pa) + [ra] (depth da) sorts before that of b,
// as Python tuples compare (a prefix first). `up(v, parent, rank)` gives popped node v's parent
// and rank (node 0 is the root); any key that orders siblings like their ranks will do for rank.
// O(depth); only reached on exactly equal scores.
template <typename Up>
DDTREE_HD bool rank_path_less_by(int pa, int ra, int da, int pb, int rb, int db, Up up) {
  int a_parent = pa, a_rank = ra, b_parent = pb, b_rank = rb;
  for (int d = da; d > db; --d) up(a_parent, a_parent, a_rank);
  for (int d = db; d > da; --d) up(b_parent, b_parent, b_rank);
  if (a_parent == b_parent && a_rank == b_rank) return da < db;  // one is a prefix of the other
  while (a_parent != b_parent) {
    up(a_parent, a_parent, a_rank);
    up(b_parent, b_parent, b_rank);
  }
  return a_rank < b_rank;
}

// The same over parent/rank arrays of the popped nodes.
template <typename Index>
DDTREE_HD bool rank_path_less(int pa, int ra, int da, int pb, int rb, int db, const Index* parent,
                              const Index* rank) {
  return rank_path_less_by(pa, ra, da, pb, rb, db, [parent, rank](int v, int& p, int& r) {
    r = rank[v];
    p = parent[v];
  });
}

// Pop order: higher score first, then the smaller rank path.
template <typename Index>
DDTREE_HD bool pops_before(double sa, uint32_t ca, double sb, uint32_t cb, const Index* parent,
                           const Index* rank) {
  if (sa != sb) return sa > sb;
  return rank_path_less(candidate_parent(ca), candidate_rank(ca), candidate_depth(ca),
                        candidate_parent(cb), candidate_rank(cb), candidate_depth(cb), parent,
                        rank);
}

// Words per mask row for a tree of n_rows = budget + 1 nodes.
DDTREE_HD int mask_words(int n_rows) { return (n_rows + 63) / 64; }

}  // namespace ddtree::tree
