// Batched tree build and accept walk: the C++ (CPU) and CUDA entry points.
//
// All tensors are dense row-major; pointers come from the Python layer (ddtree.tree), which
// validated shapes, dtypes, devices and contiguity. Every output element is written, padding
// included. Per request, `status` gets a tree::Status (0: ok).
#pragma once
#include <cstdint>

namespace ddtree::tree {

// Inputs of a batched build. budgets == nullptr: every request uses max_budget.
struct BuildArgs {
  const float* logprobs;   // [batch, depth, topk]
  const int32_t* ids;      // [batch, depth, topk]
  const int32_t* budgets;  // [batch] or nullptr
  int batch, depth, topk, max_budget;
};

// Outputs, N = max_budget, W = ceil((N + 1) / 64).
struct BuildOutputs {
  int32_t* tokens;     // [batch, N]        -1 padding
  int32_t* depths;     // [batch, N]        0 padding
  int32_t* parents;    // [batch, N + 1]    node 0 and padding -1
  int32_t* num_nodes;  // [batch]
  uint64_t* mask;      // [batch, N + 1, W] ancestor-or-self bits
  int32_t* status;     // [batch]
};

struct AcceptArgs {
  const int32_t* tokens;     // [batch, N]
  const int32_t* parents;    // [batch, N + 1]
  const int32_t* num_nodes;  // [batch]
  const int32_t* posterior;  // [batch, N + 1] target token at each node
  int batch, max_budget, max_depth;
};

struct AcceptOutputs {
  int32_t* path;    // [batch, D + 1] accepted nodes from the root, -1 padding
  int32_t* length;  // [batch] accepted nodes including the root
  int32_t* bonus;   // [batch] posterior token at the last accepted node
  int32_t* keep;    // [batch, D + 1] KV rows to keep (tree node i sits at row i), -1 padding
  int32_t* status;  // [batch]
};

// CPU: requests spread over up to `threads` std::threads.
void build_trees_cpu(const BuildArgs& in, const BuildOutputs& out, int threads);
void accept_cpu(const AcceptArgs& in, const AcceptOutputs& out, int threads);

// CUDA on `stream` (a cudaStream_t); asynchronous, no host sync, graph capturable. Throws
// std::runtime_error when a launch fails. build_trees_cuda: one block per request (parallel
// selection, verified, the warp loop as its fallback; the warp kernel where the block's shared
// memory does not fit). build_trees_cuda_warp: the warp kernel alone (one block of four warps per
// request, warp 0 running the sequential loop).
void build_trees_cuda(const BuildArgs& in, const BuildOutputs& out, void* stream);
void build_trees_cuda_warp(const BuildArgs& in, const BuildOutputs& out, void* stream);
void accept_cuda(const AcceptArgs& in, const AcceptOutputs& out, void* stream);

}  // namespace ddtree::tree
