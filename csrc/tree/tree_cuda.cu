// CUDA backend: one warp per request, no host synchronisation, capturable in a CUDA graph.
//
// Build keeps the frontier as one array in pop order, in registers, strided over the warp
// (position j = 32 * k + lane in row k). A pop takes position 0; its two offers find their
// positions with one warp reduction each (compares are branch-free; exactly equal scores take
// a rare warp-uniform path through the rank paths) and the array shifts by at most one place
// through lane shuffles. Rows past the live frontier are skipped, so a pop costs a few dozen
// instructions per live row and no memory traffic beyond the log-prob reads in shared memory.
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "tree/tree_common.h"
#include "tree/tree_ops.h"

namespace ddtree::tree {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kNoPosition = 1 << 30;
constexpr size_t kDefaultSharedLimit = 48 * 1024;

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("ddtree tree ") + what + " kernel launch failed: " +
                             cudaGetErrorString(err));
}

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

// Exactly equal scores: compare rank paths (rare on real log-probs; kept out of line so the
// common path stays small).
__device__ __noinline__ bool tie_pops_before(uint32_t ca, uint32_t cb, const int16_t* parent,
                                             const int16_t* rank) {
  return rank_path_less(candidate_parent(ca), candidate_rank(ca), candidate_depth(ca),
                        candidate_parent(cb), candidate_rank(cb), candidate_depth(cb), parent,
                        rank);
}


template <int M, typename Staged>
__global__ void __launch_bounds__(kWarp) build_kernel(BuildArgs in, BuildOutputs out) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int D = in.depth, K = in.topk, N = in.max_budget, W = mask_words(N + 1);
  const int b = blockIdx.x, lane = threadIdx.x;
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
    for (int i = lane; i < numel / 4; i += kWarp) {
      const float4 v = __ldg(lp4 + i);
      s_lp[4 * i] = v.x;
      s_lp[4 * i + 1] = v.y;
      s_lp[4 * i + 2] = v.z;
      s_lp[4 * i + 3] = v.w;
      nonfinite |= !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
      unordered |= v.x < v.y || v.y < v.z || v.z < v.w;
    }
  } else {
    for (int i = lane; i < numel; i += kWarp) {
      const float v = __ldg(lp + i);
      s_lp[i] = v;
      nonfinite |= !isfinite(v);
    }
  }
  if (lane == 0) {
    s_parent[0] = -1;
    s_rank[0] = 0;
    s_depth[0] = 0;
  }
  __syncwarp();
  const int step = vectorized ? 4 : 1;  // pairs (i - 1, i) left to compare: i % step == 0
  for (int i = lane * step; i < numel; i += kWarp * step)
    if (i % K != 0) unordered |= s_lp[i - 1] < s_lp[i];

  const int budget = in.budgets ? in.budgets[b] : N;
  int32_t status = kOk;
  if (__any_sync(kFullMask, nonfinite)) status = kNonFinite;
  else if (__any_sync(kFullMask, unordered)) status = kNotDescending;
  if (budget < 1 || budget > N) status = kBadBudget;

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
    cand[0] = pack_candidate(0, 0, 1);
  }
  int live = 1;
  const int up_lane = (lane + kWarp - 1) % kWarp, down_lane = (lane + 1) % kWarp;

  int n = 0;
  while (status == kOk && n < budget && live > 0) {
    const double head_score = __shfl_sync(kFullMask, score[0], 0);
    const uint32_t head = __shfl_sync(kFullMask, cand[0], 0);
    ++n;
    const int p = candidate_parent(head), r = candidate_rank(head), d = candidate_depth(head);
    if (lane == 0) {
      s_parent[n] = static_cast<int16_t>(p);
      s_rank[n] = static_cast<int16_t>(r);
      s_depth[n] = static_cast<int8_t>(d);
    }
    // The two offers, in the contract's float64 operation order (indices clamped so the
    // loads are unconditional; an offer that does not exist is dropped below).
    const bool has_sibling = r + 1 < K, has_child = d < D;
    const Staged* row = s_lp + (d - 1) * K;
    double sibling = head_score - static_cast<double>(row[r]);
    sibling = sibling + static_cast<double>(row[has_sibling ? r + 1 : r]);
    const double child = head_score + static_cast<double>(s_lp[has_child ? d * K : 0]);
    // On equal scores the child (path p + [r, 0]) sorts before the sibling (p + [r + 1]).
    const bool child_first = has_child && (!has_sibling || child >= sibling);
    const int offers = has_child + has_sibling;
    const double s1 = child_first ? child : sibling, s2 = child_first ? sibling : child;
    const uint32_t c1 = child_first ? pack_candidate(n, 0, d + 1) : pack_candidate(p, r + 1, d);
    const uint32_t c2 = child_first ? pack_candidate(p, r + 1, d) : pack_candidate(n, 0, d + 1);

    // Positions of the offers among the frontier without its head: count what pops first.
    bool ahead1[M], ahead2[M];
    bool tie = false;
#pragma unroll
    for (int k = 0; k < M; ++k) {
      const int j = k * kWarp + lane;
      const bool valid = j > 0 && j < live;
      ahead1[k] = valid && score[k] > s1;
      ahead2[k] = valid && score[k] > s2;
      tie |= valid && ((offers >= 1 && score[k] == s1) || (offers >= 2 && score[k] == s2));
    }
    if (__any_sync(kFullMask, tie)) {  // exactly equal scores: compare rank paths (rare)
      __syncwarp();                    // node n is visible to the tie-breaks
#pragma unroll
      for (int k = 0; k < M; ++k) {
        const int j = k * kWarp + lane;
        if (j > 0 && j < live) {
          if (offers >= 1 && score[k] == s1) ahead1[k] = tie_pops_before(cand[k], c1, s_parent, s_rank);
          if (offers >= 2 && score[k] == s2) ahead2[k] = tie_pops_before(cand[k], c2, s_parent, s_rank);
        }
      }
    }
    int q1 = 0, q2 = 1;  // s1 goes before s2
#pragma unroll
    for (int k = 0; k < M; ++k) {
      if (k * kWarp < live) {
        q1 += __popc(__ballot_sync(kFullMask, ahead1[k]));
        q2 += __popc(__ballot_sync(kFullMask, ahead2[k]));
      }
    }
    if (offers < 1) q1 = kNoPosition;
    if (offers < 2) q2 = kNoPosition;
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

  // Outputs, padding included.
  const int32_t* ids = in.ids + static_cast<long>(b) * D * K;
  int32_t* tokens = out.tokens + static_cast<long>(b) * N;
  int32_t* depths = out.depths + static_cast<long>(b) * N;
  int32_t* parents = out.parents + static_cast<long>(b) * (N + 1);
  uint64_t* mask = out.mask + static_cast<long>(b) * (N + 1) * W;
  for (int i = lane; i < N; i += kWarp) {
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
  for (int i = lane; i <= N; i += kWarp) parents[i] = (i >= 1 && i <= n) ? s_parent[i] : -1;
  // Row i, word w: the ancestors of i (parents have smaller indices) that fall in the word.
  for (int idx = lane; idx < (N + 1) * W; idx += kWarp) {
    const int row = idx / W, lo = (idx - row * W) * 64;
    uint64_t bits = 0;
    if (row <= n)
      for (int v = row; v >= lo; v = s_parent[v])
        if (v < lo + 64) bits |= uint64_t{1} << (v - lo);
    mask[idx] = bits;
  }
  if (lane == 0) {
    out.num_nodes[b] = n;
    out.status[b] = status;
  }
}

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
  build_kernel<M, Staged><<<in.batch, kWarp, smem, stream>>>(in, out);
  check_cuda(cudaGetLastError(), "build");
}

template <int M>
void launch_build(const BuildArgs& in, const BuildOutputs& out, cudaStream_t stream) {
  if (BuildShared(in.depth, in.topk, in.max_budget, sizeof(double)).bytes <= kDoubleStagingLimit)
    launch_build_staged<M, double>(in, out, stream);
  else
    launch_build_staged<M, float>(in, out, stream);
}

}  // namespace

void build_trees_cuda(const BuildArgs& in, const BuildOutputs& out, void* stream_handle) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  // After n pops the frontier holds <= n + 1 candidates, and only positions < budget - n can
  // still pop, so ceil(budget / 2) slots always suffice.
  const int rows = ((in.max_budget + 1) / 2 + kWarp - 1) / kWarp;
  if (rows <= 1) launch_build<1>(in, out, stream);
  else if (rows <= 2) launch_build<2>(in, out, stream);
  else if (rows <= 3) launch_build<3>(in, out, stream);
  else if (rows <= 4) launch_build<4>(in, out, stream);
  else if (rows <= 6) launch_build<6>(in, out, stream);
  else if (rows <= 8) launch_build<8>(in, out, stream);
  else if (rows <= 12) launch_build<12>(in, out, stream);
  else launch_build<16>(in, out, stream);
}

void accept_cuda(const AcceptArgs& in, const AcceptOutputs& out, void* stream_handle) {
  const size_t smem = sizeof(int32_t) * (in.max_budget + 1);
  accept_kernel<<<in.batch, kWarp, smem, static_cast<cudaStream_t>(stream_handle)>>>(in, out);
  check_cuda(cudaGetLastError(), "accept");
}

}  // namespace ddtree::tree
