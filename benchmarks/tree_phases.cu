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
int main(int argc, char** argv) {
  if (argc < 8) { fprintf(stderr, "tree_phases LP IDS BATCH D K BUDGET block|warp [ITERS]\n"); return 2; }
  const int Bt = atoi(argv[3]), D = atoi(argv[4]), K = atoi(argv[5]), N = atoi(argv[6]);
  const bool block = argv[7][0] == 'b';
  const int iters = argc > 8 ? atoi(argv[8]) : 50;
  auto lp = slurp(argv[1]), ids = slurp(argv[2]);
  float* d_lp; int32_t* d_ids;
  cudaMalloc(&d_lp, lp.size()); cudaMalloc(&d_ids, ids.size());
  cudaMemcpy(d_lp, lp.data(), lp.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_ids, ids.data(), ids.size(), cudaMemcpyHostToDevice);
  const int W = (N + 1 + 63) / 64;
  BuildArgs in{d_lp, d_ids, nullptr, Bt, D, K, N};
  BuildOutputs out{};
  cudaMalloc(&out.tokens, 4L * Bt * N); cudaMalloc(&out.depths, 4L * Bt * N);
  cudaMalloc(&out.parents, 4L * Bt * (N + 1)); cudaMalloc(&out.num_nodes, 4L * Bt);
  cudaMalloc(&out.mask, 8L * Bt * (N + 1) * W); cudaMalloc(&out.status, 4L * Bt);
  auto run = [&] { if (block) build_trees_cuda(in, out, nullptr); else build_trees_cuda_warp(in, out, nullptr); };
  for (int i = 0; i < 5; ++i) run();
  cudaDeviceSynchronize();
  unsigned long long zeros[16] = {};
  cudaMemcpyToSymbol(g_phase_cycles, zeros, sizeof zeros);
  cudaMemcpyToSymbol(g_phase_calls, zeros, sizeof zeros);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a); run(); cudaEventRecord(b); cudaEventSynchronize(b);
    float t; cudaEventElapsedTime(&t, a, b); ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  unsigned long long cyc[16], calls[16];
  cudaMemcpyFromSymbol(cyc, g_phase_cycles, sizeof cyc);
  cudaMemcpyFromSymbol(calls, g_phase_calls, sizeof calls);
  int khz; cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  std::vector<int32_t> nn(Bt), st(Bt);
  cudaMemcpy(nn.data(), out.num_nodes, 4L * Bt, cudaMemcpyDeviceToHost);
  cudaMemcpy(st.data(), out.status, 4L * Bt, cudaMemcpyDeviceToHost);
  long sum_n = 0; int bad = 0; for (int i = 0; i < Bt; ++i) { sum_n += nn[i]; bad += st[i] != 0; }
  printf("%s batch %d D %d K %d budget %d: event median %.1f us (min %.1f); nodes/req %.1f status!=0 %d; clock %d MHz\n",
         block ? "block" : "warp", Bt, D, K, N, 1000 * ms[ms.size() / 2], 1000 * ms[0], double(sum_n) / Bt, bad, khz / 1000);
  const char* names[16] = {"stage+checks", "level count+scan", "level write", "tighten", "candidates",
                           "sort", "verify", "fallback loop", "outputs", "", "w:stage", "w:loop", "w:outputs"};
  const double per = double(iters) * Bt;
  for (int i = 0; i < 16; ++i)
    if (calls[i]) printf("  phase %2d %-18s %8.0f cycles/req  %6.2f us/req  calls/req %.2f\n", i, names[i],
                         cyc[i] / per, cyc[i] / per / (khz / 1000.0), calls[i] / per);
  return 0;
}
