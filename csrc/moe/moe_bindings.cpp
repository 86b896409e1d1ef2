// Python binding of the INT4 tensor-core GEMM. Tensors travel as raw addresses
// (tensor.data_ptr()) so the extension does not link libtorch; ddtree.kernels.int4_moe validates
// everything before calling.
#include <cstdint>

#include <pybind11/pybind11.h>

#include "moe/int4_gemm.h"
#include "registry.h"

namespace py = pybind11;

namespace ddtree {

void register_moe(py::module_& m) {
  m.def(
      "int4_gemm_cuda",
      [](uintptr_t x, uintptr_t words, uintptr_t scales, uintptr_t out, uintptr_t sorted_ids,
         uintptr_t block_expert, uintptr_t num_used,
         int64_t x_stride, int64_t out_stride, int n_out, int out_tiles, int n_tiles, int k,
         int k_chunks, int blocks, int m_rows, int num_pairs, int topk, int mode, bool silu,
         int tokens_per_block, uintptr_t stream) {
        moe::Int4GemmArgs a{};
        a.x = reinterpret_cast<const void*>(x);
        a.words = reinterpret_cast<const int32_t*>(words);
        a.scales = reinterpret_cast<const void*>(scales);
        a.out = reinterpret_cast<void*>(out);
        a.sorted_ids = reinterpret_cast<const int32_t*>(sorted_ids);
        a.block_expert = reinterpret_cast<const int32_t*>(block_expert);
        a.num_used = reinterpret_cast<const int32_t*>(num_used);
        a.x_stride = x_stride;
        a.out_stride = out_stride;
        a.n_out = n_out;
        a.out_tiles = out_tiles;
        a.n_tiles = n_tiles;
        a.k = k;
        a.k_chunks = k_chunks;
        a.blocks = blocks;
        a.m_rows = m_rows;
        a.num_pairs = num_pairs;
        a.topk = topk;
        a.mode = mode;
        a.silu = silu ? 1 : 0;
        a.tokens_per_block = tokens_per_block;
        py::gil_scoped_release release;
        moe::int4_gemm_cuda(a, reinterpret_cast<void*>(stream));
      },
      "INT4 W4A16 GEMM on the tensor cores over int4_to_mma's layout (addresses of validated "
      "tensors; mode 0 dense, 1 MoE gate|up gather, 2 MoE down scatter).",
      py::arg("x"), py::arg("words"), py::arg("scales"), py::arg("out"), py::arg("sorted_ids"),
      py::arg("block_expert"), py::arg("num_used"),
      py::arg("x_stride"), py::arg("out_stride"), py::arg("n_out"), py::arg("out_tiles"),
      py::arg("n_tiles"), py::arg("k"), py::arg("k_chunks"), py::arg("blocks"), py::arg("m_rows"),
      py::arg("num_pairs"), py::arg("topk"), py::arg("mode"), py::arg("silu"), py::arg("tokens_per_block"),
      py::arg("stream"));
}

}  // namespace ddtree
