// The layer kernel's FFN steps (mlxllama/cuda/decode_step.cu, steps 4 and 5) timed by themselves
// for the TinyLlama shape, beside variants of their products, to tell what bounds them: the bytes,
// the instructions that turn codes into floats, or a warp waiting for its loads before it computes.
// A CUDA program of its own:
//
//     nvcc -std=c++17 -O3 -arch=sm_90 -o ffn_products_bench benchmarks/ffn_products_bench.cu
//     ./ffn_products_bench        # on the GPU machine: needs no MLX, only the driver
//
// Each launch is one step on one SM-wide grid (a block of 512 threads an SM, as layer_kernel), over
// one of 8 copies of the weights in turn (115 MB for gate and up, more than L2 holds), so that the
// weights come from memory as a step's do. The launches are timed as a CUDA graph of 64, in which a
// launch that does nothing costs about 0.6 us ("empty kernel"); launched one by one they cost about
// 4 us each however little they did, which hid what a variant takes.
// Variants (rows R a unit, groups G a lane a unit):
// - shipped: the layer kernel's loops and rows_dot as committed; "prescaled codes": rows_dot's
//   prescaled codes, as layer_kernel reads 4-bit matrices (the input divided by prescale_staged);
// - units: a warp's rows cut into units of R rows and G of a lane's groups; "prefetch" issues the
//   next unit's loads before it computes the current one, so that loads and arithmetic overlap;
//   "early loads": the first unit's before the input is staged;
// - fused, prescaled: fewer instructions a code (Codes, below);
// - copied: a block's share of the rows copied to shared memory (cp.async) before the input is
//   staged, all in flight at once, in 1 to 4 phases computed as they arrive;
// - bulk: a block's share of the rows moved to shared memory by sm_90's bulk copies (a few
//   instructions of one thread, no registers), in phases each counted by an mbarrier, computed
//   with rows_dot as each phase arrives; "bulk copies only": the copies without the products;
// - tensor cores: bulk copies a row each into padded rows, then mma.sync as decode_batch.cu's
//   tile_dot takes one input in every column (TileRows);
// - paired scales: each group's scale and bias loaded as one 4-byte pair (Scales);
// - loads only, words streamed: the bytes alone, the first with the products' loads (with the
//   scales and biases, paired, or the words alone), the second by a plain streaming loop.
// Each variant that computes the products has its outputs compared with the first's (the largest
// difference over the largest output): 0 where the sums run in the same order. The others write
// no outputs, and show 0.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
#include "../mlxllama/cuda/decode_step.cu"
#include "../mlxllama/cuda/decode_batch.cu"
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

constexpr int HIDDEN = 2048, FFN = 5632, COPIES = 8, SHIPPED_FFN_ROWS = 4;

struct Matrix {
  const uint32_t* w;
  const __half* scales;
  const __half* biases;
  const __half2* pairs;  // each group's scale and bias side by side: one 4-byte load for both
};

// Where a unit's scales and biases come from: their own arrays (as the kernels read them), the
// pairs, or nowhere (scale 1, bias 0: to time the words' loads alone).
enum Scales { SEPARATE, PAIRED, NO_SCALES };

// How a code becomes a float. FIELD: decode_step.cu's field (a shift, a mask, an or and a
// subtraction of 2^23). FUSED: the same values in fewer instructions: the mask and the or as one
// (masked_or); an 8-bit code by one byte permutation. PRESCALED: 4-bit codes masked in place, with
// no shift, for an input staged pre-divided by 16^k: decode_step.cu's prescaled_field over the input
// prescale_staged divides; 8-bit codes as FUSED.
enum Codes { FIELD, FUSED, PRESCALED };

// Value j of a group's codes as a float: q, or q * 16^k for PRESCALED 4-bit codes.
template <int BITS, Codes C>
__device__ inline float code(const uint32_t* words, int j) {
  if constexpr (C == FIELD) {
    return field<BITS>(words, j);
  } else if constexpr (BITS == 8) {
    return __uint_as_float(__byte_perm(words[j / 4], 0x4B000000u, 0x7540 | j % 4)) - 8388608.0f;
  } else if constexpr (C == FUSED) {
    static_assert(BITS == 4, "fused codes: 4 or 8 bits");
    return __uint_as_float(masked_or(words[j / 8] >> (4 * (j % 8)), 0xFu, 0x4B000000u)) - 8388608.0f;
  } else {
    static_assert(BITS == 4, "prescaled codes: 4 or 8 bits");
    return prescaled_field(words, j);
  }
}

// One unit's loads for a lane: R rows, G of its groups (lane + 32 * (first + g)).
template <int BITS, bool BIASES, int K, int R, int G, Scales S = SEPARATE>
struct Unit {
  static constexpr int groups = K / GROUP;
  uint32_t words[G][R][BITS];
  float scale[G][R], bias[G][R];

  __device__ void load(const Matrix& m, const int* rows, int first) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int b = 0; b < G; ++b) {
      const int g = lane + 32 * (first + b);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (g < groups) {
          load_group<BITS>(m.w + static_cast<size_t>(rows[r]) * (K / 32 * BITS) + g * BITS, words[b][r]);
          const size_t at = static_cast<size_t>(rows[r]) * groups + g;
          if constexpr (S == PAIRED) {
            const float2 pair = __half22float2(m.pairs[at]);
            scale[b][r] = pair.x, bias[b][r] = pair.y;
          } else if constexpr (S == NO_SCALES) {
            scale[b][r] = 1.0f, bias[b][r] = 0.0f;
          } else {
            scale[b][r] = __half2float(m.scales[at]);
            bias[b][r] = BIASES ? __half2float(m.biases[at]) : -128.0f * scale[b][r];
          }
        }
      }
    }
  }

  template <Codes C>
  __device__ void add(const float* smem, int first, float (&acc)[R]) const {
    const float* gsum = smem + groups * GROUP_STRIDE;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int b = 0; b < G; ++b) {
      const int g = lane + 32 * (first + b);
      if (g < groups) {
        float x[GROUP];
        staged_group(smem, g, x);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float dot = 0.0f;
#pragma unroll
          for (int j = 0; j < GROUP; ++j) {
            dot += x[j] * code<BITS, C>(words[b][r], j);
          }
          acc[r] += scale[b][r] * dot + bias[b][r] * gsum[g];
        }
      }
    }
  }
};

// A warp's rows of `items` items of R rows (item i: rows_of(i, rows)), each cut into units of G of
// a lane's groups; out(i, r, value) takes each row's product. PREFETCH: unit u + 1's loads are
// issued before unit u is computed.
// stage() stages the input (every warp calls it); EARLY: after the first unit's loads are issued, so
// that they are in flight while the input is staged.
template <int BITS, bool BIASES, int K, int R, int G, bool PREFETCH, Codes C, bool EARLY, Scales S,
          typename Rows, typename Out, typename Stage>
__device__ void warp_units(int items, const float* smem, Rows rows_of, Out out, Stage stage) {
  using U = Unit<BITS, BIASES, K, R, G, S>;
  constexpr int per_lane = (K / GROUP + 31) / 32, batches = (per_lane + G - 1) / G;
  const int warp = grid_warp(), warps = grid_warps();
  const int mine = warp < items ? (items - warp + warps - 1) / warps : 0, units = mine * batches;
  float acc[R];
  auto take = [&](U& unit, int u) {
    int rows[R];
    Matrix m = rows_of(warp + u / batches * warps, rows);
    unit.load(m, rows, u % batches * G);
  };
  auto finish = [&](const U& unit, int u) {
    if (u % batches == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    }
    unit.template add<C>(smem, u % batches * G, acc);
    if (u % batches == batches - 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float total = warp_sum(acc[r]);
        out(warp + u / batches * warps, r, total);
      }
    }
  };
  if (!PREFETCH) {
    stage();
    for (int u = 0; u < units; ++u) {
      U a;
      take(a, u);
      finish(a, u);
    }
    return;
  }
  U a, b;
  if (!EARLY) stage();
  if (units > 0) take(a, 0);
  if (EARLY) stage();
  for (int u = 0; u < units; u += 2) {
    if (u + 1 < units) take(b, u + 1);
    finish(a, u);
    if (u + 2 < units) take(a, u + 2);
    if (u + 1 < units) finish(b, u + 1);
  }
}

// 16 bytes from global to shared memory without registers (cp.async): a block can have all of
// its share of a matrix in flight at once, which loads into registers cannot.
__device__ inline void copy16(void* to, const void* from) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(from) : "memory");
}
__device__ inline void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ inline void wait_copies() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory"); }

// This block's consecutive share [begin, begin + count) of `total` rows, the grid's shares as even as can be.
__device__ inline void block_share(int total, int& begin, int& count) {
  begin = static_cast<int>(static_cast<long long>(blockIdx.x) * total / gridDim.x);
  count = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * total / gridDim.x) - begin;
}

// A block's share [begin, begin + count) of `total` rows (block_share) in shared memory at `at`, local
// row i being row begin + i: words [MAX_ROWS][K / 32 * BITS], scales and (BIASES) biases
// [MAX_ROWS][K / GROUP].
template <int BITS, bool BIASES, int K, int MAX_ROWS>
struct SharedRows {
  static constexpr int words = K / 32 * BITS, groups = K / GROUP;
  uint32_t* w;
  __half* scales;
  __half* biases;
  int begin, count;

  __device__ SharedRows(float* at, int total) {
    block_share(total, begin, count);
    w = reinterpret_cast<uint32_t*>(at);
    scales = reinterpret_cast<__half*>(w + MAX_ROWS * words);
    biases = scales + MAX_ROWS * groups;
  }
  __host__ __device__ static constexpr int floats() { return MAX_ROWS * (words + groups * (BIASES ? 2 : 1) / 2); }
};

// SharedRows of a matrix pair (rows [0, ROWS) of `first`, then of `second`), copied in PHASES commit
// groups of consecutive rows.
template <int BITS, bool BIASES, int K, int ROWS, int MAX_ROWS>
struct CopiedRows : SharedRows<BITS, BIASES, K, MAX_ROWS> {
  using Base = SharedRows<BITS, BIASES, K, MAX_ROWS>;
  using Base::Base, Base::words, Base::groups, Base::w, Base::scales, Base::biases, Base::begin, Base::count;

  // Rows [from, to) of the block's share: their copies issued, then committed as one group.
  __device__ void copy(const Matrix& first, const Matrix& second, int from, int to) {
    constexpr int word_chunks = words / 4, scale_chunks = groups / 8;
    for (int i = threadIdx.x; i < (to - from) * word_chunks; i += blockDim.x) {
      const int local = from + i / word_chunks, row = begin + local;
      const Matrix& m = row < ROWS ? first : second;
      const size_t source = static_cast<size_t>(row % ROWS) * words + i % word_chunks * 4;
      copy16(w + local * words + i % word_chunks * 4, m.w + source);
    }
    for (int i = threadIdx.x; i < (to - from) * scale_chunks * (BIASES ? 2 : 1); i += blockDim.x) {
      const int which = i / ((to - from) * scale_chunks), j = i % ((to - from) * scale_chunks);
      const int local = from + j / scale_chunks, row = begin + local;
      const Matrix& m = row < ROWS ? first : second;
      const size_t source = static_cast<size_t>(row % ROWS) * groups + j % scale_chunks * 8;
      __half* to_row = (which ? biases : scales) + local * groups + j % scale_chunks * 8;
      copy16(to_row, (which ? m.biases : m.scales) + source);
    }
    commit_copies();
  }

  // Local row `local`'s product with the staged input over groups [g0, g1), this lane's share, summed over the warp.
  template <Codes C>
  __device__ float dot(const float* smem, int local, int g0, int g1) const {
    const float* gsum = smem + groups * GROUP_STRIDE;
    const int lane = threadIdx.x % 32;
    float acc = 0.0f;
    for (int g = g0 + lane; g < g1; g += 32) {
      uint32_t ws[BITS];
      load_group<BITS>(w + local * words + g * BITS, ws);
      const float scale = __half2float(scales[local * groups + g]);
      const float bias = BIASES ? __half2float(biases[local * groups + g]) : -128.0f * scale;
      const float4* xg = reinterpret_cast<const float4*>(smem + g * GROUP_STRIDE);
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < GROUP / 4; ++i) {
        const float4 v = xg[i];
        dot += v.x * code<BITS, C>(ws, 4 * i) + v.y * code<BITS, C>(ws, 4 * i + 1) +
               v.z * code<BITS, C>(ws, 4 * i + 2) + v.w * code<BITS, C>(ws, 4 * i + 3);
      }
      acc += scale * dot + bias * gsum[g];
    }
    return warp_sum(acc);
  }
};

// The block's rows in PHASES phases: phase p's rows, each cut into PARTS parts of its groups, one
// (row, part) a warp at a time; parts are added in shared memory (two parts: in a fixed order).
template <int PHASES, int PARTS, Codes C, typename Rows, typename Out>
__device__ void copied_products(const Rows& rows, float* smem, float* sums, Out out) {
  for (int p = 0; p < PHASES; ++p) {
    if (p == 0) wait_copies<PHASES - 1>();
    if (p == 1) wait_copies<(PHASES > 2 ? PHASES - 2 : 0)>();
    if (p == 2) wait_copies<(PHASES > 3 ? PHASES - 3 : 0)>();
    if (p >= 3) wait_copies<0>();
    __syncthreads();
    const int from = rows.count * p / PHASES, to = rows.count * (p + 1) / PHASES;
    for (int item = threadIdx.x / 32; item < (to - from) * PARTS; item += LAYER_WARPS) {
      const int local = from + item / PARTS, part = item % PARTS;
      constexpr int groups = Rows::groups;
      const float value = rows.template dot<C>(smem, local, groups * part / PARTS, groups * (part + 1) / PARTS);
      if (PARTS == 1) {
        if (threadIdx.x % 32 == 0) out(rows.begin + local, value);
      } else if (threadIdx.x % 32 == 0) {
        sums[item] = value;
      }
    }
    if (PARTS > 1) {
      __syncthreads();
      for (int local = from + threadIdx.x; local < to; local += blockDim.x) {
        float total = 0.0f;
        for (int part = 0; part < PARTS; ++part) total += sums[(local - from) * PARTS + part];
        out(rows.begin + local, total);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bulk copies (sm_90's tensor memory accelerator): a block's rows of a matrix pair moved to shared
// memory by a few instructions of one thread, no registers, all in flight at once; phase p's
// arrival counted by mbarrier p, which the warps computing its rows wait on.

__device__ inline unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ inline void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
}

// Barriers [0, n) made ready for bulk copies to count on (one thread).
__device__ inline void init_barriers(uint64_t* bars, int n) {
  for (int p = 0; p < n; ++p) barrier_init(bars + p);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ inline void expect_bytes(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

__device__ inline void bulk_copy(void* to, const void* from, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(to)),
               "l"(from), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

__device__ inline void wait_phase(uint64_t* bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// SharedRows of a matrix pair (`first`'s ROWS rows, then `second`'s) after the phases' mbarriers at
// `at`, copied in phases of PHASE_ROWS rows, each its own mbarrier.
template <int BITS, bool BIASES, int K, int ROWS, int MAX_ROWS, int PHASE_ROWS>
struct BulkRows : SharedRows<BITS, BIASES, K, MAX_ROWS> {
  using Base = SharedRows<BITS, BIASES, K, MAX_ROWS>;
  using Base::words, Base::groups, Base::w, Base::scales, Base::biases, Base::begin, Base::count;
  static constexpr int MAX_PHASES = (MAX_ROWS + PHASE_ROWS - 1) / PHASE_ROWS;
  uint64_t* bars;

  // The phases' barriers first, 16 bytes (4 floats) a phase, which keeps the rows 16-byte aligned.
  __device__ BulkRows(float* at, int total) : Base(at + 4 * MAX_PHASES, total), bars(reinterpret_cast<uint64_t*>(at)) {}
  __host__ __device__ static constexpr int floats() { return 4 * MAX_PHASES + Base::floats(); }

  __device__ int phases() const {
    return (count + PHASE_ROWS - 1) / PHASE_ROWS;
  }

  // Every phase's rows in (to time the copies alone).
  __device__ void wait_all() const {
    for (int p = 0; p < phases(); ++p) wait_phase(bars + p, 0);
  }

  // Thread 0 of the block: every phase's copies issued (the others wait for the barriers' init).
  __device__ void copy(const Matrix& first, const Matrix& second) {
    if (threadIdx.x == 0) {
      init_barriers(bars, phases());
      for (int p = 0; p < phases(); ++p) {
        const int from = p * PHASE_ROWS, to = min(count, from + PHASE_ROWS);
        expect_bytes(bars + p, (to - from) * (words * 4 + groups * 2 * (BIASES ? 2 : 1)));
        for (int a = from; a < to;) {
          const int row = begin + a, in_first = row < ROWS;
          const int b = in_first ? min(to, ROWS - begin) : to, local = row % ROWS;
          const Matrix& m = in_first ? first : second;
          bulk_copy(w + a * words, m.w + static_cast<size_t>(local) * words, (b - a) * words * 4, bars + p);
          bulk_copy(scales + a * groups, m.scales + static_cast<size_t>(local) * groups, (b - a) * groups * 2, bars + p);
          if (BIASES) {
            bulk_copy(biases + a * groups, m.biases + static_cast<size_t>(local) * groups, (b - a) * groups * 2, bars + p);
          }
          a = b;
        }
      }
    }
    __syncthreads();
  }

  // Items of R local rows, warp w taking items w, w + LAYER_WARPS, ..., each once its phase is in;
  // out(row, value) for each of the block's rows.
  template <int R, typename Out>
  __device__ void products(const float* smem, Out out) const {
    static_assert(PHASE_ROWS % R == 0, "an item's rows in one phase");
    const int items = (count + R - 1) / R;
    for (int item = threadIdx.x / 32; item < items; item += LAYER_WARPS) {
      wait_phase(bars + item * R / PHASE_ROWS, 0);
      int rows[R];
      rows_from<R>(item * R, count, rows);
      float values[R];
      rows_dot<BITS, BIASES, K, R>(w, scales, biases, rows, smem, values);
      if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (item * R + r < count) out(begin + item * R + r, values[r]);
        }
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Tensor cores for one sequence: a block's rows bulk-copied into shared memory, one row a copy into
// padded rows (so that the 8 rows a warp's lanes read at once fall in different banks), in tiles of
// 16 rows, tile p's arrival counted by mbarrier p. Warp w takes the w-th sixteenth of every tile's
// groups (mma.sync m16n8k16 as decode_batch.cu's tile_dot: every column of B the one input, so each
// lane holds its rows' sums), and the block adds the warps' partial sums in a fixed order.

// The staged input as float16 pairs in decode_batch.cu's order (blocks of 8 columns: (c0, c4), (c1,
// c5), (c2, c6), (c3, c7)) and each group's sum of the rounded values, from the float32 staged values.
template <int K>
__device__ void stage_pairs(const float* staged_x, __half* xs, float* gsums) {
  constexpr int blocks = K / 8;
  for (int b = threadIdx.x; b < (blocks + 31) / 32 * 32; b += blockDim.x) {
    float sum = 0.0f;
    uint32_t pairs[4];
    if (b < blocks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __half2 h = __floats2half2_rn(staged_x[(8 * b + i) / GROUP * GROUP_STRIDE + (8 * b + i) % GROUP],
                                            staged_x[(8 * b + i + 4) / GROUP * GROUP_STRIDE + (8 * b + i + 4) % GROUP]);
        const float2 r = __half22float2(h);
        sum += r.x + r.y;
        pairs[i] = *reinterpret_cast<const uint32_t*>(&h);
      }
    }
    sum += __shfl_xor_sync(0xffffffff, sum, 1);
    sum += __shfl_xor_sync(0xffffffff, sum, 2);
    if (b < blocks) {
      *reinterpret_cast<uint4*>(xs + 8 * b) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
      if (b % 4 == 0) gsums[b / 4] = sum;
    }
  }
  __syncthreads();
}

template <int BITS, bool BIASES, int K, int ROWS, int MAX_TILES>
struct TileRows {
  static_assert(BITS == 4, "a lane's word of a group: 4-bit codes");
  static constexpr int words = K / 32 * BITS, stride = words + BITS, groups = K / GROUP;
  static constexpr int scale_stride = groups + 8;  // halves: 16 bytes of padding a row
  uint32_t* w;
  __half* scales;
  __half* biases;
  uint64_t* bars;
  float* red;
  int begin, count;

  __device__ TileRows(float* at, int total) {
    block_share(total, begin, count);
    bars = reinterpret_cast<uint64_t*>(at);
    red = at + 4 * MAX_TILES;  // the barriers, rounded up to 16 bytes
    w = reinterpret_cast<uint32_t*>(red + MAX_TILES * LAYER_WARPS * 16);
    scales = reinterpret_cast<__half*>(w + MAX_TILES * 16 * stride);
    biases = scales + MAX_TILES * 16 * scale_stride;
  }
  __host__ __device__ static constexpr int floats() {
    return 4 * MAX_TILES + MAX_TILES * LAYER_WARPS * 16 + MAX_TILES * 16 * (stride + scale_stride * (BIASES ? 2 : 1) / 2);
  }

  // Warp 0: every tile's rows copied, a row a copy from each lane in turn.
  __device__ void copy(const Matrix& first, const Matrix& second) {
    const int tiles = (count + 15) / 16, lane = threadIdx.x % 32;
    constexpr unsigned row_bytes = words * 4 + groups * 2 * (BIASES ? 2 : 1);
    if (threadIdx.x < 32) {
      if (lane == 0) {
        init_barriers(bars, tiles);
        for (int p = 0; p < tiles; ++p) expect_bytes(bars + p, min(16, count - 16 * p) * row_bytes);
      }
      __syncwarp();
      for (int local = lane; local < count; local += 32) {
        const int row = begin + local, in_first = row < ROWS;
        const Matrix& m = in_first ? first : second;
        const size_t r = row % ROWS;
        uint64_t* bar = bars + local / 16;
        bulk_copy(w + local * stride, m.w + r * words, words * 4, bar);
        bulk_copy(scales + local * scale_stride, m.scales + r * groups, groups * 2, bar);
        if (BIASES) bulk_copy(biases + local * scale_stride, m.biases + r * groups, groups * 2, bar);
      }
    }
    __syncthreads();
  }

  // out(row, value) for each of the block's rows; xs and gsums as stage_pairs leaves them.
  template <typename Out>
  __device__ void products(const __half* xs, const float* gsums, Out out) const {
    const int tiles = (count + 15) / 16, warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4, n = lane / 4;
    const int g0 = warp * groups / LAYER_WARPS, g1 = (warp + 1) * groups / LAYER_WARPS;
    for (int p = 0; p < tiles; ++p) {
      wait_phase(bars + p, 0);
      const int row_a = 16 * p + n, row_b = row_a + 8;
      const uint32_t* wa = w + row_a * stride;
      const uint32_t* wb = w + row_b * stride;
      float acc_a = 0.0f, acc_b = 0.0f;
#pragma unroll 4
      for (int g = g0; g < g1; ++g) {
        const uint32_t raw_a[2] = {wa[g * 4 + t], 0}, raw_b[2] = {wb[g * 4 + t], 0};
        uint32_t pa[4], pb[4];
        lane_pairs<BITS>(raw_a, t, pa);
        lane_pairs<BITS>(raw_b, t, pb);
        const uint32_t a_lo[4] = {pa[0], pb[0], pa[1], pb[1]}, a_hi[4] = {pa[2], pb[2], pa[3], pb[3]};
        const uint4 x = *reinterpret_cast<const uint4*>(xs + g * GROUP + 8 * t);
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_16816(c, a_lo, x.x, x.y);
        mma_16816(c, a_hi, x.z, x.w);
        const float sa = __half2float(scales[row_a * scale_stride + g]), sb = __half2float(scales[row_b * scale_stride + g]);
        const float ba = BIASES ? __half2float(biases[row_a * scale_stride + g]) : -128.0f * sa;
        const float bb = BIASES ? __half2float(biases[row_b * scale_stride + g]) : -128.0f * sb;
        acc_a += sa * c[0] + ba * gsums[g];
        acc_b += sb * c[2] + bb * gsums[g];
      }
      if (t == 0) {
        red[(p * LAYER_WARPS + warp) * 16 + n] = acc_a;
        red[(p * LAYER_WARPS + warp) * 16 + n + 8] = acc_b;
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const int p = i / 16, r = i % 16;
      float total = 0.0f;
      for (int v = 0; v < LAYER_WARPS; ++v) total += red[(p * LAYER_WARPS + v) * 16 + r];
      out(begin + i, total);
    }
  }
};

constexpr int TILE_GATE_UP = 6;
// Shared memory of the tile kernels: the staged input (float32), its float16 pairs and their group
// sums, then TileRows.
constexpr int TILE_X_FLOATS = FFN / GROUP * (GROUP_STRIDE + 1) + LAYER_WARPS + 64 + FFN / 2 + FFN / GROUP;

__device__ inline __half* pairs_at(float* smem) {
  return reinterpret_cast<__half*>(smem + FFN / GROUP * (GROUP_STRIDE + 1) + LAYER_WARPS + 64);
}

__global__ void gate_up_tiles(const float* x, const __half* norm, Matrix gate_w, Matrix up_w, float* gate, float* up) {
  float* smem = shared_floats();
  TileRows<4, true, HIDDEN, FFN, TILE_GATE_UP> rows(smem + TILE_X_FLOATS, 2 * FFN);
  rows.copy(gate_w, up_w);
  stage_input<true, HIDDEN, LAYER_THREADS>(x, norm, 1e-5f, smem);
  __half* xs = pairs_at(smem);
  float* gsums = reinterpret_cast<float*>(xs + FFN);
  stage_pairs<HIDDEN>(smem, xs, gsums);
  rows.products(xs, gsums, [&](int row, float v) { (row < FFN ? gate : up)[row % FFN] = v; });
}

// Rows a block takes at most in the bulk kernels (132 SMs: 86 and 16).
constexpr int BULK_GATE_UP_ROWS = 96, BULK_DOWN_ROWS = 20;

// Step 4 with the block's rows bulk-copied into shared memory before the input is staged; only the
// copies ("bulk copies only") to time the bytes' arrival.
template <int PHASE_ROWS, int R, bool COMPUTE = true>
__global__ void gate_up_bulk(const float* x, const __half* norm, Matrix gate_w, Matrix up_w, float* gate, float* up) {
  float* smem = shared_floats();
  BulkRows<4, true, HIDDEN, FFN, BULK_GATE_UP_ROWS, PHASE_ROWS> rows(smem + 2560, 2 * FFN);
  rows.copy(gate_w, up_w);
  if (!COMPUTE) {
    rows.wait_all();
    if (threadIdx.x == 0 && rows.w[threadIdx.x] == 0x12345678u) gate[0] = 1.0f;
    return;
  }
  stage_input<true, HIDDEN, LAYER_THREADS>(x, norm, 1e-5f, smem);
  rows.template products<R>(smem, [&](int row, float v) { (row < FFN ? gate : up)[row % FFN] = v; });
}

// Step 5 likewise.
template <int PHASE_ROWS, bool COMPUTE = true>
__global__ void down_bulk(const float* gate, const float* up, Matrix down_w, float* y) {
  float* smem = shared_floats();
  BulkRows<8, false, FFN, HIDDEN, BULK_DOWN_ROWS, PHASE_ROWS> rows(smem + 6656, HIDDEN);
  rows.copy(down_w, down_w);
  if (!COMPUTE) {
    rows.wait_all();
    if (threadIdx.x == 0 && rows.w[threadIdx.x] == 0x12345678u) y[0] = 1.0f;
    return;
  }
  stage_swiglu<FFN, LAYER_THREADS>(gate, up, smem);
  rows.template products<1>(smem, [&](int row, float v) { y[row] = v; });
}

enum Variant { SHIPPED, UNITS, LOADS, COPIED };

// Step 4: RMSNorm(x) staged, then gate and up (4-bit, stored biases).
template <Variant V, int R, int G, bool PREFETCH, Codes C, bool EARLY = false, Scales S = SEPARATE>
__global__ void gate_up(const float* x, const __half* norm, Matrix gate_w, Matrix up_w, float* gate, float* up) {
  float* smem = shared_floats();
  auto stage = [&] {
    stage_input<true, HIDDEN, LAYER_THREADS>(x, norm, 1e-5f, smem);
    if (C == PRESCALED) prescale_staged<HIDDEN, LAYER_THREADS>(smem);
  };
  if (V != UNITS) stage();
  if (V == SHIPPED) {
    constexpr int ffn_items = (FFN + SHIPPED_FFN_ROWS - 1) / SHIPPED_FFN_ROWS;
    for (int item = grid_warp(); item < 2 * ffn_items; item += grid_warps()) {
      const bool is_up = item >= ffn_items;
      const int first = (item - (is_up ? ffn_items : 0)) * SHIPPED_FFN_ROWS;
      int rows[SHIPPED_FFN_ROWS];
      rows_from<SHIPPED_FFN_ROWS>(first, FFN, rows);
      float out[SHIPPED_FFN_ROWS];
      const Matrix& m = is_up ? up_w : gate_w;
      rows_dot<4, true, HIDDEN, SHIPPED_FFN_ROWS, C == PRESCALED>(m.w, m.scales, m.biases, rows, smem, out);
      if (threadIdx.x % 32 == 0) {
        for (int r = 0; r < SHIPPED_FFN_ROWS; ++r) {
          if (first + r < FFN) (is_up ? up : gate)[first + r] = out[r];
        }
      }
    }
    return;
  }
  constexpr int ffn_items = (FFN + R - 1) / R;
  auto rows_of = [&](int item, int* rows) {
    const bool is_up = item >= ffn_items;
    rows_from<R>((item - (is_up ? ffn_items : 0)) * R, FFN, rows);
    return is_up ? up_w : gate_w;
  };
  auto out = [&](int item, int r, float value) {
    const bool is_up = item >= ffn_items;
    const int row = (item - (is_up ? ffn_items : 0)) * R + r;
    if (threadIdx.x % 32 == 0 && row < FFN) (is_up ? up : gate)[row] = value;
  };
  if (V == LOADS) {
    // Every word loaded and folded into one value, which no compiler can drop.
    constexpr int per_lane = HIDDEN / GROUP / 32;
    uint32_t folded = 0;
    for (int item = grid_warp(); item < 2 * ffn_items; item += grid_warps()) {
      int rows[R];
      Matrix m = rows_of(item, rows);
      Unit<4, true, HIDDEN, R, per_lane, S> unit;
      unit.load(m, rows, 0);
      for (int b = 0; b < per_lane; ++b)
        for (int r = 0; r < R; ++r) {
          for (int i = 0; i < 4; ++i) folded ^= unit.words[b][r][i];
          folded ^= __float_as_uint(unit.scale[b][r]) ^ __float_as_uint(unit.bias[b][r]);
        }
    }
    if (folded == 0x12345678u) gate[0] = 1.0f;
    return;
  }
  warp_units<4, true, HIDDEN, R, G, PREFETCH, C, EARLY, S>(2 * ffn_items, smem, rows_of, out, stage);
}

// Step 5: SiLU(gate) * up staged, then down (8-bit without stored biases, as Q6_K is held).
template <Variant V, int G, bool PREFETCH, Codes C, bool EARLY = false>
__global__ void down(const float* gate, const float* up, Matrix down_w, float* y) {
  float* smem = shared_floats();
  auto stage = [&] { stage_swiglu<FFN, LAYER_THREADS>(gate, up, smem); };
  if (V != UNITS) stage();
  if (V == SHIPPED) {
    for (int row = grid_warp(); row < HIDDEN; row += grid_warps()) {
      float dot;
      rows_dot<8, false, FFN, 1>(down_w.w, down_w.scales, down_w.biases, &row, smem, &dot);
      if (threadIdx.x % 32 == 0) y[row] = dot;
    }
    return;
  }
  auto rows_of = [&](int item, int* rows) {
    rows[0] = item;
    return down_w;
  };
  auto out = [&](int item, int, float value) {
    if (threadIdx.x % 32 == 0) y[item] = value;
  };
  warp_units<8, false, FFN, 1, G, PREFETCH, C, EARLY, SEPARATE>(HIDDEN, smem, rows_of, out, stage);
}

// What a launch of this grid costs doing nothing.
__global__ void empty(const float*, const __half*, Matrix, Matrix, float*, float*) {}

// What a launch costs without products: the input staged (norm and group sums), nothing read.
__global__ void staging_only(const float* x, const __half* norm, Matrix, Matrix, float* gate, float*) {
  float* smem = shared_floats();
  stage_input<true, HIDDEN, LAYER_THREADS>(x, norm, 1e-5f, smem);
  if (threadIdx.x == 0 && smem[blockIdx.x] == 12345.0f) gate[0] = 1.0f;
}

// The same bytes read by a plain streaming loop (16-byte loads, 8 in flight a thread), no staging:
// the bandwidth a launch of this grid gets.
__global__ void stream_only(const float*, const __half*, Matrix gate_w, Matrix up_w, float* gate, float*) {
  const uint4* parts[2] = {reinterpret_cast<const uint4*>(gate_w.w), reinterpret_cast<const uint4*>(up_w.w)};
  constexpr int chunks = FFN * HIDDEN / 8 / 4;
  uint32_t folded = 0;
  const int threads = gridDim.x * blockDim.x, t = blockIdx.x * blockDim.x + threadIdx.x;
  for (int m = 0; m < 2; ++m) {
    for (int base = t; base < chunks; base += 8 * threads) {
      uint4 v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = base + i * threads < chunks ? parts[m][base + i * threads] : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int i = 0; i < 8; ++i) folded ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    }
  }
  if (folded == 0x12345678u) gate[0] = 1.0f;
}

// Rows a block takes at most in the copied kernels (132 SMs: 86 and 16), and where they start in
// shared memory: after the staged input, its group sums and scratch.
constexpr int GATE_UP_MAX_ROWS = 96, DOWN_MAX_ROWS = 20;
constexpr int GATE_UP_X_FLOATS = HIDDEN / GROUP * (GROUP_STRIDE + 1) + LAYER_WARPS;
constexpr int DOWN_X_FLOATS = FFN / GROUP * (GROUP_STRIDE + 1) + LAYER_WARPS;
using GateUpRows = CopiedRows<4, true, HIDDEN, FFN, GATE_UP_MAX_ROWS>;
using DownRows = CopiedRows<8, false, FFN, HIDDEN, DOWN_MAX_ROWS>;
constexpr int SUMS_FLOATS = 64;

// Step 4 with the block's rows copied to shared memory before the input is staged.
template <int PHASES, Codes C>
__global__ void gate_up_copied(const float* x, const __half* norm, Matrix gate_w, Matrix up_w, float* gate, float* up) {
  float* smem = shared_floats();
  GateUpRows rows(smem + GATE_UP_X_FLOATS, 2 * FFN);
  for (int p = 0; p < PHASES; ++p) rows.copy(gate_w, up_w, rows.count * p / PHASES, rows.count * (p + 1) / PHASES);
  stage_input<true, HIDDEN, LAYER_THREADS>(x, norm, 1e-5f, smem);
  if (C == PRESCALED) prescale_staged<HIDDEN, LAYER_THREADS>(smem);
  float* sums = smem + GATE_UP_X_FLOATS + GateUpRows::floats();
  copied_products<PHASES, 1, C>(rows, smem, sums, [&](int row, float v) { (row < FFN ? gate : up)[row % FFN] = v; });
}

// Step 5 likewise.
template <int PHASES, int PARTS, Codes C>
__global__ void down_copied(const float* gate, const float* up, Matrix down_w, float* y) {
  float* smem = shared_floats();
  DownRows rows(smem + DOWN_X_FLOATS, HIDDEN);
  for (int p = 0; p < PHASES; ++p) rows.copy(down_w, down_w, rows.count * p / PHASES, rows.count * (p + 1) / PHASES);
  stage_swiglu<FFN, LAYER_THREADS>(gate, up, smem);
  float* sums = smem + DOWN_X_FLOATS + DownRows::floats();
  copied_products<PHASES, PARTS, C>(rows, smem, sums, [&](int row, float v) { y[row] = v; });
}

// ---------------------------------------------------------------------------------------------

static uint32_t next_random(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<uint32_t>(s >> 32);
}

struct HostMatrix {
  std::vector<uint32_t> w;
  std::vector<__half> scales, biases;
};

static HostMatrix random_matrix(int rows, int k, int bits, uint64_t seed) {
  HostMatrix m;
  m.w.resize(static_cast<size_t>(rows) * k / 32 * bits);
  m.scales.resize(static_cast<size_t>(rows) * k / GROUP);
  m.biases.resize(m.scales.size());
  for (auto& v : m.w) v = next_random(seed);
  for (size_t i = 0; i < m.scales.size(); ++i) {
    m.scales[i] = __float2half(0.001f + 0.002f * (next_random(seed) % 1000) / 1000.0f);
    m.biases[i] = __float2half(-0.01f - 0.02f * (next_random(seed) % 1000) / 1000.0f);
  }
  return m;
}

template <typename T>
static T* to_device(const std::vector<T>& v) {
  T* p;
  cudaMalloc(&p, v.size() * sizeof(T));
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

static Matrix upload(const HostMatrix& m) {
  std::vector<__half2> pairs(m.scales.size());
  for (size_t i = 0; i < pairs.size(); ++i) pairs[i] = __halves2half2(m.scales[i], m.biases[i]);
  return {to_device(m.w), to_device(m.scales), to_device(m.biases), to_device(pairs)};
}

static std::vector<float> fetch(const float* p, int n) {
  std::vector<float> v(n);
  cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost);
  return v;
}

// The largest difference from `ref` over the largest |ref|.
static double relative_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double worst = 0, scale = 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - ref[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(ref[i])));
  }
  return worst / scale;
}

constexpr size_t shared_default = (FFN / GROUP * (GROUP_STRIDE + 1) + LAYER_WARPS) * sizeof(float);

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::vector<float> x(HIDDEN), act(FFN);
  std::vector<__half> norm(HIDDEN);
  uint64_t seed = 7;
  for (int i = 0; i < HIDDEN; ++i) {
    x[i] = (next_random(seed) % 2001 - 1000) / 1000.0f;
    norm[i] = __float2half(0.5f + (next_random(seed) % 100) / 100.0f);
  }
  for (int i = 0; i < FFN; ++i) act[i] = (next_random(seed) % 2001 - 1000) / 500.0f;
  Matrix gates[COPIES], ups[COPIES], downs[COPIES];
  for (int c = 0; c < COPIES; ++c) {
    gates[c] = upload(random_matrix(FFN, HIDDEN, 4, 100 + c));
    ups[c] = upload(random_matrix(FFN, HIDDEN, 4, 200 + c));
    downs[c] = upload(random_matrix(HIDDEN, FFN, 8, 300 + c));
  }
  float *dx = to_device(x), *dgate = to_device(act), *dup = to_device(act), *gate_out, *up_out, *y;
  __half* dnorm = to_device(norm);
  cudaMalloc(&gate_out, FFN * sizeof(float));
  cudaMalloc(&up_out, FFN * sizeof(float));
  cudaMalloc(&y, HIDDEN * sizeof(float));

  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  // µs a launch: the median of 9 launches of a graph of 64, after one that loads the module.
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  auto time_launches = [&](auto launch) {
    std::vector<float> batches;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
    for (int i = 0; i < 64; ++i) launch(i % COPIES, stream);
    cudaStreamEndCapture(stream, &graph);
    cudaGraphInstantiate(&exec, graph, 0);
    for (int b = 0; b < 10; ++b) {
      cudaEventRecord(start, stream);
      cudaGraphLaunch(exec, stream);
      cudaEventRecord(stop, stream);
      cudaEventSynchronize(stop);
      float ms;
      cudaEventElapsedTime(&ms, start, stop);
      if (b > 0) batches.push_back(ms * 1000.0f / 64);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    std::sort(batches.begin(), batches.end());
    return batches[batches.size() / 2];
  };

  std::vector<float> gate_ref, up_ref, y_ref;
  const size_t gate_up_copied_smem = (GATE_UP_X_FLOATS + GateUpRows::floats() + SUMS_FLOATS) * sizeof(float);
  const size_t down_copied_smem = (DOWN_X_FLOATS + DownRows::floats() + SUMS_FLOATS) * sizeof(float);
  const size_t gate_up_bulk_smem =
      (2560 + BulkRows<4, true, HIDDEN, FFN, BULK_GATE_UP_ROWS, 1>::floats()) * sizeof(float);
  const size_t down_bulk_smem = (6656 + BulkRows<8, false, FFN, HIDDEN, BULK_DOWN_ROWS, 1>::floats()) * sizeof(float);
  const size_t tiles_gate_up_smem = (TILE_X_FLOATS + TileRows<4, true, HIDDEN, FFN, TILE_GATE_UP>::floats()) * 4;
  auto report_gate_up = [&](const char* name, auto kernel, size_t smem = shared_default) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    const float us = time_launches([&](int c, cudaStream_t s) {
      kernel<<<sms, LAYER_THREADS, smem, s>>>(dx, dnorm, gates[c], ups[c], gate_out, up_out);
    });
    kernel<<<sms, LAYER_THREADS, smem>>>(dx, dnorm, gates[0], ups[0], gate_out, up_out);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      printf("%s: %s\n", name, cudaGetErrorString(e));
      return;
    }
    auto g = fetch(gate_out, FFN), u = fetch(up_out, FFN);
    if (gate_ref.empty()) gate_ref = g, up_ref = u;
    printf("gate+up  %-40s %7.2f us   error %.1e\n", name, us,
           std::max(relative_error(g, gate_ref), relative_error(u, up_ref)));
  };
  auto report_down = [&](const char* name, auto kernel, size_t smem = shared_default) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    const float us = time_launches([&](int c, cudaStream_t s) {
      kernel<<<sms, LAYER_THREADS, smem, s>>>(dgate, dup, downs[c], y);
    });
    kernel<<<sms, LAYER_THREADS, smem>>>(dgate, dup, downs[0], y);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      printf("%s: %s\n", name, cudaGetErrorString(e));
      return;
    }
    auto v = fetch(y, HIDDEN);
    if (y_ref.empty()) y_ref = v;
    printf("down     %-40s %7.2f us   error %.1e\n", name, us, relative_error(v, y_ref));
  };

  printf("%d SMs; gate+up reads %.1f MB a launch, down %.1f MB\n", sms,
         2.0 * FFN * HIDDEN * (4 / 8.0 + 4.0 / GROUP) / 1e6, 1.0 * FFN * HIDDEN * (8 / 8.0 + 2.0 / GROUP) / 1e6);
  for (int round = 0; round < 2; ++round) {
    report_gate_up("shipped (items of 4 rows)", gate_up<SHIPPED, 4, 2, false, FIELD>);
    report_gate_up("shipped, prescaled codes", gate_up<SHIPPED, 4, 2, false, PRESCALED>);
    report_gate_up("empty kernel", empty);
    report_gate_up("staging only (no products)", staging_only);
    report_gate_up("words streamed, no staging", stream_only);
    report_gate_up("loads only, items of 4 rows", gate_up<LOADS, 4, 2, false, FIELD>);
    report_gate_up("loads only, items of 1 row", gate_up<LOADS, 1, 2, false, FIELD>);
    report_gate_up("loads only, items of 4 rows, words alone", gate_up<LOADS, 4, 2, false, FIELD, false, NO_SCALES>);
    report_gate_up("loads only, items of 4 rows, paired scales", gate_up<LOADS, 4, 2, false, FIELD, false, PAIRED>);
    report_gate_up("loads only, items of 1 row, paired scales", gate_up<LOADS, 1, 2, false, FIELD, false, PAIRED>);
    report_gate_up("units R4 G2 paired scales", gate_up<UNITS, 4, 2, false, FIELD, false, PAIRED>);
    report_gate_up("units R4 G2", gate_up<UNITS, 4, 2, false, FIELD>);
    report_gate_up("units R4 G2 fused", gate_up<UNITS, 4, 2, false, FUSED>);
    report_gate_up("units R4 G2 prescaled", gate_up<UNITS, 4, 2, false, PRESCALED>);
    report_gate_up("units R2 G2 prefetch", gate_up<UNITS, 2, 2, true, FIELD>);
    report_gate_up("units R2 G2 prefetch fused", gate_up<UNITS, 2, 2, true, FUSED>);
    report_gate_up("units R2 G2 prefetch prescaled", gate_up<UNITS, 2, 2, true, PRESCALED>);
    report_gate_up("units R2 G2 prefetch prescaled, paired scales", gate_up<UNITS, 2, 2, true, PRESCALED, false, PAIRED>);
    report_gate_up("units R1 G2 prefetch prescaled", gate_up<UNITS, 1, 2, true, PRESCALED>);
    report_gate_up("units R2 G2 prefetch prescaled, early loads", gate_up<UNITS, 2, 2, true, PRESCALED, true>);
    report_gate_up("bulk copies only", gate_up_bulk<32, 2, false>, gate_up_bulk_smem);
    report_gate_up("bulk, phases of 32 rows, items of 2", gate_up_bulk<32, 2>, gate_up_bulk_smem);
    report_gate_up("bulk, phases of 16 rows, items of 2", gate_up_bulk<16, 2>, gate_up_bulk_smem);
    report_gate_up("bulk, phases of 16 rows, items of 1", gate_up_bulk<16, 1>, gate_up_bulk_smem);
    report_gate_up("bulk, phases of 64 rows, items of 4", gate_up_bulk<64, 4>, gate_up_bulk_smem);
    report_gate_up("tensor cores, rows bulk-copied", gate_up_tiles, tiles_gate_up_smem);
    report_gate_up("copied, 1 phase prescaled", gate_up_copied<1, PRESCALED>, gate_up_copied_smem);
    report_gate_up("copied, 2 phases prescaled", gate_up_copied<2, PRESCALED>, gate_up_copied_smem);
    report_gate_up("copied, 4 phases prescaled", gate_up_copied<4, PRESCALED>, gate_up_copied_smem);
    report_down("shipped (a row a warp)", down<SHIPPED, 6, false, FIELD>);
    report_down("units G6 fused", down<UNITS, 6, false, FUSED>);
    report_down("units G3 prefetch", down<UNITS, 3, true, FIELD>);
    report_down("units G3 prefetch fused", down<UNITS, 3, true, FUSED>);
    report_down("units G2 prefetch fused", down<UNITS, 2, true, FUSED>);
    report_down("units G3 prefetch fused, early loads", down<UNITS, 3, true, FUSED, true>);
    report_down("bulk copies only", down_bulk<8, false>, down_bulk_smem);
    report_down("bulk, phases of 8 rows", down_bulk<8>, down_bulk_smem);
    report_down("bulk, phases of 4 rows", down_bulk<4>, down_bulk_smem);
    report_down("bulk, phases of 2 rows", down_bulk<2>, down_bulk_smem);
    report_down("bulk, one phase", down_bulk<20>, down_bulk_smem);
    report_down("copied, 1 phase fused", down_copied<1, 1, FUSED>, down_copied_smem);
    report_down("copied, 2 phases, 2 warps a row, fused", down_copied<2, 2, FUSED>, down_copied_smem);
  }
  return 0;
}
