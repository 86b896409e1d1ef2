// C++ backend: a binary heap per request (exactly the reference algorithm), requests spread
// over threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "tree/tree_common.h"
#include "tree/tree_ops.h"

namespace ddtree::tree {
namespace {

struct Candidate {
  double score;
  uint32_t packed;  // pack_candidate(parent, rank, depth)
};

// Runs fn(first, last) over [0, n) split into at most `threads` contiguous chunks; inline when
// one chunk suffices (thread start-up costs more than a small batch).
template <typename Fn>
void parallel_for(int n, int threads, long work_per_item, Fn fn) {
  constexpr long kMinWorkPerThread = 1 << 15;
  long useful = std::max<long>(1, (static_cast<long>(n) * work_per_item) / kMinWorkPerThread);
  int chunks = static_cast<int>(std::min<long>({static_cast<long>(std::max(threads, 1)),
                                               static_cast<long>(n), useful}));
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(chunks - 1);
  int per = (n + chunks - 1) / chunks;
  for (int c = 1; c < chunks; ++c) {
    int first = c * per, last = std::min(n, first + per);
    if (first < last) pool.emplace_back(fn, first, last);
  }
  fn(0, std::min(n, per));
  for (auto& t : pool) t.join();
}

int32_t check_rows(const float* lp, int depth, int topk) {
  for (int i = 0; i < depth * topk; ++i)
    if (!std::isfinite(lp[i])) return kNonFinite;
  for (int d = 0; d < depth; ++d)
    for (int k = 0; k + 1 < topk; ++k)
      if (lp[d * topk + k] < lp[d * topk + k + 1]) return kNotDescending;
  return kOk;
}

void build_one(const BuildArgs& in, const BuildOutputs& out, int b, std::vector<Candidate>& heap,
               std::vector<int16_t>& parent, std::vector<int16_t>& rank,
               std::vector<int8_t>& depth) {
  const int D = in.depth, K = in.topk, N = in.max_budget, W = mask_words(N + 1);
  const float* lp = in.logprobs + static_cast<long>(b) * D * K;
  const int32_t* ids = in.ids + static_cast<long>(b) * D * K;
  int32_t* tokens = out.tokens + static_cast<long>(b) * N;
  int32_t* depths = out.depths + static_cast<long>(b) * N;
  int32_t* parents = out.parents + static_cast<long>(b) * (N + 1);
  uint64_t* mask = out.mask + static_cast<long>(b) * (N + 1) * W;

  const int budget = in.budgets ? in.budgets[b] : N;
  int32_t status = (budget < 1 || budget > N) ? kBadBudget : check_rows(lp, D, K);

  int n = 0;  // nodes popped
  if (status == kOk) {
    parent[0] = -1;
    rank[0] = 0;
    depth[0] = 0;
    // Max-heap on pop order: comp(x, y) is "x pops after y".
    auto pops_after = [&](const Candidate& x, const Candidate& y) {
      return pops_before(y.score, y.packed, x.score, x.packed, parent.data(), rank.data());
    };
    heap.clear();
    heap.push_back({static_cast<double>(lp[0]), pack_candidate(0, 0, 1)});
    while (n < budget && !heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), pops_after);
      const Candidate c = heap.back();
      heap.pop_back();
      const int p = candidate_parent(c.packed), r = candidate_rank(c.packed),
                d = candidate_depth(c.packed);
      ++n;
      parent[n] = static_cast<int16_t>(p);
      rank[n] = static_cast<int16_t>(r);
      depth[n] = static_cast<int8_t>(d);
      if (r + 1 < K) {
        double s = c.score - static_cast<double>(lp[(d - 1) * K + r]);
        s = s + static_cast<double>(lp[(d - 1) * K + r + 1]);
        heap.push_back({s, pack_candidate(p, r + 1, d)});
        std::push_heap(heap.begin(), heap.end(), pops_after);
      }
      if (d < D) {
        heap.push_back({c.score + static_cast<double>(lp[d * K]), pack_candidate(n, 0, d + 1)});
        std::push_heap(heap.begin(), heap.end(), pops_after);
      }
    }
  }

  out.status[b] = status;
  out.num_nodes[b] = n;
  parents[0] = -1;
  std::memset(mask, 0, sizeof(uint64_t) * (N + 1) * W);
  mask[0] = 1;  // the root sees itself
  for (int i = 1; i <= N; ++i) {
    if (i <= n) {
      tokens[i - 1] = ids[(depth[i] - 1) * K + rank[i]];
      depths[i - 1] = depth[i];
      parents[i] = parent[i];
      // Parents pop before their children, so the parent's row is complete.
      std::memcpy(mask + static_cast<long>(i) * W, mask + static_cast<long>(parent[i]) * W,
                  sizeof(uint64_t) * W);
      mask[static_cast<long>(i) * W + i / 64] |= uint64_t{1} << (i % 64);
    } else {
      tokens[i - 1] = -1;
      depths[i - 1] = 0;
      parents[i] = -1;
    }
  }
}

void accept_one(const AcceptArgs& in, const AcceptOutputs& out, int b, std::vector<int32_t>& child) {
  const int N = in.max_budget, L = in.max_depth + 1;
  const int32_t* tokens = in.tokens + static_cast<long>(b) * N;
  const int32_t* parents = in.parents + static_cast<long>(b) * (N + 1);
  const int32_t* posterior = in.posterior + static_cast<long>(b) * (N + 1);
  int32_t* path = out.path + static_cast<long>(b) * L;
  int32_t* keep = out.keep + static_cast<long>(b) * L;

  int32_t status = kOk;
  int n = in.num_nodes[b];
  if (n < 0 || n > N) {
    status = kBadTree;
    n = 0;
  }
  // child[p] = the first node under p whose token is the target's choice at p.
  std::fill(child.begin(), child.begin() + n + 1, -1);
  for (int j = 1; j <= n; ++j) {
    const int p = parents[j];
    if (p < 0 || p >= j) {
      status = kBadTree;
      continue;
    }
    if (child[p] < 0 && tokens[j - 1] == posterior[p]) child[p] = j;
  }
  int len = 0, cur = 0;
  path[len++] = 0;
  while (len < L && child[cur] >= 0) {
    cur = child[cur];
    path[len++] = cur;
  }
  for (int i = 0; i < L; ++i) keep[i] = path[i] = i < len ? path[i] : -1;
  out.length[b] = len;
  out.bonus[b] = posterior[cur];
  out.status[b] = status;
}

}  // namespace

void build_trees_cpu(const BuildArgs& in, const BuildOutputs& out, int threads) {
  const long work = static_cast<long>(in.max_budget) * 16 + static_cast<long>(in.depth) * in.topk;
  parallel_for(in.batch, threads, work, [&](int first, int last) {
    std::vector<Candidate> heap;
    heap.reserve(in.max_budget + 2);
    std::vector<int16_t> parent(in.max_budget + 1), rank(in.max_budget + 1);
    std::vector<int8_t> depth(in.max_budget + 1);
    for (int b = first; b < last; ++b) build_one(in, out, b, heap, parent, rank, depth);
  });
}

void accept_cpu(const AcceptArgs& in, const AcceptOutputs& out, int threads) {
  parallel_for(in.batch, threads, static_cast<long>(in.max_budget) * 4, [&](int first, int last) {
    std::vector<int32_t> child(in.max_budget + 1);
    for (int b = first; b < last; ++b) accept_one(in, out, b, child);
  });
}

}  // namespace ddtree::tree
