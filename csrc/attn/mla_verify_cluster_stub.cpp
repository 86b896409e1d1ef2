// CPU-only builds: the cluster verify kernel says that it was not built.
#ifndef DDTREE_WITH_CUDA
#include <stdexcept>

#include "attn/mla_verify_cluster.h"

namespace ddtree::attn {
int mla_verify_cluster_max_active(int) {
  throw std::runtime_error("ddtree._C was built without CUDA kernels (no nvcc at build time)");
}
void mla_verify_cluster(const VerifyClusterArgs&, void*) {
  throw std::runtime_error("ddtree._C was built without CUDA kernels (no nvcc at build time)");
}
}  // namespace ddtree::attn
#endif
