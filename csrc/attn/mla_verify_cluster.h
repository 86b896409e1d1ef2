// Tree-verify MLA attention on Hopper thread-block clusters (C 512, R 64, bf16): the CTAs of a
// cluster share one row block and split its KV range; their partial outputs are reduced over
// distributed shared memory, so only one fp32 partial per cluster reaches global memory (and the
// merge launch), instead of one per CTA.
// services/ddtree/kernels/mla_verify_cluster.py validates every argument before the launch.
#pragma once
#include <cstdint>

namespace ddtree::attn {

struct VerifyClusterArgs {
  const void* q_latent;  // bf16 [B*T, H, 512], strides (q_lat_row, q_lat_head, 1)
  const void* q_rope;    // bf16 [B*T, H, 64], strides (q_rope_row, q_rope_head, 1)
  const void* cache;     // bf16 [pages, page_size, 576] with packed pages (row stride cache_row)
  const int32_t* table;  // [B, max_pages], row stride table_row
  const int64_t* prefix;  // [B]
  const uint64_t* mask;  // [B*T, mask_words]: ancestor bitmask of the tree tail
  void* out;              // bf16 [B*T, H, 512], strides (out_row, out_head, 1)
  float* lse;             // [B*T, H], row stride lse_row
  float* o_part;          // fp32 [clusters, B*T*H, 512] when clusters > 1
  float* lse_part;        // fp32 [clusters, B*T*H]
  int64_t q_lat_row, q_lat_head, q_rope_row, q_rope_head, cache_row, table_row;
  int64_t out_row, out_head, lse_row;
  int batch, tokens, heads, mask_words, page_size, max_pages, num_pages;
  int splits;        // CTAs per (request, row block): a multiple of cluster
  int cluster;       // CTAs per cluster: 1, 2, 4 or 8 (trees); 1-16 (decode)
  float scale_log2;  // softmax scale * log2(e)
  bool tail_mask;    // false only in benchmarks: the whole tail visible
};

// How many clusters of `cluster` CTAs the current device runs at once (one CTA per SM; a cluster's
// CTAs share a GPC, so this is below SMs / cluster where GPCs have SM counts it does not divide).
int mla_verify_cluster_max_active(int cluster);

// Launches on `stream` (a cudaStream_t); throws std::runtime_error on a launch failure.
void mla_verify_cluster(const VerifyClusterArgs& args, void* stream);

// Decode and other requests of <= 16 rows (csrc/attn/mla_decode_cluster.cu): the transposed kernel
// (keys as the wgmma M side) with one request's splits in clusters. `args` as above; `splits` CTAs
// per request, a multiple of `cluster` (1-16; above 8 a non-portable size); heads dividing 8 (<= 8
// rows) or 16.
int mla_decode_cluster_max_active(int cluster, int rows_per_request);
void mla_decode_cluster(const VerifyClusterArgs& args, void* stream);

}  // namespace ddtree::attn
