// CPU-only builds: the CUDA entry points say that the kernels were not built.
#ifndef DDTREE_WITH_CUDA
#include <stdexcept>

#include "tree/tree_ops.h"

namespace ddtree::tree {
void build_trees_cuda(const BuildArgs&, const BuildOutputs&, void*) {
  throw std::runtime_error("ddtree._C was built without CUDA kernels (no nvcc at build time)");
}
void build_trees_cuda_warp(const BuildArgs&, const BuildOutputs&, void*) {
  throw std::runtime_error("ddtree._C was built without CUDA kernels (no nvcc at build time)");
}
void accept_cuda(const AcceptArgs&, const AcceptOutputs&, void*) {
  throw std::runtime_error("ddtree._C was built without CUDA kernels (no nvcc at build time)");
}
}  // namespace ddtree::tree
#endif
