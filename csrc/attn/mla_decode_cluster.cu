// Verify attention for requests of <= 16 query rows (decode; 2-token chains at h 8) on Hopper
// thread-block clusters (see mla_verify_cluster.h).
//
// The scheme of the Gluon transposed kernel (services/ddtree/kernels/mla_decode_wgmma.py): the keys
// are the wgmma M side, so a CTA computes NR = 8 or 16 query columns, not 64 padded rows:
// - scores^T [64 keys, NR] = K Q^T (wgmma m64nNRk16; A the KV tile, B Q, both K-major),
// - out^T [512, NR] += V^T P^T (A the same KV tile read M-major, B P^T written to shared memory),
// with the softmax statistics along the keys (a reduction across the warpgroup's warps). One
// warpgroup computes; a producer warp issues the TMA copies of the KV tiles, two in flight.
//
// What is new is the end: where the Gluon kernel writes one fp32 partial per split and a second
// launch merges them, the `cluster` CTAs of a cluster (1-16, any size) hold consecutive splits of
// one request and reduce over distributed shared memory (CTA k owns output column quads [k * 128 /
// cluster, (k + 1) * 128 / cluster)); a request served by one cluster is written directly. With
// more clusters per request each cluster writes one fp32 partial, merged by merge_splits. Also: the
// producer warp (see kThreads), and a sequence's partial last tile reads only its 8-row groups that
// hold keys (issue_kv_tile).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <utility>

#include "attn/mla_verify_cluster.h"
#include "attn/sm90.cuh"

namespace ddtree::attn {
namespace {

using namespace sm90;
// A compute warpgroup and a producer warp: the TMA issue (and its page-table reads) never holds the
// warpgroup's wgmma, which waits for all four of its warps. With the issue in warp 0 the first
// scores wgmma of each tile waited ~900 cycles for it (ncu, single CTA, H200): 2.0 us a tile.
constexpr int kCompute = 128, kThreads = kCompute + 32, kStages = 2;
constexpr int kOStride = kC + 4;  // staged output row, floats (padding: no bank conflicts)
// CTAs per cluster: 1-16, non-portable above 8 (Hopper's limit). Sizes that are not powers of two
// balance a request's tiles: 17 of them (a 1k-prefix decode) take 2 rounds over 9 CTAs where 8 need
// 3. A compile-time size: with a runtime one the epilogue measured ~1 us slower (H200, 2026-12-01).
constexpr int kMaxCluster = 16;

// Shared memory of a CTA with NR query columns, from a 1024-byte aligned base.
template <int kNR>
struct Layout {
  static constexpr uint32_t kv = 0;                                // kStages KV tiles; the staged output after the loop
  static constexpr uint32_t q = kv + kStages * kTileBytes;          // Q [NR, 576]: 9 chunks of [NR, 64], swizzled
  static constexpr uint32_t p = q + kChunks * kNR * 128;            // P^T [NR, 64 keys], swizzled (B of the values)
  static constexpr uint32_t red = p + kNR * 128;                    // [4 warps][NR] column maxima
  static constexpr uint32_t red_l = red + 4 * kNR * 4;              // [4 warps][NR] column sums
  static constexpr uint32_t lse = red_l + 4 * kNR * 4;              // [NR] this CTA's log-sum-exp, log2 units
  static constexpr uint32_t bar = lse + kNR * 4;                    // kQFull, kKvFull + stage, kKvFree + stage
  static constexpr uint32_t bytes = bar + 8 * (1 + 2 * kStages) + 1024;  // + alignment slack
  static_assert(kNR * kOStride * 4 <= kTileBytes, "the staged output fits KV buffer 0");
  static_assert(bytes <= 227 * 1024, "one CTA per SM");
};

// d = A B + (accumulate ? d : 0) for an m64nNk16 tile (N = 8 or 16), A and B from shared memory,
// B K-major; A K-major (the scores: the KV tile) or M-major (kTransA: the KV tile read as V^T).
// A chain's first product does not accumulate, so no zeroing sits between wgmmas (ptxas would
// wait for the ones in flight before it).
template <int kTransA>
__device__ __forceinline__ void wgmma_n(float (&d)[4], uint64_t a, uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %7, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %6, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b), "n"(kTransA), "r"(static_cast<int>(accumulate)));
}
template <int kTransA>
__device__ __forceinline__ void wgmma_n(float (&d)[8], uint64_t a, uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %11, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %10, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b), "n"(kTransA), "r"(static_cast<int>(accumulate)));
}

// An m64nN accumulator's element e in this thread: key (or output column) row r0 + 8 * half(e),
// query column 8 * (e / 4) + c0 + e % 2, which is the thread's column slot col_slot(e).
__device__ __forceinline__ constexpr int half_of(int e) { return (e / 2) % 2; }
__device__ __forceinline__ constexpr int col_slot(int e) { return 2 * (e / 4) + e % 2; }
__device__ __forceinline__ int slot_col(int k, int c0) { return 8 * (k / 2) + c0 + k % 2; }

template <int kNR, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    decode_cluster_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap rope_map,
                          const __grid_constant__ CUtensorMap kv_map, const __grid_constant__ CUtensorMap kv8_map,
                          const VerifyClusterArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Layout<kNR>;
  constexpr int kAcc = kNR / 2, kSlots = kNR / 4;  // accumulator registers; query columns a thread holds
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  float* red = reinterpret_cast<float*>(smem + L::red);
  float* red_l = reinterpret_cast<float*>(smem + L::red_l);
  float* o_stage = reinterpret_cast<float*>(smem + L::kv);
  auto bar = [base](int i) { return base + L::bar + 8u * i; };
  constexpr int kQFull = 0, kKvFull = 1, kKvFree = 1 + kStages;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int r0 = warp * 16 + lane / 4, c0 = 2 * (lane % 4);
  const int split = blockIdx.x, b = blockIdx.y;
  const int rows = a.tokens * a.heads;  // <= kNR: the request's (token, head) pairs

  // This split's 64-key tiles lo..hi-1, spread evenly over the splits; below full_hi wholly prefix.
  const int prefix = max(static_cast<int>(a.prefix[b]), 0);
  const int kv_len = prefix + a.tokens;
  const int n_tiles = (kv_len + kKeyTile - 1) / kKeyTile;
  const int lo = split_bound(split, n_tiles, a.splits), hi = split_bound(split + 1, n_tiles, a.splits);
  const int full_hi = max(min(hi, prefix / kKeyTile), lo);
  const Paging paging{a.table + b * a.table_row, a.page_size, a.max_pages, a.num_pages};

  if (tid == 0) {
    for (int i = 0; i < 1 + kStages; ++i) bar_init(bar(i), 1);
    for (int i = 0; i < kStages; ++i) bar_init(bar(kKvFree + i), 4);  // one arrival per compute warp
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 4) {  // the producer: Q (needed first), the first tiles, then each tile once its buffer is free
    if (lane == 0 && lo < hi) {  // empty splits load nothing
      bar_expect(bar(kQFull), kChunks * kNR * 128);
      for (int j = 0; j < kChunks; ++j)  // rows past the request: its neighbour's, or zeros by TMA; never written
        tma_load_3d(base + L::q + j * kNR * 128, j < kChunks - 1 ? &q_map : &rope_map, j < kChunks - 1 ? j * 64 : 0,
                    0, b * a.tokens, bar(kQFull));
      KvTileRows first[kStages];  // the first tiles' table reads together, then their copies
#pragma unroll
      for (int s = 0; s < kStages; ++s) first[s] = kv_tile_pages(paging, min(lo + s, hi - 1));
#pragma unroll
      for (int s = 0; s < kStages; ++s)
        if (lo + s < hi)
          issue_kv_tile(&kv_map, paging, kv_tile_rows(paging, lo + s, first[s]), base + L::kv + s * kTileBytes,
                        bar(kKvFull + s), &kv8_map, kv_len - (lo + s) * kKeyTile);
      for (int tile = lo + kStages; tile < hi; ++tile) {
        const int i = tile - lo, buf = i % kStages;
        const KvTileRows rows_of_tile = kv_tile_rows(paging, tile);  // read while the buffer drains
        bar_wait(bar(kKvFree + buf), (i / kStages - 1) & 1);
        issue_kv_tile(&kv_map, paging, rows_of_tile, base + L::kv + buf * kTileBytes, bar(kKvFull + buf), &kv8_map,
                      kv_len - tile * kKeyTile);
      }
    }
    __syncwarp();
  } else {
    float acc[8][kAcc];  // out^T: output columns 64 * blk + r0 (+ 8), query columns by slot
#pragma unroll
    for (int blk = 0; blk < 8; ++blk)
#pragma unroll
      for (int e = 0; e < kAcc; ++e) acc[blk][e] = 0.f;
    float m_run[kSlots], l_part[kSlots];  // m: the column's running max (the same in every thread); l: this thread's keys
    const uint64_t* mask_row[kSlots];
    bool col_ok[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      m_run[k] = -INFINITY, l_part[k] = 0.f;
      const int n = slot_col(k, c0);
      col_ok[k] = n < rows;
      mask_row[k] = a.mask + static_cast<int64_t>(b * a.tokens + min(n, rows - 1) / a.heads) * a.mask_words;
    }
    const uint64_t q_desc = sw128_desc(base + L::q), p_desc = sw128_desc(base + L::p);
    if (lo < hi) bar_wait(bar(kQFull), 0);

    for (int tile = lo; tile < hi; ++tile) {
      const int i = tile - lo, buf = i % kStages;
      const uint32_t kv = base + L::kv + buf * kTileBytes;
      bar_wait(bar(kKvFull + buf), (i / kStages) & 1);
      const int valid = kv_len - tile * kKeyTile;
      if (valid < kKeyTile) {  // rows past the sequence: stale page rows or not loaded at all; zero V (0 x NaN is NaN)
        uint4* kv_rows = reinterpret_cast<uint4*>(smem + L::kv + buf * kTileBytes);
        for (int idx = tid; idx < (kC / 64) * 64 * 8; idx += kCompute)  // [chunk, row, 16-byte piece]
          if ((idx / 8) % 64 >= valid) kv_rows[idx] = make_uint4(0, 0, 0, 0);
        fence_proxy_async();
        named_sync(1, kCompute);
      }
      float s[kAcc];  // one chain: three independent ones measured the same (.diag/s22/chains.py)
      const uint64_t k_desc = sw128_desc(kv);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_n<0>(s, k_desc + ((j * kChunkBytes + kk * 32) >> 4), q_desc + ((j * kNR * 128 + kk * 32) >> 4),
                     j > 0 || kk > 0);
      wgmma_commit();
      wgmma_wait_all();

      if (tile >= full_hi) {  // a tile touching the tail: bitmask for tail keys, nothing past it
        uint64_t vis[kSlots];
#pragma unroll
        for (int k = 0; k < kSlots; ++k)
          vis[k] = visible_keys(mask_row[k], a.mask_words, a.tail_mask, col_ok[k], tile, prefix, kv_len);
#pragma unroll
        for (int e = 0; e < kAcc; ++e)
          s[e] = (vis[col_slot(e)] >> (r0 + 8 * half_of(e))) & 1 ? s[e] * a.scale_log2 : -INFINITY;
      } else {
#pragma unroll
        for (int e = 0; e < kAcc; ++e) s[e] *= a.scale_log2;
      }
      // Column maxima: this thread's two keys, the 8 lanes of a column, then the 4 warps. One buffer:
      // every warp reads tile i's before the P^T barrier below, and writes tile i + 1's after it.
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        float mx = fmaxf(s[4 * (k / 2) + k % 2], s[4 * (k / 2) + 2 + k % 2]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        if (lane < 4) red[warp * kNR + slot_col(k, c0)] = mx;
      }
      named_sync(1, kCompute);
      float alpha[kSlots], m_safe[kSlots];
#pragma unroll
      for (int k = 0; k < kSlots; ++k) {
        const int n = slot_col(k, c0);
        const float mx = fmaxf(fmaxf(red[n], red[kNR + n]), fmaxf(red[2 * kNR + n], red[3 * kNR + n]));
        const float m_new = fmaxf(m_run[k], mx);
        m_safe[k] = m_new == -INFINITY ? 0.f : m_new;  // a column that has seen nothing yet
        alpha[k] = fast_exp2(m_run[k] - m_safe[k]);
        m_run[k] = m_new;
        l_part[k] *= alpha[k];
      }
      // P^T [NR, 64 keys] bf16, K-major with the 128-byte swizzle: key r's 16-byte piece r / 8 of
      // row n lands at piece (r / 8) ^ (n % 8).
#pragma unroll
      for (int e = 0; e < kAcc; ++e) {
        const float p = fast_exp2(s[e] - m_safe[col_slot(e)]);
        l_part[col_slot(e)] += p;
        const int n = 8 * (e / 4) + c0 + e % 2, piece = (warp * 2 + half_of(e)) ^ (n % 8);
        *reinterpret_cast<__nv_bfloat16*>(smem + L::p + n * 128 + piece * 16 + (lane / 4) * 2) = __float2bfloat16_rn(p);
      }
      fence_proxy_async();  // P^T is read by wgmma (the async proxy)
      named_sync(1, kCompute);
#pragma unroll
      for (int blk = 0; blk < 8; ++blk)
#pragma unroll
        for (int e = 0; e < kAcc; ++e) acc[blk][e] *= alpha[col_slot(e)];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // the 8 accumulators in turn
#pragma unroll
        for (int blk = 0; blk < 8; ++blk)
          wgmma_n<1>(acc[blk], sw128_desc(kv + blk * kChunkBytes, kChunkBytes) + ((kk * 2048) >> 4),
                     p_desc + ((kk * 32) >> 4));
      wgmma_commit();
      wgmma_wait_all();
      warp_arrive(bar(kKvFree + buf));  // this warp's products are done with the buffer (P^T: the next red barrier)
    }

    // Column sums (the 8 lanes of a column, then the 4 warps), 1 / l and the log-sum-exp (log2 units).
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      float l = l_part[k];
      l += __shfl_xor_sync(0xffffffffu, l, 4);
      l += __shfl_xor_sync(0xffffffffu, l, 8);
      l += __shfl_xor_sync(0xffffffffu, l, 16);
      if (lane < 4) red_l[warp * kNR + slot_col(k, c0)] = l;
    }
    named_sync(1, kCompute);
    float inv_l[kSlots];
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int n = slot_col(k, c0);
      const float l = red_l[n] + red_l[kNR + n] + red_l[2 * kNR + n] + red_l[3 * kNR + n];
      inv_l[k] = l > 0.f ? 1.f / l : 0.f;
      if (tid < 4) reinterpret_cast<float*>(smem + L::lse)[n] = l > 0.f ? m_run[k] + log2f(l) : -INFINITY;
    }
    // Stage the normalized out^T as [NR, 512] fp32 over KV buffer 0 (no load is in flight now).
#pragma unroll
    for (int blk = 0; blk < 8; ++blk)
#pragma unroll
      for (int e = 0; e < kAcc; ++e)
        o_stage[(8 * (e / 4) + c0 + e % 2) * kOStride + 64 * blk + r0 + 8 * half_of(e)] = acc[blk][e] * inv_l[col_slot(e)];
  }  // compute warps
  if constexpr (kCluster > 1) cluster_sync(); else __syncthreads();

  // Reduce this CTA's column quads over the cluster: each item (query column n, quad) loads its
  // column's log-sum-exp and staged output from every CTA, kItems items' loads in flight at once
  // (one round trip of distributed shared memory; the weights are recomputed per item rather than
  // shared through a second round trip and a barrier).
  constexpr int kQuadsRow = kC / 4, kQuadsMax = (kQuadsRow + kCluster - 1) / kCluster;
  constexpr int kItems = kCluster <= 2 ? 4 : kCluster <= 4 ? 2 : 1;
  const int rank = kCluster > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int q_lo = rank * kQuadsRow / kCluster, quads = (rank + 1) * kQuadsRow / kCluster - q_lo;
  const int clusters = a.splits / kCluster, cluster_id = split / kCluster;
  const int64_t part0 = static_cast<int64_t>(b) * rows;  // this request's first pair in the partials
  const int64_t pairs = static_cast<int64_t>(a.batch) * rows;
  uint32_t peer_base[kCluster];  // each peer's shared window: its staged output and log-sum-exps
#pragma unroll
  for (int j = 0; j < kCluster; ++j) peer_base[j] = kCluster > 1 ? peer_addr(base, j) : base;
  for (int u0 = tid; u0 < rows * kQuadsMax; u0 += kItems * kThreads) {
    float4 v[kItems][kCluster];
    float w[kItems][kCluster];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int u = u0 + i * kThreads, n = u / kQuadsMax, qi = u % kQuadsMax;
      const uint32_t off = L::kv + 4u * (n * kOStride + 4 * (q_lo + qi));
#pragma unroll
      for (int j = 0; j < kCluster; ++j)
        if (n < rows && qi < quads) {
          v[i][j] = ld_cluster4<kCluster>(peer_base[j] + off);
          w[i][j] = ld_cluster<kCluster>(peer_base[j] + L::lse + 4 * n);
        }
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int u = u0 + i * kThreads, n = u / kQuadsMax, qi = u % kQuadsMax, col = 4 * (q_lo + qi);
      if (n >= rows || qi >= quads) continue;
      const float lse = merge_weights(w[i]);
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < kCluster; ++j) {  // a zero weight (a split that saw nothing) adds nothing, even NaN
        const float wj = w[i][j];
        if (wj > 0.f) o.x += wj * v[i][j].x, o.y += wj * v[i][j].y, o.z += wj * v[i][j].z, o.w += wj * v[i][j].w;
      }
      if (clusters == 1) {
        const int64_t orow = static_cast<int64_t>(b) * a.tokens + n / a.heads;
        __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(a.out) + orow * a.out_row + (n % a.heads) * a.out_head + col;
        *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
        if (col == 0) a.lse[orow * a.lse_row + n % a.heads] = lse;
      } else {
        const int64_t prow = cluster_id * pairs + part0 + n;
        *reinterpret_cast<float4*>(a.o_part + prow * kC + col) = o;
        if (col == 0) a.lse_part[prow] = lse;
      }
    }
  }

  if constexpr (kCluster > 1) cluster_sync();  // no CTA leaves while a peer still reads its shared memory
#else
  __trap();  // built for sm_90a only (the host side refuses other devices)
#endif
}

template <int kNR, int kCluster>
void launch(const VerifyClusterArgs& a, cudaStream_t stream) {
  const VerifyMaps m = verify_maps(a, kNR / a.heads, true);
  ClusterLaunch l(decode_cluster_kernel<kNR, kCluster>, kCluster, dim3(a.splits, a.batch), kThreads,
                  Layout<kNR>::bytes, stream);
  check(cudaLaunchKernelEx(&l.cfg, decode_cluster_kernel<kNR, kCluster>, m.q, m.rope, m.kv, m.kv8, a), "launch");
}

template <int kNR, int kCluster>
int active() {
  return max_active_clusters(decode_cluster_kernel<kNR, kCluster>, kCluster, kThreads, Layout<kNR>::bytes);
}

// launch<kNR, cluster> and active<kNR, cluster> for a runtime cluster size in 1..kMaxCluster.
using Sizes = std::make_integer_sequence<int, kMaxCluster>;
template <int kNR, int... kSize>
void launch_sized(const VerifyClusterArgs& a, cudaStream_t stream, std::integer_sequence<int, kSize...>) {
  ((a.cluster == kSize + 1 ? launch<kNR, kSize + 1>(a, stream) : void()), ...);
}
template <int kNR, int... kSize>
int active_sized(int cluster, std::integer_sequence<int, kSize...>) {
  int n = 0;
  ((n = cluster == kSize + 1 ? active<kNR, kSize + 1>() : n), ...);
  return n;
}

void check_cluster(int cluster) {
  if (cluster < 1 || cluster > kMaxCluster) throw std::invalid_argument("mla_decode_cluster: cluster must be 1-16");
}

}  // namespace

int mla_decode_cluster_max_active(int cluster, int rows_per_request) {
  check_cluster(cluster);
  return rows_per_request <= 8 ? active_sized<8>(cluster, Sizes{}) : active_sized<16>(cluster, Sizes{});
}

void mla_decode_cluster(const VerifyClusterArgs& a, void* stream) {
  const int rows = a.tokens * a.heads, nr = rows <= 8 ? 8 : 16;
  check_cluster(a.cluster);
  if (a.heads < 1 || rows > 16 || nr % a.heads != 0 || a.splits % a.cluster != 0)
    throw std::invalid_argument("mla_decode_cluster: <= 16 rows per request, heads dividing 8 or 16, cluster dividing splits");
  const auto s = static_cast<cudaStream_t>(stream);
  if (nr == 8) return launch_sized<8>(a, s, Sizes{});
  launch_sized<16>(a, s, Sizes{});
}

}  // namespace ddtree::attn
