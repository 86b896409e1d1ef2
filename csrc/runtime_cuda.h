#pragma once

namespace ddtree {
// Number of visible CUDA devices; 0 without CUDA kernels or without a driver.
int cuda_device_count();
// CUDART_VERSION the kernels were built against (e.g. 13000); 0 without CUDA.
int cuda_runtime_version();
}  // namespace ddtree
