// Entry point of the extension ddtree._C: each kernel family registers its functions here.
#include <pybind11/pybind11.h>

#include "registry.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "ddtree-serve native kernels (C++ always, CUDA when built with nvcc)";
#ifdef DDTREE_WITH_CUDA
  m.attr("CUDA_BUILT") = true;
#else
  m.attr("CUDA_BUILT") = false;
#endif
  ddtree::register_runtime(m);
  ddtree::register_tree(m);
  ddtree::register_transport(m);
  ddtree::register_moe(m);
}
