// combine_runs (mlxllama/cuda/decode_step.cu) timed by itself: one warp combining a head's runs on
// an otherwise idle H100, to tell the cost of its code from that of the layer kernel around it
// (benchmarks/attention_stamps.py times it inside the kernel). A CUDA program of its own:
//
//     nvcc -std=c++17 -O3 -arch=sm_90 -o combine_runs_bench benchmarks/combine_runs_bench.cu
//     ./combine_runs_bench        # on the GPU machine: needs no MLX, only the driver
//
// Results: benchmarks/results/h100-attention-depth/combine-microbench/.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include "../mlxllama/cuda/decode_step.cu"
#include <cstdio>
#include <vector>
#include <algorithm>
constexpr int HD = 64, STRIDE = HD + 2;

// Run b's value d: its weighted values, then its largest score and sum of exponentials.
__host__ __device__ float run_value(int b, int d) {
  return d < HD ? 0.01f * d + b : (d == HD ? 0.25f * (b % 7) : 1.0f + b);
}

// Modes 3 to 5: every block but the combining one polls `flag` from its first thread until the
// combining is done, as the layer kernel's blocks poll the grid barrier's count meanwhile.
enum Poll { ACQUIRE = 3, RELAXED = 4, ACQUIRE_SLEEPING = 5 };

__device__ void poll_until_set(const unsigned int* flag, int mode) {
  unsigned int seen;
  do {
    if (mode == RELAXED) {
      asm volatile("ld.relaxed.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
    } else {
      asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
    }
    if (mode == ACQUIRE_SLEEPING && !seen) __nanosleep(2000);
  } while (!seen);
}

// One warp (block 0's first) combines `runs` runs of one head. mode 0: the runs are written in this
// launch by the first warp of blocks 0..runs-1, each fenced and counted, and the combining warp
// waits for the count and fences, as attention_items does; mode 1: the host wrote them before the
// launch (no wait, no fence); mode 2: as 0 without the fence after the wait; modes 3 to 5 (Poll):
// as 0, with the other blocks polling. Stamps: the wait and fence, the first pass alone, then
// combine_runs twice; then block 0 sets `flag`.
__global__ void bench(float* partials, float* out, unsigned int* done, unsigned int* flag, long long* stamps, int runs,
                      int mode) {
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, b = blockIdx.x;
  if (w != 0) return;
  if (mode != 1 && b < runs) {
    float* p = partials + b * STRIDE;
    for (int d = lane; d < STRIDE; d += 32) p[d] = run_value(b, d);
    __threadfence();
    __syncwarp();
    if (lane == 0) atomicAdd(done, 1u);
  }
  if (b != 0) {
    if (mode >= ACQUIRE && lane == 0) poll_until_set(flag, mode);
    return;
  }
  long long t0 = clock64();
  if (mode != 1) {
    wait_for_count(done, runs);
    if (mode != 2) __threadfence();
  }
  long long t1 = clock64();
  float top, den;
  largest_score_and_sum<HD>(partials, runs, top, den);
  if (lane == 0) {
    out[128] = top;
    out[129] = den;
  }
  long long t2 = clock64();
  combine_runs<HD>(partials, runs, out);
  long long t3 = clock64();
  combine_runs<HD>(partials, runs, out + 256);
  long long t4 = clock64();
  if (lane == 0) {
    stamps[0] = t1 - t0; stamps[1] = t2 - t1; stamps[2] = t3 - t2; stamps[3] = t4 - t3;
    atomicExch(flag, 1u);
  }
}

int main() {
  float *partials, *out; unsigned int *done, *flag; long long* stamps;
  cudaMalloc(&partials, 132 * STRIDE * sizeof(float)); cudaMalloc(&out, 1024 * sizeof(float));
  cudaMalloc(&done, sizeof(unsigned int)); cudaMalloc(&flag, sizeof(unsigned int)); cudaMalloc(&stamps, 4 * sizeof(long long));
  std::vector<float> host(132 * STRIDE);
  for (int b = 0; b < 132; ++b) for (int d = 0; d < STRIDE; ++d) host[b * STRIDE + d] = run_value(b, d);
  const char* names[] = {"written this launch, fence", "written by the host", "written this launch, no fence",
                         "as the first, 131 blocks polling", "as the first, polling relaxed", "as the first, polling, 2 us sleeps"};
  for (int runs : {4, 32, 128}) {
    for (int mode = 0; mode < 6; ++mode) {
      std::vector<long long> s[4];
      for (int rep = 0; rep < 41; ++rep) {
        cudaMemcpy(partials, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
        cudaMemset(done, 0, sizeof(unsigned int));
        cudaMemset(flag, 0, sizeof(unsigned int));
        bench<<<132, 512>>>(partials, out, done, flag, stamps, runs, mode);
        long long h[4];
        cudaError_t e = cudaMemcpy(h, stamps, sizeof(h), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) { printf("error %s\n", cudaGetErrorString(e)); return 1; }
        if (rep > 0) for (int i = 0; i < 4; ++i) s[i].push_back(h[i]);  // the first launch loads the module
      }
      for (auto& v : s) std::sort(v.begin(), v.end());
      printf("runs %3d, %-34s wait+fence %6lld  first pass %6lld  combine_runs %6lld  again %6lld  (medians of 40, cycles)\n",
             runs, names[mode], s[0][20], s[1][20], s[2][20], s[3][20]);
    }
  }
  return 0;
}
