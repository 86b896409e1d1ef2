// CUDA runtime queries, compiled only when nvcc is found.
#include <cuda_runtime.h>

#include "runtime_cuda.h"

namespace ddtree {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

int cuda_runtime_version() { return CUDART_VERSION; }

}  // namespace ddtree
