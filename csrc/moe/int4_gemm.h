// INT4 W4A16 GEMMs on the tensor cores (mma.sync m16n8k16, bf16 x int4 -> fp32), dense or for
// the sorted blocks of a fused MoE step. The weight layout (ddtree.models.quant.int4_to_mma) puts
// each lane's A fragments of four 16x16 tiles in one 16-byte word group, so a K chunk of 64
// columns is one coalesced 512-byte load per warp and no shuffle. Pointers come from the Python
// layer (ddtree.kernels.int4_moe), which validated shapes, dtypes, devices and alignment.
#pragma once
#include <cstdint>

namespace ddtree::moe {

struct Int4GemmArgs {
  const void* x;                // bf16 activations, rows of k columns, row stride x_stride
  const int32_t* words;         // [E, n_tiles, k_chunks, 32 lanes, 4] (int4_to_mma)
  const void* scales;           // bf16 [E, n_tiles, k_chunks, 8, 2, 2] (int4_to_mma)
  void* out;                    // mode 0/1: bf16 [rows, out_stride]; mode 2: fp32 [num_pairs, out_stride]
  const int32_t* sorted_ids;    // modes 1, 2: [blocks * tokens_per_block] pair ids (sentinel num_pairs)
  const int32_t* block_expert;  // modes 1, 2: [blocks] local expert, -1 unused
  const int32_t* num_used;      // modes 1, 2: [1] blocks in use (they come first)
  int64_t x_stride, out_stride;
  int n_out;      // output columns (silu: the gate's rows; up's tiles follow the gate's)
  int out_tiles;  // 16-column output tiles; silu: up tile = tile + out_tiles
  int n_tiles;    // 16-row tiles of one expert's weight (silu: 2 * out_tiles)
  int k;          // activation columns (a multiple of 8)
  int k_chunks;   // 64-column chunks of the weight (ceil(k / 64))
  int blocks;     // row blocks (at most; modes 1, 2: num_used of them are in use)
  int m_rows;     // mode 0: activation rows
  int num_pairs, topk;  // modes 1, 2
  int mode;       // 0: dense rows; 1: gather rows pair / topk, write sorted rows; 2: sorted rows in, write pair rows
  int silu;       // out = silu(x Wg^T) * (x Wu^T)
  int tokens_per_block;  // 8, 16 or 32
};

// Asynchronous on `stream` (a cudaStream_t), no host sync, graph capturable; throws
// std::runtime_error for an unsupported combination or a failed launch.
void int4_gemm_cuda(const Int4GemmArgs& args, void* stream);

}  // namespace ddtree::moe
