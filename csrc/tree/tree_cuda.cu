// CUDA backend: no host synchronisation, capturable in a CUDA graph.
//
// Build (warp kernel): one block of kBuildThreads per request; all threads stage and check the
// log-probs and write the outputs, warp 0 runs the best-first loop. The loop keeps the frontier
// UNSORTED in registers: slot i (the i-th candidate ever inserted) is row i / 32 of lane i % 32;
// a popped candidate's next sibling takes over its slot and its first child gets the next slot.
// Each lane keeps the best of its rows. A pop is a warp argmax of the lanes' bests as
// order-preserving 64-bit keys: __reduce_max_sync of the high words; when one lane holds that
// high word and no other row of it ties, that lane wins and __reduce_or_sync broadcasts its
// candidate and its child's score (both computed ahead, off the critical path, as is the best
// of its other rows, its next best). Otherwise a second reduction on the low words, and, for
// two or more rows with exactly the top score, a rare warp-uniform path comparing rank paths.
// The block kernel (below) falls back to the same loop.
#ifndef DDTREE_TREE_EMULATION  // tree_cuda_emulate.cc compiles the build kernels as host C++
#include <cuda_runtime.h>
#define DDTREE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define DDTREE_BLOCK_PATH(fallback, exact)  // the emulation counts the block kernel's paths
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>

#include "tree/tree_common.h"
#include "tree/tree_ops.h"

namespace ddtree::tree {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kBuildThreads = 128;  // warp kernel: staging and outputs; warp 0 runs the loop
constexpr size_t kDefaultSharedLimit = 48 * 1024;
constexpr uint32_t kNoCandidate = 0xffffffffu;  // an empty frontier slot (never a packed candidate)

#ifndef DDTREE_TREE_EMULATION
void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("ddtree tree ") + what + " kernel launch failed: " +
                             cudaGetErrorString(err));
}
#endif

// Shared memory of one build block: log-probs [D][K] (staged as double when they fit, so a pop
// converts nothing), then node parent/rank/depth.
constexpr size_t kDoubleStagingLimit = 200 * 1024;
struct BuildShared {
  size_t bytes;
  size_t parent_offset, rank_offset, depth_offset;
  __host__ __device__ BuildShared(int D, int K, int N, size_t staged_size) {
    parent_offset = staged_size * static_cast<size_t>(D) * K;
    rank_offset = parent_offset + sizeof(int16_t) * (N + 1);
    depth_offset = rank_offset + sizeof(int16_t) * (N + 1);
    bytes = depth_offset + (N + 1);
  }
};

// Frontier rows per lane of the warp loop: every candidate ever inserted has its own slot, and a
// build of `budget` nodes inserts at most budget of them.
inline int frontier_rows(int max_budget) { return (max_budget + kWarp - 1) / kWarp; }

// Doubles as unsigned keys in the same order (no NaN here).
__device__ __forceinline__ unsigned long long order_key(double x) {
  const unsigned long long k = static_cast<unsigned long long>(__double_as_longlong(x));
  return (k >> 63) ? ~k : (k | 0x8000000000000000ull);
}
__device__ __forceinline__ double key_double(unsigned long long k) {
  return __longlong_as_double(static_cast<long long>((k >> 63) ? (k & 0x7fffffffffffffffull) : ~k));
}
// The key of a frontier score: -0.0 and +0.0 compare equal, so both map to the key of +0.0.
// (Scores that differ only in the sign of a zero give offers that differ at most in the sign of
// a zero, so no comparison, hence no tree, depends on which one a pop carries on.)
__device__ __forceinline__ unsigned long long score_key(double x) { return order_key(x == 0.0 ? 0.0 : x); }

// Exactly equal scores: compare rank paths (rare on real log-probs; kept out of line so the
// common path stays small).
__device__ __noinline__ bool tie_pops_before(uint32_t ca, uint32_t cb, const int16_t* parent,
                                             const int16_t* rank) {
  return rank_path_less(candidate_parent(ca), candidate_rank(ca), candidate_depth(ca),
                        candidate_parent(cb), candidate_rank(cb), candidate_depth(cb), parent,
                        rank);
}

// The two offers of candidate c with score s, in the contract's float64 operation order: the next
// sibling (s - lp[d-1][r]) + lp[d-1][r+1] and the first child s + lp[d][0]; -inf where there is
// none. Loads are clamped so they are unconditional and in bounds for any packed candidate of
// this request.
template <typename Staged>
__device__ __forceinline__ void offer_scores(const Staged* s_lp, int D, int K, double s, uint32_t c,
                                             double& sibling, double& child) {
  const int r = candidate_rank(c), d = candidate_depth(c);
  const bool has_sibling = r + 1 < K, has_child = d < D;
  const Staged* row = s_lp + (d - 1) * K;
  const double here = static_cast<double>(row[r]);
  const double next = static_cast<double>(row[has_sibling ? r + 1 : r]);
  const double first = static_cast<double>(s_lp[has_child ? d * K : 0]);
  sibling = has_sibling ? (s - here) + next : -INFINITY;
  child = has_child ? s + first : -INFINITY;
}

__device__ __forceinline__ double reduce_or_double(bool mine, double x) {
  const unsigned long long bits = mine ? static_cast<unsigned long long>(__double_as_longlong(x)) : 0ull;
  const unsigned hi = __reduce_or_sync(kFullMask, static_cast<unsigned>(bits >> 32));
  const unsigned lo = __reduce_or_sync(kFullMask, static_cast<unsigned>(bits));
  return __longlong_as_double(static_cast<long long>((static_cast<unsigned long long>(hi) << 32) | lo));
}

// Folds row (s, c) into a running best (score, candidate, "another row has the same score").
__device__ __forceinline__ void merge_best(double& best, uint32_t& best_cand, bool& best_tie, double s,
                                           uint32_t c) {
  best_tie = (best_tie && s <= best) || (s == best && s != -INFINITY);
  if (s > best) {
    best = s;
    best_cand = c;
  }
}

// The sequential best-first loop of one warp (the exact algorithm, pop by pop). Node 0 of
// s_parent/s_rank/s_depth must hold the root. Returns the number of nodes popped. M rows per lane:
// 32 * M >= budget (every candidate ever inserted has its own slot: the root's first child plus at
// most one child per pop before the last).
template <int M, typename Staged>
__device__ int warp_build(const Staged* s_lp, int D, int K, int budget, int16_t* s_parent,
                          int16_t* s_rank, int8_t* s_depth, int lane) {
  double score[M];
  uint32_t cand[M];
#pragma unroll
  for (int k = 0; k < M; ++k) {
    score[k] = -INFINITY;
    cand[k] = kNoCandidate;
  }
  const uint32_t first_child = pack_candidate(0, 0, 1);
  if (lane == 0) {
    score[0] = static_cast<double>(s_lp[0]);
    cand[0] = first_child;
  }
  // This lane's best row: its score and candidate (first_child with score -inf for none: a
  // harmless stand-in for the offers' loads), and whether another row holds the same score.
  double best = score[0];
  uint32_t best_cand = first_child;
  bool best_tie = false;
  int inserted = 1;  // slots handed out; rows k with 32 * k < inserted are in use
  const unsigned empty_hi = static_cast<unsigned>(score_key(-INFINITY) >> 32);  // only -inf has it

  int n = 0;
  while (true) {
    // Ahead of the reductions (independent of them): the offers of this lane's best, used if it
    // pops, and the best of its other rows, which then becomes its best.
    double sibling, my_child;
    offer_scores(s_lp, D, K, best, best_cand, sibling, my_child);
    const unsigned long long key = score_key(best);
    const unsigned key_hi = static_cast<unsigned>(key >> 32);
    const unsigned top_hi = __reduce_max_sync(kFullMask, key_hi);
    double second = -INFINITY;
    uint32_t second_cand = first_child;
    bool second_tie = false;
#pragma unroll
    for (int k = 0; k < M; ++k)
      if (k * kWarp < inserted && cand[k] != best_cand) merge_best(second, second_cand, second_tie, score[k], cand[k]);
    if (top_hi == empty_hi) break;  // the frontier is empty (warp-uniform)
    // Usually one lane holds the only best key with this high word: the winner.
    bool mine = key_hi == top_hi;
    uint32_t head = __reduce_or_sync(kFullMask, mine ? best_cand : 0u);
    unsigned rows_at_top = __reduce_add_sync(kFullMask, mine ? 1u + best_tie : 0u);
    double child = reduce_or_double(mine, my_child);  // the sibling stays in the popping lane
    const bool unique = rows_at_top == 1;   // warp-uniform
    if (!unique) {  // several lanes share the high word, or the winner's rows tie: the full key
      const unsigned top_lo = __reduce_max_sync(kFullMask, mine ? static_cast<unsigned>(key) : 0u);
      const unsigned long long top = (static_cast<unsigned long long>(top_hi) << 32) | top_lo;
      mine = key == top;
      head = __reduce_or_sync(kFullMask, mine ? best_cand : 0u);
      rows_at_top = __reduce_add_sync(kFullMask, mine ? 1u + best_tie : 0u);
      child = reduce_or_double(mine, my_child);
      if (rows_at_top > 1) {  // exactly equal scores (warp-uniform, rare): the smallest rank path
        __syncwarp();         // nodes 1..n are visible to the tie-breaks
        const double top_score = key_double(top);
        uint32_t m = kNoCandidate;
#pragma unroll
        for (int k = 0; k < M; ++k)
          if (k * kWarp < inserted && cand[k] != kNoCandidate && score[k] == top_score &&
              (m == kNoCandidate || tie_pops_before(cand[k], m, s_parent, s_rank)))
            m = cand[k];
#pragma unroll
        for (int o = kWarp / 2; o > 0; o /= 2) {
          const uint32_t other = __shfl_xor_sync(kFullMask, m, o);
          if (other != kNoCandidate && (m == kNoCandidate || tie_pops_before(other, m, s_parent, s_rank)))
            m = other;
        }
        head = m;  // the same in every lane
        offer_scores(s_lp, D, K, top_score, head, sibling, child);
      }
    }
    ++n;
    const int p = candidate_parent(head), r = candidate_rank(head), d = candidate_depth(head);
    if (lane == 0) {
      s_parent[n] = static_cast<int16_t>(p);
      s_rank[n] = static_cast<int16_t>(r);
      s_depth[n] = static_cast<int8_t>(d);
    }
    if (n == budget) break;
    // The sibling takes over the popped slot (in the lane holding `head`, the one lane whose
    // `sibling` is head's: candidates are unique); the child gets the next slot.
    const uint32_t sibling_cand = r + 1 < K ? pack_candidate(p, r + 1, d) : kNoCandidate;
    const bool insert = d < D;
    const int slot = inserted;
    inserted += insert;
    const bool child_here = insert && lane == slot % kWarp;
    const int child_row = slot / kWarp;
    const uint32_t child_cand = pack_candidate(n, 0, d + 1);
#pragma unroll
    for (int k = 0; k < M; ++k) {
      if (k * kWarp < inserted) {  // warp-uniform
        if (cand[k] == head) {
          score[k] = sibling;
          cand[k] = sibling_cand;
        }
        if (child_here && k == child_row) {
          score[k] = child;
          cand[k] = child_cand;
        }
      }
    }
    // The lanes' new bests: the winner's is its second best or the sibling; the child merges in.
    if (unique) {
      if (mine) {
        best = second;
        best_cand = second_cand;
        best_tie = second_tie;
        merge_best(best, best_cand, best_tie, sibling, sibling_cand);
      }
      if (child_here) merge_best(best, best_cand, best_tie, child, child_cand);
    } else {  // after the slow path: every lane rescans its rows
      best = -INFINITY;
      best_cand = first_child;
      best_tie = false;
#pragma unroll
      for (int k = 0; k < M; ++k)
        if (k * kWarp < inserted) merge_best(best, best_cand, best_tie, score[k], cand[k]);
    }
  }
  __syncwarp();
  return n;
}

// Outputs of request b, padding included, by threads tid = 0..nthreads-1. Mask row i: one walk
// up i's ancestors (indices fall along the walk), filling its words from the last down.
__device__ void write_outputs(const BuildArgs& in, const BuildOutputs& out, int b, int n,
                              int32_t status, const int16_t* s_parent, const int16_t* s_rank,
                              const int8_t* s_depth, int tid, int nthreads) {
  const int D = in.depth, K = in.topk, N = in.max_budget, W = mask_words(N + 1);
  const int32_t* ids = in.ids + static_cast<long>(b) * D * K;
  int32_t* tokens = out.tokens + static_cast<long>(b) * N;
  int32_t* depths = out.depths + static_cast<long>(b) * N;
  int32_t* parents = out.parents + static_cast<long>(b) * (N + 1);
  uint64_t* mask = out.mask + static_cast<long>(b) * (N + 1) * W;
  for (int i = tid; i < N; i += nthreads) {
    const int node = i + 1;
    if (node <= n) {
      const int d = s_depth[node];
      tokens[i] = __ldg(ids + (d - 1) * K + s_rank[node]);
      depths[i] = d;
    } else {
      tokens[i] = -1;
      depths[i] = 0;
    }
  }
  for (int i = tid; i <= N; i += nthreads) parents[i] = (i >= 1 && i <= n) ? s_parent[i] : -1;
  for (int row = tid; row <= N; row += nthreads) {
    uint64_t* words = mask + static_cast<long>(row) * W;
    int v = row <= n ? row : -1;  // the root's parent is -1
    for (int w = W - 1; w >= 0; --w) {
      const int lo = w * 64;
      uint64_t bits = 0;
      for (; v >= lo; v = s_parent[v]) bits |= uint64_t{1} << (v - lo);
      words[w] = bits;
    }
  }
  if (tid == 0) {
    out.num_nodes[b] = n;
    out.status[b] = status;
  }
}

template <int M, typename Staged>
__global__ void __launch_bounds__(kBuildThreads) build_kernel(BuildArgs in, BuildOutputs out) {
  DDTREE_DYNAMIC_SMEM(smem);
  __shared__ int s_nodes;
  const int D = in.depth, K = in.topk, N = in.max_budget;
  const int b = blockIdx.x, tid = threadIdx.x;
  const BuildShared layout(D, K, N, sizeof(Staged));
  Staged* s_lp = reinterpret_cast<Staged*>(smem);
  int16_t* s_parent = reinterpret_cast<int16_t*>(smem + layout.parent_offset);
  int16_t* s_rank = reinterpret_cast<int16_t*>(smem + layout.rank_offset);
  int8_t* s_depth = reinterpret_cast<int8_t*>(smem + layout.depth_offset);

  // Stage this request's log-probs in shared memory and check them.
  const float* lp = in.logprobs + static_cast<long>(b) * D * K;
  const int numel = D * K;
  bool nonfinite = false, unordered = false;
  const bool vectorized = (K & 3) == 0 && (reinterpret_cast<uintptr_t>(lp) & 15) == 0;
  if (vectorized) {  // a float4 never straddles two rows
    const float4* lp4 = reinterpret_cast<const float4*>(lp);
#pragma unroll 4
    for (int i = tid; i < numel / 4; i += kBuildThreads) {
      const float4 v = __ldg(lp4 + i);
      s_lp[4 * i] = v.x;
      s_lp[4 * i + 1] = v.y;
      s_lp[4 * i + 2] = v.z;
      s_lp[4 * i + 3] = v.w;
      nonfinite |= !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
      unordered |= v.x < v.y || v.y < v.z || v.z < v.w;
    }
  } else {
    for (int i = tid; i < numel; i += kBuildThreads) {
      const float v = __ldg(lp + i);
      s_lp[i] = v;
      nonfinite |= !isfinite(v);
    }
  }
  if (tid == 0) {
    s_parent[0] = -1;
    s_rank[0] = 0;
    s_depth[0] = 0;
  }
  __syncthreads();
  const int step = vectorized ? 4 : 1;  // pairs (i - 1, i) left to compare: i % step == 0
  for (int i = tid * step; i < numel; i += kBuildThreads * step)
    if (i % K != 0) unordered |= s_lp[i - 1] < s_lp[i];

  const int budget = in.budgets ? in.budgets[b] : N;
  int32_t status = kOk;
  if (__syncthreads_or(nonfinite)) status = kNonFinite;
  else if (__syncthreads_or(unordered)) status = kNotDescending;
  if (budget < 1 || budget > N) status = kBadBudget;

  if (tid < kWarp) {
    const int n = status == kOk ? warp_build<M>(s_lp, D, K, budget, s_parent, s_rank, s_depth, tid) : 0;
    if (tid == 0) s_nodes = n;
  }
  __syncthreads();
  write_outputs(in, out, b, s_nodes, status, s_parent, s_rank, s_depth, tid, kBuildThreads);
}

// ---------------------------------------------------------------------------------------------
// Block build: one block of kBlock threads per request, selection in parallel, verified exactly,
// the warp loop above as the fallback. services/ddtree/tree/parallel_model.py is a plain-Python
// model of these steps (same float64 operations, bins and checks), tested against the oracle;
// docs/tree.md "The block kernel" gives the argument.
//
// 1. Scores: when every log-prob is a multiple of 2^-q with D * max|lp| < 2^(53-q), every
//    float64 partial sum along a path is exact, so a path's contract score is the plain sum of
//    its log-probs in any order ("exact": children by binary search, one thread per child).
//    Otherwise each thread replays the contract's sibling chain for its parents.
// 2. Pool: level by level, each live parent p (score >= tau) gets its children j in rank order
//    while score >= tau and (j + 1) * prod(p) <= budget (prod = product of rank + 1 along the
//    path), written to consecutive slots after a block scan of the counts. tau rises
//    (histogram select) when more than 2 * budget nodes live after a level, and at the end
//    when more than budget do.
// 3. The live nodes are ranked by the contract's total order by counting; the first budget form
//    the tree (node index = rank + 1).
// 4. Verification: each tree node's generator (elder sibling, or the parent for rank 0) is in
//    the tree and ranks before it; each offer of a tree node that is not in the tree pops after
//    the last tree node; a tree short of budget has no such offer. Then the heap algorithm pops
//    exactly these nodes in this order. Otherwise (or on inexact inputs, a full pool, too many
//    tied candidates) warp 0 runs the exact sequential loop.

constexpr int kBlock = 256;
constexpr int kBins = kBlock;            // histogram bins of one threshold step
constexpr int kMaxPool = 8192;           // pool slots (int16 indices)
constexpr int kMinPool = 2048;
constexpr int kCandidateFactor = 4;      // more than 4 * budget tied candidates: fall back
constexpr int kTightenFactor = 2;        // after a level, tighten when > 2 * budget nodes live
constexpr size_t kBlockSharedLimit = 227 * 1024 - 2048;  // dynamic; BlockScalars is static

// Dynamic shared memory of one block build: 8-byte arrays first, then 4-, 2- and 1-byte ones.
struct BlockShared {
  size_t bytes;
  size_t lp, pool_score, cand_score, offs, pool_prefix, pool_rank, pool_prod, pool_index,
      cand_slot, parent, rank, order, pool_depth, has_next, has_child, depth;
  __host__ __device__ BlockShared(int D, int K, int N, int C, size_t staged_size) {
    const int Mc = kCandidateFactor * N;
    size_t o = 0;
    auto take = [&o](size_t n, size_t align) {
      o = (o + align - 1) / align * align;
      const size_t at = o;
      o += n;
      return at;
    };
    pool_score = take(sizeof(double) * C, 8);
    cand_score = take(sizeof(double) * Mc, 8);
    lp = take(staged_size * static_cast<size_t>(D) * K, 8);
    offs = take(sizeof(int32_t) * C, 4);
    pool_prefix = take(sizeof(int16_t) * C, 2);
    pool_rank = take(sizeof(int16_t) * C, 2);
    pool_prod = take(sizeof(int16_t) * C, 2);
    pool_index = take(sizeof(int16_t) * C, 2);
    cand_slot = take(sizeof(int16_t) * Mc, 2);
    parent = take(sizeof(int16_t) * (N + 1), 2);
    rank = take(sizeof(int16_t) * (N + 1), 2);
    order = take(sizeof(int16_t) * (N + 1), 2);
    pool_depth = take(C, 1);
    has_next = take(C, 1);
    has_child = take(C, 1);
    depth = take(N + 1, 1);
    bytes = (o + 15) / 16 * 16;
  }
};

struct BlockScalars {
  int warp_sums[kBlock / kWarp];
  int hist[kBins];
  unsigned long long key_min, key_max, key_cut;
  int total, cut_bin, cut_live, m, n;
  unsigned int abs_max;  // float bits of max |lp|
};
static_assert(sizeof(BlockScalars) <= 2048, "static shared memory beyond kBlockSharedLimit's margin");

// Inclusive prefix sum of v over the block; *total gets the sum. Contains two __syncthreads.
__device__ int block_inclusive_scan(int v, BlockScalars& sh, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const int u = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += u;
  }
  if (lane == kWarp - 1) sh.warp_sums[warp] = v;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kBlock / kWarp; ++w) {
    const int s = sh.warp_sums[w];
    before += w < warp ? s : 0;
    all += s;
  }
  __syncthreads();  // warp_sums may be reused
  *total = all;
  return v + before;
}

__device__ __forceinline__ int bin_of(double s, double mn, double scale) {
  const double t = (s - mn) * scale;  // >= 0 and finite; NaN-safe all the same
  return t >= kBins ? kBins - 1 : (t > 0.0 ? static_cast<int>(t) : 0);
}

// Raises tau so that the live nodes (pool slots 1..count-1 with score >= tau, `live` of them,
// live > budget) shrink to the top histogram bins holding >= budget of them; tau becomes the
// smallest score in those bins. Leaves tau alone when all live scores are equal. Block-uniform
// arguments; every thread returns the same tau and live.
__device__ void tighten(const double* score, int count, double& tau, int& live, int budget,
                        BlockScalars& sh) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    sh.key_min = ~0ull;
    sh.key_max = 0ull;
    sh.key_cut = ~0ull;
  }
  sh.hist[tid] = 0;
  __syncthreads();
  unsigned long long kmin = ~0ull, kmax = 0ull;
  for (int s = 1 + tid; s < count; s += kBlock) {
    if (score[s] >= tau) {
      const unsigned long long k = order_key(score[s]);
      kmin = min(kmin, k);
      kmax = max(kmax, k);
    }
  }
  if (kmin != ~0ull) {
    atomicMin(&sh.key_min, kmin);
    atomicMax(&sh.key_max, kmax);
  }
  __syncthreads();
  const double mn = key_double(sh.key_min), mx = key_double(sh.key_max);
  if (!(mx - mn > 0.0)) {
    __syncthreads();  // everyone has read the keys
    return;
  }
  const double scale = kBins / (mx - mn);
  for (int s = 1 + tid; s < count; s += kBlock)
    if (score[s] >= tau) atomicAdd(&sh.hist[bin_of(score[s], mn, scale)], 1);
  __syncthreads();
  // Suffix sums of the histogram: thread t scans bin kBins - 1 - t.
  const int h = sh.hist[kBins - 1 - tid];
  int unused;
  const int suffix = block_inclusive_scan(h, sh, &unused);
  if (suffix >= budget && suffix - h < budget) {  // exactly one thread: the cut bin
    sh.cut_bin = kBins - 1 - tid;
    sh.cut_live = suffix;
  }
  __syncthreads();
  const int cut = sh.cut_bin;
  unsigned long long kcut = ~0ull;
  for (int s = 1 + tid; s < count; s += kBlock)
    if (score[s] >= tau && bin_of(score[s], mn, scale) >= cut) kcut = min(kcut, order_key(score[s]));
  if (kcut != ~0ull) atomicMin(&sh.key_cut, kcut);
  __syncthreads();
  tau = key_double(sh.key_cut);
  live = sh.cut_live;
  __syncthreads();  // everyone has read the scalars
}

// The contract's order between pool candidates (prefix slot, rank, depth) with scores.
__device__ __forceinline__ bool pool_before(double sa, int pa, int ra, int da, double sb, int pb,
                                            int rb, int db, const int16_t* prefix,
                                            const int16_t* rank) {
  if (sa != sb) return sa > sb;
  return rank_path_less(pa, ra, da, pb, rb, db, prefix, rank);
}

template <int M, typename Staged>
__global__ void __launch_bounds__(kBlock) block_build_kernel(BuildArgs in, BuildOutputs out,
                                                             int capacity) {
  DDTREE_DYNAMIC_SMEM(smem);
  __shared__ BlockScalars sh;
  const int D = in.depth, K = in.topk, N = in.max_budget, C = capacity;
  const int b = blockIdx.x, tid = threadIdx.x;
  const BlockShared layout(D, K, N, C, sizeof(Staged));
  Staged* s_lp = reinterpret_cast<Staged*>(smem + layout.lp);
  double* p_score = reinterpret_cast<double*>(smem + layout.pool_score);
  double* c_score = reinterpret_cast<double*>(smem + layout.cand_score);
  int32_t* offs = reinterpret_cast<int32_t*>(smem + layout.offs);
  int16_t* p_prefix = reinterpret_cast<int16_t*>(smem + layout.pool_prefix);
  int16_t* p_rank = reinterpret_cast<int16_t*>(smem + layout.pool_rank);
  int16_t* p_prod = reinterpret_cast<int16_t*>(smem + layout.pool_prod);
  int16_t* p_index = reinterpret_cast<int16_t*>(smem + layout.pool_index);
  int16_t* c_slot = reinterpret_cast<int16_t*>(smem + layout.cand_slot);
  int16_t* s_parent = reinterpret_cast<int16_t*>(smem + layout.parent);
  int16_t* s_rank = reinterpret_cast<int16_t*>(smem + layout.rank);
  int16_t* s_order = reinterpret_cast<int16_t*>(smem + layout.order);
  int8_t* p_depth = reinterpret_cast<int8_t*>(smem + layout.pool_depth);
  uint8_t* has_next = reinterpret_cast<uint8_t*>(smem + layout.has_next);
  uint8_t* has_child = reinterpret_cast<uint8_t*>(smem + layout.has_child);
  int8_t* s_depth = reinterpret_cast<int8_t*>(smem + layout.depth);

  // Stage and check this request's log-probs; max |lp| for the exactness test.
  const float* lp = in.logprobs + static_cast<long>(b) * D * K;
  const int numel = D * K;
  if (tid == 0) {
    sh.abs_max = 0u;
    s_parent[0] = -1;  // the root, for either path
    s_rank[0] = 0;
    s_depth[0] = 0;
    s_order[0] = 0;    // pool slot of node 0 (read as `last` only when n = 0: then fall back)
  }
  __syncthreads();
  bool nonfinite = false, unordered = false;
  float abs_max = 0.0f;
  for (int i = tid; i < numel; i += kBlock) {
    const float v = __ldg(lp + i);
    s_lp[i] = v;
    nonfinite |= !isfinite(v);
    abs_max = fmaxf(abs_max, fabsf(v));  // fmaxf ignores NaN; NaN is reported anyway
  }
  if (isfinite(abs_max)) atomicMax(&sh.abs_max, __float_as_uint(abs_max));
  __syncthreads();
  for (int i = tid; i < numel; i += kBlock)
    if (i % K != 0) unordered |= static_cast<float>(s_lp[i - 1]) < static_cast<float>(s_lp[i]);
  const int budget = in.budgets ? in.budgets[b] : N;
  int32_t status = kOk;
  if (__syncthreads_or(nonfinite)) status = kNonFinite;
  else if (__syncthreads_or(unordered)) status = kNotDescending;
  if (budget < 1 || budget > N) status = kBadBudget;

  bool exact = status == kOk;
  if (exact) {
    const double big = static_cast<double>(__uint_as_float(sh.abs_max));
    if (big > 0.0) {
      int e;
      frexp(static_cast<double>(D) * big, &e);  // D * max|lp| < 2^e
      const int q = 53 - e;
      bool ok = true;
      for (int i = tid; i < numel; i += kBlock) {
        const double t = ldexp(static_cast<double>(s_lp[i]), q);
        ok &= t == floor(t);
      }
      exact = __syncthreads_and(ok);
    }
  }

  int n = 0;
  bool fallback = false;
  if (status == kOk) {
    // The pool: slot 0 is the root.
    if (tid == 0) {
      p_score[0] = 0.0;
      p_prefix[0] = -1;
      p_rank[0] = 0;
      p_prod[0] = 1;
      p_depth[0] = 0;
    }
    __syncthreads();
    double tau = -INFINITY;
    int count = 1, lo = 0, hi = 1, live = 0;
    for (int d = 1; d <= D; ++d) {
      const Staged* row = s_lp + (d - 1) * K;
      // Children per live parent of the last level, a contiguous chunk of parents per thread.
      const int P = hi - lo, chunk = (P + kBlock - 1) / kBlock;
      const int first = lo + min(P, tid * chunk), last = lo + min(P, (tid + 1) * chunk);
      int mine = 0;
      for (int p = first; p < last; ++p) {
        int c = 0;
        if (p == 0 || p_score[p] >= tau) {
          const double base = p_score[p];
          const int limit = min(K, budget / p_prod[p]);
          if (exact) {  // children j < c: base + row[j] >= tau, a prefix (rows descend)
            int a = 0, z = limit;
            while (a < z) {
              const int mid = (a + z) / 2;
              if (base + static_cast<double>(row[mid]) >= tau) a = mid + 1;
              else z = mid;
            }
            c = a;
          } else {  // the contract's sibling chain, up to the first score below tau
            double sc = base + static_cast<double>(row[0]);
            while (c < limit && sc >= tau) {
              ++c;
              if (c < limit) sc = (sc - static_cast<double>(row[c - 1])) + static_cast<double>(row[c]);
            }
          }
        }
        offs[p - lo] = c;
        mine += c;
      }
      int total;
      const int first_off = block_inclusive_scan(mine, sh, &total) - mine;
      if (count + total > C) {  // block-uniform
        fallback = true;
        break;
      }
      if (total == 0) break;
      if (exact) {  // one thread per child: its parent by binary search over the offsets
        int off = first_off;
        for (int p = first; p < last; ++p) {
          const int c = offs[p - lo];
          offs[p - lo] = off;
          off += c;
        }
        __syncthreads();  // offs complete
        for (int i = tid; i < total; i += kBlock) {
          int a = 0, z = P - 1;  // the last parent whose offset is <= i
          while (a < z) {
            const int mid = (a + z + 1) / 2;
            if (offs[mid] <= i) a = mid;
            else z = mid - 1;
          }
          const int p = lo + a, j = i - offs[a], slot = count + i;
          p_score[slot] = p_score[p] + static_cast<double>(row[j]);
          p_prefix[slot] = static_cast<int16_t>(p);
          p_rank[slot] = static_cast<int16_t>(j);
          p_prod[slot] = static_cast<int16_t>((j + 1) * p_prod[p]);
          p_depth[slot] = static_cast<int8_t>(d);
        }
      } else {  // each thread replays the chains of its parents into its range of slots
        int slot = count + first_off;
        for (int p = first; p < last; ++p) {
          const int c = offs[p - lo];
          double sc = p_score[p] + static_cast<double>(row[0]);
          for (int j = 0; j < c; ++j, ++slot) {
            if (j > 0) sc = (sc - static_cast<double>(row[j - 1])) + static_cast<double>(row[j]);
            p_score[slot] = sc;
            p_prefix[slot] = static_cast<int16_t>(p);
            p_rank[slot] = static_cast<int16_t>(j);
            p_prod[slot] = static_cast<int16_t>((j + 1) * p_prod[p]);
            p_depth[slot] = static_cast<int8_t>(d);
          }
        }
      }
      __syncthreads();  // the new level is visible; offs may be reused
      lo = count;
      hi = count + total;
      count += total;
      live += total;
      if (live > kTightenFactor * budget) tighten(p_score, count, tau, live, budget, sh);
    }
    if (!fallback && live > budget) tighten(p_score, count, tau, live, budget, sh);
    if (!fallback && live > kCandidateFactor * budget) fallback = true;

    if (!fallback) {
      // Candidates: the live slots. Clear the pool's marks.
      if (tid == 0) sh.m = 0;
      __syncthreads();
      for (int s = tid; s < count; s += kBlock) {
        p_index[s] = s == 0 ? 0 : -1;
        has_next[s] = 0;
        has_child[s] = 0;
        if (s > 0 && p_score[s] >= tau) {
          const int at = atomicAdd(&sh.m, 1);
          if (at < kCandidateFactor * budget) {  // == live <= 4 * budget: always, kept safe
            c_slot[at] = static_cast<int16_t>(s);
            c_score[at] = p_score[s];
          }
        }
      }
      __syncthreads();
      const int m = min(sh.m, kCandidateFactor * budget);  // sh.m == live
      n = min(m, budget);
      // Rank by counting; the first `budget` become nodes 1..n.
      for (int i = tid; i < m; i += kBlock) {
        const int s = c_slot[i];
        const double si = c_score[i];
        const int pi = p_prefix[s], ri = p_rank[s], di = p_depth[s];
        int r = 0;
        for (int j = 0; j < m; ++j) {
          const double sj = c_score[j];
          if (sj > si) ++r;
          else if (sj == si && j != i) {
            const int t = c_slot[j];
            r += rank_path_less(p_prefix[t], p_rank[t], p_depth[t], pi, ri, di, p_prefix, p_rank);
          }
        }
        if (r < budget) {
          p_index[s] = static_cast<int16_t>(r + 1);
          s_order[r + 1] = static_cast<int16_t>(s);
        }
      }
      __syncthreads();
      // Verification, part 1: generators in the tree and before; the tree's node arrays.
      bool bad = n < 1;  // never on exact inputs (level 1 always adds (0)); kept safe
      for (int i = 1 + tid; i <= n; i += kBlock) {
        const int s = s_order[i];
        const int gen = p_rank[s] > 0 ? s - 1 : p_prefix[s];  // siblings sit in consecutive slots
        if (gen != 0) {
          const int g = p_index[gen];
          bad |= g < 1 || g >= i;
          if (p_rank[s] > 0) has_next[gen] = 1;
          else has_child[gen] = 1;
        }
        const int parent = p_index[p_prefix[s]];
        bad |= parent < 0 || parent >= i;
        s_parent[i] = static_cast<int16_t>(parent);
        s_rank[i] = p_rank[s];
        s_depth[i] = p_depth[s];
      }
      __syncthreads();
      // Part 2: every offer of a tree node that is not in the tree pops after the last node.
      const int last = s_order[n];
      const double s_last = p_score[last];
      for (int i = 1 + tid; i <= n; i += kBlock) {
        const int g = s_order[i], d = p_depth[g], r = p_rank[g];
        const Staged* grow = s_lp + (d - 1) * K;
        if (r + 1 < K && !has_next[g]) {
          double so = p_score[g] - static_cast<double>(grow[r]);
          so = so + static_cast<double>(grow[r + 1]);
          bad |= n < budget || !pool_before(s_last, p_prefix[last], p_rank[last], p_depth[last], so,
                                            p_prefix[g], r + 1, d, p_prefix, p_rank);
        }
        if (d < D && !has_child[g]) {
          const double so = p_score[g] + static_cast<double>(s_lp[d * K]);
          bad |= n < budget || !pool_before(s_last, p_prefix[last], p_rank[last], p_depth[last], so,
                                            g, 0, d + 1, p_prefix, p_rank);
        }
      }
      fallback = __syncthreads_or(bad);
    }
  }

  if (tid == 0 && status == kOk) DDTREE_BLOCK_PATH(fallback, exact);
  if (fallback) {  // block-uniform: the exact sequential loop on warp 0
    if (tid < kWarp) {
      n = warp_build<M>(s_lp, D, K, budget, s_parent, s_rank, s_depth, tid);
      if (tid == 0) sh.n = n;
    }
    __syncthreads();
    n = sh.n;
  }
  write_outputs(in, out, b, n, status, s_parent, s_rank, s_depth, tid, kBlock);
}

// Block build: pool capacity (slots) for this launch, or 0 when the block kernel does not fit.
template <typename Staged>
int block_capacity(int D, int K, int N) {
  int C = std::min(kMaxPool, std::max(kMinPool, 64 * N));
  while (C >= kMinPool && BlockShared(D, K, N, C, sizeof(Staged)).bytes > kBlockSharedLimit) C -= 256;
  return C >= kMinPool ? C : 0;
}

#ifndef DDTREE_TREE_EMULATION
__global__ void __launch_bounds__(kWarp) accept_kernel(AcceptArgs in, AcceptOutputs out) {
  extern __shared__ int32_t s_child[];  // [N + 1] first matching child of each node
  __shared__ int32_t s_path[kMaxDepth + 1];
  const int N = in.max_budget, L = in.max_depth + 1;
  const int b = blockIdx.x, lane = threadIdx.x;
  const int32_t* tokens = in.tokens + static_cast<long>(b) * N;
  const int32_t* parents = in.parents + static_cast<long>(b) * (N + 1);
  const int32_t* posterior = in.posterior + static_cast<long>(b) * (N + 1);

  int n = __ldg(in.num_nodes + b);
  bool bad = n < 0 || n > N;
  if (bad) n = 0;
  for (int i = lane; i <= n; i += kWarp) s_child[i] = INT_MAX;
  __syncwarp();
  bool bad_parent = false;
  for (int j = lane + 1; j <= n; j += kWarp) {
    const int p = __ldg(parents + j);
    if (p < 0 || p >= j) bad_parent = true;
    else if (__ldg(tokens + j - 1) == __ldg(posterior + p)) atomicMin(s_child + p, j);
  }
  bad |= __any_sync(kFullMask, bad_parent);
  __syncwarp();
  int len = 1;
  if (lane == 0) {
    int cur = 0;
    s_path[0] = 0;
    while (len < L && s_child[cur] != INT_MAX) {
      cur = s_child[cur];
      s_path[len++] = cur;
    }
    out.length[b] = len;
    out.bonus[b] = __ldg(posterior + cur);
    out.status[b] = bad ? kBadTree : kOk;
  }
  len = __shfl_sync(kFullMask, len, 0);
  __syncwarp();
  for (int i = lane; i < L; i += kWarp) {
    const int32_t v = i < len ? s_path[i] : -1;
    out.path[static_cast<long>(b) * L + i] = v;
    out.keep[static_cast<long>(b) * L + i] = v;
  }
}

template <int M, typename Staged>
void launch_build_staged(const BuildArgs& in, const BuildOutputs& out, cudaStream_t stream) {
  const size_t smem = BuildShared(in.depth, in.topk, in.max_budget, sizeof(Staged)).bytes;
  if (smem > kDefaultSharedLimit)
    check_cuda(cudaFuncSetAttribute(build_kernel<M, Staged>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)),
               "build (shared memory opt-in)");
  build_kernel<M, Staged><<<in.batch, kBuildThreads, smem, stream>>>(in, out);
  check_cuda(cudaGetLastError(), "build");
}

template <int M>
void launch_build(const BuildArgs& in, const BuildOutputs& out, cudaStream_t stream) {
  if (BuildShared(in.depth, in.topk, in.max_budget, sizeof(double)).bytes <= kDoubleStagingLimit)
    launch_build_staged<M, double>(in, out, stream);
  else
    launch_build_staged<M, float>(in, out, stream);
}

template <int M, typename Staged>
bool launch_block_staged(const BuildArgs& in, const BuildOutputs& out, cudaStream_t stream) {
  const int C = block_capacity<Staged>(in.depth, in.topk, in.max_budget);
  if (C == 0) return false;
  const size_t smem = BlockShared(in.depth, in.topk, in.max_budget, C, sizeof(Staged)).bytes;
  // The limit without opt-in counts static + dynamic shared memory: a dynamic size just under 48 KB
  // plus BlockScalars failed to launch ("invalid argument") on the H200.
  if (smem + sizeof(BlockScalars) > kDefaultSharedLimit)
    check_cuda(cudaFuncSetAttribute(block_build_kernel<M, Staged>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "block build (shared memory opt-in)");
  block_build_kernel<M, Staged><<<in.batch, kBlock, smem, stream>>>(in, out, C);
  check_cuda(cudaGetLastError(), "block build");
  return true;
}

template <int M>
bool launch_block(const BuildArgs& in, const BuildOutputs& out, cudaStream_t stream) {
  if (sizeof(double) * static_cast<size_t>(in.depth) * in.topk <= 64 * 1024)
    return launch_block_staged<M, double>(in, out, stream);
  return launch_block_staged<M, float>(in, out, stream);
}

#endif  // DDTREE_TREE_EMULATION

}  // namespace

#ifndef DDTREE_TREE_EMULATION

void build_trees_cuda_warp(const BuildArgs& in, const BuildOutputs& out, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int rows = frontier_rows(in.max_budget);
  if (rows <= 1) launch_build<1>(in, out, stream);
  else if (rows <= 2) launch_build<2>(in, out, stream);
  else if (rows <= 4) launch_build<4>(in, out, stream);
  else if (rows <= 8) launch_build<8>(in, out, stream);
  else if (rows <= 16) launch_build<16>(in, out, stream);
  else launch_build<32>(in, out, stream);
}

void build_trees_cuda(const BuildArgs& in, const BuildOutputs& out, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  // The block kernel's fallback loop uses 32, 64, 256 or 1024 frontier slots.
  const int rows = frontier_rows(in.max_budget);
  bool launched;
  if (rows <= 1) launched = launch_block<1>(in, out, stream);
  else if (rows <= 2) launched = launch_block<2>(in, out, stream);
  else if (rows <= 8) launched = launch_block<8>(in, out, stream);
  else launched = launch_block<32>(in, out, stream);
  if (!launched) build_trees_cuda_warp(in, out, stream_handle);
}

void accept_cuda(const AcceptArgs& in, const AcceptOutputs& out, void* stream_handle) {
  const size_t smem = sizeof(int32_t) * (in.max_budget + 1);
  accept_kernel<<<in.batch, kWarp, smem, static_cast<cudaStream_t>(stream_handle)>>>(in, out);
  check_cuda(cudaGetLastError(), "accept");
}

#endif  // DDTREE_TREE_EMULATION

}  // namespace ddtree::tree
