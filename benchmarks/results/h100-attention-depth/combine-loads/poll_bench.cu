// combine_runs timed alone (as benchmarks/combine_runs_bench.cu times it) while the other 131
// blocks' first threads poll one flag, as the layer kernel's grid barrier does while its last warps
// combine: whether that polling slows the combining. A CUDA program of its own, from the
// repository's root:
//
//     nvcc -std=c++17 -O3 -arch=sm_90 -o poll_bench benchmarks/results/h100-attention-depth/combine-loads/poll_bench.cu
//     ./poll_bench        # on the GPU machine: needs no MLX, only the driver; its output: poll.txt
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include "../../../../mlxllama/cuda/decode_step.cu"
#include <cstdio>
#include <vector>
#include <algorithm>
constexpr int HD = 64, STRIDE = HD + 2;

// Run b's value d: its weighted values, then its largest score and sum of exponentials.
__host__ __device__ float run_value(int b, int d) {
  return d < HD ? 0.01f * d + b : (d == HD ? 0.25f * (b % 7) : 1.0f + b);
}

// One warp (block 0's first) combines `runs` runs of one head, alone on the GPU. mode 0: the runs
// are written in this launch by the first warp of blocks 0..runs-1, each fenced and counted, and the
// combining warp waits for the count and fences, as attention_items does; mode 1: the host wrote
// them before the launch (no wait, no fence); mode 2: as 0 without the fence after the wait.
// Stamps: the wait and fence, the first pass alone, then combine_runs twice.
// mode 0: as combine_runs_bench.cu's mode 0; mode 1: the same while every other block's thread 0
// polls a flag with ld.acquire.gpu (as grid_barrier does) until block 0 is done; mode 2: polls with
// ld.relaxed.gpu; mode 3: polls with ld.acquire.gpu and a 2 us sleep between polls.
__global__ void bench(float* partials, float* out, unsigned int* done, unsigned int* flag, long long* stamps, int runs, int mode) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, b = blockIdx.x;
  if (w != 0) return;
  if (b < runs) {
    float* p = partials + b * STRIDE;
    for (int d = lane; d < STRIDE; d += 32) p[d] = run_value(b, d);
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(done, 1u);
  }
  if (b != 0) {
    if (mode != 0 && lane == 0) {
      unsigned int seen;
      do {
        if (mode == 2) asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
        else asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
        if (mode == 3 && !seen) __nanosleep(2000);
      } while (!seen);
    }
    return;
  }
  wait_for_count(done, runs);
  __threadfence();
  long long t1 = clock64();
  float top, den;
  largest_score_and_sum<HD>(partials, runs, top, den);
  if (lane == 0) { out[128] = top; out[129] = den; }
  long long t2 = clock64();
  combine_runs<HD>(partials, runs, out);
  long long t3 = clock64();
  if (lane == 0) { stamps[0] = t2 - t1; stamps[1] = t3 - t2; atomicExch(flag, 1u); }
}

int main() {
  float *partials, *out; unsigned int *done, *flag; long long* stamps;
  cudaMalloc(&partials, 132 * STRIDE * sizeof(float)); cudaMalloc(&out, 1024 * sizeof(float));
  cudaMalloc(&done, sizeof(unsigned int)); cudaMalloc(&flag, 4096); cudaMalloc(&stamps, 2 * sizeof(long long));
  const char* names[] = {"no pollers", "131 pollers, acquire", "131 pollers, relaxed", "131 pollers, acquire, 2 us sleep"};
  for (int runs : {4, 32, 128}) {
    for (int mode = 0; mode < 4; ++mode) {
      std::vector<long long> s[2];
      for (int rep = 0; rep < 41; ++rep) {
        cudaMemset(done, 0, sizeof(unsigned int)); cudaMemset(flag, 0, 4096);
        bench<<<132, 512>>>(partials, out, done, flag, stamps, runs, mode);
        long long h[2];
        cudaError_t e = cudaMemcpy(h, stamps, sizeof(h), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
        if (rep > 0) for (int i = 0; i < 2; ++i) s[i].push_back(h[i]);
      }
      for (auto& v : s) std::sort(v.begin(), v.end());
      printf("runs %3d, %-34s first pass %6lld  combine_runs %6lld  (medians of 40, cycles)\n", runs, names[mode], s[0][20], s[1][20]);
    }
  }
  return 0;
}
