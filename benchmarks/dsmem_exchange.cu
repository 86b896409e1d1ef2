// How fast the CTAs of a thread-block cluster exchange data over distributed shared memory: the
// reduction at the end of the cluster kernels (csrc/attn/mla_decode_cluster.cu, mla_verify_cluster.cu),
// where each of C CTAs owns 1/C of a staged fp32 output and sums that slice over all C CTAs.
// Three ways, each from the cluster barrier to the slice summed (globaltimer, per CTA):
//   pull:    every thread loads 16 bytes of the slice from each CTA (ld.shared::cluster.v4), one
//            such round at a time (as many loads in flight as CTAs);
//   pull x4: the same with four rounds' loads issued before any is used;
//   push:    one thread per CTA sends each peer its slice by a bulk copy (cp.async.bulk
//            shared::cta -> shared::cluster, completing on the receiver's mbarrier); the receiver
//            sums from its own shared memory.
// The three sums must agree (checked). Run through benchmarks/dsmem_exchange.sh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "attn/sm90.cuh"

using namespace ddtree::attn::sm90;

namespace {

constexpr int kThreads = 160;  // the decode kernel's: a warpgroup and a producer warp
enum Mode { kPull = 0, kPull4 = 1, kPush = 2 };
const char* kModeNames[] = {"pull", "pull x4", "push"};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// kBytes of staged output per CTA; the slice a CTA owns (and sends each peer) is kBytes / C.
template <int C, int kBytes, int kMode>
__global__ void __launch_bounds__(kThreads, 1) exchange(float* sums, unsigned long long* ns) {
  extern __shared__ __align__(1024) uint8_t smem[];
  constexpr int kSlice = kBytes / C / 16 * 16, kSliceFloats = kSlice / 4;
  float* staged = reinterpret_cast<float*>(smem);           // [C slices]: slice j is peer j's
  float* received = reinterpret_cast<float*>(smem + kBytes);  // [C slices]: slice j from CTA j (push)
  const uint32_t bar = smem_addr(smem + 2 * kBytes);
  const int tid = threadIdx.x, rank = static_cast<int>(cluster_rank());
  for (int i = tid; i < kBytes / 4; i += kThreads) staged[i] = static_cast<float>(i % 977 + rank);
  if (tid == 0) {
    bar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  fence_proxy_async();  // the bulk copies read `staged` through the async proxy
  __syncthreads();
  if (kMode == kPush && tid == 0) bar_expect(bar, (C - 1) * kSlice);
  cluster_sync();
  const uint64_t t0 = global_ns();
  float sum = 0.f;
  if constexpr (kMode == kPull) {
    const uint32_t own = smem_addr(staged) + rank * kSlice;
    for (int i = tid * 16; i < kSlice; i += kThreads * 16) {
      float4 v[C];
#pragma unroll
      for (int j = 0; j < C; ++j) v[j] = ld_cluster4<C>(peer_addr(own + i, j));
#pragma unroll
      for (int j = 0; j < C; ++j) sum += v[j].x + v[j].y + v[j].z + v[j].w;
    }
  } else if constexpr (kMode == kPull4) {
    const uint32_t own = smem_addr(staged) + rank * kSlice;
    constexpr int kRound = kThreads * 16;
    for (int i0 = tid * 16; i0 < kSlice; i0 += 4 * kRound) {
      float4 v[4][C];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < C; ++j)
          if (i0 + u * kRound < kSlice) v[u][j] = ld_cluster4<C>(peer_addr(own + i0 + u * kRound, j));
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < C; ++j)
          if (i0 + u * kRound < kSlice) sum += v[u][j].x + v[u][j].y + v[u][j].z + v[u][j].w;
    }
  } else {
    if (tid == 0)
      for (int j = 0; j < C; ++j)
        if (j != rank)
          asm volatile(
              "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                  peer_addr(smem_addr(received) + rank * kSlice, j)),
              "r"(smem_addr(staged) + j * kSlice), "r"(kSlice), "r"(peer_addr(bar, j))
              : "memory");
    bar_wait(bar, 0);
    for (int i = tid * 4; i < kSliceFloats; i += kThreads * 4)
#pragma unroll
      for (int j = 0; j < C; ++j) {
        const float* src = j == rank ? staged + rank * kSliceFloats : received + j * kSliceFloats;
        const float4 v = *reinterpret_cast<const float4*>(src + i);
        sum += v.x + v.y + v.z + v.w;
      }
  }
  __syncthreads();
  const uint64_t t1 = global_ns();
  cluster_sync();  // no CTA leaves while a peer still reads its shared memory
  sums[blockIdx.x * kThreads + tid] = sum;
  if (tid == 0) ns[blockIdx.x] = t1 - t0;
}

// Median over 25 launches (after 5 warm-up ones) of the CTAs' median and maximum exchange time, us;
// `total` the sum of every thread's sum. CUDA errors throw (sm90.cuh's check).
template <int C, int kBytes, int kMode>
void measure(int ctas, double* median_us, double* max_us, double* total) {
  auto kernel = exchange<C, kBytes, kMode>;
  ClusterLaunch l(kernel, C, dim3(ctas), kThreads, 2 * kBytes + 1024, nullptr);
  float* sums;
  unsigned long long* ns;
  check(cudaMalloc(&sums, ctas * kThreads * sizeof(float)), "malloc");
  check(cudaMalloc(&ns, ctas * 8), "malloc");
  std::vector<double> medians, maxima;
  std::vector<unsigned long long> host(ctas);
  for (int launch = 0; launch < 30; ++launch) {
    check(cudaLaunchKernelEx(&l.cfg, kernel, sums, ns), "launch");
    check(cudaDeviceSynchronize(), "run");
    check(cudaMemcpy(host.data(), ns, ctas * 8, cudaMemcpyDeviceToHost), "copy");
    std::sort(host.begin(), host.end());
    if (launch >= 5) medians.push_back(host[ctas / 2] * 1e-3), maxima.push_back(host.back() * 1e-3);
  }
  std::sort(medians.begin(), medians.end());
  std::sort(maxima.begin(), maxima.end());
  *median_us = medians[medians.size() / 2], *max_us = maxima[maxima.size() / 2];
  std::vector<float> h(ctas * kThreads);
  check(cudaMemcpy(h.data(), sums, h.size() * sizeof(float), cudaMemcpyDeviceToHost), "copy");
  *total = 0;
  for (float v : h) *total += v;
  cudaFree(sums);
  cudaFree(ns);
}

template <int C, int kBytes>
bool row(int ctas) {
  double med[3], mx[3], total[3];
  measure<C, kBytes, kPull>(ctas, &med[0], &mx[0], &total[0]);
  measure<C, kBytes, kPull4>(ctas, &med[1], &mx[1], &total[1]);
  measure<C, kBytes, kPush>(ctas, &med[2], &mx[2], &total[2]);
  const double remote_kb = (C - 1) * (kBytes / C / 16 * 16) / 1024.0;  // what a CTA takes from its peers
  printf("cluster %2d x %3d CTAs, %2d KB staged a CTA (%4.1f KB from peers):", C, ctas / C, kBytes / 1024, remote_kb);
  for (int m = 0; m < 3; ++m)
    printf(" | %s %.2f us (max %.2f), %.1f GB/s", kModeNames[m], med[m], mx[m], remote_kb * 1.024 / med[m]);
  const bool agree = total[0] == total[1] && std::fabs(total[0] - total[2]) <= 1e-6 * std::fabs(total[0]);
  printf("%s\n", agree ? "" : " | SUMS DIFFER");
  return agree;
}

}  // namespace

int main() {
  printf("# per-CTA time from the cluster barrier to its slice summed; GB/s: bytes from peers / median time\n");
  bool good = true;
  try {
    // The decode kernel's shapes: 16 query columns (32 KB staged) or 8 (16 KB) in clusters of 2, 6,
    // 9, 16; alone (one cluster) and filling the device as the batch does.
    good &= row<2, 32768>(128) && row<2, 32768>(2) && row<2, 16384>(128);
    good &= row<6, 16384>(96) && row<6, 16384>(6);
    good &= row<9, 16384>(126) && row<9, 16384>(9);
    good &= row<16, 16384>(16);
  } catch (const std::exception& e) {
    fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return good ? 0 : 1;
}
