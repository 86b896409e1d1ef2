// CUDA backend: no host synchronisation, capturable in a CUDA graph.
//
// Build keeps the frontier as one array in pop order, in registers, strided over the warp
// (position j = 32 * k + lane in row k). A pop takes the head; its two offers find their
// positions with one ballot each (compares are branch-free; exactly equal scores take a rare
// warp-uniform path through the rank paths) and the array shifts by at most one place through
// lane shuffles. Budgets <= 64 fit one row, whose loop (warp_build_row) is software-pipelined;
// more rows skip those past the live frontier. No memory traffic beyond the log-prob reads and
// the node words in shared memory. The block kernel further down selects in parallel instead.
#include <cstdint>
#ifndef DDTREE_TREE_EMULATION  // tree_cuda_emulate.cc compiles the build kernels as host C++
#include <cuda_runtime.h>
#define DDTREE_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define DDTREE_BLOCK_PATH(fallback, exact)  // the emulation counts the block kernel's paths
#define DDTREE_QUEUE_PATH(used)  // ... and queue_pool's outcomes
#define DDTREE_BOUND(tau)  // ... and checks tau_lower_bound against the exact budget-th score
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
// The lane and its bit from the special registers, through volatile asm: nvcc otherwise recomputes
// them from the thread index (an S2R, ~20 cycles) inside the pop loop instead of keeping a register.
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}
__device__ __forceinline__ unsigned lane_bit() {
  unsigned bit;
  asm volatile("mov.u32 %0, %%lanemask_eq;" : "=r"(bit));
  return bit;
}
// *to = *from | bits in shared memory where `on`, as predicated PTX: written as a C++ `if` on the
// lane, nvcc branched around the whole update (a divergent branch in the pop loop).
__device__ __forceinline__ void or_copy_if(const uint64_t* from, uint64_t* to, uint64_t bits, bool on) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 v;\n setp.ne.b32 p, %3, 0;\n @p ld.shared.b64 v, [%0];\n"
      " or.b64 v, v, %2;\n @p st.shared.b64 [%1], v;\n}"
      ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(from))),
      "r"(static_cast<unsigned>(__cvta_generic_to_shared(to))), "l"(bits), "r"(static_cast<int>(on)));
}
#endif
#ifndef DDTREE_PHASE  // phase timing hooks: a profiling harness defines them (clock64 per phase)
#define DDTREE_PHASE_START()
#define DDTREE_PHASE(i)
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "tree/tree_common.h"
#include "tree/tree_ops.h"

namespace ddtree::tree {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kNoPosition = 1 << 30;
constexpr size_t kDefaultSharedLimit = 48 * 1024;

#ifndef DDTREE_TREE_EMULATION
void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("ddtree tree ") + what + " kernel launch failed: " +
                             cudaGetErrorString(err));
}
#endif

// A node (and a frontier candidate) as one word: parent node (11 bits), the index of its log-prob
// in lp[D][K], (depth - 1) * K + rank (15 bits), and depth (6 bits). The index, not the rank, so
// that a pop's loads need no address arithmetic beyond a mask; at equal depths indices order
// siblings as ranks do, so the tie-break can walk them. The root is word 0.
__host__ __device__ __forceinline__ uint32_t node_word(int parent, int index, int depth) {
  return static_cast<uint32_t>(parent) | (static_cast<uint32_t>(index) << 11) |
         (static_cast<uint32_t>(depth) << 26);
}
__host__ __device__ __forceinline__ int node_parent(uint32_t w) { return static_cast<int>(w & 0x7FFu); }
__host__ __device__ __forceinline__ int node_index(uint32_t w) { return static_cast<int>((w >> 11) & 0x7FFFu); }
__host__ __device__ __forceinline__ int node_depth(uint32_t w) { return static_cast<int>(w >> 26); }
constexpr uint32_t kNextSibling = 1u << 11;  // node_word(p, i + 1, d) - node_word(p, i, d)

// Shared memory of one warp-kernel block: log-probs [D][K] (staged as double when they fit, so a
// pop converts nothing) and one value of slack (the pop loop loads offers that do not exist
// unclamped and drops them), then the node words and the mask rows.
constexpr size_t kDoubleStagingLimit = 200 * 1024;
constexpr int kRowMaxBudget = 64;  // budgets the one-row loop serves: ceil(64 / 2) = 32 slots
struct BuildShared {
  size_t bytes;
  size_t node_offset, mask_offset;  // mask rows: only for the one-row loop, which builds them
  __host__ __device__ BuildShared(int D, int K, int N, size_t staged_size) {
    node_offset = staged_size * (static_cast<size_t>(D) * K + 1);
    mask_offset = (node_offset + sizeof(uint32_t) * (N + 1) + 7) / 8 * 8;
    bytes = mask_offset + (N <= kRowMaxBudget ? sizeof(uint64_t) * (N + 1) * mask_words(N + 1) : 0);
  }
};

// Exactly equal scores: compare rank paths (rare on real log-probs; kept out of line so the
// common path stays small).
__device__ __noinline__ bool tie_pops_before(uint32_t a, uint32_t b, const uint32_t* s_node) {
  return rank_path_less_by(node_parent(a), node_index(a), node_depth(a), node_parent(b),
                           node_index(b), node_depth(b), [s_node](int v, int& p, int& i) {
                             const uint32_t w = s_node[v];
                             p = node_parent(w);
                             i = node_index(w);
                           });
}

// The two offers of a popped head (node n): its next sibling and its first child, in pop order
// (s1 first), scored in the contract's float64 operation order. An offer that does not exist
// scores -inf, which lands it past every live position. The loads are unclamped (one that does
// not exist reads a neighbour or the slack past [D][K]) and their values are dropped.
struct Offers {
  double s1, s2;
  uint32_t c1, c2;
  int count;  // offers that exist
  double child, sibling;  // the same two offers unordered (-inf: none)
  bool child_first;       // s1 is the child
};
// The three log-probs a pop reads: lp[i] and lp[i + 1] of the head's row, lp[d][0] of the next.
struct PopLoads {
  double here, next, child;
};
template <typename Staged>
__device__ __forceinline__ PopLoads pop_loads(uint32_t head, const Staged* s_lp, int K) {
  const int i = node_index(head), child_index = node_depth(head) * K;
  return {static_cast<double>(s_lp[i]), static_cast<double>(s_lp[i + 1]),
          static_cast<double>(s_lp[child_index])};
}
__device__ __forceinline__ Offers offers_of(uint32_t head, double head_score, int n, const PopLoads& lp,
                                            int D, int K) {
  const int i = node_index(head), d = node_depth(head), child_index = d * K;
  const bool has_sibling = i + 1 < child_index, has_child = d < D;
  double sibling = head_score - lp.here;
  sibling = sibling + lp.next;
  // The child's select is off the chain (the sibling's second add is slower), and with it the
  // order below needs no test of has_child.
  const double child = has_child ? head_score + lp.child : -INFINITY;
  // On equal scores the child (path p + [r, 0]) sorts before the sibling (p + [r + 1]).
  const bool child_first = !has_sibling || child >= sibling;
  const double sibling_or_none = has_sibling ? sibling : -INFINITY;
  const uint32_t child_word = node_word(n, child_index, d + 1), sibling_word = head + kNextSibling;
  return {child_first ? child : sibling, child_first ? sibling_or_none : child,
          child_first ? child_word : sibling_word, child_first ? sibling_word : child_word,
          has_child + has_sibling, child, sibling_or_none, child_first};
}
template <typename Staged>
__device__ __forceinline__ Offers offers_of(uint32_t head, double head_score, int n, const Staged* s_lp,
                                            int D, int K) {
  return offers_of(head, head_score, n, pop_loads(head, s_lp, K), D, K);
}

// The frontier without its head, on one row: lane j holds position j + 1, in pop order; lanes
// past the live candidates hold -inf.
struct Row {
  double score;
  uint32_t cand;
};

// Places a pop's offers into the row, given ballots of the lanes that pop before each offer (or
// tie with it; a tie redoes them exactly). Those are lanes 0..c1-1 for s1 and 0..c2-1 for s2, so
// a lane reads its case off the ballots' bits, with no counts. If s1 became the head (c1 = 0):
// before c2 a lane keeps its value, at c2 it takes s2, after it R[j - 1]. Else R[0] became the head
// and the row also moves down before s1: R[j + 1] before c1 - 1, s1 at c1 - 1. An offer that does
// not exist is -inf, which every lane reaches: s2 then goes nowhere, and s1 to lane 31 as padding.
__device__ __forceinline__ Row place_offers(const Offers& o, unsigned ahead1, unsigned ahead2, Row old,
                                            int lane, unsigned bit) {
  const unsigned next_bit = bit << 1, prev_bit = bit >> 1;
  const bool before1 = (ahead1 & next_bit) != 0, at1 = !before1 && (ahead1 & bit) != 0;
  const bool before2 = (ahead2 & bit) != 0, at2 = !before2 && (lane == 0 || (ahead2 & prev_bit) != 0);
  const int src = before1 ? lane + 1 : (before2 ? lane : lane - 1);
  const double moved_score = __shfl_sync(kFullMask, old.score, src);
  const uint32_t moved_cand = __shfl_sync(kFullMask, old.cand, src);
  return {at1 ? o.s1 : (at2 ? o.s2 : moved_score), at1 ? o.c1 : (at2 ? o.c2 : moved_cand)};
}

// The best-first loop on one frontier row (budgets <= 64), software-pipelined: pop k computes its
// offers from the head while it places pop k-1's offers into the row (the two are independent, so
// their latencies overlap in one basic block), then takes its own offers' ballots against the
// placed row. Every lane carries the head: the first offer if no candidate pops before it, else
// R[0]. Exactly equal scores (rare) redo the ballots with the rank-path tie-break at the end of
// the pop; the placement they feed is the next pop's. No count of live candidates is kept: the
// row holds at most 32, and one pushed past lane 31 is at position >= 33 >= budget - n, so it
// could never pop (after n pops at most n + 1 candidates exist, so the row overflows only once
// n >= 32).
// With kMaskRows (words per row W = 1 or 2), lanes 0..W-1 also build the ancestor mask rows in
// s_mask as nodes pop: row n = row[parent] | bit n, off the loop's chain; row 0 (the root) is the
// caller's.
template <bool kMaskRows, typename Staged>
__device__ int warp_build_row(const Staged* s_lp, int D, int K, int budget, uint32_t* s_node,
                              uint64_t* s_mask, int W) {
  const int lane = lane_id();
  const unsigned bit = lane_bit();
  double head_score = static_cast<double>(s_lp[0]);
  uint32_t head = node_word(0, 0, 1);
  Row row{-INFINITY, 0u};
  Offers pending{-INFINITY, -INFINITY, 0u, 0u, 0, -INFINITY, -INFINITY, true};  // nothing to place yet
  unsigned ahead1 = kFullMask, ahead2 = kFullMask;
  PopLoads lp = pop_loads(head, s_lp, K);  // the head's log-probs, loaded before the back-edge
  int n = 0;
  for (;;) {
    row = place_offers(pending, ahead1, ahead2, row, lane, bit);
    ++n;
    if (lane == 0) s_node[n] = head;
    if constexpr (kMaskRows)  // lane w < W: word w
      or_copy_if(s_mask + node_parent(head) * W + lane, s_mask + n * W + lane,
                 (n >> 6) == lane ? uint64_t{1} << (n & 63) : 0, lane < W);
    const Offers o = offers_of(head, head_score, n, lp, D, K);
    const double second_score = __shfl_sync(kFullMask, row.score, 0);
    const uint32_t second = __shfl_sync(kFullMask, row.cand, 0);
    // Ballots against the child and the sibling as they come out of their adds, ordered after
    // the votes: the order's compare and selects stay off the chain to the next head.
    const unsigned ahead_child = __ballot_sync(kFullMask, row.score >= o.child);
    const unsigned ahead_sibling = __ballot_sync(kFullMask, row.score >= o.sibling);
    ahead1 = o.child_first ? ahead_child : ahead_sibling;
    ahead2 = o.child_first ? ahead_sibling : ahead_child;
    // The next head and its log-probs, from ahead1 (again after a tie).
    const auto take_head = [&] {
      head_score = ahead1 == 0 ? o.s1 : second_score;
      head = ahead1 == 0 ? o.c1 : second;
      lp = pop_loads(head, s_lp, K);
    };
    take_head();
    const bool more = n < budget && head_score > -INFINITY;  // -inf: the frontier is empty
    pending = o;
    // Bitwise, not short-circuit: nvcc otherwise branches around the compares.
    const bool tie = __any_sync(kFullMask, ((row.score == o.child) | (row.score == o.sibling)) & (row.score > -INFINITY));
    if (!tie && more) continue;  // the common case: one branch per pop
    if (tie) {
      __syncwarp();  // node n is visible to the tie-breaks
      const bool real = row.score > -INFINITY;
      bool a1 = row.score > o.s1 || (row.score == o.s1 && !real);
      bool a2 = row.score > o.s2 || (row.score == o.s2 && !real);
      if (real && row.score == o.s1) a1 = tie_pops_before(row.cand, o.c1, s_node);
      if (real && row.score == o.s2) a2 = tie_pops_before(row.cand, o.c2, s_node);
      ahead1 = __ballot_sync(kFullMask, a1);
      ahead2 = __ballot_sync(kFullMask, a2);
      take_head();
    }
    if (!more) break;
  }
  __syncwarp();
  return n;
}

// The best-first loop on M > 1 frontier rows: position j = k * 32 + lane. The offers' positions
// are counts over the rows, and the array shifts through neighbour-lane shuffles.
template <int M, typename Staged>
__device__ int warp_build_rows(const Staged* s_lp, int D, int K, int budget, uint32_t* s_node, int lane) {
  // Frontier position j = k * 32 + lane lives in score[k] / cand[k]; positions < live are
  // valid, in pop order. live <= min(32 * M, budget - n): later positions could never pop.
  double score[M];
  uint32_t cand[M];
#pragma unroll
  for (int k = 0; k < M; ++k) {
    score[k] = 0.0;
    cand[k] = 0;
  }
  if (lane == 0) {
    score[0] = static_cast<double>(s_lp[0]);
    cand[0] = node_word(0, 0, 1);
  }
  int live = 1;
  const int up_lane = (lane + kWarp - 1) % kWarp, down_lane = (lane + 1) % kWarp;
  // Position 0 (the head), known to every lane, as in warp_build_row.
  double head_score = static_cast<double>(s_lp[0]);
  uint32_t head = node_word(0, 0, 1);

  int n = 0;
  while (n < budget && live > 0) {
    const double second_score = __shfl_sync(kFullMask, score[0], 1);
    const uint32_t second = __shfl_sync(kFullMask, cand[0], 1);
    ++n;
    if (lane == 0) s_node[n] = head;
    const Offers o = offers_of(head, head_score, n, s_lp, D, K);
    const int offers = o.count;
    const double s1 = o.s1, s2 = o.s2;
    const uint32_t c1 = o.c1, c2 = o.c2;
    // Positions of the offers among the frontier without its head: count what pops first. The
    // ballots come straight from the compares; only a tie (rare) recomputes them, so the common
    // path keeps its flags in predicates.
    unsigned ahead1[M], ahead2[M];
    bool tie = false;
#pragma unroll
    for (int k = 0; k < M; ++k) {
      const int j = k * kWarp + lane;
      const bool valid = j > 0 && j < live;
      ahead1[k] = ahead2[k] = 0;
      if (k * kWarp < live) {
        ahead1[k] = __ballot_sync(kFullMask, valid && score[k] > s1);
        ahead2[k] = __ballot_sync(kFullMask, valid && score[k] > s2);
      }
      // Bitwise, not short-circuit: nvcc otherwise branches around the two compares (a divergent
      // branch and a convergence barrier in every pop).
      tie |= valid & (((offers >= 1) & (score[k] == s1)) | ((offers >= 2) & (score[k] == s2)));
    }
    if (__any_sync(kFullMask, tie)) {  // exactly equal scores: compare rank paths (rare)
      __syncwarp();                    // node n is visible to the tie-breaks
#pragma unroll
      for (int k = 0; k < M; ++k) {
        const int j = k * kWarp + lane;
        const bool valid = j > 0 && j < live;
        bool a1 = valid && score[k] > s1, a2 = valid && score[k] > s2;
        if (valid && offers >= 1 && score[k] == s1) a1 = tie_pops_before(cand[k], c1, s_node);
        if (valid && offers >= 2 && score[k] == s2) a2 = tie_pops_before(cand[k], c2, s_node);
        if (k * kWarp < live) {
          ahead1[k] = __ballot_sync(kFullMask, a1);
          ahead2[k] = __ballot_sync(kFullMask, a2);
        }
      }
    }
    int q1 = 0, q2 = 1;  // s1 goes before s2
    unsigned any_ahead1 = 0;
#pragma unroll
    for (int k = 0; k < M; ++k) {
      q1 += __popc(ahead1[k]);
      q2 += __popc(ahead2[k]);
      any_ahead1 |= ahead1[k];
    }
    if (offers < 1) q1 = kNoPosition;
    if (offers < 2) q2 = kNoPosition;
    // The next head from the ballots, not the counts: the next pop's loads wait for less.
    const bool first_is_head = offers >= 1 && any_ahead1 == 0;
    head_score = first_is_head ? s1 : second_score;
    head = first_is_head ? c1 : second;
    const int next_live = min(min(live - 1 + offers, M * kWarp), budget - n);

    // Shift: new[j] = old[j+1] before q1, s1 at q1, old[j] up to q2, s2 at q2, old[j-1] after.
    // old[j-1] / old[j+1] come from the neighbour lane (row k-1 / k+1 across the warp edge).
    double up_s_prev = 0.0, down_s = 0.0;
    uint32_t up_c_prev = 0, down_c = 0;
    down_s = __shfl_sync(kFullMask, score[0], down_lane);
    down_c = __shfl_sync(kFullMask, cand[0], down_lane);
#pragma unroll
    for (int k = 0; k < M; ++k) {
      if (k * kWarp < next_live) {
        const double old_s = score[k];
        const uint32_t old_c = cand[k];
        const double up_s = __shfl_sync(kFullMask, old_s, up_lane);
        const uint32_t up_c = __shfl_sync(kFullMask, old_c, up_lane);
        double down_next_s = 0.0;
        uint32_t down_next_c = 0;
        if (k + 1 < M) {
          down_next_s = __shfl_sync(kFullMask, score[k + 1], down_lane);
          down_next_c = __shfl_sync(kFullMask, cand[k + 1], down_lane);
        }
        const double below_s = lane == 0 ? up_s_prev : up_s;  // old[j-1]
        const uint32_t below_c = lane == 0 ? up_c_prev : up_c;
        const double above_s = lane == kWarp - 1 ? down_next_s : down_s;  // old[j+1]
        const uint32_t above_c = lane == kWarp - 1 ? down_next_c : down_c;
        const int j = k * kWarp + lane;
        double new_s = j < q1 ? above_s : (j < q2 ? old_s : below_s);
        uint32_t new_c = j < q1 ? above_c : (j < q2 ? old_c : below_c);
        if (j == q1) {
          new_s = s1;
          new_c = c1;
        }
        if (j == q2) {
          new_s = s2;
          new_c = c2;
        }
        score[k] = new_s;
        cand[k] = new_c;
        up_s_prev = up_s;
        up_c_prev = up_c;
        down_s = down_next_s;
        down_c = down_next_c;
      }
    }
    live = next_live;
  }
  __syncwarp();
  return n;
}

// The sequential best-first loop of one warp (the exact algorithm, pop by pop): node n's word goes
// to s_node[n] (s_node[0], the root, is the caller's). s_lp must be readable one value past
// [D][K]. s_mask (M = 1 only, else ignored): see warp_build_row. Returns the number of nodes popped.
template <int M, bool kMaskRows = false, typename Staged>
__device__ int warp_build(const Staged* s_lp, int D, int K, int budget, uint32_t* s_node, int lane,
                          uint64_t* s_mask = nullptr, int W = 0) {
  if constexpr (M == 1) return warp_build_row<kMaskRows>(s_lp, D, K, budget, s_node, s_mask, W);
  else return warp_build_rows<M>(s_lp, D, K, budget, s_node, lane);
}

// Outputs of request b, padding included, by threads tid = 0..nthreads-1 (all of the block's
// threads: the staged walk has barriers). Mask rows: kWalkRows, one ancestor walk per row, staged
// in `scratch` (shared memory free for scratch_words words, or nullptr); else word by word, copied
// from s_mask (the rows the one-row pop loop built) or, where that is null, a walk per word. The
// warp kernel with M = 1 (always with s_mask) keeps the word-by-word body: with the row walk
// instead, ptxas scheduled its pop loop worse (105 -> 108 instructions, +7% kernel time at budget
// 64), for code that runs after the loop.
template <bool kWalkRows>
__device__ void write_outputs(const BuildArgs& in, const BuildOutputs& out, int b, int n,
                              int32_t status, const uint32_t* s_node, int tid, int nthreads,
                              const uint64_t* s_mask, uint64_t* scratch = nullptr, long scratch_words = 0) {
  const int D = in.depth, K = in.topk, N = in.max_budget, W = mask_words(N + 1);
  const int32_t* ids = in.ids + static_cast<long>(b) * D * K;
  int32_t* tokens = out.tokens + static_cast<long>(b) * N;
  int32_t* depths = out.depths + static_cast<long>(b) * N;
  int32_t* parents = out.parents + static_cast<long>(b) * (N + 1);
  uint64_t* mask = out.mask + static_cast<long>(b) * (N + 1) * W;
  for (int i = tid; i < N; i += nthreads) {
    const int node = i + 1;
    if (node <= n) {
      const uint32_t w = s_node[node];
      tokens[i] = __ldg(ids + node_index(w));
      depths[i] = node_depth(w);
    } else {
      tokens[i] = -1;
      depths[i] = 0;
    }
  }
  for (int i = tid; i <= N; i += nthreads) parents[i] = (i >= 1 && i <= n) ? node_parent(s_node[i]) : -1;
  if constexpr (kWalkRows) {
    // One walk per row, nthreads rows at a time. Parents have smaller indices, so the walk visits
    // the row's words from its own down to word 0 (the root, bit 0, is everyone's ancestor), each
    // word stored as the walk leaves it: straight to the output rows (a store per row and word,
    // strided), or, for rows of 8 words or more, into `scratch` (when it holds nthreads rows) and
    // copied out coalesced. H200, block kernel, batch 64, outputs per request against a walk per
    // word (until 2026-11-30): budget 1024 (17 words) 19.3 us -> 18.6 strided / 7.6 staged; 512
    // (9 words) 6.5 -> 4.3 / 3.5; 256 (5 words) 2.5 -> 1.6 / 2.1.
    const bool staged = W >= 8 && scratch != nullptr && static_cast<long>(nthreads) * W <= scratch_words;
    for (int first = 0; first <= N; first += nthreads) {  // uniform trips: barriers inside
      const int row = first + tid;
      uint64_t* dst = staged ? scratch + static_cast<long>(tid) * W : mask + static_cast<long>(row) * W;
      if (row <= N) {
        const int own = row <= n ? row / 64 : -1;
        for (int w = W - 1; w > own; --w) dst[w] = 0;
        if (row <= n) {
          int word = own;
          uint64_t bits = 0;
          for (int v = row;; v = node_parent(s_node[v])) {
            for (; v / 64 < word; --word) {
              dst[word] = bits;
              bits = 0;
            }
            bits |= uint64_t{1} << (v % 64);
            if (v == 0) break;
          }
          dst[0] = bits;
        }
      }
      if (staged) {
        __syncthreads();
        const int words = min(nthreads, N + 1 - first) * W;
        for (int i = tid; i < words; i += nthreads) mask[static_cast<long>(first) * W + i] = scratch[i];
        __syncthreads();
      }
    }
  } else {
    // Row i, word w: the ancestors of i that fall in the word; the root is everyone's.
    for (int idx = tid; idx < (N + 1) * W; idx += nthreads) {
      const int row = idx / W, lo = (idx - row * W) * 64;
      uint64_t bits = 0;
      if (row <= n && s_mask != nullptr) {
        bits = s_mask[idx];
      } else if (row <= n) {
        for (int v = row; v >= lo && v > 0; v = node_parent(s_node[v]))
          if (v < lo + 64) bits |= uint64_t{1} << (v - lo);
        if (lo == 0) bits |= 1;
      }
      mask[idx] = bits;
    }
  }
  if (tid == 0) {
    out.num_nodes[b] = n;
    out.status[b] = status;
  }
}

// Stages a request's log-probs in shared memory (as Staged) by threads tid = 0..nthreads-1, in one
// pass that also checks them: check(v, left neighbour, v starts a row) sees every value.
template <typename Staged, typename Check>
__device__ void stage_logprobs(const float* lp, Staged* s_lp, int numel, int K, int tid, int nthreads,
                               Check check) {
  if ((K & 3) == 0 && (reinterpret_cast<uintptr_t>(lp) & 15) == 0) {  // a float4 never straddles rows
    const float4* lp4 = reinterpret_cast<const float4*>(lp);
#pragma unroll 4
    for (int i = tid; i < numel / 4; i += nthreads) {
      const float4 v = __ldg(lp4 + i);
      const bool row_start = (4 * i) % K == 0;
      const float before = row_start ? 0.0f : __ldg(lp + 4 * i - 1);
      s_lp[4 * i] = v.x;
      s_lp[4 * i + 1] = v.y;
      s_lp[4 * i + 2] = v.z;
      s_lp[4 * i + 3] = v.w;
      check(v.x, before, row_start);
      check(v.y, v.x, false);
      check(v.z, v.y, false);
      check(v.w, v.z, false);
    }
  } else {
    for (int i = tid; i < numel; i += nthreads) {
      const float v = __ldg(lp + i);
      const bool row_start = i % K == 0;
      s_lp[i] = v;
      check(v, row_start ? 0.0f : __ldg(lp + i - 1), row_start);
    }
  }
}


// The warp kernel: warp 0 runs the pop loop; all kBuildThreads stage the log-probs and write the
// outputs (the other warps wait at the barrier meanwhile, issuing nothing). H200, batch 64, budget
// 64, per request: staging 2.08 -> 0.83 us, outputs 2.22 -> 1.08 against one warp. A second warp
// that wrote each node's outputs while warp 0 popped (polling the nodes it published) was slower:
// its shared-memory traffic slowed the pops by 60%.
constexpr int kBuildThreads = 4 * kWarp;

template <int M, typename Staged>
__global__ void __launch_bounds__(kBuildThreads, 1) build_kernel(BuildArgs in, BuildOutputs out) {
  DDTREE_DYNAMIC_SMEM(smem);
  DDTREE_PHASE_START();
  __shared__ int s_n;
  const int D = in.depth, K = in.topk, N = in.max_budget;
  const int b = blockIdx.x, tid = threadIdx.x;
  const BuildShared layout(D, K, N, sizeof(Staged));
  Staged* s_lp = reinterpret_cast<Staged*>(smem);
  uint32_t* s_node = reinterpret_cast<uint32_t*>(smem + layout.node_offset);
  const int W = mask_words(N + 1);
  uint64_t* s_mask = M == 1 && N <= kRowMaxBudget ? reinterpret_cast<uint64_t*>(smem + layout.mask_offset) : nullptr;

  // Stage this request's log-probs in shared memory and check them.
  bool nonfinite = false, unordered = false;
  stage_logprobs(in.logprobs + static_cast<long>(b) * D * K, s_lp, D * K, K, tid, kBuildThreads,
                 [&](float v, float before, bool row_start) {
                   nonfinite |= !isfinite(v);
                   unordered |= !row_start && before < v;
                 });
  // The outputs read ids[d - 1][rank] per node: bring this request's ids into L1 meanwhile.
  const int32_t* ids = in.ids + static_cast<long>(b) * D * K;
  for (int i = tid * 32; i < D * K; i += kBuildThreads * 32) prefetch_l1(ids + i);  // 128-byte lines
  if (tid == 0) s_node[0] = 0;  // the root
  if (s_mask != nullptr && tid < W) s_mask[tid] = tid == 0 ? 1 : 0;
  const int budget = in.budgets ? in.budgets[b] : N;
  int32_t status = kOk;
  // Votes, so the compiler sees the status (and the loop's branch below) warp-uniform: without them
  // every shuffle of the pop loop gets a divergence check (BRA.DIV).
  const bool any_nonfinite = __syncthreads_or(nonfinite), any_unordered = __syncthreads_or(unordered);
  if (__any_sync(kFullMask, any_nonfinite)) status = kNonFinite;
  else if (__any_sync(kFullMask, any_unordered)) status = kNotDescending;
  if (budget < 1 || budget > N) status = kBadBudget;

  DDTREE_PHASE(10);
  if (__any_sync(kFullMask, tid < kWarp)) {  // warp 0
    const int n = status == kOk ? warp_build<M, M == 1>(s_lp, D, K, budget, s_node, tid, s_mask, W) : 0;
    if (tid == 0) s_n = n;
  }
  __syncthreads();
  DDTREE_PHASE(11);
  // M == 1 serves budgets <= 64, whose loop builds the mask rows (s_mask is never null there).
  write_outputs<M != 1>(in, out, b, s_n, status, s_node, tid, kBuildThreads, s_mask);
  DDTREE_PHASE(12);
}

// ---------------------------------------------------------------------------------------------
// Block build: one block of kBlock threads per request, selection in parallel, verified exactly,
// the warp loop above as the fallback. tests/tree_parallel_model.py is a plain-Python
// model of these steps' decisions (same float64 operations, bins and checks; it ranks by plain
// counting), tested against the oracle;
// docs/tree.md "The block kernel" gives the argument.
//
// 1. Scores: when every log-prob is a multiple of 2^-q with D * max|lp| < 2^(53-q), every
//    float64 partial sum along a path is exact, so a path's contract score is the plain sum of
//    its log-probs in any order ("exact": children by binary search, one thread per child).
//    Otherwise each thread replays the contract's sibling chain for its parents.
// 2. Pool: level by level, each live parent p (score >= tau) gets its children j in rank order
//    while score >= tau and (j + 1) * prod(p) <= budget (prod = product of rank + 1 along the
//    path), written to consecutive slots after a block scan of the counts (one parent per
//    thread and a one-barrier scan on levels of <= kBlock parents). tau rises (histogram
//    select) when more than 2 * budget nodes live after a level, and at the end when more
//    than budget do. Where tau is fixed from the start (exact sums, a lower bound), a work
//    queue builds the same pool without levels instead (queue_pool).
// 3. The live nodes are ranked by the histogram's bins (a count within each bin in the
//    contract's order), or, where a bin is crowded, sorted by score (bitonic, 64-bit order
//    keys) with runs of equal scores put in rank-path order; the first budget form the tree
//    (node index = rank + 1).
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
constexpr int kTightenFactor = 2;        // after a level, tau rises when > 2 * budget nodes live
constexpr int kOwnerWidest = 8;          // narrow levels whose families are all this small: owners write
constexpr int kBinRankMax = 64;          // rank by bins when no bin (nor the sliver) holds more candidates
static_assert(kBlock * kMaxTopK < (1 << 20) && kBlock < (1 << 11), "a narrow level's scan word");

// The largest power of two <= x (0 for x <= 0): the first step of a branchless binary search.
__device__ __forceinline__ int pow2_at_most(int x) { return x > 0 ? 1 << (31 - __clz(x)) : 0; }

__host__ __device__ __forceinline__ int pow2_at_least(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

// Keys the candidate sort takes for m candidates: a power of two, at least one 64-key register
// chunk. The shared-memory layout reserves it for m = kCandidateFactor * budget.
__host__ __device__ __forceinline__ int sort_length(int m) { return m > 64 ? pow2_at_least(m) : 64; }

// Dynamic shared memory of one block build: 8-byte arrays first, then 4-, 2- and 1-byte ones.
struct BlockShared {
  size_t bytes;
  size_t lp, pool_score, cand_score, offs, pool_prefix, pool_rank, pool_prod, pool_index,
      cand_slot, node, order, pool_depth, has_next, has_child;
  BlockShared(int D, int K, int N, int C, size_t staged_size) {  // host only: the kernel takes it as an argument
    const int Mc = sort_length(kCandidateFactor * N);
    size_t o = 0;
    auto take = [&o](size_t n, size_t align) {
      o = (o + align - 1) / align * align;
      const size_t at = o;
      o += n;
      return at;
    };
    pool_score = take(sizeof(double) * C, 8);
    cand_score = take(sizeof(double) * Mc, 8);
    lp = take(staged_size * (static_cast<size_t>(D) * K + 1), 8);  // + the pop loop's slack
    offs = take(sizeof(int32_t) * C, 4);
    node = take(sizeof(uint32_t) * (N + 1), 4);
    pool_prefix = take(sizeof(int16_t) * C, 2);
    pool_rank = take(sizeof(int16_t) * C, 2);
    pool_prod = take(sizeof(int16_t) * C, 2);
    pool_index = take(sizeof(int16_t) * C, 2);
    cand_slot = take(sizeof(int16_t) * Mc, 2);
    order = take(sizeof(int16_t) * (N + 1), 2);
    pool_depth = take(C, 1);
    has_next = take(C, 2);  // with has_child after it: the levels' int16 counts
    has_child = take(C, 1);
    bytes = (o + 15) / 16 * 16;
  }
};

struct BlockScalars {
  long long warp_sums[kBlock / kWarp];
  int level_sums[kBlock / kWarp];  // narrow levels' scan: (children, families) per warp
  int level_max[kBlock / kWarp];   // and each warp's largest family
  int hist[kBins];
  unsigned long long key_min, key_max;
  int total, cut_bin, cut_live, m, n;
  unsigned int abs_max;  // float bits of max |lp|
  int lowest_bit;        // min over the log-probs of lowest_bit_exponent
  int flags;             // 1: a value not finite, 2: a row out of order
  unsigned long long bound_key;  // tau_lower_bound's best candidate
  int q_head, q_slots, q_done, q_finished;  // queue_pool: the queue's head, slots taken, items done, the end
};
// Dynamic shared memory a block may take: BlockScalars is static and counts against the 227 KB.
constexpr size_t kBlockSharedLimit = 227 * 1024 - (sizeof(BlockScalars) + 15) / 16 * 16;

// Doubles as unsigned keys in the same order (no NaN here).
__device__ __forceinline__ unsigned long long order_key(double x) {
  const unsigned long long k = static_cast<unsigned long long>(__double_as_longlong(x));
  return (k >> 63) ? ~k : (k | 0x8000000000000000ull);
}
__device__ __forceinline__ double key_double(unsigned long long k) {
  return __longlong_as_double(static_cast<long long>((k >> 63) ? (k & 0x7fffffffffffffffull) : ~k));
}

// The exponent of the lowest set bit of a finite float (v = odd * 2^result), so v is a multiple
// of 2^-q iff the result is >= -q; zeros, multiples of everything, get a large value.
__device__ __forceinline__ int lowest_bit_exponent(float v) {
  // Branch-free (selects): it runs on every staged value. Subnormals scale as exponent 1 without
  // the implicit bit; zeros have m = 0.
  const unsigned u = __float_as_uint(v), exponent = (u >> 23) & 0xFFu, mantissa = u & 0x7FFFFFu;
  const unsigned m = exponent != 0 ? (mantissa | 0x800000u) : mantissa;
  const int e = exponent != 0 ? static_cast<int>(exponent) : 1;
  return m == 0 ? 1 << 20 : e - 151 + __ffs(static_cast<int>(m));
}

// Warp-wide min / max, so a block's shared atomics take one update per warp. 32-bit integers
// take one redux instruction, wider types five shuffle rounds.
template <typename T>
__device__ __forceinline__ T warp_min(T v) {
  if constexpr (std::is_same_v<T, int> || std::is_same_v<T, unsigned>) {
    return __reduce_min_sync(kFullMask, v);
  } else {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) v = min(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
  }
}
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
  if constexpr (std::is_same_v<T, int> || std::is_same_v<T, unsigned>) {
    return __reduce_max_sync(kFullMask, v);
  } else {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) v = max(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
  }
}
// The warp's largest x rounded down to a float: a lower bound on it by one redux (for the bound
// on tau, where 2^-24 of a score is far below what matters).
__device__ __forceinline__ double warp_max_down(double x) {
  const unsigned bits = __float_as_uint(__double2float_rd(x));
  const unsigned m = warp_max((bits >> 31) ? ~bits : (bits | 0x80000000u));  // floats in order
  return static_cast<double>(__uint_as_float((m >> 31) ? (m & 0x7FFFFFFFu) : ~m));
}

// Inclusive prefix sum of v over the warp (lane: this thread's lane).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v, int lane) {
#pragma unroll
  for (int o = 1; o < kWarp; o *= 2) {
    const T u = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Inclusive prefix sum of v over the block; *total gets the sum. Contains two __syncthreads.
// T is int, or long long carrying two counts (low and high 32 bits) through one scan.
template <typename T>
__device__ T block_inclusive_scan(T v, BlockScalars& sh, T* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_inclusive_scan(v, lane);
  if (lane == kWarp - 1) sh.warp_sums[warp] = v;
  __syncthreads();
  T before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kBlock / kWarp; ++w) {
    const T s = static_cast<T>(sh.warp_sums[w]);
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

// Threshold rises. The first one lays a grid of kBins bins over [min, max] of the live scores
// and fills hist (a count per bin) from the pool; the grid then stays, every later pool node is
// added to its bin as it is written, and a later rise is a scan of the bins alone. A rise keeps
// the top bins holding >= budget live nodes: tau becomes the cut bin's lower edge, less a margin
// that covers the rounding of bin_of, so every node in those bins stays live (a sliver of the bin
// below may too: live but not counted, which only makes the pool larger). Apart from that sliver
// the bins below hold only dead nodes from then on (the scans never reach them again: the cut
// only moves up). Scores above the grid (positive log-probs) land in the top bin. Until
// 2026-11-30 tau was the smallest score in the cut bin, kept per bin by a 64-bit shared atomicMin
// on every node, a compare-and-swap loop (ATOMS.CAST.SPIN.64); without it, H200, budget 256, per
// request: rises 4.1 -> 3.0 us, writes 6.6 -> 6.1.
// Block-uniform arguments; every thread returns the same tau, live and grid.
struct Grid {
  double mn = 0.0, scale = 0.0;
  bool on = false;
};

// The grid of kBins bins over [mn, mx] (mx > mn).
__device__ __forceinline__ Grid grid_over(double mn, double mx) { return {mn, kBins / (mx - mn), true}; }

__device__ __forceinline__ void add_to_grid(const Grid& grid, double s, BlockScalars& sh) {
  atomicAdd(&sh.hist[bin_of(s, grid.mn, grid.scale)], 1);
}

// A lower bound on every score s with bin_of(s) >= cut (cut >= 1): s >= mn + (cut / scale) *
// (1 - 2^-50) from the rounding of bin_of's subtraction and product; the margin 2^-40 * (|mn| +
// width) also covers the rounding of this sum.
__device__ __forceinline__ double bin_floor(const Grid& grid, int cut) {
  const double width = static_cast<double>(cut) / grid.scale;
  return (grid.mn + width) - 0x1p-40 * (fabs(grid.mn) + width);
}

// tau and live from the bins: the cut is the bin where the suffix count reaches budget. A cut at
// bin 0 keeps tau (nodes below the grid's min sit in bin 0 too).
__device__ void rise_from_grid(const Grid& grid, double& tau, int& live, int budget, BlockScalars& sh) {
  const int tid = threadIdx.x;
  const int h = sh.hist[kBins - 1 - tid];  // thread t scans bin kBins - 1 - t
  int unused;
  const int suffix = block_inclusive_scan(h, sh, &unused);
  if (suffix >= budget && suffix - h < budget) {  // exactly one thread: the cut bin
    sh.cut_bin = kBins - 1 - tid;
    sh.cut_live = suffix;
  }
  __syncthreads();
  if (sh.cut_bin > 0) tau = fmax(tau, bin_floor(grid, sh.cut_bin));
  live = sh.cut_live;
  __syncthreads();  // everyone has read the scalars
}

// Lays the grid over [min, max] of the scores `for_each_score(fn)` calls fn with (every thread
// its share) and adds them to it. False, and no grid, when they are all equal.
template <typename ForEachScore>
__device__ bool lay_grid(ForEachScore for_each_score, Grid& grid, BlockScalars& sh) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    sh.key_min = ~0ull;
    sh.key_max = 0ull;
  }
  sh.hist[tid] = 0;
  __syncthreads();
  unsigned long long kmin = ~0ull, kmax = 0ull;
  for_each_score([&](double s) {
    const unsigned long long k = order_key(s);
    kmin = min(kmin, k);
    kmax = max(kmax, k);
  });
  kmin = warp_min(kmin);
  kmax = warp_max(kmax);
  if (tid % kWarp == 0 && kmin != ~0ull) {
    atomicMin(&sh.key_min, kmin);
    atomicMax(&sh.key_max, kmax);
  }
  __syncthreads();
  const double mn = key_double(sh.key_min), mx = key_double(sh.key_max);
  __syncthreads();  // everyone has read the keys
  if (!(mx - mn > 0.0)) return false;
  grid = grid_over(mn, mx);
  for_each_score([&](double s) { add_to_grid(grid, s, sh); });
  __syncthreads();
  return true;
}

struct NoScores {
  template <typename F>
  __device__ void operator()(F) const {}
};

// A rise with live > budget (pool slots 1..count-1 with score >= tau). `for_each_new(fn)` gives
// scores not yet in the grid (a level's children before they are written; none otherwise): they
// join it, or, without a grid yet, it is laid over them and the live pool. False, tau untouched,
// when there is no grid (all those scores equal).
template <typename ForEachNew = NoScores>
__device__ bool rise(const double* score, int count, double& tau, int& live, int budget, Grid& grid,
                     BlockScalars& sh, ForEachNew for_each_new = {}) {
  if (grid.on) {
    if constexpr (!std::is_same_v<ForEachNew, NoScores>) {
      for_each_new([&](double s) { add_to_grid(grid, s, sh); });
      __syncthreads();
    }
  } else {
    auto live_and_new = [&](auto fn) {
      for (int s = 1 + threadIdx.x; s < count; s += kBlock)
        if (score[s] >= tau) fn(score[s]);
      for_each_new(fn);
    };
    if (!lay_grid(live_and_new, grid, sh)) return false;
  }
  rise_from_grid(grid, tau, live, budget, sh);
  return true;
}

// The number of j < limit for which holds(j), a prefix. Galloping (probes 0, 1, 3, 7, ..., then a
// binary search between the last two), since most live parents have few children.
template <typename Holds>
__device__ __forceinline__ int count_prefix(int limit, Holds holds) {
  int a = 0, z = limit;
  for (int probe = 0; probe < z;) {
    if (holds(probe)) a = probe + 1;
    else z = probe;
    probe = 2 * probe + 1;
  }
  while (a < z) {
    const int mid = (a + z) / 2;
    if (holds(mid)) a = mid + 1;
    else z = mid;
  }
  return a;
}
// Exact sums: the children of a node scoring `base` whose scores base + row[j] are >= tau, among
// j < limit (a prefix, since rows descend).
template <typename Staged>
__device__ __forceinline__ int count_at_least(const Staged* row, double base, double tau, int limit) {
  return count_prefix(limit, [&](int j) { return base + static_cast<double>(row[j]) >= tau; });
}

#ifndef DDTREE_TREE_EMULATION
// Words other threads of the block publish. Polls are volatile loads (re-read every time); the
// caller fences where a poll guards later reads, and before a publish. Publishes are atomic
// exchanges, so that compute-sanitizer racecheck, which does not model fences, sees the handoff
// as synchronised (it does not report plain loads against atomic stores; a relaxed st.shared
// compiles to the same STS as a volatile store and is reported). H200, batch 64, us a launch over
// 300 back to back, volatile -> atomic publishes: budget 128 17.9 -> 18.5, 256 21.0 -> 21.2,
// 512 27.3 -> 29.1, 1024 43.3 -> 46.2; racecheck 24 hazards -> 0. Atomic polls too were 24.3 at 256.
__device__ __forceinline__ unsigned long long poll_word(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}
__device__ __forceinline__ int poll_int(const int* p) { return *reinterpret_cast<const volatile int*>(p); }
__device__ __forceinline__ void publish_word(unsigned long long* p, unsigned long long v) { atomicExch(p, v); }
__device__ __forceinline__ void publish_int(int* p, int v) { atomicExch(p, v); }
__device__ __forceinline__ void publish_score(double* p, double v) {
  atomicExch(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(__double_as_longlong(v)));
}
__device__ __forceinline__ void idle_pause() {}  // __nanosleep(64) or (256): 0.4-0.8 us slower at budget 256
#endif

// The pool by a work queue (session 17), where tau is fixed from the start (exact sums, a lower
// bound): no level barriers. A node's item is published once its slot is reserved: families take
// consecutive slots in rank order (so a node's elder sibling is the slot before it), and the item
// of slot s sits at queue[s - 1], so one atomic reserves both. The lane that takes an item writes
// the node, counts its children above tau, reserves their slots and publishes their items, then
// adds the node to the grid (off the chain: the shared atomic would hold up the publish's fence).
// A warp takes the run of published items at the queue's head, up to one per lane, and processes
// them side by side. Counters are 32-bit (64-bit shared atomics are compare-and-swap loops).
// Returns the slots used, or 0 on abort (a reservation took the slots past max_slots, which
// the count then shows; the caller builds by levels). The pool is the set the levels build
// without rises: every node above tau whose product of ranks + 1 is <= budget. H200, batch 64,
// us a launch over 300 back to back, against the levels (same trees; the phase harness built per
// variant, side by side): budget 256 30.2 -> 23.2, 256
// at T 0.5 39.9 -> 28.1, 512 32.9 -> 28.5, 1024 49.3 -> 44.4. On the way (codegen alone moves
// these by up to ~0.5 us): the first version, one 64-bit state word (a compare-and-swap loop
// per update) and a ticket per lane (a lane's pickup waited for its warp's work), took 37.7k
// cycles a request at budget 256 against 13.2k for the warps' runs and 32-bit counters (the two
// changed together); items of 2 or 4 children (1.1-1.5 us slower at 256), warps taking at most
// 16, 8 or 4 items (5, 18, 45 us slower at 1024), __nanosleep for warps that find nothing
// (0.4-0.8 slower), the limit by integer division (0.3-1.9 slower), a lane taking its first child
// itself instead of publishing it (at most 0.25 faster at 256, 0.8-0.9 slower at 512 / 1024).
// An item: parent slot (bits 0-15), rank (16-31), depth (32-37), the parent's product of ranks + 1
// (40-55: <= budget; carried so the lane reads no more of the parent's record than its score), and a
// set bit 62 so that no item is 0.
__device__ __forceinline__ unsigned long long queue_item(int parent, int rank, int depth, int prod) {
  return static_cast<unsigned long long>(parent) | static_cast<unsigned long long>(rank) << 16 |
         static_cast<unsigned long long>(depth) << 32 | static_cast<unsigned long long>(prod) << 40 | 1ull << 62;
}
template <typename Staged>
__device__ int queue_pool(const Staged* s_lp, int D, int K, int budget, double tau, const Grid& grid, double* p_score,
                          int16_t* p_prefix, int16_t* p_rank, int8_t* p_depth, unsigned long long* queue, int C,
                          BlockScalars& sh) {
  const int tid = threadIdx.x, lane = tid % kWarp;
  // A pool past kCandidateFactor * budget means a weak bound: the levels, which raise tau as
  // they go, take over (the emulator's adversarial rows went to 5,700 slots at budget 256). The
  // queue holds max_slots - 1 items.
  const int max_slots = min(C, kCandidateFactor * budget);
  // The root's children (prod(root) = 1), ranks j < min(K, budget) with lp[0][j] >= tau (a
  // prefix, c0 >= 1 since tau <= lp[0][0]): each thread tests its own j and publishes its item,
  // each warp counts its own into the slots (the counters were set before the caller's barrier).
  // (A galloping count on every thread and a second barrier measured the same within noise.)
  const int roots = min(K, budget);
  for (int i0 = 0; i0 < max_slots; i0 += kBlock) {  // block-uniform trips
    const int i = i0 + tid;
    const bool child = i < roots && 0.0 + static_cast<double>(s_lp[i]) >= tau;  // the levels' operation
    if (i < max_slots) queue[i] = child ? queue_item(0, i, 1, 1) : 0ull;
    const unsigned children = __ballot_sync(kFullMask, child);
    if (lane == 0 && children) atomicAdd(&sh.q_slots, __popc(children));
  }
  __syncthreads();
  // Writes the node of `slot` from its item, reserves its children's slots and publishes their items.
  auto process = [&](int slot, unsigned long long item) {
    const int p = static_cast<int>(item & 0xFFFF), j = static_cast<int>((item >> 16) & 0xFFFF);
    const int d = static_cast<int>((item >> 32) & 0x3F);
    const Staged* row = s_lp + (d - 1) * K;
    const int prod = (j + 1) * static_cast<int>((item >> 40) & 0xFFFF);
    const double sc = p_score[p] + static_cast<double>(row[j]);
    publish_score(&p_score[slot], sc);  // its children's lanes read it
    p_prefix[slot] = static_cast<int16_t>(p);
    p_rank[slot] = static_cast<int16_t>(j);
    p_depth[slot] = static_cast<int8_t>(d);  // (products are only the levels' and ride in the items here)
    // Its children: the product bound (j + 1) * prod <= budget tested per probe (an integer
    // division for the limit instead was 0.3-1.9 us slower at budget 256).
    const Staged* kids_row = row + K;
    const int c = d < D ? count_prefix(K, [&](int i) {
      return ((i + 1) * prod <= budget) & (sc + static_cast<double>(kids_row[i]) >= tau);
    }) : 0;
    if (c > 0) {
      const int kids = atomicAdd(&sh.q_slots, c);
      if (kids + c > max_slots) {
        publish_int(&sh.q_finished, 1);  // abort
      } else {
        __threadfence_block();  // this node's record before the items that read it
        for (int k = 0; k < c; ++k) publish_word(&queue[kids + k - 1], queue_item(slot, k, d + 1, prod));
      }
    }
    add_to_grid(grid, sc, sh);
  };
  for (;;) {
    const int h = __shfl_sync(kFullMask, lane == 0 ? poll_int(&sh.q_head) : 0, 0);  // one read for the warp
    const unsigned long long item = h + lane < max_slots ? poll_word(&queue[h + lane]) : 0ull;
    const unsigned ready = __ballot_sync(kFullMask, item != 0);
    const int k = ready == kFullMask ? kWarp : __ffs(static_cast<int>(~ready)) - 1;  // the run at the head
    if (k > 0) {
      int won = 0;
      if (lane == 0) won = atomicCAS(&sh.q_head, h, h + k) == h;
      if (__shfl_sync(kFullMask, won, 0)) {
        __threadfence_block();  // the items' records after the items
        if (lane < k) process(h + lane + 1, item);
        __syncwarp();  // every lane's children reserved before these count as done
        if (lane == 0) {
          // The warp that completes the last reserved slot's item says so: any item still in
          // flight, or any child it will reserve, keeps the slots ahead of the items done.
          const int done = atomicAdd(&sh.q_done, k) + k;
          __threadfence_block();
          if (done + 1 == poll_int(&sh.q_slots)) publish_int(&sh.q_finished, 1);
        }
      }
      continue;
    }
    // Nothing published at the head: poll the one word that ends the loop (an abort sets it too).
    // Idle warps reading the items done and the slots themselves, every round, were 0.2-0.3 us
    // slower at budget 256; every 4th or 16th round, 0.3-2 us slower still (the end is late).
    if (__shfl_sync(kFullMask, lane == 0 ? poll_int(&sh.q_finished) : 0, 0)) break;
    idle_pause();
  }
  __syncthreads();
  return sh.q_slots > max_slots ? 0 : sh.q_slots;  // (never written again)
}

// A lower bound on tau, the budget-th best score, before any level is built (session 15), so
// that the levels enumerate little more than the tree and rarely need a rise. A path of depth d
// scores Z_d - (sum of its steps' costs), where Z_d is the rank-0 chain's score and a step to
// rank r of row i costs c = lp[i][0] - lp[i][r] >= 0. Costs binned upward on a grid of kWarp
// bins of width w (bin(c) >= c / w; rank 0 costs exactly 0, so the chain itself loses nothing)
// turn "paths with score >= t" into a count a dynamic program gives: F_d[v], the depth-d paths
// whose binned costs sum to v, is F_{d-1} convolved with row d's bin counts. Every path counted
// under floor((Z_d - t) / w) scores >= t, so wherever the counts reach the budget, t <= tau.
// The grid spans [lb, Z_1], lb the weakest bound: for A rows and J = ceil(budget / A) <= K, the
// A * J paths 0^a j (a < A, j < J) all score >= min_a Z_a + lp[a][J - 1]; the best A is taken.
// On drafter-like rows (random_topk, budget 256) the levels then hold 1.1-1.5x the budget
// (max 1.7x at temperature 0.25) instead of rising from -inf. Float counts are exact below 2^24,
// far above any budget; larger ones only need to read as >= budget. Rounding always errs low:
// bins are computed in float rounded up, lb and the best candidate are rounded down to floats
// (a few 1e-7 of a score), and the factors 1 +- 2^-40 and a final margin cover the doubles; the
// verification decides in the end anyway. Returns -inf (no bound) when fewer than budget such
// paths exist. Block-uniform.
// Where the time goes: every part is one or two dependent passes spread over warps (session 16:
// lb on four warps and the counts on two took budget 256 from 32.1 to 31.0 us, 512 from 36.5 to
// 35.6; lb on all eight warps alike was slower). Session 18, cycles per request at budget 256
// (clock64, tid 0): the bins 2.4k -> 1.5k (branch-free float passes over the ranks instead of a
// binary search per bin; the same passes in double with branches took 4.2k), the candidates
// 2.3k -> 1.7k (integer offsets instead of a double product per depth), the warp maxima one
// redux each; the bound 8.7k -> 7.2k. Preloading the next row's bins in the convolution chain
// was 0.2-0.7 us slower.
// Scratch: Z (33 doubles, 34 taken so that Fs is 16-byte aligned), the rows' bin counts as floats
// behind kWarp zeros each (so that G[v - u] for u > v reads 0), the counts by depth (first lb's
// partial minima), two warps' densities, and the candidates' offsets (bytes).
constexpr int kChainSlots = kMaxDepth + 2;
constexpr int kBoundMinBudget = 128;  // smaller budgets start tau at -inf (the warp kernel's anyway)
constexpr size_t kBoundScratch = sizeof(double) * kChainSlots +
                                 sizeof(float) * (2 * kMaxDepth * kWarp + kMaxDepth * kWarp + 2 * kWarp) + kMaxDepth * kWarp;
static_assert(kBoundScratch <= sizeof(double) * kMinPool, "tau_lower_bound's scratch is the pool's scores");
template <typename Staged>
__device__ double tau_lower_bound(const Staged* s_lp, int D, int K, int budget, unsigned char* scratch,
                                  BlockScalars& sh) {
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  double* Z = reinterpret_cast<double*>(scratch);                   // Z[d], d = 0..D
  float* gpad = reinterpret_cast<float*>(Z + kChainSlots);       // [d][kWarp + v]: row d's ranks in bins <= v
  float* cum = gpad + 2 * kMaxDepth * kWarp;                        // [d][v]: depth d+1 paths in bins <= v
  float* Fs = cum + kMaxDepth * kWarp;                              // [w][v]: warp w's density at hand
  // lb: warps 0..3 (one per scheduler) each take the chain's scores (D <= 32, one per lane) and,
  // lane A - 1, the minimum over a quarter of the rows a < A; every warp then joins the quarters.
  double* lb_part = reinterpret_cast<double*>(cum);  // [quarter][A - 1]
  if (warp < 4) {
    const double x = lane < D ? static_cast<double>(s_lp[lane * K]) : 0.0;
    const double z = warp_inclusive_scan(x, lane);  // Z_{lane + 1}
    if (warp == 0) {
      Z[lane + 1] = z;
      if (lane == 0) {
        Z[0] = 0.0;
        sh.bound_key = 0ull;
      }
    }
    const int A = lane + 1, J = (budget + A - 1) / A;
    const bool rows_enough = A <= D && J <= K;
    double bound = INFINITY;
    const int a0 = warp * D / 4, a1 = (warp + 1) * D / 4;
    for (int a = a0; a < a1; ++a) {
      const double za = a > 0 ? __shfl_sync(kFullMask, z, a - 1) : 0.0;
      if (rows_enough && a < A) bound = fmin(bound, za + static_cast<double>(s_lp[a * K + J - 1]));
    }
    lb_part[warp * kWarp + lane] = rows_enough ? bound : -INFINITY;
  }
  __syncthreads();
  const double lb = warp_max_down(fmin(fmin(lb_part[lane], lb_part[kWarp + lane]),
                                  fmin(lb_part[2 * kWarp + lane], lb_part[3 * kWarp + lane])));
  const double top = Z[1];
  const unsigned above = __ballot_sync(kFullMask, lane < D && Z[lane + 1] >= lb);
  const int depths = above == kFullMask ? kWarp : __ffs(~above) - 1;  // depths 1..n at or above lb
  if (!(lb > -INFINITY) || !(top - lb > 0.0)) return lb - 0x1p-40 * (fabs(lb) + fabs(top));  // block-uniform
  const double width = (top - lb) / kWarp, per_width = 1.0 / width;
  const double up = (1.0 + 0x1p-40) * per_width, down = (1.0 - 0x1p-40) * per_width;
  // Row d's ranks in bins <= v: a prefix (costs grow with the rank), bin(c) = 0 for c <= 0, else
  // floor(c * up) + 1 (kWarp: past the grid). A warp bins two rows at once, 8 chunks of 32 ranks
  // each at a time, branch-free, every load in flight together. Where the bin steps up from rank
  // r to r + 1, rank r + 1 is the count of bins bin(r) .. bin(r + 1) - 1: it is written at bin(r)
  // (rank 0 costs 0, so bin 0 gets one) and a max-scan over the bins fills the rest. Passes stop
  // at the first rank past the grid. Binned in float, rounded so that no rank bins lower than
  // its exact cost (staged log-probs are floats, exactly). (A binary search per bin took 2.4k
  // cycles at budget 256: 8 dependent steps.)
  const float up_f = __double2float_ru(up);
  constexpr int kRows = 2, kChunks = 8, kWarps = kBlock / kWarp;
  for (int d = warp; d < depths; d += kRows * kWarps) {
    const Staged* row[kRows];
    float row0[kRows];
    float* G[kRows];
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const int dq = d + q * kWarps < depths ? d + q * kWarps : d;  // (a lone row is binned twice alike)
      row[q] = s_lp + dq * K;
      row0[q] = static_cast<float>(row[q][0]);
      G[q] = gpad + dq * 2 * kWarp + kWarp;
      G[q][lane - kWarp] = 0.0f;
      G[q][lane] = 0.0f;
    }
    auto bin_at = [&](int q, int r) {
      const float c = __fsub_ru(row0[q], static_cast<float>(row[q][min(r, K - 1)]));
      const float x = fminf(__fmul_ru(c, up_f), kWarp - 1.0f);
      const int b = static_cast<int>(__float_as_uint(__fadd_rd(x, 0x1p23f)) - 0x4B000000u) + 1;  // floor(x) + 1
      return r >= K ? kWarp : (c > 0.0f ? b : 0);
    };
    __syncwarp();
    for (int r0 = 0; r0 < K; r0 += kChunks * kWarp) {
      int b[kRows][kChunks], after[kRows];
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
#pragma unroll
        for (int j = 0; j < kChunks; ++j) b[q][j] = bin_at(q, r0 + j * kWarp + lane);
        after[q] = bin_at(q, r0 + kChunks * kWarp);
      }
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
#pragma unroll
        for (int j = 0; j < kChunks; ++j) {
          const int below = __shfl_down_sync(kFullMask, b[q][j], 1);
          const int wrap = j + 1 < kChunks ? __shfl_sync(kFullMask, b[q][(j + 1) % kChunks], 0) : after[q];
          if ((lane == kWarp - 1 ? wrap : below) > b[q][j]) G[q][b[q][j]] = static_cast<float>(r0 + j * kWarp + lane + 1);
        }
      }
      if (min(after[0], after[1]) >= kWarp) break;  // warp-uniform: every later rank is past the grid
    }
    __syncwarp();
    float g[kRows];
#pragma unroll
    for (int q = 0; q < kRows; ++q) g[q] = G[q][lane];
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
#pragma unroll
      for (int q = 0; q < kRows; ++q) g[q] = fmaxf(g[q], __shfl_up_sync(kFullMask, g[q], o));  // (lanes < o: with itself)
    }
#pragma unroll
    for (int q = 0; q < kRows; ++q) G[q][lane] = g[q];
  }
  // The candidates' offsets (below): steps[d'][d] = floor((Z_{d+1} - Z_{d'+1}) / w), clamped to
  // [-kWarp, kWarp] (beyond it the count reads 0 or the last bin either way).
  signed char* steps = reinterpret_cast<signed char*>(Fs + 2 * kWarp);
  for (int dc = warp; dc < depths; dc += kBlock / kWarp) {
    const double e = floor((Z[lane + 1] - Z[dc + 1]) * down);  // (lanes >= depths: unused)
    steps[dc * kWarp + lane] = static_cast<signed char>(fmax(fmin(e, static_cast<double>(kWarp)), -static_cast<double>(kWarp)));
  }
  __syncthreads();
  // The counts: cum[d] cumulates P_d = g_0 * ... * g_d (densities, * the convolution). Two
  // warps share the chain: warp 0 takes P_0..P_{h-1} (into cum), warp 1 meanwhile the products
  // g_h * ... * g_d of the other half (cumulated, in place of row d's bins); after a barrier
  // every warp takes one of those d and convolves it with P_{h-1}: h + 1 dependent steps
  // instead of depths. convolve(f, d): lane v gets sum_u f[u] * (row d's bins)[v - u].
  auto convolve = [&](const float* f, int d) {
    const float* g = gpad + d * 2 * kWarp + kWarp + lane;  // g[-u] = G[lane - u], 0 for u > lane
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int u = 0; u < kWarp; u += 4) {
      const float4 fu = *reinterpret_cast<const float4*>(f + u);  // f[u..u+3] to every lane
      c[0] += fu.x * g[-u];
      c[1] += fu.y * g[-u - 1];
      c[2] += fu.z * g[-u - 2];
      c[3] += fu.w * g[-u - 3];
    }
    return fminf((c[0] + c[1]) + (c[2] + c[3]), 1e30f);  // no inf, so no inf - inf below
  };
  const int h = (depths + 1) / 2;
  if (warp < 2) {
    const int d0 = warp == 0 ? 0 : h, d1 = warp == 0 ? h : depths;
    float* fs = Fs + warp * kWarp;
    float F = lane == 0 ? 1.0f : 0.0f;  // the density so far
    for (int d = d0; d < d1; ++d) {
      fs[lane] = F;
      __syncwarp();
      const float C = convolve(fs, d);
      __syncwarp();  // row d's bins are read before warp 1 overwrites them
      (warp == 0 ? cum + d * kWarp : gpad + d * 2 * kWarp + kWarp)[lane] = C;
      const float below = __shfl_up_sync(kFullMask, C, 1);
      F = lane > 0 ? C - below : C;
    }
    if (warp == 0) Fs[lane] = F;  // P_{h-1}
  }
  __syncthreads();
  for (int d = h + warp; d < depths; d += kBlock / kWarp) cum[d * kWarp + lane] = convolve(Fs, d);
  __syncthreads();
  // The candidates: t = Z_{d'} - k * w, the points where depth d' 's count steps; the best t
  // whose count reaches the budget. Depth d's paths with binned costs <= floor((Z_d - t) / w) =
  // steps[d'][d] + k score >= t (up to rounding, which the final margin covers).
  double best = lb;
  for (int i = tid; i < depths * kWarp; i += kBlock) {
    const int k = i % kWarp;
    const double t = Z[1 + i / kWarp] - static_cast<double>(k) * width;
    if (!(t > best)) continue;
    const signed char* step = steps + (i / kWarp) * kWarp;
    float count = 0.0f;
#pragma unroll 4
    for (int d = 0; d < depths; ++d) {
      const int v = step[d] + k;
      count += v >= 0 ? cum[d * kWarp + min(v, kWarp - 1)] : 0.0f;
    }
    if (count >= static_cast<float>(budget)) best = t;
  }
  const unsigned long long k = order_key(warp_max_down(best));
  if (lane == 0) atomicMax(&sh.bound_key, k);
  __syncthreads();
  const double t = key_double(sh.bound_key);
  return t - 0x1p-40 * (fabs(t) + fabs(top) + (top - lb));
}

// Sorts keys[0, n) ascending (n a power of two >= 64; all threads of the block call it). A
// bitonic network: steps between elements of one 64-element chunk run in registers (lane l holds
// chunk elements l and l + 32; partners by shuffle), only the wider steps go through shared
// memory with a barrier each. The keys carry their payload in their low bits (the candidates'
// pool slots), so one 64-bit word moves per element.
__device__ void chunk_steps(unsigned long long* keys, int n, int k_first, int k_last) {
  const int lane = threadIdx.x % kWarp;
  for (int base = 64 * (threadIdx.x / kWarp); base < n; base += 64 * (kBlock / kWarp)) {
    unsigned long long key[2] = {keys[base + lane], keys[base + 32 + lane]};
    for (int k = k_first; k <= k_last; k *= 2) {
      for (int j = min(k / 2, 32); j > 0; j /= 2) {
        if (j == 32) {  // partners in one lane (k >= 64, so both share the direction)
          const bool up = ((base + lane) & k) == 0;
          const unsigned long long lo = min(key[0], key[1]), hi = max(key[0], key[1]);
          key[0] = up ? lo : hi;
          key[1] = up ? hi : lo;
          continue;
        }
        const bool lower = (lane & j) == 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool up = ((base + 32 * h + lane) & k) == 0;
          const unsigned long long pk = __shfl_xor_sync(kFullMask, key[h], j);
          // Ascending: the lower position keeps the smaller key, the higher one the larger.
          key[h] = lower == up ? min(key[h], pk) : max(key[h], pk);
        }
      }
    }
    keys[base + lane] = key[0];
    keys[base + 32 + lane] = key[1];
  }
}

__device__ void bitonic_sort(unsigned long long* keys, int n) {
  chunk_steps(keys, n, 2, 64);
  __syncthreads();
  for (int k = 128; k <= n; k *= 2) {
    for (int j = k / 2; j >= 64; j /= 2) {
      for (int i = threadIdx.x; i < n / 2; i += kBlock) {
        const int a = 2 * i - (i & (j - 1)), c = a + j;  // the pair (a, a + j), bit j of a clear
        const unsigned long long ka = keys[a], kc = keys[c];
        if ((ka > kc) == ((a & k) == 0)) {
          keys[a] = kc;
          keys[c] = ka;
        }
      }
      __syncthreads();
    }
    chunk_steps(keys, n, k, k);
    __syncthreads();
  }
}

// A candidate's sort key: the order key of its score, descending, with the low kSlotBits bits
// replaced by its pool slot. Keys equal above those bits form a run (exactly equal scores, or
// scores within ~2^-39 of each other), which the contract's order re-ranks after the sort.
constexpr int kSlotBits = 13;
constexpr unsigned long long kSlotMask = (1ull << kSlotBits) - 1;
static_assert(kMaxPool <= (1 << kSlotBits), "pool slots must fit the sort key's low bits");
__device__ __forceinline__ unsigned long long candidate_key(double score, int slot) {
  // +0.0 folds -0.0 into 0.0: they compare equal, so they must share a run too.
  return (~order_key(score + 0.0) & ~kSlotMask) | static_cast<unsigned long long>(slot);
}

// The contract's order between pool candidates (prefix slot, rank, depth) with scores.
__device__ __forceinline__ bool pool_before(double sa, int pa, int ra, int da, double sb, int pb,
                                            int rb, int db, const int16_t* prefix,
                                            const int16_t* rank) {
  if (sa != sb) return sa > sb;
  return rank_path_less(pa, ra, da, pb, rb, db, prefix, rank);
}

// The layout comes from the host: computed by every thread it took ~4% of the kernel's warp
// samples (ncu, budget 256), ahead of the first loads.
template <int M, typename Staged>
__global__ void __launch_bounds__(kBlock) block_build_kernel(BuildArgs in, BuildOutputs out,
                                                             BlockShared layout, int capacity) {
  DDTREE_DYNAMIC_SMEM(smem);
  DDTREE_PHASE_START();
  __shared__ BlockScalars sh;
  const int D = in.depth, K = in.topk, N = in.max_budget, C = capacity;
  const int b = blockIdx.x, tid = threadIdx.x;
  Staged* s_lp = reinterpret_cast<Staged*>(smem + layout.lp);
  double* p_score = reinterpret_cast<double*>(smem + layout.pool_score);
  double* c_score = reinterpret_cast<double*>(smem + layout.cand_score);
  int32_t* offs = reinterpret_cast<int32_t*>(smem + layout.offs);
  int16_t* p_prefix = reinterpret_cast<int16_t*>(smem + layout.pool_prefix);
  int16_t* p_rank = reinterpret_cast<int16_t*>(smem + layout.pool_rank);
  int16_t* p_prod = reinterpret_cast<int16_t*>(smem + layout.pool_prod);
  int16_t* p_index = reinterpret_cast<int16_t*>(smem + layout.pool_index);
  int16_t* c_slot = reinterpret_cast<int16_t*>(smem + layout.cand_slot);
  uint32_t* s_node = reinterpret_cast<uint32_t*>(smem + layout.node);
  int16_t* s_order = reinterpret_cast<int16_t*>(smem + layout.order);
  int8_t* p_depth = reinterpret_cast<int8_t*>(smem + layout.pool_depth);
  uint8_t* has_next = reinterpret_cast<uint8_t*>(smem + layout.has_next);
  uint8_t* has_child = reinterpret_cast<uint8_t*>(smem + layout.has_child);
  // The levels' scratch, in arrays the candidates step takes over: the children per parent of a
  // level (int16 over has_next and has_child, which are adjacent), the families' parents (over
  // pool_index) and their first children's offsets.
  int16_t* l_count = reinterpret_cast<int16_t*>(has_next);
  int16_t* f_parent = p_index;
  int32_t* f_off = offs;

  // Stage and check this request's log-probs in one pass: non-finite values, rows out of order,
  // max |lp| and the lowest set bit over all values (the exactness test below).
  const float* lp = in.logprobs + static_cast<long>(b) * D * K;
  const int numel = D * K;
  if (tid == 0) {
    sh.abs_max = 0u;
    sh.lowest_bit = 1 << 20;
    sh.flags = 0;
    s_node[0] = 0;     // the root, for either path
    s_order[0] = 0;    // pool slot of node 0 (read as `last` only when n = 0: then fall back)
  }
  __syncthreads();
  bool nonfinite = false, unordered = false;
  float abs_max = 0.0f;
  int lowest_bit = 1 << 20;
  auto check = [&](float v, float before, bool row_start) {
    nonfinite |= !isfinite(v);
    unordered |= !row_start && before < v;
    abs_max = fmaxf(abs_max, fabsf(v));  // fmaxf ignores NaN; NaN is reported anyway
    lowest_bit = min(lowest_bit, lowest_bit_exponent(v));
  };
  stage_logprobs(lp, s_lp, numel, K, tid, kBlock, check);
  const unsigned abs_max_bits = warp_max(__float_as_uint(abs_max));  // >= 0, so the bits order
  const int lowest = warp_min(lowest_bit);
  const bool any_nonfinite = __any_sync(kFullMask, nonfinite);
  const bool any_unordered = __any_sync(kFullMask, unordered);
  if (tid % kWarp == 0) {
    if (isfinite(__uint_as_float(abs_max_bits))) atomicMax(&sh.abs_max, abs_max_bits);
    atomicMin(&sh.lowest_bit, lowest);
    if (any_nonfinite || any_unordered)
      atomicOr(&sh.flags, (any_nonfinite ? 1 : 0) | (any_unordered ? 2 : 0));
  }
  __syncthreads();
  const int budget = in.budgets ? in.budgets[b] : N;
  int32_t status = kOk;
  if (sh.flags & 1) status = kNonFinite;
  else if (sh.flags & 2) status = kNotDescending;
  if (budget < 1 || budget > N) status = kBadBudget;

  // Exact sums: every log-prob a multiple of 2^-q with D * max|lp| < 2^(53 - q).
  bool exact = status == kOk;
  const double big = static_cast<double>(__uint_as_float(sh.abs_max));
  if (exact && big > 0.0) {
    int e;
    frexp(static_cast<double>(D) * big, &e);  // D * max|lp| < 2^e
    exact = sh.lowest_bit >= e - 53;
  }

  DDTREE_PHASE(0);
  int n = 0;
  bool fallback = false;
  if (status == kOk) {
    // tau starts at a lower bound on the budget-th best score from budget kBoundMinBudget on (at
    // first from 192: budget 128 went 25.6 -> 27.3 us at batch 64 with it; since session 18's
    // cheaper bound, 24.8 -> 17.9 us, and 160 25.9 -> 17.9, 300 launches back to back); the pool's
    // scores are its scratch (a launch's capacity C is >= kMinPool; the emulation's small ones go without).
    sh.hist[tid] = 0;  // (the bound's barriers order this before the grid's first use)
    double tau = C >= kMinPool && budget >= kBoundMinBudget ? tau_lower_bound(s_lp, D, K, budget, reinterpret_cast<unsigned char*>(p_score), sh)
                               : -INFINITY;
    if (tid == 0) DDTREE_BOUND(tau);
    // With a bound the threshold grid is laid at once over [tau, lp[0][0]] (every score but
    // positive log-probs' lies below lp[0][0]; those land in the top bin), and every node joins
    // it as it is written: the final rise is then a scan of the bins.
    Grid grid;
    const double top = static_cast<double>(s_lp[0]);
    if (tau > -INFINITY && top - tau > 0.0) {  // block-uniform
      grid = grid_over(tau, top);
      if (tid == 0) sh.cut_bin = 0;  // no cut yet: the rank sorts unless a rise sets one
    }
    DDTREE_PHASE(3);
    // The pool: slot 0 is the root.
    if (tid == 0) {
      p_score[0] = 0.0;
      p_prefix[0] = -1;
      p_rank[0] = 0;
      p_prod[0] = 1;
      p_depth[0] = 0;
      sh.q_head = 0;  // queue_pool's counters: the root's slot taken
      sh.q_slots = 1;
      sh.q_done = 0;
      sh.q_finished = 0;
    }
    __syncthreads();
    int count = 1, lo = 0, hi = 1, live = 0;
    int first_level = 1;
    if (exact && grid.on) {  // tau is fixed: the pool by the work queue, else (on abort) by levels
      const int used = queue_pool(s_lp, D, K, budget, tau, grid, p_score, p_prefix, p_rank, p_depth,
                                  reinterpret_cast<unsigned long long*>(c_score), C, sh);
      DDTREE_PHASE(9);
      if (tid == 0) DDTREE_QUEUE_PATH(used);
      if (used > 0) {
        count = used;
        live = used - 1;
        first_level = D + 1;
      } else {
        sh.hist[tid] = 0;  // the levels add every node again
        __syncthreads();
      }
    }
    if (exact && first_level == 1) {  // level 1 needs no scan: the root's children are ranks 0..c-1 (prod(root) = 1)
      const int c0 = min(K, budget);  // C >= kMinPool > c0
      const int c = count_at_least(s_lp, 0.0, tau, c0);  // those above tau: every thread counts alike
      for (int j = tid; j < c; j += kBlock) {
        const double sc = 0.0 + static_cast<double>(s_lp[j]);  // the general path's operation
        p_score[1 + j] = sc;
        if (grid.on) add_to_grid(grid, sc, sh);
        p_prefix[1 + j] = 0;
        p_rank[1 + j] = static_cast<int16_t>(j);
        p_prod[1 + j] = static_cast<int16_t>(j + 1);
        p_depth[1 + j] = 1;
      }
      __syncthreads();
      lo = 1;
      hi = count = 1 + c;
      live = c;  // <= budget: no rise yet
      first_level = 2;
    }
    for (int d = first_level; d <= D; ++d) {
      const Staged* row = s_lp + (d - 1) * K;
      const int P = hi - lo, chunk = (P + kBlock - 1) / kBlock;
      const int first = lo + min(P, tid * chunk), last = lo + min(P, (tid + 1) * chunk);
      // Levels of at most kBlock parents (all but the widest) take one parent per thread and a
      // scan with one barrier; wider ones count strided parents and scan contiguous chunks.
      const bool narrow = P <= kBlock;
      // A parent's child limit: 0 when it is dead.
      auto limit_of = [&](int p) { return p == 0 || p_score[p] >= tau ? min(K, budget / p_prod[p]) : 0; };
      // Its children above tau: j < c with base + row[j] >= tau, a prefix since rows descend.
      // Exact sums: count_at_least's galloping search; otherwise the contract's sibling chain.
      auto children_of = [&](double base, int limit) {
        if (exact) return count_at_least(row, base, tau, limit);
        int a = 0;
        double sc = base + static_cast<double>(row[0]);
        while (a < limit && sc >= tau) {
          ++a;
          if (a < limit) sc = (sc - static_cast<double>(row[a - 1])) + static_cast<double>(row[a]);
        }
        return a;
      };
      // Wide levels: children per parent (l_count[p - lo]), parents strided over the threads
      // (live ones cluster, so their searches spread out), two at a time; on exact sums two
      // branchless binary searches interleaved, so that their load latencies overlap.
      auto count_children = [&]() {
        for (int pa = lo + tid; pa < hi; pa += 2 * kBlock) {
          const int pb = pa + kBlock;
          const int la = limit_of(pa), lb = pb < hi ? limit_of(pb) : 0;
          const double ba = la > 0 ? p_score[pa] : 0.0, bb = lb > 0 ? p_score[pb] : 0.0;
          int ca = 0, cb = 0;
          if (exact) {
            for (int step = pow2_at_most(max(la, lb)); step > 0; step /= 2) {
              if (ca + step <= la && ba + static_cast<double>(row[ca + step - 1]) >= tau) ca += step;
              if (cb + step <= lb && bb + static_cast<double>(row[cb + step - 1]) >= tau) cb += step;
            }
          } else {
            if (la > 0) ca = children_of(ba, la);
            if (lb > 0) cb = children_of(bb, lb);
          }
          l_count[pa - lo] = static_cast<int16_t>(ca);
          if (pb < hi) l_count[pb - lo] = static_cast<int16_t>(cb);
        }
      };
      // The families (parents with children) in parent order, each with its parent and the
      // offset of its first child, from one scan that carries both the children and the families
      // counted so far (in one 64-bit word; on narrow levels in one 32-bit word). Returns the
      // children in all. Narrow levels also keep each thread's own family (own_off, own_c) and
      // the largest family (widest).
      int families = 0, own_off = 0, own_c = 0, widest = 0;
      auto pack = [](int kids, int fams) {
        return static_cast<long long>(kids) | (static_cast<long long>(fams) << 32);
      };
      auto count_and_scan = [&]() {
        long long both;
        if (narrow) {  // one barrier: warp scans, the warps' sums through shared memory
          own_c = 0;
          if (tid < P) {
            const int limit = limit_of(lo + tid);
            if (limit > 0) own_c = children_of(p_score[lo + tid], limit);
          }
          // Children in the low 20 bits, families above (the static_assert by kOwnerWidest).
          const int mine = own_c | (own_c > 0 ? 1 << 20 : 0);
          const int v = warp_inclusive_scan(mine, tid % kWarp);
          const int wmax = warp_max(own_c);
          if (tid % kWarp == kWarp - 1) {
            sh.level_sums[tid / kWarp] = v;
            sh.level_max[tid / kWarp] = wmax;
          }
          __syncthreads();
          int prior = 0, all = 0;
          widest = 0;
#pragma unroll
          for (int w = 0; w < kBlock / kWarp; ++w) {
            const int s = sh.level_sums[w];
            prior += w < tid / kWarp ? s : 0;
            all += s;
            widest = max(widest, sh.level_max[w]);
          }
          const int at = prior + v - mine;
          own_off = at & 0xFFFFF;
          if (own_c > 0) {
            f_parent[at >> 20] = static_cast<int16_t>(lo + tid);
            f_off[at >> 20] = own_off;
          }
          both = pack(all & 0xFFFFF, all >> 20);
        } else {
          count_children();
          __syncthreads();  // counts complete
          int kids = 0, fams = 0;
          for (int p = first; p < last; ++p) {
            const int c = l_count[p - lo];
            kids += c;
            fams += c > 0;
          }
          const long long mine = pack(kids, fams);
          const long long before = block_inclusive_scan(mine, sh, &both) - mine;
          int off = static_cast<int>(before & 0xFFFFFFFFll), f = static_cast<int>(before >> 32);
          for (int p = first; p < last; ++p) {
            const int c = l_count[p - lo];
            if (c > 0) {
              f_parent[f] = static_cast<int16_t>(p);
              f_off[f++] = off;
              off += c;
            }
          }
          widest = kOwnerWidest + 1;
        }
        families = static_cast<int>(both >> 32);
        // Owners write narrow levels' small families themselves; otherwise the families are read
        // by every thread below.
        if (widest > kOwnerWidest) __syncthreads();
        return static_cast<int>(both & 0xFFFFFFFFll);
      };
      // fn(slot offset i, parent, rank, score) for every child of the level, each thread its
      // share. Families of at most kOwnerWidest children on a narrow level: each thread its own.
      // Otherwise, exact sums: thread t takes children [t * per, (t + 1) * per), finds the family
      // of its first one by a binary search over the families' offsets and walks on from there
      // (families are never empty, so a child moves at most one family on): the block shares
      // the children evenly however large a family is. (Until session 14 the scan wrote each
      // child slot's parent, a loop as long as the family on one thread.) Inexact sums: one
      // thread per family replays the contract's chain.
      auto for_each_child = [&](int total, auto fn) {
        auto family = [&](int p, int i0, int c) {
          const double base = p_score[p];
          double sc = base + static_cast<double>(row[0]);
          for (int j = 0; j < c; ++j) {
            if (j > 0)
              sc = exact ? base + static_cast<double>(row[j])
                         : (sc - static_cast<double>(row[j - 1])) + static_cast<double>(row[j]);
            fn(i0 + j, p, j, sc);
          }
        };
        if (widest <= kOwnerWidest) {
          if (own_c > 0) family(lo + tid, own_off, own_c);
        } else if (exact) {
          const int per = (total + kBlock - 1) / kBlock;
          const int i0 = min(total, tid * per), i1 = min(total, i0 + per);
          if (i0 < i1) {
            int f = 0;  // the last family whose offset is <= i0
            for (int step = pow2_at_most(families - 1); step > 0; step /= 2)
              if (f + step < families && f_off[f + step] <= i0) f += step;
            int p = f_parent[f], start = f_off[f];
            int next = f + 1 < families ? f_off[f + 1] : total;
            double base = p_score[p];
            for (int i = i0; i < i1; ++i) {
              if (i == next) {
                ++f;
                p = f_parent[f];
                start = next;
                next = f + 1 < families ? f_off[f + 1] : total;
                base = p_score[p];
              }
              const int j = i - start;
              fn(i, p, j, base + static_cast<double>(row[j]));
            }
          }
        } else {
          for (int f = tid; f < families; f += kBlock)
            family(f_parent[f], f_off[f], (f + 1 < families ? f_off[f + 1] : total) - f_off[f]);
        }
      };
      int total = count_and_scan();
      DDTREE_PHASE(1);
      // The rise these children would cause once written is taken before when the pool is
      // tight: they join the grid from the offsets, so only those above the new tau take pool
      // slots (dead slots are never reclaimed). Otherwise they are written and the rise follows
      // (cheaper: no second count).
      bool risen = false;
      if (total > 0 && live + total > kTightenFactor * budget && count + total > C / 2) {
        auto children = [&](auto fn) { for_each_child(total, [&](int, int, int, double sc) { fn(sc); }); };
        risen = rise(p_score, count, tau, live, budget, grid, sh, children);
        if (risen) total = count_and_scan();
        DDTREE_PHASE(3);
      }
      if (count + total > C) {  // block-uniform
        fallback = true;
        break;
      }
      if (total == 0) break;
      for_each_child(total, [&](int i, int p, int j, double sc) {
        const int slot = count + i;
        p_score[slot] = sc;
        if (grid.on && !risen) add_to_grid(grid, sc, sh);  // after a rise it is in already
        p_prefix[slot] = static_cast<int16_t>(p);
        p_rank[slot] = static_cast<int16_t>(j);
        p_prod[slot] = static_cast<int16_t>((j + 1) * p_prod[p]);
        p_depth[slot] = static_cast<int8_t>(d);
      });
      __syncthreads();  // the new level is visible; the scratch may be reused
      DDTREE_PHASE(2);
      lo = count;
      hi = count + total;
      count += total;
      if (!risen) {  // (a rise counted them)
        live += total;
        if (live > kTightenFactor * budget) {
          rise(p_score, count, tau, live, budget, grid, sh);
          DDTREE_PHASE(3);
        }
      }
    }
    if (!fallback && live > budget) {
      rise(p_score, count, tau, live, budget, grid, sh);
      DDTREE_PHASE(3);
    }

    if (!fallback) {
      // Candidates: the live slots. Clear the pool's marks.
      if (tid == 0) sh.m = 0;
      __syncthreads();
      for (int s0 = tid - tid % kWarp; s0 < count; s0 += kBlock) {  // warp-uniform trips
        const int s = s0 + tid % kWarp;
        const bool is_live = s > 0 && s < count && p_score[s] >= tau;
        if (s < count) {
          p_index[s] = s == 0 ? 0 : -1;
          has_next[s] = 0;
          has_child[s] = 0;
        }
        // One atomic per warp: lane l of the live ones takes base + (live lanes below l).
        const unsigned live_lanes = __ballot_sync(kFullMask, is_live);
        int base = 0;
        if (tid % kWarp == 0 && live_lanes) base = atomicAdd(&sh.m, __popc(live_lanes));
        base = __shfl_sync(kFullMask, base, 0);
        const int at = base + __popc(live_lanes & ((1u << (tid % kWarp)) - 1u));
        if (is_live && at < kCandidateFactor * budget) {
          c_slot[at] = static_cast<int16_t>(s);
          c_score[at] = p_score[s];
        }
      }
      __syncthreads();
      // sh.m >= live (tau may keep a sliver of the bin below the cut, bin_floor), so this is
      // the one test of the candidates' bound.
      fallback = sh.m > kCandidateFactor * budget;
      DDTREE_PHASE(4);
    }
    if (!fallback) {
      const int m = sh.m;
      n = min(m, budget);
      // Rank by the grid's bins where they spread the candidates thinly (the common case): the
      // bins at and above the last rise's cut hold live nodes only, and the grid counted every
      // one of them, so a suffix scan of the counts gives each bin its first rank; the
      // candidates below the cut (the sliver bin_floor's margin keeps) rank after all of them.
      // Each candidate takes a place in its bin's segment (one shared atomic), then counts the
      // segment's candidates that come before it in the contract's order (score, then rank
      // path). Bins order scores (bin_of is monotone), so that is its rank. (Until session 14
      // every request sorted: 4.5 us a request at budget 256.)
      bool by_bins = false;
      if (grid.on && sh.cut_bin >= 1) {  // block-uniform
        const int cut = sh.cut_bin, bin = kBins - 1 - tid;  // thread t: bin kBins - 1 - t
        const int h = bin >= cut ? sh.hist[bin] : 0;
        int in_bins;
        const int incl = block_inclusive_scan(h, sh, &in_bins);
        by_bins = !__syncthreads_or(h > kBinRankMax) && in_bins <= m && m - in_bins <= kBinRankMax;
        if (by_bins) {
          if (bin >= cut) sh.hist[bin] = incl - h;  // the bin's first place, then its cursor
          if (tid == 0) sh.total = in_bins;          // the cursor of the places below the cut
          __syncthreads();
          for (int i = tid; i < m; i += kBlock) {
            const int b2 = bin_of(c_score[i], grid.mn, grid.scale);
            f_off[b2 >= cut ? atomicAdd(&sh.hist[b2], 1) : atomicAdd(&sh.total, 1)] = i;
          }
          __syncthreads();
          for (int at = tid; at < m; at += kBlock) {  // at: the candidate's place
            const int i = f_off[at], s = c_slot[i];
            const int b2 = bin_of(c_score[i], grid.mn, grid.scale);
            // Its segment: after the scatter a bin's cursor is its end, and the next bin up ends
            // where it starts.
            const int first = b2 < cut ? in_bins : (b2 + 1 < kBins ? sh.hist[b2 + 1] : 0);
            const int end = b2 < cut ? m : sh.hist[b2];
            int r = first;
            const double si = c_score[i];
            // Scores first (independent loads); the rank paths only on an exact tie.
#pragma unroll 4
            for (int q = first; q < end; ++q) {
              const int j = f_off[q];
              const double sj = c_score[j];
              if (sj > si) ++r;
              else if (sj == si && j != i) {
                const int t = c_slot[j];
                r += rank_path_less(p_prefix[t], p_rank[t], p_depth[t], p_prefix[s], p_rank[s], p_depth[s], p_prefix, p_rank);
              }
            }
            if (r < budget) {
              p_index[s] = static_cast<int16_t>(r + 1);
              s_order[r + 1] = static_cast<int16_t>(s);
            }
          }
          __syncthreads();
        }
      }
      // Otherwise a bitonic sort of the candidates by score (keys ascending = scores descending,
      // padded to a power of two), then each run of keys equal above the slot bits put in the
      // contract's order (score, then rank path) by counting within the run. The first
      // `budget` become nodes 1..n.
      if (!by_bins) {
      unsigned long long* c_key = reinterpret_cast<unsigned long long*>(c_score);  // in place
      const int P2 = sort_length(m);
      for (int i = tid; i < P2; i += kBlock) c_key[i] = i < m ? candidate_key(c_score[i], c_slot[i]) : ~0ull;
      __syncthreads();
      bitonic_sort(c_key, P2);
      auto run_of = [&](int j) { return c_key[j] >> kSlotBits; };  // the key without its slot
      for (int i = tid; i < m; i += kBlock) {
        const unsigned long long ki = run_of(i);
        const int s = static_cast<int>(c_key[i] & kSlotMask);
        int r = i;
        if ((i > 0 && run_of(i - 1) == ki) || (i + 1 < m && run_of(i + 1) == ki)) {
          int first = i, end = i + 1;
          while (first > 0 && run_of(first - 1) == ki) --first;
          while (end < m && run_of(end) == ki) ++end;
          r = first;
          if (first < budget) {
            const double si = p_score[s];
            const int pi = p_prefix[s], ri = p_rank[s], di = p_depth[s];
            for (int j = first; j < end; ++j) {
              const int t = static_cast<int>(c_key[j] & kSlotMask);
              if (t != s)
                r += pool_before(p_score[t], p_prefix[t], p_rank[t], p_depth[t], si, pi, ri, di, p_prefix, p_rank);
            }
          } else {
            r = budget;  // the whole run ranks after the tree
          }
        }
        if (r < budget) {
          p_index[s] = static_cast<int16_t>(r + 1);
          s_order[r + 1] = static_cast<int16_t>(s);
        }
      }
      __syncthreads();
      }
      DDTREE_PHASE(5);
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
        s_node[i] = node_word(parent, (p_depth[s] - 1) * K + p_rank[s], p_depth[s]);
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
      DDTREE_PHASE(6);
    }
  }

  if (tid == 0 && status == kOk) DDTREE_BLOCK_PATH(fallback, exact);
  if (__any_sync(kFullMask, fallback)) {  // block-uniform: the exact sequential loop on warp 0
    if (__any_sync(kFullMask, tid < kWarp)) {  // (votes: no divergence checks in the loop)
      n = warp_build<M>(s_lp, D, K, budget, s_node, tid);
      if (tid == 0) sh.n = n;
    }
    __syncthreads();
    n = sh.n;
    DDTREE_PHASE(7);
  }
  // The pool's scores and the sort keys are dead by now: the mask rows are staged there.
  write_outputs<true>(in, out, b, n, status, s_node, tid, kBlock, nullptr, reinterpret_cast<uint64_t*>(smem),
                       static_cast<long>(layout.lp / sizeof(uint64_t)));
  DDTREE_PHASE(8);
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
  const BlockShared layout(in.depth, in.topk, in.max_budget, C, sizeof(Staged));
  const size_t smem = layout.bytes;
  // The limit without opt-in counts static + dynamic shared memory: a dynamic size just under 48 KB
  // plus BlockScalars failed to launch ("invalid argument") on the H200.
  if (smem + sizeof(BlockScalars) > kDefaultSharedLimit)
    check_cuda(cudaFuncSetAttribute(block_build_kernel<M, Staged>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
               "block build (shared memory opt-in)");
  block_build_kernel<M, Staged><<<in.batch, kBlock, smem, stream>>>(in, out, layout, C);
  check_cuda(cudaGetLastError(), "block build");
  return true;
}

template <int M>
bool launch_block(const BuildArgs& in, const BuildOutputs& out, cudaStream_t stream) {
  if (sizeof(double) * static_cast<size_t>(in.depth) * in.topk <= 64 * 1024)
    return launch_block_staged<M, double>(in, out, stream);
  return launch_block_staged<M, float>(in, out, stream);
}

// Frontier rows of the warp loop: after n pops the frontier holds <= n + 1 candidates, and only
// positions < budget - n can still pop, so ceil(budget / 2) slots always suffice.
int frontier_rows(int max_budget) { return ((max_budget + 1) / 2 + kWarp - 1) / kWarp; }
#endif  // DDTREE_TREE_EMULATION

}  // namespace

#ifndef DDTREE_TREE_EMULATION

void build_trees_cuda_warp(const BuildArgs& in, const BuildOutputs& out, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int rows = frontier_rows(in.max_budget);
  if (rows <= 1) launch_build<1>(in, out, stream);
  else if (rows <= 2) launch_build<2>(in, out, stream);
  else if (rows <= 3) launch_build<3>(in, out, stream);
  else if (rows <= 4) launch_build<4>(in, out, stream);
  else if (rows <= 6) launch_build<6>(in, out, stream);
  else if (rows <= 8) launch_build<8>(in, out, stream);
  else if (rows <= 12) launch_build<12>(in, out, stream);
  else launch_build<16>(in, out, stream);
}

void build_trees_cuda(const BuildArgs& in, const BuildOutputs& out, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  // The block kernel's fallback loop uses 32, 128 or 512 frontier slots.
  const int rows = frontier_rows(in.max_budget);
  bool launched;
  if (rows <= 1) launched = launch_block<1>(in, out, stream);
  else if (rows <= 4) launched = launch_block<4>(in, out, stream);
  else launched = launch_block<16>(in, out, stream);
  if (!launched) build_trees_cuda_warp(in, out, stream_handle);
}

void accept_cuda(const AcceptArgs& in, const AcceptOutputs& out, void* stream_handle) {
  const size_t smem = sizeof(int32_t) * (in.max_budget + 1);
  accept_kernel<<<in.batch, kWarp, smem, static_cast<cudaStream_t>(stream_handle)>>>(in, out);
  check_cuda(cudaGetLastError(), "accept");
}

#endif  // DDTREE_TREE_EMULATION

}  // namespace ddtree::tree
