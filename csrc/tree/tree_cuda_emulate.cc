// Runs the CUDA build kernels of tree_cuda.cu as plain host C++ (one std::thread per CUDA
// thread, barriers for __syncthreads / __syncwarp, exchange buffers for shuffles and ballots)
// and compares every output with the C++ backend (tree_cpu.cpp, itself equal to the Python
// oracle), and every lower bound on tau the block kernel takes against the exact budget-th best
// score. For machines without a GPU; tests/test_tree_cuda_emulation.py builds and runs it:
//
//   g++ -std=c++20 -O1 -pthread -I csrc csrc/tree/tree_cuda_emulate.cc csrc/tree/tree_cpu.cpp
//   ./a.out CASES SEED          # prints "ok ..." or the first mismatch, exit status 1
//
// With -fsanitize=thread it is a race check on the kernels' shared memory (every access
// between two barriers); with -fsanitize=address,undefined a bounds and UB check.
//
// Not built into the extension (CMake globs *.cpp and *.cu only).
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <queue>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace emu {
constexpr int kWarpSize = 32;
struct Dim {
  int x;
};
thread_local int tid = 0, bid = 0;
std::atomic<int> path_count[3];  // block kernel requests: fast path (exact sums, chains), fallback
std::atomic<int> queue_count[2];  // queue_pool: pools built, aborted
std::vector<double> bounds;       // tau_lower_bound's result per block (NaN: the bound did not run)
struct Block {
  int threads = 0;
  std::unique_ptr<std::barrier<>> block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<uint64_t> exchange;  // one slot per thread
  std::vector<unsigned char> smem;
};
Block* current = nullptr;
inline Dim thread_idx() { return {tid}; }
inline Dim block_idx() { return {bid}; }
inline std::barrier<>& warp_barrier() { return *current->warp_barriers[tid / kWarpSize]; }
inline unsigned char* dynamic_smem() { return current->smem.data(); }

template <typename T>
uint64_t to_bits(T v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
template <typename T>
T shfl(T v, int src_lane) {
  const int base = tid / kWarpSize * kWarpSize;
  current->exchange[tid] = to_bits(v);
  warp_barrier().arrive_and_wait();
  const T r = from_bits<T>(current->exchange[base + (src_lane & (kWarpSize - 1))]);
  warp_barrier().arrive_and_wait();
  return r;
}
inline unsigned ballot(bool p) {
  const int base = tid / kWarpSize * kWarpSize;
  current->exchange[tid] = p ? 1 : 0;
  warp_barrier().arrive_and_wait();
  unsigned bits = 0;
  for (int l = 0; l < kWarpSize; ++l)
    if (current->exchange[base + l]) bits |= 1u << l;
  warp_barrier().arrive_and_wait();
  return bits;
}
inline int block_reduce(int p, bool want_and) {
  current->block_barrier->arrive_and_wait();  // the exchange slots are free
  current->exchange[tid] = p ? 1 : 0;
  current->block_barrier->arrive_and_wait();
  bool r = want_and;
  for (int t = 0; t < current->threads; ++t) r = want_and ? (r && current->exchange[t]) : (r || current->exchange[t]);
  current->block_barrier->arrive_and_wait();
  return r ? 1 : 0;
}
template <typename T>
T atomic_add(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <typename T>
T atomic_min(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <typename T>
T atomic_max(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v > old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}

// Runs kernel() as grid x threads CUDA threads, one block at a time.
template <typename F>
void launch(int grid, int threads, size_t smem_bytes, F kernel) {
  for (int b = 0; b < grid; ++b) {
    Block block;
    block.threads = threads;
    block.block_barrier = std::make_unique<std::barrier<>>(threads);
    for (int w = 0; w < threads / kWarpSize; ++w)
      block.warp_barriers.push_back(std::make_unique<std::barrier<>>(kWarpSize));
    block.exchange.assign(threads, 0);
    block.smem.assign(smem_bytes + 64, (b % 2) ? 0xCD : 0x11);  // garbage, as on a GPU
    current = &block;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        tid = t;
        bid = b;
        kernel();
      });
    for (auto& th : pool) th.join();
    current = nullptr;
  }
}
}  // namespace emu

// The CUDA vocabulary the build kernels use.
#define DDTREE_TREE_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define DDTREE_DYNAMIC_SMEM(name) unsigned char* name = ::emu::dynamic_smem()
#define threadIdx (::emu::thread_idx())
#define DDTREE_BLOCK_PATH(fallback, exact) (::emu::path_count[(fallback) ? 2 : ((exact) ? 0 : 1)] += 1)
#define DDTREE_QUEUE_PATH(used) (::emu::queue_count[(used) > 0 ? 0 : 1] += 1)
#define DDTREE_BOUND(tau) (::emu::bounds[::emu::bid] = (tau))
#define blockIdx (::emu::block_idx())
struct float4 {
  float x, y, z, w;
};
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline void __syncthreads() { emu::current->block_barrier->arrive_and_wait(); }
inline int __syncthreads_or(int p) { return emu::block_reduce(p, false); }
inline int __syncthreads_and(int p) { return emu::block_reduce(p, true); }
inline void __syncwarp() { emu::warp_barrier().arrive_and_wait(); }
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) {
  return emu::shfl(v, src);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
  const int lane = emu::tid % emu::kWarpSize;
  const T r = emu::shfl(v, lane - static_cast<int>(delta));
  return lane >= static_cast<int>(delta) ? r : v;
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta) {
  const int lane = emu::tid % emu::kWarpSize;
  const T r = emu::shfl(v, lane + static_cast<int>(delta));
  return lane + static_cast<int>(delta) < emu::kWarpSize ? r : v;
}
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  return emu::shfl(v, (emu::tid % emu::kWarpSize) ^ lane_mask);
}
inline unsigned __ballot_sync(unsigned, bool p) { return emu::ballot(p); }
inline bool __any_sync(unsigned, bool p) { return emu::ballot(p) != 0; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }
inline long long __double_as_longlong(double x) { return emu::from_bits<long long>(emu::to_bits(x)); }
inline double __longlong_as_double(long long x) { return emu::from_bits<double>(emu::to_bits(x)); }
inline unsigned __float_as_uint(float x) { return emu::from_bits<unsigned>(emu::to_bits(x)); }
inline float __uint_as_float(unsigned x) { return emu::from_bits<float>(emu::to_bits(x)); }
// Directed rounding: the double result (exact for these operands but where a sum spans more than
// 29 binades) rounded to float upward or downward.
inline float float_up(double x) {
  const float r = static_cast<float>(x);
  return static_cast<double>(r) < x ? std::nextafter(r, INFINITY) : r;
}
inline float float_down(double x) {
  const float r = static_cast<float>(x);
  return static_cast<double>(r) > x ? std::nextafter(r, -INFINITY) : r;
}
inline float __fsub_ru(float a, float b) { return float_up(static_cast<double>(a) - b); }
inline float __fmul_ru(float a, float b) { return float_up(static_cast<double>(a) * b); }
inline float __fadd_rd(float a, float b) { return float_down(static_cast<double>(a) + b); }
inline float __double2float_ru(double x) { return float_up(x); }
inline float __double2float_rd(double x) { return float_down(x); }
template <typename T>
inline T __reduce_max_sync(unsigned, T v) {
  for (int o = emu::kWarpSize / 2; o > 0; o /= 2) v = std::max(v, __shfl_xor_sync(0u, v, o));
  return v;
}
template <typename T>
inline T __reduce_min_sync(unsigned, T v) {
  for (int o = emu::kWarpSize / 2; o > 0; o /= 2) v = std::min(v, __shfl_xor_sync(0u, v, o));
  return v;
}
inline int atomicAdd(int* p, int v) { return emu::atomic_add(p, v); }
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) { return emu::atomic_min(p, v); }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) { return emu::atomic_max(p, v); }
inline unsigned atomicMax(unsigned* p, unsigned v) { return emu::atomic_max(p, v); }
inline int atomicMin(int* p, int v) { return emu::atomic_min(p, v); }
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
inline int atomicCAS(int* p, int compare, int v) {
  std::atomic_ref<int>(*p).compare_exchange_strong(compare, v);
  return compare;
}
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// queue_pool's polled words: atomic in C++ terms (a plain load would be a data race).
inline unsigned long long poll_word(const unsigned long long* p) {
  return std::atomic_ref<unsigned long long>(*const_cast<unsigned long long*>(p)).load();
}
inline int poll_int(const int* p) { return std::atomic_ref<int>(*const_cast<int*>(p)).load(); }
inline void publish_word(unsigned long long* p, unsigned long long v) { std::atomic_ref<unsigned long long>(*p).store(v); }
inline void publish_int(int* p, int v) { std::atomic_ref<int>(*p).store(v); }
inline void publish_score(double* p, double v) { std::atomic_ref<double>(*p).store(v); }
inline void idle_pause() { std::this_thread::yield(); }  // 256 threads on a few cores make progress
inline void prefetch_l1(const void*) {}
inline int lane_id() { return emu::tid % emu::kWarpSize; }
inline unsigned lane_bit() { return 1u << lane_id(); }
inline void or_copy_if(const uint64_t* from, uint64_t* to, uint64_t bits, bool on) {
  if (on) *to = *from | bits;
}
using std::frexp;
using std::isfinite;
using std::max;
using std::min;

#include "tree/tree_cuda.cu"

namespace tree = ddtree::tree;

struct Case {
  int batch, depth, topk, budget;
  std::vector<float> lp;
  std::vector<int32_t> ids;
  std::vector<int32_t> budgets;  // empty: all `budget`
  std::string kind;
};

struct Result {
  std::vector<int32_t> tokens, depths, parents, num_nodes, status;
  std::vector<uint64_t> mask;
  explicit Result(const Case& c) {
    const int N = c.budget, W = (N + 64) / 64;
    tokens.assign(c.batch * N, 7);
    depths.assign(c.batch * N, 7);
    parents.assign(c.batch * (N + 1), 7);
    num_nodes.assign(c.batch, 7);
    status.assign(c.batch, 7);
    mask.assign(static_cast<size_t>(c.batch) * (N + 1) * W, 7);
  }
  tree::BuildOutputs outputs() {
    return {tokens.data(), depths.data(), parents.data(), num_nodes.data(), mask.data(), status.data()};
  }
  bool operator==(const Result& o) const {
    return tokens == o.tokens && depths == o.depths && parents == o.parents && num_nodes == o.num_nodes &&
           status == o.status && mask == o.mask;
  }
};

Case make_case(std::mt19937_64& rng, int index) {
  const char* kinds[] = {"rand", "rand", "rand", "ties", "zeros", "pos", "tiny", "fewvals", "bad", "signedzeros"};
  Case c;
  c.kind = kinds[rng() % 10];
  const int depths[] = {1, 2, 3, 4, 8, 16, 16, 32};
  const int budgets[] = {1, 2, 5, 16, 33, 64, 64, 100, 256, 257};
  c.depth = depths[rng() % 8];
  c.budget = budgets[rng() % 10];
  if (index % 17 == 0) c.budget = 1024;
  c.topk = 1 + static_cast<int>(rng() % std::min(c.budget, 64));
  if (rng() % 3 == 0) c.topk = std::min(c.budget, 1 << (rng() % 9));
  if (index == 1) {  // every run: a drafter-like case whose sort goes through shared memory (> 64 keys)
    c.kind = "rand";
    c.depth = 6;
    c.budget = c.topk = 128;
  }
  const bool drafter_like = index == 2;  // every run: a pool built by the queue (exact sums, a bound, peaked rows)
  if (drafter_like) {
    c.kind = "rand";
    c.depth = 16;
    c.budget = c.topk = 256;
  }
  c.batch = 1 + static_cast<int>(rng() % 3);
  const int numel = c.depth * c.topk;
  c.lp.resize(static_cast<size_t>(c.batch) * numel);
  c.ids.resize(c.lp.size());
  std::normal_distribution<double> normal;
  const double temps[] = {0.3, 1.0, 3.0};
  const double temp = drafter_like ? 1.0 : temps[rng() % 3];
  const float few[] = {0.0f, -0.1f, -0.25f, -0.3f, -0.7f, -1.0f};
  for (int b = 0; b < c.batch; ++b)
    for (int d = 0; d < c.depth; ++d) {
      float* row = c.lp.data() + (static_cast<size_t>(b) * c.depth + d) * c.topk;
      const int vocab = std::max(c.topk, 64);
      std::vector<double> logits(vocab);
      double mx = -1e300;
      for (auto& x : logits) {
        x = normal(rng) * 3.0 / temp;
        mx = std::max(mx, x);
      }
      double z = 0;
      for (double x : logits) z += std::exp(x - mx);
      std::vector<float> v(vocab);
      for (int j = 0; j < vocab; ++j) v[j] = static_cast<float>(logits[j] - mx - std::log(z));
      if (c.kind == "ties" || c.kind == "fewvals")
        for (auto& x : v) x = few[rng() % (c.kind == "ties" ? 6 : 3)];
      if (c.kind == "signedzeros") {  // +0.0 and -0.0 compare equal: exact ties across signs
        const float signed_zeros[] = {0.0f, -0.0f, -0.0f, -0.5f};
        for (auto& x : v) x = signed_zeros[rng() % 4];
      }
      std::sort(v.begin(), v.end(), std::greater<float>());
      for (int j = 0; j < c.topk; ++j) row[j] = v[j];
      if (c.kind == "zeros")
        for (int j = 0; j < 1 + static_cast<int>(rng() % c.topk); ++j) row[j] = 0.0f;
      if (c.kind == "pos")
        for (int j = 0; j < c.topk; ++j) row[j] += 0.5f;
      if (c.kind == "tiny") row[0] = -1e-9f;
      for (int j = 0; j < c.topk; ++j)
        c.ids[(static_cast<size_t>(b) * c.depth + d) * c.topk + j] = static_cast<int32_t>((rng() % 50021));
    }
  if (c.kind == "bad") {  // one request with a NaN, one out of order, one bad budget
    c.lp[rng() % c.lp.size()] = (rng() % 2) ? NAN : INFINITY;
    if (c.batch > 1 && c.topk > 1) std::swap(c.lp[numel], c.lp[numel + 1]);
  }
  if (rng() % 4 == 0) {
    c.budgets.resize(c.batch);
    for (auto& x : c.budgets) x = 1 + static_cast<int>(rng() % c.budget);
    c.budgets[0] = c.budget;
    if (c.kind == "bad") c.budgets[c.batch - 1] = 0;
  }
  return c;
}

tree::BuildArgs args_of(const Case& c) {
  return {c.lp.data(), c.ids.data(), c.budgets.empty() ? nullptr : c.budgets.data(), c.batch, c.depth,
          c.topk, c.budget};
}

template <int M, typename Staged>
void run_block(const Case& c, Result& r, int capacity) {
  emu::bounds.assign(c.batch, NAN);
  const auto in = args_of(c);
  const auto out = r.outputs();
  const tree::BlockShared layout(c.depth, c.topk, c.budget, capacity, sizeof(Staged));
  emu::launch(c.batch, tree::kBlock, layout.bytes, [&] { tree::block_build_kernel<M, Staged>(in, out, layout, capacity); });
}

template <int M>
void run_warp(const Case& c, Result& r) {
  const auto in = args_of(c);
  const auto out = r.outputs();
  const size_t smem = tree::BuildShared(c.depth, c.topk, c.budget, sizeof(double)).bytes;
  emu::launch(c.batch, tree::kBuildThreads, smem, [&] { tree::build_kernel<M, double>(in, out); });
}

// Frontier rows (per lane) for this budget: the smallest of the instantiated M that holds them.
int rows_of(const Case& c) { return ((c.budget + 1) / 2 + 31) / 32; }

template <typename Staged>
void run_block_rows(const Case& c, Result& r, int capacity) {
  const int rows = rows_of(c);
  if (rows <= 1) run_block<1, Staged>(c, r, capacity);
  else if (rows <= 4) run_block<4, Staged>(c, r, capacity);
  else run_block<16, Staged>(c, r, capacity);
}

void run_warp_rows(const Case& c, Result& r) {
  const int rows = rows_of(c);
  if (rows <= 1) run_warp<1>(c, r);
  else if (rows <= 4) run_warp<4>(c, r);
  else run_warp<16>(c, r);
}

// The budget-th best score of request b, by the contract's heap walk on scores alone (the same
// float64 operations, so the same values as the tree's nodes); NaN when fewer nodes exist.
double budget_th_score(const Case& c, int b) {
  const int D = c.depth, K = c.topk, budget = c.budgets.empty() ? c.budget : c.budgets[b];
  const float* lp = c.lp.data() + static_cast<size_t>(b) * D * K;
  struct Item {
    double score;
    int depth, rank;
    bool operator<(const Item& o) const { return score < o.score; }
  };
  std::priority_queue<Item> heap;
  heap.push({static_cast<double>(lp[0]), 1, 0});
  for (int n = 1; !heap.empty(); ++n) {
    const Item it = heap.top();
    heap.pop();
    if (n == budget) return it.score;
    const float* row = lp + (it.depth - 1) * K;
    if (it.rank + 1 < K) heap.push({it.score - row[it.rank] + row[it.rank + 1], it.depth, it.rank + 1});
    if (it.depth < D) heap.push({it.score + row[K], it.depth + 1, 0});
  }
  return NAN;
}

// tau_lower_bound must never exceed the budget-th best score (a bound above it would make the
// pool miss nodes; the verification would catch that, so the trees alone do not show it).
// Returns the requests checked, or -1 (printed) on a bound above the score.
int check_bounds(const Case& c, const Result& got, int index) {
  int checked = 0;
  for (int b = 0; b < c.batch; ++b) {
    const double bound = emu::bounds[b];
    if (!(bound > -INFINITY) || got.status[b] != 0) continue;  // no bound (NaN or -inf), or a bad request
    const double tau = budget_th_score(c, b);
    if (bound > tau || std::isnan(tau)) {
      std::printf("BOUND ABOVE TAU case %d request %d kind %s D %d K %d budget %d: bound %.17g, tau %.17g\n",
                  index, b, c.kind.c_str(), c.depth, c.topk, c.budget, bound, tau);
      return -1;
    }
    ++checked;
  }
  return checked;
}

void print_mismatch(const char* which, int i, const Case& c, const Result& got, const Result& want) {
  std::printf("MISMATCH (%s) case %d kind %s batch %d D %d K %d budget %d\n", which, i, c.kind.c_str(), c.batch,
              c.depth, c.topk, c.budget);
  for (int b = 0; b < c.batch; ++b)
    std::printf("  request %d: nodes %d/%d status %d/%d\n", b, got.num_nodes[b], want.num_nodes[b], got.status[b],
                want.status[b]);
}

// The block kernel's trees against the cpu backend's, then its bounds on tau: the bounds checked,
// or -1 (printed) on either failure.
int check_block(const Case& c, const Result& got, const Result& want, int index) {
  if (!(got == want)) {
    print_mismatch("block kernel", index, c, got, want);
    return -1;
  }
  return check_bounds(c, got, index);
}

// ./a.out CASES SEED [both|warp]: "both" (default) runs the block kernel on every case and the
// warp kernel on every other one (budgets <= 256, and larger ones now and then); "warp" runs only
// the warp kernel, on every case.
// ./a.out file LP IDS BATCH D K BUDGET: the block kernel on one batch from disk (float32 log-probs,
// int32 ids, as benchmarks/tree_inputs.py writes them) against the cpu backend.
int run_file(char** argv) {
  Case c;
  c.kind = "file";
  c.batch = std::atoi(argv[4]);
  c.depth = std::atoi(argv[5]);
  c.topk = std::atoi(argv[6]);
  c.budget = std::atoi(argv[7]);
  const size_t numel = static_cast<size_t>(c.batch) * c.depth * c.topk;
  c.lp.resize(numel);
  c.ids.resize(numel);
  auto read = [](const char* path, void* dst, size_t bytes) {
    FILE* f = std::fopen(path, "rb");
    const bool ok = f && std::fread(dst, 1, bytes, f) == bytes;
    if (f) std::fclose(f);
    return ok;
  };
  if (!read(argv[2], c.lp.data(), numel * 4) || !read(argv[3], c.ids.data(), numel * 4)) {
    std::printf("cannot read the batch\n");
    return 2;
  }
  Result want(c), got(c);
  tree::build_trees_cpu(args_of(c), want.outputs(), 1);
  run_block_rows<double>(c, got, tree::block_capacity<double>(c.depth, c.topk, c.budget));
  const int bounds = check_block(c, got, want, 0);
  if (bounds < 0) return 1;
  std::printf("ok %d trees; block kernel: %d fast, %d fallback; pools by the queue: %d built, %d aborted; "
              "bounds on tau: %d checked\n",
              c.batch, emu::path_count[0].load() + emu::path_count[1].load(), emu::path_count[2].load(),
              emu::queue_count[0].load(), emu::queue_count[1].load(), bounds);
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 8 && std::string(argv[1]) == "file") return run_file(argv);
  const int cases = argc > 1 ? std::atoi(argv[1]) : 50;
  const unsigned seed = argc > 2 ? std::atoi(argv[2]) : 1;
  const std::string mode = argc > 3 ? argv[3] : "both";
  std::mt19937_64 rng(seed);
  int checked = 0, warp_checked = 0, bounds_checked = 0;
  for (int i = 0; i < cases; ++i) {
    const Case c = make_case(rng, i);
    Result want(c);
    tree::build_trees_cpu(args_of(c), want.outputs(), 1);
    if (mode != "warp") {
      Result block(c);
      const bool as_float = i % 5 == 4;  // also the float-staged variant
      // The launch's capacity, or a small one now and then to exercise the overflow fallback.
      int capacity = as_float ? tree::block_capacity<float>(c.depth, c.topk, c.budget)
                              : tree::block_capacity<double>(c.depth, c.topk, c.budget);
      if (capacity > 0) {
        if (i % 7 == 3) capacity = std::min(capacity, 64 + static_cast<int>(rng() % 512));
        as_float ? run_block_rows<float>(c, block, capacity) : run_block_rows<double>(c, block, capacity);
        const int bounds = check_block(c, block, want, i);
        if (bounds < 0) return 1;
        bounds_checked += bounds;
        checked += c.batch;
      }
    }
    if (mode == "warp" || (mode == "both" && i % 2 == 0 && (c.budget <= 256 || i % 6 == 0))) {
      Result warp(c);
      run_warp_rows(c, warp);
      if (!(warp == want)) {
        print_mismatch("warp kernel", i, c, warp, want);
        return 1;
      }
      warp_checked += c.batch;
    }
  }
  std::printf("ok %d cases, %d trees (block kernel), %d trees (warp kernel); block kernel: %d fast (%d of them on "
              "chains), %d fallback; pools by the queue: %d built, %d aborted; bounds on tau: %d checked\n",
              cases, checked, warp_checked, emu::path_count[0].load() + emu::path_count[1].load(),
              emu::path_count[1].load(), emu::path_count[2].load(), emu::queue_count[0].load(),
              emu::queue_count[1].load(), bounds_checked);
  return 0;
}
