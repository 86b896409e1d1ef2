// CPU-only builds: the cluster attention kernels say that they were not built.
#ifndef DDTREE_WITH_CUDA
#include <stdexcept>

#include "attn/mla_verify_cluster.h"

namespace ddtree::attn {
namespace {
[[noreturn]] void not_built() {
  throw std::runtime_error("ddtree._C was built without CUDA kernels (no nvcc at build time)");
}
}  // namespace
int mla_verify_cluster_max_active(int) { not_built(); }
void mla_verify_cluster(const VerifyClusterArgs&, void*) { not_built(); }
int mla_decode_cluster_max_active(int, int) { not_built(); }
void mla_decode_cluster(const VerifyClusterArgs&, void*) { not_built(); }
}  // namespace ddtree::attn
#endif
