// Per-step hand-off helpers of ddtree.transport: one call per step instead of several torch ops.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ddtree {
namespace transport {

// Sum of `nbytes` bytes at `data` as unsigned integers, modulo 2^64 (host memory).
uint64_t byte_sum_cpu(const uint8_t* data, size_t nbytes);

#ifdef DDTREE_WITH_CUDA
// On `stream` of device `device`: wait on `event` (when non-null), then write the byte sum of
// `nbytes` device bytes at `data` into the int64 at `out`. Nothing is synchronized.
void wait_byte_sum_cuda(int device, void* stream, void* event, const uint8_t* data, size_t nbytes,
                        uint64_t* out);
// cudaEventRecord(event, stream) on device `device`.
void record_event_cuda(int device, void* stream, void* event);
// cudaStreamWaitEvent(stream, event) on device `device`.
void wait_event_cuda(int device, void* stream, void* event);
#endif

}  // namespace transport
}  // namespace ddtree
