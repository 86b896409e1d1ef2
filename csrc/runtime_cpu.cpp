// CPU-only builds: the CUDA runtime queries answer "nothing here".
#ifndef DDTREE_WITH_CUDA
#include "runtime_cuda.h"

namespace ddtree {
int cuda_device_count() { return 0; }
int cuda_runtime_version() { return 0; }
}  // namespace ddtree
#endif
