// CUDA side of the transport hand-off helpers: the consumer's "wait on the producer's IPC event,
// then read every byte" as one host call (cudaStreamWaitEvent + one reduction kernel; over 2 MiB a
// memset of the cell first), and the producer's event record / the consumer's event wait.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "transport_ops.h"

namespace ddtree {
namespace transport {
namespace {

constexpr int kThreads = 256;           // multi-block launch: per-block sums added atomically
constexpr int kMaxBlocks = 1024;
constexpr int kSingleThreads = 1024;     // up to kSingleMax bytes: one block writes the sum itself
constexpr size_t kSingleMax = 2u << 20;  // (no memset, no atomics: one launch per step)

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error
    throw std::runtime_error(std::string("ddtree transport ") + what + " failed: " +
                             cudaGetErrorString(err));
  }
}

// Makes `device` current for the scope (only when it is not already).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

__device__ __forceinline__ unsigned int bytes_of(unsigned int w) { return __vsadu4(w, 0u); }

// Sum of n bytes at p: a head up to 16-byte alignment and a tail byte by byte (block 0), the
// aligned middle 16 bytes per load (grid-stride). kDirect (a single block): the block stores the
// sum; otherwise per-block sums are added atomically to *out (zeroed before, same stream).
template <int kBlock, bool kDirect>
__global__ void __launch_bounds__(kBlock) byte_sum_kernel(const uint8_t* __restrict__ p, size_t n,
                                                          unsigned long long* __restrict__ out) {
  const size_t misalign = reinterpret_cast<uintptr_t>(p) & 15;
  const size_t head = misalign == 0 ? 0 : (16 - misalign < n ? 16 - misalign : n);
  const size_t vecs = (n - head) / 16;
  const size_t tail_start = head + vecs * 16;
  unsigned long long acc = 0;
  if (blockIdx.x == 0) {
    if (threadIdx.x < head) acc += p[threadIdx.x];
    if (tail_start + threadIdx.x < n) acc += p[tail_start + threadIdx.x];  // tail < 16 bytes
  }
  const uint4* v = reinterpret_cast<const uint4*>(p + head);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 x = __ldg(v + i);
    acc += bytes_of(x.x) + bytes_of(x.y) + bytes_of(x.z) + bytes_of(x.w);
  }
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  __shared__ unsigned long long warp_sums[kBlock / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kBlock / 32 ? warp_sums[lane] : 0;
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (lane == 0) {
      if (kDirect) {
        *out = acc;
      } else if (acc != 0) {
        atomicAdd(out, acc);
      }
    }
  }
}

}  // namespace

void wait_byte_sum_cuda(int device, void* stream, void* event, const uint8_t* data, size_t nbytes,
                        uint64_t* out) {
  DeviceScope scope(device);
  auto s = static_cast<cudaStream_t>(stream);
  if (event != nullptr) check(cudaStreamWaitEvent(s, static_cast<cudaEvent_t>(event), 0), "cudaStreamWaitEvent");
  auto* sum = reinterpret_cast<unsigned long long*>(out);
  if (nbytes <= kSingleMax) {
    byte_sum_kernel<kSingleThreads, true><<<1, kSingleThreads, 0, s>>>(data, nbytes, sum);
  } else {
    check(cudaMemsetAsync(out, 0, sizeof(uint64_t), s), "cudaMemsetAsync");
    const size_t vecs = nbytes / 16 + 1;
    size_t blocks = (vecs + kThreads - 1) / kThreads;
    if (blocks > kMaxBlocks) blocks = kMaxBlocks;
    byte_sum_kernel<kThreads, false><<<static_cast<unsigned int>(blocks), kThreads, 0, s>>>(data, nbytes, sum);
  }
  check(cudaGetLastError(), "byte sum kernel launch");
}

void record_event_cuda(int device, void* stream, void* event) {
  DeviceScope scope(device);
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)), "cudaEventRecord");
}

void wait_event_cuda(int device, void* stream, void* event) {
  DeviceScope scope(device);
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
}

}  // namespace transport
}  // namespace ddtree
