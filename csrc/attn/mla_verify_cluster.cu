// Tree-verify MLA attention on Hopper with thread-block clusters (see mla_verify_cluster.h).
//
// One CTA owns 64 query rows (tail token x head pairs of one request) and one split of the
// request's KV range, like the Gluon kernel (services/ddtree/kernels/mla_verify_wgmma.py), with two
// warpgroups: warpgroup 0 computes each 64-key tile's scores (wgmma m64n64k16, Q and K from shared
// memory), masks the tree tail, runs the online softmax, hands P and the row scale to warpgroup 1
// through shared memory and accumulates output columns [0, 256) with P from registers; warpgroup
// 1 issues the TMA loads a tile ahead and accumulates columns [256, 512) with P from shared memory.
//
// What is new is the epilogue. The `cluster` CTAs of a cluster hold consecutive splits of the same
// rows; each stages its normalized fp32 output and log-sum-exp in its own shared memory, and after
// a cluster barrier CTA k reduces rows [k * 64 / cluster, (k + 1) * 64 / cluster) over all of them
// through distributed shared memory. Only one partial per cluster reaches global memory (or the
// final bf16 output, when one cluster covers the whole range), where the Gluon kernel writes and
// merges one 128 KB fp32 partial per CTA: at B 1 those partials are half the L2 traffic. Q, the
// same for the whole cluster, is multicast: each CTA loads about 1 / cluster of it for all.
//
// Where a B 1 tree's time goes (1 x 16 x h 8 at 8k, (56, 8), per-CTA globaltimer stamps, medians
// from the first CTA's start): Q 1.7 us, first KV tile 2.7, loop end 7.9 (1.77 us a tile), staged
// and cluster-synced 10.6, reduced over the cluster 14.8, last CTA out 16.1; then the merge. The
// epilogue is half of it, bound by moving 128 KB of fp32 per CTA (docs/verify_attention.md).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>

#include "attn/mla_verify_cluster.h"
#include "attn/sm90.cuh"

namespace ddtree::attn {
namespace {

using namespace sm90;
constexpr int kBlockM = 64, kBlockN = kKeyTile, kStages = 2, kThreads = 256;
constexpr int kOStride = kC + 4;  // staged output row, floats (padding: fewer bank conflicts)
// Shared memory, from a 1024-byte aligned base (the swizzle atoms need it).
constexpr uint32_t kQ = 0, kKV = kTileBytes, kP = kKV + kStages * kTileBytes, kAlpha = kP + kChunkBytes,
                   kInvL = kAlpha + 256, kLse = kInvL + 256, kBar = kLse + 256, kSmemBytes = kBar + 64 + 1024;
enum Barrier { kQFull = 0, kKvFull = 1, kKDone = kKvFull + kStages, kPReady = kKDone + kStages, kPFree };
static_assert(kBlockM * kOStride * 4 <= kStages * kTileBytes, "the staged output reuses the KV buffers");
static_assert(kSmemBytes <= 227 * 1024, "one CTA per SM");
static_assert(8 * (kPFree + 1) <= 64, "the barriers fit their 64 bytes");

// --- wgmma (m64n64k16 scores, m64n256k16 values; bf16 in, fp32 accumulators) ---
#define DDTREE_ACC8(d, i)                                                                                  \
  "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])
#define DDTREE_ACC32(d) DDTREE_ACC8(d, 0), DDTREE_ACC8(d, 8), DDTREE_ACC8(d, 16), DDTREE_ACC8(d, 24)
#define DDTREE_D32                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d += A B, A [64, 16] and B [16, 64] from shared memory (K-major: the scores).
__device__ __forceinline__ void wgmma_64(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DDTREE_D32 ", %32, %33, p, 1, 1, 0, 0;\n}"
      : DDTREE_ACC32(d)
      : "l"(a), "l"(b));
}

#define DDTREE_ACC128(d) DDTREE_ACC32(d[0]), DDTREE_ACC32(d[1]), DDTREE_ACC32(d[2]), DDTREE_ACC32(d[3])
#define DDTREE_D128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "\
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "\
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "\
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "\
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "\
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "\
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// d += A B for a [64, 256] output block, B [16 keys, 256] N-major (the values): A from shared
// memory, or from registers (the m16n8k16 A fragment layout, per warp).
__device__ __forceinline__ void wgmma_256_ss(float (&d)[4][32], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " DDTREE_D128 ", %128, %129, p, 1, 1, 0, 1;\n}"
      : DDTREE_ACC128(d)
      : "l"(a), "l"(b));
}
__device__ __forceinline__ void wgmma_256_rs(float (&d)[4][32], const uint32_t* a, uint64_t b) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n"
      " wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " DDTREE_D128 ", {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}"
      : DDTREE_ACC128(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

template <int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    verify_cluster_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap rope_map,
                          const __grid_constant__ CUtensorMap kv_map, const VerifyClusterArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  float* alpha_s = reinterpret_cast<float*>(smem + kAlpha);
  float* inv_l_s = reinterpret_cast<float*>(smem + kInvL);
  float* lse_s = reinterpret_cast<float*>(smem + kLse);  // log2 units
  float* o_stage = reinterpret_cast<float*>(smem + kKV);
  auto bar = [base](int i) { return base + kBar + 8u * i; };

  const int tid = threadIdx.x, t = tid % 128;
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);  // warp-uniform to the compiler
  const int warp = t / 32, lane = t % 32;
  const int r0 = warp * 16 + lane / 4;  // this thread's rows r0 and r0 + 8 of an m64 accumulator
  const int c0 = 2 * (lane % 4);        // and columns c0, c0 + 1 of each 8-column group
  const int split = blockIdx.x, pid_m = blockIdx.y, b = blockIdx.z;
  const int rows_total = a.tokens * a.heads;

  // This split's 64-key tiles lo..hi-1 (the Gluon kernel's _split_tiles); below full_hi wholly prefix.
  const int prefix = max(static_cast<int>(a.prefix[b]), 0);
  const int kv_len = prefix + a.tokens;
  const int n_tiles = (kv_len + kBlockN - 1) / kBlockN;
  const int per_split = (n_tiles + a.splits - 1) / a.splits;
  const int lo = split * per_split, hi = min(lo + per_split, n_tiles);
  const int full_hi = max(min(hi, prefix / kBlockN), lo);
  const Paging paging{a.table + b * a.table_row, a.page_size, a.max_pages, a.num_pages};

  if (tid == 0) {
    bar_init(bar(kQFull), 1);
    for (int s = 0; s < kStages; ++s) {
      bar_init(bar(kKvFull + s), 1);
      bar_init(bar(kKDone + s), 4);
    }
    bar_init(bar(kPReady), 4);
    bar_init(bar(kPFree), 4);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // Q is the same for the whole cluster: CTA k loads the 64-column chunks j = k (mod cluster) and
  // multicasts each to every CTA, so L2 serves it once per cluster, not once per CTA. A peer's
  // chunk may land before this CTA's expect-tx (the phase waits for that arrival as well), but
  // not before its barriers exist: hence the cluster barrier after their init.
  KvTileRows first_rows;  // tile lo's page rows, looked up under the barrier
  if (tid == 128 && lo < hi) first_rows = kv_tile_rows(paging, lo);
  if constexpr (kCluster > 1) cluster_sync(); else __syncthreads();
  if (tid == 128) {  // Q (rows past the request: its neighbour's, or zeros by TMA), then tile lo
    bar_expect(bar(kQFull), kTileBytes);
    const int token0 = b * a.tokens + pid_m * (kBlockM / a.heads);
    const int rank = kCluster > 1 ? static_cast<int>(cluster_rank()) : 0;
    for (int j = rank; j < kChunks; j += kCluster) {
      const CUtensorMap* map = j < kChunks - 1 ? &q_map : &rope_map;
      const int col = j < kChunks - 1 ? j * 64 : 0;
      if constexpr (kCluster > 1)
        tma_load_3d_multicast(base + kQ + j * kChunkBytes, map, col, 0, token0, bar(kQFull), (1u << kCluster) - 1);
      else
        tma_load_3d(base + kQ + j * kChunkBytes, map, col, 0, token0, bar(kQFull));
    }
    if (lo < hi) issue_kv_tile(&kv_map, paging, first_rows, base + kKV, bar(kKvFull));
  }

  float acc[4][32];  // output columns wg * 256 + [0, 256): one m64n256 accumulator, by 64-column block
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[c][e] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // l: this thread's columns only
  // Descriptors advance by adding (byte offset >> 4): addresses stay below 2^18, so no carry.
  const uint64_t q_desc = sw128_desc(base + kQ), p_desc = sw128_desc(base + kP);

  if (wg == 0) {  // scores, mask, softmax, P; columns [0, 256)
    const uint64_t* mask_row[2];
    bool row_ok[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = pid_m * kBlockM + r0 + 8 * h;
      row_ok[h] = m < rows_total;
      mask_row[h] = a.mask + static_cast<int64_t>(b * a.tokens + min(m, rows_total - 1) / a.heads) * a.mask_words;
    }
    bar_wait(bar(kQFull), 0);  // empty splits too: no CTA leaves while peers' multicasts into it are in flight
    for (int tile = lo; tile < hi; ++tile) {
      const int i = tile - lo, buf = i % kStages;
      const uint32_t kv = base + kKV + buf * kTileBytes;
      bar_wait(bar(kKvFull + buf), (i / kStages) & 1);
      const int valid = kv_len - tile * kBlockN;
      if (valid < kBlockN) {  // rows past the sequence hold stale page rows: zero V (0 x NaN is NaN)
        uint4* rows = reinterpret_cast<uint4*>(smem + kKV + buf * kTileBytes);
        for (int idx = t; idx < (kC / 64) * 64 * 8; idx += 128)  // [chunk, row, 16-byte piece]
          if ((idx / 8) % 64 >= valid) rows[idx] = make_uint4(0, 0, 0, 0);
        fence_proxy_async();
        named_sync(1, 128);
      }
      float s[32];
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] = 0.f;
      const uint64_t k_desc = sw128_desc(kv);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kChunks; ++j)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t step = (j * kChunkBytes + kk * 32) >> 4;
          wgmma_64(s, q_desc + step, k_desc + step);
        }
      wgmma_commit();
      wgmma_wait_all();

      float mx[2] = {-INFINITY, -INFINITY};
      if (tile >= full_hi) {  // a tile touching the tail: bitmask for tail keys, nothing past it
        uint64_t vis[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) vis[h] = visible_keys(mask_row[h], a.mask_words, a.tail_mask, row_ok[h], tile, prefix, kv_len);
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          const int col = 8 * (e / 4) + c0 + e % 2;
          s[e] = (vis[(e / 2) % 2] >> col) & 1 ? s[e] * a.scale_log2 : -INFINITY;
        }
      } else {
#pragma unroll
        for (int e = 0; e < 32; ++e) s[e] *= a.scale_log2;
      }
#pragma unroll
      for (int e = 0; e < 32; ++e) mx[(e / 2) % 2] = fmaxf(mx[(e / 2) % 2], s[e]);
      float alpha[2], m_safe[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m_run[h], mx[h]);
        m_safe[h] = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen nothing yet
        alpha[h] = fast_exp2(m_run[h] - m_safe[h]);
        m_run[h] = m_new;
      }
      uint32_t p_frag[16];  // bf16 pairs: the A fragments of the four 16-key blocks
      float row_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int g = 0; g < 8; ++g)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float p0 = fast_exp2(s[4 * g + 2 * h] - m_safe[h]), p1 = fast_exp2(s[4 * g + 2 * h + 1] - m_safe[h]);
          row_sum[h] += p0 + p1;
          p_frag[2 * g + h] = pack_bf16(p0, p1);
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + row_sum[h];

      if (i > 0) bar_wait(bar(kPFree), (i - 1) & 1);  // warpgroup 1 is done with P(i - 1)
#pragma unroll
      for (int g = 0; g < 8; ++g)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // K-major, 128-byte swizzle: 16-byte piece g of row r lands at g ^ (r % 8)
          const int r = r0 + 8 * h;
          *reinterpret_cast<uint32_t*>(smem + kP + r * 128 + ((g ^ (r % 8)) * 16) + c0 * 2) = p_frag[2 * g + h];
        }
      if (lane % 4 == 0) {
        alpha_s[r0] = alpha[0];
        alpha_s[r0 + 8] = alpha[1];
      }
      fence_proxy_async();  // P is read by wgmma (the async proxy)
      warp_arrive(bar(kPReady));

#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int e = 0; e < 32; ++e) acc[c][e] *= alpha[(e / 2) % 2];
      const uint64_t v_desc = sw128_desc(kv, kChunkBytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_256_rs(acc, p_frag + 4 * kk, v_desc + ((kk * 2048) >> 4));
      wgmma_commit();
      wgmma_wait_all();
      warp_arrive(bar(kKDone + buf));  // this warpgroup's reads of the buffer are over
    }
    // Row statistics: the quad's column sums, then 1 / l and the log-sum-exp (log2 units).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (lane % 4 == 0) {
        inv_l_s[r0 + 8 * h] = l > 0.f ? 1.f / l : 0.f;
        lse_s[r0 + 8 * h] = l > 0.f ? m_run[h] + log2f(l) : -INFINITY;
      }
    }
  } else {  // TMA loads a tile ahead; columns [256, 512)
    for (int tile = lo; tile < hi; ++tile) {
      const int i = tile - lo, buf = i % kStages;
      const uint32_t kv = base + kKV + buf * kTileBytes;
      if (t == 0 && tile + 1 < hi) {
        const int j = i + 1, nbuf = j % kStages;  // its buffer held tile j - kStages
        const KvTileRows rows = kv_tile_rows(paging, tile + 1);  // looked up while the buffer drains
        if (j >= kStages) bar_wait(bar(kKDone + nbuf), (j / kStages - 1) & 1);
        issue_kv_tile(&kv_map, paging, rows, base + kKV + nbuf * kTileBytes, bar(kKvFull + nbuf));
      }
      __syncwarp();
      bar_wait(bar(kPReady), i & 1);
      bar_wait(bar(kKvFull + buf), (i / kStages) & 1);
      const float alpha[2] = {alpha_s[r0], alpha_s[r0 + 8]};
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int e = 0; e < 32; ++e) acc[c][e] *= alpha[(e / 2) % 2];
      const uint64_t v_desc = sw128_desc(kv + 4 * kChunkBytes, kChunkBytes);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_256_ss(acc, p_desc + ((kk * 32) >> 4), v_desc + ((kk * 2048) >> 4));
      wgmma_commit();
      wgmma_wait_all();
      warp_arrive(bar(kPFree));
    }
  }

  // Stage the normalized output over the (now idle) KV buffers.
  __syncthreads();
  const float inv_l[2] = {inv_l_s[r0], inv_l_s[r0 + 8]};
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int g = 0; g < 8; ++g)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = wg * 256 + c * 64 + 8 * g + c0;
        *reinterpret_cast<float2*>(o_stage + (r0 + 8 * h) * kOStride + col) =
            make_float2(acc[c][4 * g + 2 * h] * inv_l[h], acc[c][4 * g + 2 * h + 1] * inv_l[h]);
      }
  if constexpr (kCluster > 1) cluster_sync(); else __syncthreads();

  // Reduce this CTA's share of the rows over the cluster; write the output or the cluster's partial.
  constexpr int kRowsPer = kBlockM / kCluster, kQuads = kC / 4;
  const int rank = kCluster > 1 ? static_cast<int>(cluster_rank()) : 0;
  const int clusters = a.splits / kCluster, cluster_id = split / kCluster;
  auto write_out = [&](int m, int q4, float4 o, float lse) {
    const int64_t orow = static_cast<int64_t>(b) * a.tokens + m / a.heads;
    __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(a.out) + orow * a.out_row + (m % a.heads) * a.out_head + 4 * q4;
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16(o.x, o.y), pack_bf16(o.z, o.w));
    if (q4 == 0) a.lse[orow * a.lse_row + m % a.heads] = lse;
  };
  auto part_row = [&](int cluster, int m) {
    return (static_cast<int64_t>(cluster) * a.batch + b) * rows_total + m;
  };
  // First each row's weights over the cluster (one thread a row), then the weighted sums, all of
  // two items' kCluster loads issued before any is used. The reads still run at ~35 GB/s per SM
  // (H200, globaltimer stamps, 2026-12-01): 3.7 us for the 112 KB a CTA of a cluster of 8 reads,
  // about what the same CTA takes to store its 128 KB partial when it has no cluster.
  float* weight_s = reinterpret_cast<float*>(smem + kP);  // [kRowsPer, kCluster]; P is free now
  float* row_lse_s = weight_s + kBlockM;                  // [kRowsPer], natural log
  if (tid < kRowsPer) {
    const int r = rank * kRowsPer + tid;
    row_lse_s[tid] = cluster_row_weights<kCluster>(base + kLse + 4 * r, weight_s + tid * kCluster);
  }
  __syncthreads();
  uint32_t peer_base[kCluster];  // each peer's staged output, in the cluster's shared window
#pragma unroll
  for (int j = 0; j < kCluster; ++j) peer_base[j] = kCluster > 1 ? peer_addr(base + kKV, j) : base + kKV;
  static_assert(kRowsPer * kQuads % (2 * kThreads) == 0, "two items a thread per step");
  for (int u0 = tid; u0 < kRowsPer * kQuads; u0 += 2 * kThreads) {
    float4 v[2][kCluster];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int u = u0 + i * kThreads;
      const uint32_t off = 4u * ((rank * kRowsPer + u / kQuads) * kOStride + 4 * (u % kQuads));
#pragma unroll
      for (int j = 0; j < kCluster; ++j)
        v[i][j] = kCluster > 1 ? ld_cluster4<kCluster>(peer_base[j] + off) : *reinterpret_cast<const float4*>(smem + kKV + off);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int u = u0 + i * kThreads, q4 = u % kQuads;
      const int m = pid_m * kBlockM + rank * kRowsPer + u / kQuads;
      if (m >= rows_total) continue;
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int j = 0; j < kCluster; ++j) {  // a zero weight (a split that saw nothing) adds nothing, even NaN
        const float w = weight_s[(u / kQuads) * kCluster + j];
        if (w > 0.f) o.x += w * v[i][j].x, o.y += w * v[i][j].y, o.z += w * v[i][j].z, o.w += w * v[i][j].w;
      }
      const float lse = row_lse_s[u / kQuads];
      if (clusters == 1) {
        write_out(m, q4, o, lse);
      } else {
        const int64_t prow = part_row(cluster_id, m);
        *reinterpret_cast<float4*>(a.o_part + prow * kC + 4 * q4) = o;
        if (q4 == 0) a.lse_part[prow] = lse;
      }
    }
  }

  if constexpr (kCluster > 1) cluster_sync();  // no CTA leaves while a peer still reads its shared memory
#else
  __trap();  // built for sm_90a only (the host side refuses other devices)
#endif
}

template <int kCluster>
void launch(const VerifyClusterArgs& a, const VerifyMaps& m, cudaStream_t stream) {
  ClusterLaunch l(verify_cluster_kernel<kCluster>, kCluster,
                  dim3(a.splits, (a.tokens * a.heads + kBlockM - 1) / kBlockM, a.batch), kThreads, kSmemBytes, stream);
  check(cudaLaunchKernelEx(&l.cfg, verify_cluster_kernel<kCluster>, m.q, m.rope, m.kv, a), "launch");
}

template <int kCluster>
int active_clusters() {
  return max_active_clusters(verify_cluster_kernel<kCluster>, kCluster, kThreads, kSmemBytes);
}

}  // namespace

int mla_verify_cluster_max_active(int cluster) {
  switch (cluster) {
    case 1: return active_clusters<1>();
    case 2: return active_clusters<2>();
    case 4: return active_clusters<4>();
    case 8: return active_clusters<8>();
    default: throw std::invalid_argument("mla_verify_cluster: cluster must be 1, 2, 4 or 8");
  }
}

void mla_verify_cluster(const VerifyClusterArgs& a, void* stream) {
  if (a.heads < 1 || kBlockM % a.heads != 0 || a.cluster < 1 || a.splits % a.cluster != 0)
    throw std::invalid_argument("mla_verify_cluster: heads must divide 64 and cluster the splits");
  const VerifyMaps maps = verify_maps(a, kBlockM / a.heads, false);
  const auto s = static_cast<cudaStream_t>(stream);
  switch (a.cluster) {
    case 1: return launch<1>(a, maps, s);
    case 2: return launch<2>(a, maps, s);
    case 4: return launch<4>(a, maps, s);
    case 8: return launch<8>(a, maps, s);
    default: throw std::invalid_argument("mla_verify_cluster: cluster must be 1, 2, 4 or 8");
  }
}

}  // namespace ddtree::attn
