// INT4 W4A16 GEMM on the tensor cores: see int4_gemm.h and ddtree.models.quant.int4_to_mma.
//
// A work item is one 16-column output tile (silu: the gate tile and its up tile) of one row
// block of 8 * NT tokens; persistent CTAs (as many as the GPU holds) stride over the items of
// the blocks in use. A CTA's kWarps warps split K in chunks of 64 columns and sum their partials
// through shared memory in warp order (deterministic). Per chunk a lane copies (cp.async, into
// its own slot of its warp's ring of Stage::kDepth chunks, read back by no other lane) one
// 16-byte word group per weight (four 16x16 A fragments of 8 nibbles each), the scale pairs of
// its rows (g, g + 8) and, per n8 token tile, 2 x 16 bytes of activations: the chunk's columns are
// permuted the same way in the weights and the activations (a sum over k does not care), so a
// lane's B fragments are 8 contiguous columns of one token row. A nibble pair becomes a bf16x2
// (q, q') exactly: one LOP3 puts it under the bits of 128.0, one HSUB2 takes 136 off. Each 32-column
// group's two MMAs accumulate from zero and are scaled in fp32 into the accumulator, so a weight
// is q * s exactly (as float64 would have it), not rounded to bf16. Activations past k and of
// sentinel rows are zero-filled by the copy itself, so the inner loop has no predicate.
//
// ncu on the H200 (one Kimi-K2 TP8 rank, 1 and 16 tokens): both GEMMs are bound by instruction
// issue, not by DRAM (23-57% of it): ~11 instructions per 8 weights to dequantize, 0.45-0.7
// warp instructions a cycle per scheduler. Hence the lean inner loop and, at decode, three
// gate|up CTAs an SM. K split over CTAs was measured and lost at every size (its reduction costs
// more than the shorter chains save), so there is none.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>

#include "moe/int4_gemm.h"

namespace ddtree::moe {
namespace {


__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));  // (a & b) | c
  return d;
}

// One word's 8 nibbles -> the 4 bf16x2 registers of an A fragment: register j holds nibbles j
// (low half) and j + 4 (high half), as q = nibble - 8.
__device__ __forceinline__ void dequant(uint32_t w, uint32_t (&a)[4]) {
  const uint32_t mask = 0x000F000Fu, bits128 = 0x43004300u;  // bf16 128.0 in both halves
  const uint32_t off = 0x43084308u;                          // bf16 136.0 in both halves
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t v = lop3_and_or(w >> (4 * j), mask, bits128);  // 128 + nibble, exact
    __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&v),
                               *reinterpret_cast<const __nv_bfloat162*>(&off));
    a[j] = *reinterpret_cast<uint32_t*>(&q);
  }
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One 32-column group (half h of a chunk) of one weight: acc[j] += s * (A_h x B_h[j]).
template <int NT>
__device__ __forceinline__ void group_mma(float (&acc)[NT][4], const uint4& w, int h, uint32_t s_pair,
                                          const uint4 (&xv)[NT][2]) {
  float t[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) t[j][0] = t[j][1] = t[j][2] = t[j][3] = 0.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    uint32_t a[4];
    dequant(word(w, 2 * h + r), a);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const uint4& b = xv[j][h];
      mma(t[j], a, r ? b.z : b.x, r ? b.w : b.y);
    }
  }
  const float s_lo = __uint_as_float(s_pair << 16);          // row g
  const float s_hi = __uint_as_float(s_pair & 0xFFFF0000u);  // row g + 8
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    acc[j][0] = fmaf(t[j][0], s_lo, acc[j][0]);
    acc[j][1] = fmaf(t[j][1], s_lo, acc[j][1]);
    acc[j][2] = fmaf(t[j][2], s_hi, acc[j][2]);
    acc[j][3] = fmaf(t[j][3], s_hi, acc[j][3]);
  }
}

constexpr int kWarps = 8;
constexpr int kSiluDecodeCtas = 3;  // gate|up CTAs an SM holds with blocks of 8 (registers and stages)
constexpr int kDecodeTiles = 2;     // output tiles of one down item with blocks of 8 (shared activations)

template <int NT, bool SILU>
struct Stage {
  // weights an item streams: silu the gate and up tiles; otherwise kTiles adjacent output tiles
  static constexpr int kTiles = SILU ? 1 : NT == 1 ? kDecodeTiles : 1;
  static_assert(kTiles <= 2, "tile_item clamps the second output tile of an item only");
  static constexpr int kAcc = SILU ? 2 : kTiles;
  // bytes a lane stages per chunk: kAcc weight word groups (16 B) and scale pairs (8 B), NT x 2
  // activation vectors (16 B)
  static constexpr int kLaneBytes = kAcc * 24 + NT * 32;
  static constexpr int kWarpBytes = kLaneBytes * 32;
  // CTAs an SM holds (registers: the launch bounds; shared memory: the budget)
  static constexpr int kCtas = SILU ? (NT == 1 ? kSiluDecodeCtas : NT == 2 ? 2 : 1) : (NT == 4 ? 2 : 3);
  // chunks in flight per warp, 2 to 8, from a CTA's stage budget: gate|up (K = hidden, many
  // chunks a warp) ~100 KB, two CTAs an SM (three at decode: more warps to issue from beat a
  // deeper ring); down (K = intermediate, few chunks a warp) ~64 KB, three CTAs an SM
  static constexpr int kBudget = SILU ? 200 * 1024 / std::max(2, kCtas) : 64 * 1024;
  static constexpr int kDepth = std::min(8, std::max(2, kBudget / (kWarpBytes * kWarps)));
  static constexpr int kSmem = kDepth * kWarpBytes * kWarps;
  // an output's items per row block
  __host__ __device__ static constexpr int items_per_block(int out_tiles) {
    return (out_tiles + kTiles - 1) / kTiles;
  }
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src));
}

// 16 bytes, or zeros where src_bytes is 0 (src is then not read)
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src));
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// One work item: output tile `tile` of row block `blk`. Every thread of the CTA calls it; the
// early returns are uniform over the CTA or come after its last barrier.
template <int NT, bool SILU, int MODE>
__device__ __forceinline__ void tile_item(const Int4GemmArgs& a, unsigned char* smem, const int tile,
                                          const int blk, const int warp, const int lane) {
  using St = Stage<NT, SILU>;
  constexpr int BM = 8 * NT;
  constexpr int ACC = St::kAcc;
  constexpr int S = St::kDepth;
  const int g = lane >> 2, t = lane & 3;
  // the block's expert and the lane's pair ids are loaded together (one round trip before the
  // weights, whose address needs the expert)
  int expert = 0;
  int ids[NT];
  if (MODE != 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j) ids[j] = a.sorted_ids[blk * BM + 8 * j + g];
    expert = a.block_expert[blk];
    if (expert < 0) return;  // unused block
  }
  // the lane's token row in each n8 tile (its B fragments' column g)
  const __nv_bfloat16* xrow[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int slot = blk * BM + 8 * j + g;
    int64_t row = -1;
    if (MODE == 0) {
      row = slot < a.m_rows ? slot : -1;
    } else if (MODE == 1) {
      row = ids[j] < a.num_pairs ? ids[j] / a.topk : -1;
    } else {
      row = ids[j] < a.num_pairs ? slot : -1;  // sentinel rows: not read (as zeros)
    }
    xrow[j] = row < 0 ? nullptr : static_cast<const __nv_bfloat16*>(a.x) + row * a.x_stride + 8 * t;
  }
  const int64_t tile_chunks = static_cast<int64_t>(a.k_chunks);
  constexpr int TILES = St::kTiles;
  // the item's matrices m: silu the gate tile and its up tile (out_tiles on); otherwise output
  // tiles TILES * tile + m, a last one past the weight reading the one before it (not written)
  const int64_t wtile = static_cast<int64_t>(expert) * a.n_tiles + TILES * tile;
  const uint4* wg = reinterpret_cast<const uint4*>(a.words) + wtile * tile_chunks * 32 + lane;
  const uint2* sg = static_cast<const uint2*>(a.scales) + wtile * tile_chunks * 8 + g;
  const int64_t up = (SILU ? a.out_tiles : TILES * tile + 1 < a.n_tiles ? 1 : 0) * tile_chunks;
  const int per = (a.k_chunks + kWarps - 1) / kWarps;  // the warps' K chunks
  const int c0 = min(warp * per, a.k_chunks), c1 = min(c0 + per, a.k_chunks);

  // this lane's stages (no other lane reads them: cp.async.wait_group alone orders them)
  unsigned char* mine = smem + warp * S * St::kWarpBytes + lane * 16;
  auto w_at = [&](int st, int m) { return reinterpret_cast<uint4*>(mine + st * St::kWarpBytes + m * 512); };
  auto s_at = [&](int st, int m) {
    return reinterpret_cast<uint2*>(mine + st * St::kWarpBytes + ACC * 512 - lane * 8 + m * 256);
  };
  auto x_at = [&](int st, int j, int h) {
    return reinterpret_cast<uint4*>(mine + st * St::kWarpBytes + ACC * 768 + (j * 2 + h) * 512);
  };
  // the chunk's global sources, advanced a chunk per issue; activations past k or of sentinel
  // rows are zero-filled (a 0-byte source), so the smem reads need no predicate
  const uint4* wsrc = wg + static_cast<int64_t>(c0) * 32;
  const uint2* ssrc = sg + static_cast<int64_t>(c0) * 8;
  const __nv_bfloat16* xsrc[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    xsrc[j] = xrow[j] != nullptr ? xrow[j] + c0 * 64 : static_cast<const __nv_bfloat16*>(a.x);
  const int col0 = c0 * 64 + 8 * t;  // the lane's first activation column of chunk c0 (h = 0)
  int wst = 0;                       // the stage the next issue fills
  auto issue = [&](int c) {          // chunk c's loads into stage wst, one commit group (empty past c1)
    if (c < c1) {
#pragma unroll
      for (int m = 0; m < ACC; ++m) {
        cp_async16(w_at(wst, m), wsrc + m * up * 32);
        cp_async8(s_at(wst, m), ssrc + m * up * 8);
      }
      const int col = col0 + (c - c0) * 64;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          cp_async16_zfill(x_at(wst, j, h), xsrc[j] + 32 * h,
                           xrow[j] != nullptr && col + 32 * h < a.k ? 16 : 0);
      wsrc += 32;
      ssrc += 8;
#pragma unroll
      for (int j = 0; j < NT; ++j) xsrc[j] += xrow[j] != nullptr ? 64 : 0;
      wst = wst + 1 == S ? 0 : wst + 1;
    }
    asm volatile("cp.async.commit_group;");
  };

  float acc[ACC][NT][4];
#pragma unroll
  for (int m = 0; m < ACC; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(c0 + i);
  int rst = 0;  // the stage chunk c landed in
  for (int c = c0; c < c1; ++c) {
    cp_async_wait<S - 2>();  // chunk c has landed
    uint4 wv[ACC];
    uint2 sv[ACC];
    uint4 xv[NT][2];
#pragma unroll
    for (int m = 0; m < ACC; ++m) {
      wv[m] = *w_at(rst, m);
      sv[m] = *s_at(rst, m);
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) xv[j][h] = *x_at(rst, j, h);
    issue(c + S - 1);  // into the stage read one iteration ago
    rst = rst + 1 == S ? 0 : rst + 1;
#pragma unroll
    for (int m = 0; m < ACC; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) group_mma<NT>(acc[m], wv[m], h, h ? sv[m].y : sv[m].x, xv);
  }
  cp_async_wait<0>();

  // the warps' partials (over the stages), summed in warp order by warp 0
  static_assert(kWarps * ACC * NT * 4 * 32 * 4 <= St::kSmem, "the partials fit the stages");
  float* part = reinterpret_cast<float*>(smem);  // [kWarps][ACC * NT * 4][32]
  auto part_at = [&](int w, int m, int j, int i) -> float& {
    return part[(w * ACC * NT * 4 + (m * NT + j) * 4 + i) * 32 + lane];
  };
  __syncthreads();
#pragma unroll
  for (int m = 0; m < ACC; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) part_at(warp, m, j, i) = acc[m][j][i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int m = 0; m < ACC; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += part_at(w, m, j, i);
        acc[m][j][i] = sum;
      }
  // C fragment: element i is weight row g (+8 for i >= 2), token slot 2t + (i & 1) of tile j
#pragma unroll
  for (int m = 0; m < TILES; ++m)
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = (TILES * tile + m) * 16 + g + (i >= 2 ? 8 : 0);
      const int slot = blk * BM + 8 * j + 2 * t + (i & 1);
      float v = acc[m][j][i];
      if (SILU) v = v / (1.f + __expf(-v)) * acc[ACC - 1][j][i];
      if (n >= a.n_out) continue;
      if (MODE == 2) {
        const int pair = a.sorted_ids[slot];
        if (pair < a.num_pairs) static_cast<float*>(a.out)[pair * a.out_stride + n] = v;
      } else if (MODE == 1 || slot < a.m_rows) {
        static_cast<__nv_bfloat16*>(a.out)[slot * a.out_stride + n] = __float2bfloat16(v);
      }
    }
}

// Persistent CTAs (a grid of at most the resident CTAs) stride over the work items (tile, block)
// of the blocks in use, their count read on the device: no CTA is launched for an unused block
// (a decode step's grid was mostly those), and the CTAs' items differ by one at most.
template <int NT, bool SILU, int MODE>
__global__ void __launch_bounds__(kWarps * 32, Stage<NT, SILU>::kCtas)
    int4_gemm_kernel(const Int4GemmArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int used = MODE == 0 ? a.blocks : min(*a.num_used, a.blocks);
  const int item_tiles = Stage<NT, SILU>::items_per_block(a.out_tiles);
  const int items = used * item_tiles;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    __syncthreads();  // the previous item's partials (over the stages) have been read
    tile_item<NT, SILU, MODE>(a, smem, item % item_tiles, item / item_tiles, warp, lane);
  }
}

template <int NT, bool SILU, int MODE>
void launch(const Int4GemmArgs& a, cudaStream_t stream) {
  constexpr int smem = Stage<NT, SILU>::kSmem;
  auto kernel = int4_gemm_kernel<NT, SILU, MODE>;
  // per device (up to 64): the shared-memory limit raised, and the resident CTAs of the GPU
  static std::atomic<int> resident[64] = {};
  int device = 0;
  cudaGetDevice(&device);
  std::atomic<int>& slots = resident[device & 63];
  if (slots.load() == 0) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int per_sm = 0, sms = 0;
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, smem);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) throw std::runtime_error(std::string("int4_gemm_cuda setup: ") + cudaGetErrorString(err));
    slots.store(std::max(1, per_sm * sms));
  }
  const int64_t items = static_cast<int64_t>(a.blocks) * Stage<NT, SILU>::items_per_block(a.out_tiles);  // at most
  const int grid = static_cast<int>(std::min<int64_t>(items, slots.load()));
  kernel<<<grid, kWarps * 32, smem, stream>>>(a);
}

template <int NT>
void launch_nt(const Int4GemmArgs& a, cudaStream_t stream) {
  if (a.silu && a.mode == 0) return launch<NT, true, 0>(a, stream);
  if (a.silu && a.mode == 1) return launch<NT, true, 1>(a, stream);
  if (!a.silu && a.mode == 0) return launch<NT, false, 0>(a, stream);
  if (!a.silu && a.mode == 2) return launch<NT, false, 2>(a, stream);
  throw std::runtime_error("int4_gemm_cuda: silu needs mode 0 or 1, no silu mode 0 or 2; got silu " +
                           std::to_string(a.silu) + " mode " + std::to_string(a.mode));
}

}  // namespace

void int4_gemm_cuda(const Int4GemmArgs& a, void* stream_handle) {
  if (a.out_tiles <= 0 || a.blocks <= 0) return;
  if (a.mode != 0 && a.num_used == nullptr) throw std::runtime_error("int4_gemm_cuda: modes 1, 2 need num_used");
  auto stream = static_cast<cudaStream_t>(stream_handle);
  switch (a.tokens_per_block) {
    case 8: launch_nt<1>(a, stream); break;
    case 16: launch_nt<2>(a, stream); break;
    case 32: launch_nt<4>(a, stream); break;
    default:
      throw std::runtime_error("int4_gemm_cuda: tokens_per_block must be 8, 16 or 32, got " +
                               std::to_string(a.tokens_per_block));
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string("int4_gemm_cuda launch: ") + cudaGetErrorString(err));
}

}  // namespace ddtree::moe
