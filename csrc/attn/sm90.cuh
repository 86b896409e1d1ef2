// Hopper (sm_90a) building blocks shared by the verify-attention kernels of csrc/attn: mbarriers,
// TMA loads, thread-block clusters and distributed shared memory, wgmma descriptors, the paged
// KV tile load, the tree-tail visibility window, and the host-side tensor maps.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace ddtree::attn::sm90 {

constexpr int kC = 512, kR = 64, kChunks = (kC + kR) / 64;  // 64-column chunks: one 128-byte swizzle atom wide
constexpr int kKeyTile = 64;                                 // keys per KV tile
constexpr uint32_t kChunkBytes = 64 * 128;                   // [64 rows, 64 columns] bf16
constexpr uint32_t kTileBytes = kChunks * kChunkBytes;       // one KV tile (or 64 query rows): 72 KB

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- mbarriers, TMA, clusters ---
__device__ __forceinline__ void bar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival per warp, after the whole warp's prior writes: warpgroup handshakes count 4 (as
// fast as an arrival per thread, measured on the H200; fewer barrier transactions).
__device__ __forceinline__ void warp_arrive(uint32_t bar) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) bar_arrive(bar);
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                      uint32_t bar, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(ctas)
      : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t peer_addr(uint32_t addr, uint32_t rank) {  // the same offset in CTA `rank`
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// A float (float4) of shared memory in a cluster of kCluster CTAs: ld.shared::cluster at an address
// in the cluster's window (peer_addr), or, in a cluster of one, ld.shared at this CTA's own address.
template <int kCluster>
__device__ __forceinline__ float ld_cluster(uint32_t addr) {
  float v;
  if constexpr (kCluster > 1)
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  else
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
template <int kCluster>
__device__ __forceinline__ float4 ld_cluster4(uint32_t addr) {
  float4 v;
  if constexpr (kCluster > 1)
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
  else
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
  return v;
}

// --- wgmma (bf16 in, fp32 accumulators) ---
// Operand descriptor of a 128-byte swizzled tile whose 8-row atoms are 1024 bytes apart (the
// stride byte offset). K-major operands span one atom in K per instruction, so the leading byte
// offset is unused; N-major (or M-major) ones wider than 64 columns step it between chunks.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t leading = 16) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; -inf -> 0 (as the Gluon kernels' gl.exp2)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The merge weights of kN partial results of a row from their log-sum-exps (log2 units), in place:
// lse[j] becomes 2^(lse_j - lse) for the row's log-sum-exp lse over all of them, which is returned
// in natural log (-inf, and zero weights, for a row none saw a key of).
template <int kN>
__device__ __forceinline__ float merge_weights(float (&lse)[kN]) {
  float top = -INFINITY;
#pragma unroll
  for (int j = 0; j < kN; ++j) top = fmaxf(top, lse[j]);
  float wsum = 0.f;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    lse[j] = top > -INFINITY ? fast_exp2(lse[j] - top) : 0.f;
    wsum += lse[j];
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
#pragma unroll
  for (int j = 0; j < kN; ++j) lse[j] *= inv;
  return wsum > 0.f ? (top + log2f(wsum)) * 0.6931471805599453f : -INFINITY;
}

// One row's weights over a cluster's partial results (merge_weights), CTA j's log-sum-exp of the
// row at the shared address `lse_addr` of its own window. After a cluster barrier that follows
// every CTA's write of its lse.
template <int kCluster>
__device__ __forceinline__ float cluster_row_weights(uint32_t lse_addr, float* weights) {
  float w[kCluster];
#pragma unroll
  for (int j = 0; j < kCluster; ++j) w[j] = ld_cluster<kCluster>(kCluster > 1 ? peer_addr(lse_addr, j) : lse_addr);
  const float lse = merge_weights(w);
#pragma unroll
  for (int j = 0; j < kCluster; ++j) weights[j] = w[j];
  return lse;
}

// The first tile of split `split` when `tiles` are spread evenly over `splits`: split * tiles /
// splits, in 32-bit arithmetic where it fits (a 64-bit division is a long software routine at the
// head of every CTA's critical path).
__device__ __forceinline__ int split_bound(int split, int tiles, int splits) {
  if (tiles < 65536 && split < 65536)
    return static_cast<int>(static_cast<uint32_t>(split) * static_cast<uint32_t>(tiles) / static_cast<uint32_t>(splits));
  return static_cast<int>(static_cast<int64_t>(split) * tiles / splits);
}

// Where a request's keys live: its block-table row and the cache's paging.
struct Paging {
  const int32_t* table_row;
  int page_size, max_pages, num_pages;
};

// The cache rows where KV tile `tile` of a request (keys tile * 64..) starts in each of its
// min(page_size, 64)-row boxes, one per page; page ids out of the table or the cache are clamped
// (wrong rows, never a fault). In two steps, so that a caller can issue several tiles' table reads
// before it needs any: kv_tile_pages loads the page ids (the reads issued together: one after each
// TMA copy, whose asm is a memory barrier to the compiler, cost a round trip per page), and
// kv_tile_rows turns them into rows.
struct KvTileRows {
  int row[kKeyTile / 16];  // pages of >= 16 rows: at most 4 boxes a tile
};
__device__ __forceinline__ KvTileRows kv_tile_pages(const Paging& p, int tile) {
  const int page_rows = min(p.page_size, kKeyTile);
  KvTileRows r;
#pragma unroll
  for (int k = 0; k < kKeyTile / 16; ++k)
    r.row[k] = k < kKeyTile / page_rows ? p.table_row[min((tile * kKeyTile + k * page_rows) / p.page_size, p.max_pages - 1)] : 0;
  return r;
}
__device__ __forceinline__ KvTileRows kv_tile_rows(const Paging& p, int tile, KvTileRows pages) {
  const int page_rows = min(p.page_size, kKeyTile);
#pragma unroll
  for (int k = 0; k < kKeyTile / 16; ++k) {
    const int pos = tile * kKeyTile + k * page_rows;
    pages.row[k] = min(max(pages.row[k], 0), p.num_pages - 1) * p.page_size + pos % p.page_size;
  }
  return pages;
}
__device__ __forceinline__ KvTileRows kv_tile_rows(const Paging& p, int tile) {
  return kv_tile_rows(p, tile, kv_tile_pages(p, tile));
}

// The TMA copies of a KV tile into the buffer at `dst` from the rows kv_tile_rows found: boxes of
// min(page_size, 64) rows x 64 columns. With `kv8_map` (boxes of 8 rows) a tile holding fewer than
// 64 keys (`valid`: a sequence's last) copies only its 8-row groups that hold keys: a decode step at
// a 1k prefix has 1025 keys, and its 17th tile would otherwise read 64 rows for one. The rows past
// `valid` then hold whatever the buffer held: the caller zeroes V there (as it must for stale page
// rows anyway). Completion: `full` (expect-tx). One thread.
__device__ __forceinline__ void issue_kv_tile(const CUtensorMap* kv_map, const Paging& p, const KvTileRows& rows,
                                              uint32_t dst, uint32_t full, const CUtensorMap* kv8_map = nullptr,
                                              int valid = kKeyTile) {
  const int page_rows = min(p.page_size, kKeyTile);
  if (kv8_map != nullptr && valid < kKeyTile) {
    const int groups = (valid + 7) / 8;  // 8 | page_rows: a group never straddles pages
    bar_expect(full, groups * kChunks * 1024);
    for (int g = 0; g < groups; ++g) {
      const int box = 8 * g / page_rows;
      int row = rows.row[0];  // rows.row[box], without a dynamic index (it would put `rows` in local memory)
#pragma unroll
      for (int k = 1; k < kKeyTile / 16; ++k) row = k == box ? rows.row[k] : row;
      row += 8 * g % page_rows;
      for (int j = 0; j < kChunks; ++j) tma_load_2d(dst + j * kChunkBytes + g * 1024, kv8_map, j * 64, row, full);
    }
    return;
  }
  bar_expect(full, kTileBytes);
#pragma unroll
  for (int k = 0; k < kKeyTile / 16; ++k) {
    if (k >= kKeyTile / page_rows) break;
    for (int j = 0; j < kChunks; ++j)
      tma_load_2d(dst + j * kChunkBytes + k * page_rows * 128, kv_map, j * 64, rows.row[k], full);
  }
}

// Which of the 64 keys of `tile` a query row sees, as bits: the prefix, then the tree tail
// through the row's ancestor bitmask (all of it when !tail_mask), nothing past the sequence.
// Tail tiles only. One window per row and a shift per score keep the loops small.
__device__ __forceinline__ uint64_t visible_keys(const uint64_t* mask_row, int mask_words, bool tail_mask,
                                                 bool row_ok, int tile, int prefix, int kv_len) {
  const int first = tile * kKeyTile - prefix;  // the tile's first key, relative to the tail (>= -63)
  const int in_seq = min(kv_len - tile * kKeyTile, kKeyTile);
  const uint64_t in_seq_bits = in_seq >= 64 ? ~0ull : (1ull << in_seq) - 1;
  const auto* words = reinterpret_cast<const unsigned long long*>(mask_row);
  uint64_t tail = 0;  // bit k: tail key first + k
  if (row_ok) {
    if (!tail_mask) {
      tail = ~0ull;
    } else if (first >= 0) {
      const int word = first / 64, shift = first % 64;
      tail = __ldg(words + word) >> shift;
      if (shift != 0 && word + 1 < mask_words) tail |= __ldg(words + word + 1) << (64 - shift);
    } else {
      tail = __ldg(words) << -first;
    }
  }
  const uint64_t prefix_bits = first >= 0 ? 0ull : (1ull << -first) - 1;
  return (prefix_bits | (first >= 0 ? tail : tail & ~prefix_bits)) & in_seq_bits;
}

// --- host side ---
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("ddtree attention kernel: ") + what + ": " + cudaGetErrorString(e));
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiled encode_tiled() {  // from the driver, so the extension does not link libcuda
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      throw std::runtime_error("ddtree attention kernel: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A bf16 tensor map with 128-byte swizzled boxes; dims innermost first, strides in bytes. L2
// promotion 128 B, as Triton's descriptors: with 256 B the decode kernel's box rows (128 B of a
// 1152-byte cache row) made 22% more L2 sector reads and ran at 78% of DRAM peak against the Gluon
// kernel's 85% (ncu, B 64 x h 8 at 8k, H200, 2026-12-01).
inline CUtensorMap tensor_map(const void* ptr, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                              const cuuint32_t* box) {
  CUtensorMap map;
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(ptr), dims, strides,
                                    box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("ddtree attention kernel: cuTensorMapEncodeTiled failed, CUresult " + std::to_string(r));
  return map;
}

// A launch of `kernel` in clusters of `cluster` CTAs along x (up to 16: above 8 the kernel is allowed
// non-portable sizes), its dynamic shared memory allowed first.
template <class Kernel>
struct ClusterLaunch {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = {};
  ClusterLaunch(Kernel* kernel, int cluster, dim3 grid, int threads, uint32_t smem_bytes, cudaStream_t stream) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes), "shared memory size");
    if (cluster > 8)  // Hopper runs clusters of up to 16 CTAs when the kernel opts in
      check(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "cluster size");
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
};

// How many clusters of `cluster` CTAs of `kernel` the current device runs at once.
template <class Kernel>
int max_active_clusters(Kernel* kernel, int cluster, int threads, uint32_t smem_bytes) {
  ClusterLaunch<Kernel> l(kernel, cluster, dim3(cluster * 64), threads, smem_bytes, nullptr);
  int n = 0;
  check(cudaOccupancyMaxActiveClusters(&n, kernel, &l.cfg), "cluster occupancy");
  return n;
}

// Tensor maps of a verify call: Q latent and rope as [B*T, H, 512 | 64] in boxes of 64 columns x
// H heads x `q_tokens` tokens, the cache as [pages * page_size, 576] in boxes of min(page_size, 64)
// rows x 64 columns, and with `rows8` also in boxes of 8 rows (issue_kv_tile's partial tiles; only
// the decode kernel copies them: one host-side encode fewer for the tree kernel).
struct VerifyMaps {
  CUtensorMap q, rope, kv, kv8;  // kv8: unset without rows8
};
template <class Args>
VerifyMaps verify_maps(const Args& a, cuuint32_t q_tokens, bool rows8) {
  const cuuint64_t tokens = static_cast<cuuint64_t>(a.batch) * a.tokens, heads = a.heads;
  const cuuint64_t q_dims[3] = {kC, heads, tokens}, rope_dims[3] = {kR, heads, tokens};
  const cuuint64_t q_strides[2] = {2ull * a.q_lat_head, 2ull * a.q_lat_row};
  const cuuint64_t rope_strides[2] = {2ull * a.q_rope_head, 2ull * a.q_rope_row};
  const cuuint32_t q_box[3] = {64, static_cast<cuuint32_t>(a.heads), q_tokens};
  const cuuint64_t kv_dims[2] = {kC + kR, static_cast<cuuint64_t>(a.num_pages) * a.page_size};
  const cuuint64_t kv_strides[1] = {2ull * a.cache_row};
  const cuuint32_t kv_box[2] = {64, static_cast<cuuint32_t>(a.page_size < kKeyTile ? a.page_size : kKeyTile)};
  const cuuint32_t kv8_box[2] = {64, 8};
  VerifyMaps m{};
  m.q = tensor_map(a.q_latent, 3, q_dims, q_strides, q_box);
  m.rope = tensor_map(a.q_rope, 3, rope_dims, rope_strides, q_box);
  m.kv = tensor_map(a.cache, 2, kv_dims, kv_strides, kv_box);
  if (rows8) m.kv8 = tensor_map(a.cache, 2, kv_dims, kv_strides, kv8_box);
  return m;
}

}  // namespace ddtree::attn::sm90
