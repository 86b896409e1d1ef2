// Python bindings of the tree kernels. Tensors travel as raw addresses (tensor.data_ptr()) so
// the extension does not link libtorch; ddtree.tree validates everything before calling.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "registry.h"
#include "tree/tree_common.h"
#include "tree/tree_ops.h"

namespace py = pybind11;

namespace ddtree {
namespace {

template <typename T>
T* as_ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

tree::BuildArgs build_args(uintptr_t logprobs, uintptr_t ids, uintptr_t budgets, int batch,
                           int depth, int topk, int max_budget) {
  return {as_ptr<const float>(logprobs), as_ptr<const int32_t>(ids),
          as_ptr<const int32_t>(budgets), batch, depth, topk, max_budget};
}

tree::BuildOutputs build_outputs(uintptr_t tokens, uintptr_t depths, uintptr_t parents,
                                 uintptr_t num_nodes, uintptr_t mask, uintptr_t status) {
  return {as_ptr<int32_t>(tokens),    as_ptr<int32_t>(depths), as_ptr<int32_t>(parents),
          as_ptr<int32_t>(num_nodes), as_ptr<uint64_t>(mask),  as_ptr<int32_t>(status)};
}

tree::AcceptArgs accept_args(uintptr_t tokens, uintptr_t parents, uintptr_t num_nodes,
                             uintptr_t posterior, int batch, int max_budget, int max_depth) {
  return {as_ptr<const int32_t>(tokens), as_ptr<const int32_t>(parents),
          as_ptr<const int32_t>(num_nodes), as_ptr<const int32_t>(posterior), batch,
          max_budget, max_depth};
}

tree::AcceptOutputs accept_outputs(uintptr_t path, uintptr_t length, uintptr_t bonus,
                                   uintptr_t keep, uintptr_t status) {
  return {as_ptr<int32_t>(path), as_ptr<int32_t>(length), as_ptr<int32_t>(bonus),
          as_ptr<int32_t>(keep), as_ptr<int32_t>(status)};
}

using CudaBuild = void (*)(const tree::BuildArgs&, const tree::BuildOutputs&, void*);

// The two CUDA build kernels share one signature: (inputs, outputs, stream address).
void def_cuda_build(py::module_& m, const char* name, CudaBuild build, const char* doc) {
  m.def(
      name,
      [build](uintptr_t logprobs, uintptr_t ids, uintptr_t budgets, int batch, int depth, int topk,
              int max_budget, uintptr_t tokens, uintptr_t depths, uintptr_t parents,
              uintptr_t num_nodes, uintptr_t mask, uintptr_t status, uintptr_t stream) {
        py::gil_scoped_release release;
        build(build_args(logprobs, ids, budgets, batch, depth, topk, max_budget),
              build_outputs(tokens, depths, parents, num_nodes, mask, status),
              reinterpret_cast<void*>(stream));
      },
      doc, py::arg("logprobs"), py::arg("ids"), py::arg("budgets"), py::arg("batch"),
      py::arg("depth"), py::arg("topk"), py::arg("max_budget"), py::arg("tokens"),
      py::arg("depths"), py::arg("parents"), py::arg("num_nodes"), py::arg("mask"),
      py::arg("status"), py::arg("stream"));
}

}  // namespace

void register_tree(py::module_& m) {
  const char* build_doc =
      "Best-first tree build over a batch (addresses of contiguous tensors; budgets = 0 means "
      "every request uses max_budget). Writes tokens/depths/parents/num_nodes/mask/status.";
  const char* build_warp_doc =
      "tree_build_cuda with the previous kernel only (one warp per request, sequential pops); "
      "kept for comparison.";
  const char* accept_doc =
      "Accept walk over a batch of trees (addresses of contiguous int32 tensors). Writes "
      "path/length/bonus/keep/status.";
  m.def(
      "tree_build_cpu",
      [](uintptr_t logprobs, uintptr_t ids, uintptr_t budgets, int batch, int depth, int topk,
         int max_budget, uintptr_t tokens, uintptr_t depths, uintptr_t parents,
         uintptr_t num_nodes, uintptr_t mask, uintptr_t status, int threads) {
        py::gil_scoped_release release;
        tree::build_trees_cpu(build_args(logprobs, ids, budgets, batch, depth, topk, max_budget),
                              build_outputs(tokens, depths, parents, num_nodes, mask, status),
                              threads);
      },
      build_doc, py::arg("logprobs"), py::arg("ids"), py::arg("budgets"), py::arg("batch"),
      py::arg("depth"), py::arg("topk"), py::arg("max_budget"), py::arg("tokens"),
      py::arg("depths"), py::arg("parents"), py::arg("num_nodes"), py::arg("mask"),
      py::arg("status"), py::arg("threads"));
  def_cuda_build(m, "tree_build_cuda", tree::build_trees_cuda, build_doc);
  def_cuda_build(m, "tree_build_cuda_warp", tree::build_trees_cuda_warp, build_warp_doc);
  m.def(
      "tree_accept_cpu",
      [](uintptr_t tokens, uintptr_t parents, uintptr_t num_nodes, uintptr_t posterior,
         int batch, int max_budget, int max_depth, uintptr_t path, uintptr_t length,
         uintptr_t bonus, uintptr_t keep, uintptr_t status, int threads) {
        py::gil_scoped_release release;
        tree::accept_cpu(
            accept_args(tokens, parents, num_nodes, posterior, batch, max_budget, max_depth),
            accept_outputs(path, length, bonus, keep, status), threads);
      },
      accept_doc, py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"),
      py::arg("posterior"), py::arg("batch"), py::arg("max_budget"), py::arg("max_depth"),
      py::arg("path"), py::arg("length"), py::arg("bonus"), py::arg("keep"), py::arg("status"),
      py::arg("threads"));
  m.def(
      "tree_accept_cuda",
      [](uintptr_t tokens, uintptr_t parents, uintptr_t num_nodes, uintptr_t posterior,
         int batch, int max_budget, int max_depth, uintptr_t path, uintptr_t length,
         uintptr_t bonus, uintptr_t keep, uintptr_t status, uintptr_t stream) {
        py::gil_scoped_release release;
        tree::accept_cuda(
            accept_args(tokens, parents, num_nodes, posterior, batch, max_budget, max_depth),
            accept_outputs(path, length, bonus, keep, status), reinterpret_cast<void*>(stream));
      },
      accept_doc, py::arg("tokens"), py::arg("parents"), py::arg("num_nodes"),
      py::arg("posterior"), py::arg("batch"), py::arg("max_budget"), py::arg("max_depth"),
      py::arg("path"), py::arg("length"), py::arg("bonus"), py::arg("keep"), py::arg("status"),
      py::arg("stream"));
  py::dict limits;
  limits["max_budget"] = tree::kMaxBudget;
  limits["max_depth"] = tree::kMaxDepth;
  limits["max_topk"] = tree::kMaxTopK;
  limits["max_batch"] = tree::kMaxBatch;
  m.attr("TREE_LIMITS") = limits;
}

}  // namespace ddtree
