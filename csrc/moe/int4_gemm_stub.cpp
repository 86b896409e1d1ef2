// CPU-only builds: the CUDA entry point says that the kernels were not built.
#ifndef DDTREE_WITH_CUDA
#include <stdexcept>

#include "moe/int4_gemm.h"

namespace ddtree::moe {
void int4_gemm_cuda(const Int4GemmArgs&, void*) {
  throw std::runtime_error("ddtree._C was built without CUDA kernels (no nvcc at build time)");
}
}  // namespace ddtree::moe
#endif
