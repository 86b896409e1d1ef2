// Python bindings of the cluster verify-attention kernels (trees: mla_verify_cluster; <= 16 rows
// per request: mla_decode_cluster). Tensors travel as raw addresses;
// services/ddtree/kernels/mla_verify_cluster.py and mla_decode_cluster.py validate every argument
// before calling.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "attn/mla_verify_cluster.h"
#include "registry.h"

namespace py = pybind11;

namespace ddtree {
namespace {

attn::VerifyClusterArgs make_args(uintptr_t q_latent, uintptr_t q_rope, uintptr_t cache, uintptr_t table,
                                  uintptr_t prefix, uintptr_t mask, uintptr_t out, uintptr_t lse, uintptr_t o_part,
                                  uintptr_t lse_part, const py::tuple& strides, int batch,
                                  int tokens, int heads, int mask_words, int page_size, int max_pages, int num_pages,
                                  int splits, int cluster, float scale_log2, bool tail_mask) {
  if (strides.size() != 9) throw py::value_error("strides: 9 integers expected");
  attn::VerifyClusterArgs a{};
  a.q_latent = reinterpret_cast<const void*>(q_latent);
  a.q_rope = reinterpret_cast<const void*>(q_rope);
  a.cache = reinterpret_cast<const void*>(cache);
  a.table = reinterpret_cast<const int32_t*>(table);
  a.prefix = reinterpret_cast<const int64_t*>(prefix);
  a.mask = reinterpret_cast<const uint64_t*>(mask);
  a.out = reinterpret_cast<void*>(out);
  a.lse = reinterpret_cast<float*>(lse);
  a.o_part = reinterpret_cast<float*>(o_part);
  a.lse_part = reinterpret_cast<float*>(lse_part);
  int64_t* fields[9] = {&a.q_lat_row, &a.q_lat_head, &a.q_rope_row, &a.q_rope_head, &a.cache_row,
                        &a.table_row, &a.out_row,    &a.out_head,   &a.lse_row};
  for (int i = 0; i < 9; ++i) *fields[i] = strides[i].cast<int64_t>();
  a.batch = batch, a.tokens = tokens, a.heads = heads, a.mask_words = mask_words;
  a.page_size = page_size, a.max_pages = max_pages, a.num_pages = num_pages;
  a.splits = splits, a.cluster = cluster, a.scale_log2 = scale_log2, a.tail_mask = tail_mask;
  return a;
}

// Binds `name`, a launch of `kernel` taking make_args' arguments plus the stream.
template <void (*kernel)(const attn::VerifyClusterArgs&, void*)>
void def_launch(py::module_& m, const char* name, const char* doc) {
  m.def(
      name,
      [](uintptr_t q_latent, uintptr_t q_rope, uintptr_t cache, uintptr_t table, uintptr_t prefix, uintptr_t mask,
         uintptr_t out, uintptr_t lse, uintptr_t o_part, uintptr_t lse_part, py::tuple strides,
         int batch, int tokens, int heads, int mask_words, int page_size, int max_pages, int num_pages, int splits,
         int cluster, float scale_log2, bool tail_mask, uintptr_t stream) {
        const attn::VerifyClusterArgs a =
            make_args(q_latent, q_rope, cache, table, prefix, mask, out, lse, o_part, lse_part, strides,
                      batch, tokens, heads, mask_words, page_size, max_pages, num_pages, splits, cluster,
                      scale_log2, tail_mask);
        py::gil_scoped_release release;
        kernel(a, reinterpret_cast<void*>(stream));
      },
      doc, py::arg("q_latent"), py::arg("q_rope"), py::arg("cache"), py::arg("table"), py::arg("prefix"),
      py::arg("mask"), py::arg("out"), py::arg("lse"), py::arg("o_part"), py::arg("lse_part"),
      py::arg("strides"), py::arg("batch"), py::arg("tokens"), py::arg("heads"), py::arg("mask_words"),
      py::arg("page_size"), py::arg("max_pages"), py::arg("num_pages"), py::arg("splits"), py::arg("cluster"),
      py::arg("scale_log2"), py::arg("tail_mask"), py::arg("stream"));
}

}  // namespace

void register_attn(py::module_& m) {
  m.def(
      "mla_verify_cluster_max_active",
      [](int cluster) { return attn::mla_verify_cluster_max_active(cluster); },
      "Clusters of `cluster` CTAs of the verify kernel that the current device runs at once.",
      py::arg("cluster"));
  m.def(
      "mla_decode_cluster_max_active",
      [](int cluster, int rows_per_request) { return attn::mla_decode_cluster_max_active(cluster, rows_per_request); },
      "Clusters of `cluster` CTAs of the decode kernel (for this many rows per request) that the current device "
      "runs at once.",
      py::arg("cluster"), py::arg("rows_per_request"));
  def_launch<attn::mla_verify_cluster>(
      m, "mla_verify_cluster",
      "Tree-verify MLA attention on thread-block clusters (sm_90a; addresses of tensors that "
      "ddtree.kernels.mla_verify_cluster checked). strides: q_latent row/head, q_rope row/head, "
      "cache row, table row, out row/head, lse row (elements).");
  def_launch<attn::mla_decode_cluster>(
      m, "mla_decode_cluster",
      "Verify attention for <= 16 rows per request on thread-block clusters (sm_90a; addresses of tensors that "
      "ddtree.kernels.mla_decode_cluster checked). strides as mla_verify_cluster's.");
}

}  // namespace ddtree
