// Per-phase clock64 timing of the tree build kernels: compiles csrc/tree/tree_cuda.cu with its
// DDTREE_PHASE hooks defined (tid 0 of each block adds the cycles since the previous hook to a
// per-phase counter) and launches the real entry points on a batch read from disk.
// Run through benchmarks/tree_phases.sh.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
__device__ unsigned long long g_phase_cycles[16];
__device__ unsigned long long g_phase_calls[16];
#define DDTREE_PHASE_START() long long ddtree_phase_last_ = clock64()
#define DDTREE_PHASE(i)                                                                  \
  do {                                                                                   \
    const long long t_ = clock64();                                                      \
    if (threadIdx.x == 0) {                                                              \
      atomicAdd(&g_phase_cycles[i], static_cast<unsigned long long>(t_ - ddtree_phase_last_)); \
      atomicAdd(&g_phase_calls[i], 1ull);                                                \
    }                                                                                    \
    ddtree_phase_last_ = t_;                                                             \
  } while (0)
#include "tree/tree_cuda.cu"
using namespace ddtree::tree;
static std::vector<char> slurp(const char* path) {
  FILE* f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", path);
    exit(2);
  }
  fseek(f, 0, SEEK_END);
  const long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  std::vector<char> v(n);
  if (fread(v.data(), 1, n, f) != static_cast<size_t>(n)) exit(2);
  fclose(f);
  return v;
}
template <typename T>
static T* upload(const std::vector<char>& bytes) {
  T* d = nullptr;
  cudaMalloc(&d, bytes.size());
  cudaMemcpy(d, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
  return d;
}

template <typename T>
static T* device_array(long n) {
  T* d = nullptr;
  cudaMalloc(&d, sizeof(T) * n);
  return d;
}

static const char* kPhaseNames[16] = {"stage+checks", "level count+scan", "level write", "rises",
                                      "candidates", "rank (bins|sort)", "verify", "fallback loop", "outputs", "queue pool",
                                      "w:stage", "w:loop", "w:outputs"};

int main(int argc, char** argv) {
  if (argc < 8) {
    fprintf(stderr, "tree_phases LP IDS BATCH D K BUDGET block|warp [ITERS]   (TREE_PHASES_DUMP=FILE: write the trees; TREE_PHASES_CHAINED=N: also time N launches back to back)\n");
    return 2;
  }
  const int batch = atoi(argv[3]), D = atoi(argv[4]), K = atoi(argv[5]), N = atoi(argv[6]);
  const bool block = argv[7][0] == 'b';
  const int iters = argc > 8 ? atoi(argv[8]) : 50;
  const BuildArgs in{upload<float>(slurp(argv[1])), upload<int32_t>(slurp(argv[2])), nullptr, batch, D, K, N};
  const long W = (N + 1 + 63) / 64;
  const BuildOutputs out{device_array<int32_t>(long{batch} * N),       device_array<int32_t>(long{batch} * N),
                         device_array<int32_t>(long{batch} * (N + 1)), device_array<int32_t>(batch),
                         device_array<uint64_t>(batch * (N + 1) * W),  device_array<int32_t>(batch)};
  auto run = [&] {
    if (block) build_trees_cuda(in, out, nullptr);
    else build_trees_cuda_warp(in, out, nullptr);
  };

  for (int i = 0; i < 5; ++i) run();  // warm-up, then count the timed launches only
  cudaDeviceSynchronize();
  const unsigned long long zeros[16] = {};
  cudaMemcpyToSymbol(g_phase_cycles, zeros, sizeof zeros);
  cudaMemcpyToSymbol(g_phase_calls, zeros, sizeof zeros);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> ms(iters);
  for (float& t : ms) {
    cudaEventRecord(start);
    run();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&t, start, stop);
  }
  if (cudaGetLastError() != cudaSuccess) {
    fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  std::sort(ms.begin(), ms.end());
  float chained_us = 0.0f;  // launches back to back between two events: kernel time plus the gap
  if (const char* env = getenv("TREE_PHASES_CHAINED")) {
    const int reps = atoi(env);
    cudaEventRecord(start);
    for (int i = 0; i < reps; ++i) run();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&chained_us, start, stop);
    chained_us *= 1000.0f / reps;
  }

  unsigned long long cycles[16], calls[16];
  cudaMemcpyFromSymbol(cycles, g_phase_cycles, sizeof cycles);
  cudaMemcpyFromSymbol(calls, g_phase_calls, sizeof calls);
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  std::vector<int32_t> nodes(batch), status(batch);
  cudaMemcpy(nodes.data(), out.num_nodes, 4L * batch, cudaMemcpyDeviceToHost);
  cudaMemcpy(status.data(), out.status, 4L * batch, cudaMemcpyDeviceToHost);
  if (const char* dump = getenv("TREE_PHASES_DUMP")) {  // the trees, to compare two builds
    std::vector<int32_t> parents(long{batch} * (N + 1)), tokens(long{batch} * N);
    std::vector<uint64_t> mask(long{batch} * (N + 1) * W);
    cudaMemcpy(parents.data(), out.parents, 4 * parents.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(tokens.data(), out.tokens, 4 * tokens.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(mask.data(), out.mask, 8 * mask.size(), cudaMemcpyDeviceToHost);
    FILE* f = fopen(dump, "wb");
    if (!f) return 2;
    fwrite(nodes.data(), 4, nodes.size(), f);
    fwrite(parents.data(), 4, parents.size(), f);
    fwrite(tokens.data(), 4, tokens.size(), f);
    fwrite(mask.data(), 8, mask.size(), f);
    fclose(f);
  }
  long total_nodes = 0;
  int bad = 0;
  for (int i = 0; i < batch; ++i) {
    total_nodes += nodes[i];
    bad += status[i] != 0;
  }
  printf("%s batch %d D %d K %d budget %d: event median %.1f us (min %.1f); nodes/req %.1f status!=0 %d; "
         "clock %d MHz", block ? "block" : "warp", batch, D, K, N, 1000 * ms[ms.size() / 2], 1000 * ms[0],
         double(total_nodes) / batch, bad, khz / 1000);
  if (chained_us > 0.0f) printf("; chained %.2f us", chained_us);
  printf("\n");
  const double per_request = double(iters) * batch;
  for (int i = 0; i < 16; ++i)
    if (calls[i])
      printf("  phase %2d %-18s %8.0f cycles/req  %6.2f us/req  calls/req %.2f\n", i, kPhaseNames[i],
             cycles[i] / per_request, cycles[i] / per_request / (khz / 1000.0), calls[i] / per_request);
  return 0;
}
