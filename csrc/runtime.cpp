// Build and device facts of the extension, so Python can say what it runs on.
#include <string>

#include <pybind11/pybind11.h>

#include "registry.h"
#include "runtime_cuda.h"

namespace ddtree {

void register_runtime(pybind11::module_& m) {
  m.def("cuda_device_count", &cuda_device_count,
        "CUDA devices visible to the extension's runtime (0 when CUDA kernels were not built "
        "or no driver is present)");
  m.def("build_info", []() {
    pybind11::dict info;
#ifdef DDTREE_WITH_CUDA
    info["cuda"] = true;
    info["cuda_runtime_version"] = cuda_runtime_version();
#else
    info["cuda"] = false;
    info["cuda_runtime_version"] = 0;
#endif
    info["cxx_standard"] = static_cast<long>(__cplusplus);
    return info;
  });
}

}  // namespace ddtree
