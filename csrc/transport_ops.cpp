// Bindings of the transport hand-off helpers (csrc/transport_ops.h). Tensors, streams and events
// travel as raw addresses (data_ptr(), cuda_stream / _cuda_getCurrentRawStream, Event.cuda_event):
// ddtree.transport validates everything before calling. The GIL is kept: each call takes a few
// microseconds of host time, and handing the GIL to another thread in the middle of a step costs
// more than that.
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include <pybind11/pybind11.h>

#include "registry.h"
#include "transport_ops.h"

namespace py = pybind11;

namespace ddtree {
namespace transport {

uint64_t byte_sum_cpu(const uint8_t* data, size_t nbytes) {
  // 8 bytes per step into 16-bit lanes (even and odd bytes apart): a lane gains at most 255 per
  // word, so blocks of 256 words keep every lane exact; each block is folded into the total.
  constexpr size_t kBlockWords = 256;
  constexpr uint64_t kEven = 0x00ff00ff00ff00ffULL;
  uint64_t total = 0;
  size_t i = 0;
  while (nbytes - i >= 8) {
    size_t words = (nbytes - i) / 8;
    if (words > kBlockWords) words = kBlockWords;
    uint64_t even = 0, odd = 0;
    for (size_t w = 0; w < words; ++w) {
      uint64_t v;
      std::memcpy(&v, data + i + 8 * w, 8);
      even += v & kEven;
      odd += (v >> 8) & kEven;
    }
    i += 8 * words;
    for (int lane = 0; lane < 4; ++lane) {
      total += ((even >> (16 * lane)) & 0xffff) + ((odd >> (16 * lane)) & 0xffff);
    }
  }
  for (; i < nbytes; ++i) total += data[i];
  return total;
}

}  // namespace transport

void register_transport(py::module_& m) {
  m.def(
      "transport_byte_sum_cpu",
      [](uintptr_t data, size_t nbytes, uintptr_t out) {
        *reinterpret_cast<uint64_t*>(out) =
            transport::byte_sum_cpu(reinterpret_cast<const uint8_t*>(data), nbytes);
      },
      "Writes the byte sum (unsigned, mod 2^64) of nbytes host bytes at `data` into the int64 at "
      "`out`.",
      py::arg("data"), py::arg("nbytes"), py::arg("out"));
#ifdef DDTREE_WITH_CUDA
  m.def(
      "transport_wait_byte_sum_cuda",
      [](int device, uintptr_t stream, uintptr_t event, uintptr_t data, size_t nbytes,
         uintptr_t out) {
        transport::wait_byte_sum_cuda(device, reinterpret_cast<void*>(stream),
                                      reinterpret_cast<void*>(event),
                                      reinterpret_cast<const uint8_t*>(data), nbytes,
                                      reinterpret_cast<uint64_t*>(out));
      },
      "On `stream` of `device`: wait on `event` (0: none), then write the byte sum (unsigned, "
      "mod 2^64) of nbytes device bytes at `data` into the int64 at `out`. Asynchronous.",
      py::arg("device"), py::arg("stream"), py::arg("event"), py::arg("data"), py::arg("nbytes"),
      py::arg("out"));
  m.def(
      "transport_record_event_cuda",
      [](int device, uintptr_t stream, uintptr_t event) {
        transport::record_event_cuda(device, reinterpret_cast<void*>(stream),
                                     reinterpret_cast<void*>(event));
      },
      "cudaEventRecord(event, stream) on `device`.", py::arg("device"), py::arg("stream"),
      py::arg("event"));
  m.def(
      "transport_wait_event_cuda",
      [](int device, uintptr_t stream, uintptr_t event) {
        transport::wait_event_cuda(device, reinterpret_cast<void*>(stream),
                                   reinterpret_cast<void*>(event));
      },
      "cudaStreamWaitEvent(stream, event) on `device`: work queued later on `stream` runs after "
      "the event's recorded work.",
      py::arg("device"), py::arg("stream"), py::arg("event"));
#endif
}

}  // namespace ddtree
