// Kernels of step.py: one decode step of one sequence, one launch a layer (layer_kernel)
// and one for the output head (head_kernel). decode_batch.cu, which follows this file in its
// kernels' header, decodes several sequences with the helpers here.
//
// Included as the header of MLX custom kernels (mx.fast.cuda_kernel), whose generated bodies are
// one call each to a *_kernel function below; the names in those calls are the kernels' inputs
// and outputs and their template arguments. Weights are in MLX's affine format (quants.py): each
// row packs BITS-bit values little-endian into uint32 words, and every 32 values share a float16
// scale and bias (value = scale * q + bias; without stored biases, bias = -128 * scale).
//
// A block first stages its input vector in shared memory (normalized by RMSNorm where the kernel
// starts with a norm), then each warp computes a few whole output rows. Accumulation is in float32.

constexpr int GROUP = 32;
// Shared-memory stride of a group of staged inputs: with 36 floats, the 8 lanes that a 16-byte
// shared load serves at once, each reading its own group, hit 8 different sets of 4 banks.
constexpr int GROUP_STRIDE = 36;

// -infinity without math.h, which MLX's run-time compilation (NVRTC) does not include.
__device__ inline float negative_infinity() {
  return __int_as_float(0xff800000);
}

__device__ inline float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffff, v, offset);
  }
  return v;
}

// L1 caches are not coherent between SMs: what other blocks wrote earlier in the same launch
// (layer_kernel) is read from L2.
template <typename T>
__device__ inline float load_fresh(const T* p) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "float, or a 16-bit float type");
  if constexpr (sizeof(T) == 4) {
    return __ldcg(reinterpret_cast<const float*>(p));
  } else {
    const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
    return static_cast<float>(*reinterpret_cast<const T*>(&bits));
  }
}

// Threads a block of head_kernel (step.py launches it so): as a constant, the staging
// loops unroll and issue all their loads at once.
constexpr int THREADS = 256;

__device__ inline float* shared_floats() {
  extern __shared__ float4 shared_memory[];  // float4: 16-byte aligned
  return reinterpret_cast<float*>(shared_memory);
}

// Staged value k of the input.
__device__ inline float& staged(float* smem, int k) {
  return smem[k / GROUP * GROUP_STRIDE + k % GROUP];
}

// After the values: the sum of each group, which the group's bias multiplies.
template <int K, int NT = THREADS>
__device__ void stage_group_sums(float* smem) {
  __syncthreads();
  float* gsum = smem + K / GROUP * GROUP_STRIDE;
  for (int g = threadIdx.x; g < K / GROUP; g += NT) {
    const float4* group = reinterpret_cast<const float4*>(smem + g * GROUP_STRIDE);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < GROUP / 4; ++i) {
      const float4 v = group[i];
      sum += (v.x + v.y) + (v.z + v.w);
    }
    gsum[g] = sum;
  }
  __syncthreads();
}

// This thread's values of src [K] (k = threadIdx.x + i * NT; 0 past K), read from L2
// (load_fresh): unrolled, so all the loads are issued before the first is used.
template <int K, int NT, typename T>
__device__ inline void load_spread(const T* src, float (&out)[(K + NT - 1) / NT]) {
#pragma unroll
  for (int i = 0; i < (K + NT - 1) / NT; ++i) {
    const int k = threadIdx.x + i * NT;
    out[i] = k < K ? load_fresh(src + k) : 0.0f;
  }
}

// The input x (times 1 / rms(x) * norm_w when NORM), read from L2.
template <bool NORM, int K, int NT = THREADS, typename T, typename N>
__device__ void stage_input(const T* x, const N* norm_w, float eps, float* smem) {
  constexpr int per_thread = (K + NT - 1) / NT;
  float v[per_thread], w[per_thread];
  load_spread<K, NT>(x, v);
#pragma unroll
  for (int i = 0; i < per_thread; ++i) {
    const int k = threadIdx.x + i * NT;
    w[i] = NORM && k < K ? static_cast<float>(norm_w[k]) : 1.0f;
  }
  if (NORM) {
    float* scratch = smem + K / GROUP * (GROUP_STRIDE + 1);
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < per_thread; ++i) {
      squares += v[i] * v[i];
    }
    squares = warp_sum(squares);
    if (threadIdx.x % 32 == 0) {
      scratch[threadIdx.x / 32] = squares;
    }
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < NT / 32; ++i) {
      total += scratch[i];
    }
    const float inv_rms = rsqrtf(total / K + eps);
#pragma unroll
    for (int i = 0; i < per_thread; ++i) {
      v[i] *= inv_rms * w[i];
    }
  }
#pragma unroll
  for (int i = 0; i < per_thread; ++i) {
    const int k = threadIdx.x + i * NT;
    if (k < K) {
      staged(smem, k) = v[i];
    }
  }
  stage_group_sums<K, NT>(smem);
}

// SiLU(gate) * up, the input of the down projection (layer_kernel), read from L2.
template <int K, int NT>
__device__ void stage_swiglu(const float* gate, const float* up, float* smem) {
  constexpr int per_thread = (K + NT - 1) / NT;
  float g[per_thread], u[per_thread];
  load_spread<K, NT>(gate, g);
  load_spread<K, NT>(up, u);
#pragma unroll
  for (int i = 0; i < per_thread; ++i) {
    const int k = threadIdx.x + i * NT;
    if (k < K) {
      staged(smem, k) = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
  }
  stage_group_sums<K, NT>(smem);
}

// One group's BITS words: 16-byte loads where the group's offset allows them.
template <int BITS>
__device__ inline void load_group(const uint32_t* src, uint32_t* words) {
  if constexpr (BITS % 4 == 0) {
#pragma unroll
    for (int i = 0; i < BITS / 4; ++i) {
      uint4 v = reinterpret_cast<const uint4*>(src)[i];
      words[4 * i] = v.x;
      words[4 * i + 1] = v.y;
      words[4 * i + 2] = v.z;
      words[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < BITS; ++i) {
      words[i] = src[i];
    }
  }
}

// A value below 2^23 as a float, exactly: placed in the mantissa of 2^23, an integer operation and
// an add instead of a quarter-rate conversion.
__device__ inline float small_float(uint32_t v) {
  return __uint_as_float(0x4B000000u | v) - 8388608.0f;
}

// Value j of a group whose BITS-bit fields fill `words` (indices are compile-time once unrolled),
// as a float (small_float).
template <int BITS>
__device__ inline float field(const uint32_t* words, int j) {
  const int bit = j * BITS, word = bit / 32, shift = bit % 32;
  uint32_t v = words[word] >> shift;
  if (shift + BITS > 32) {
    v |= words[word + 1] << (32 - shift);
  }
  return small_float(v & ((1u << BITS) - 1));
}

// Prescaled codes: with the staged input divided by 16^k at value j of each group (k = j % 8, less 5
// from the sixth value of a word on; prescale_staged), a 4-bit code is read from its word in place:
// masked, with 2^23's exponent or-ed in, as one instruction (masked_or), then 2^23 subtracted, which
// gives q * 16^k exactly. Against field's shift, mask, or and subtraction that is a weight's code in
// two instructions instead of four (and a shift a word for its last three values); the products
// are the same bit for bit, 16^k being a power of two. masked_or is (w & mask) | bits as one LOP3,
// which ptxas otherwise splits in two for the two constants.
__device__ inline uint32_t masked_or(uint32_t w, uint32_t mask, uint32_t bits) {
  uint32_t out;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(w), "r"(mask), "r"(bits));
  return out;
}

__device__ inline int prescale_place(int j) {
  const int n = j % 8;
  return n < 5 ? n : n - 5;
}

// Value j of a group of 4-bit codes times 16^prescale_place(j) (indices compile-time once unrolled).
__device__ inline float prescaled_field(const uint32_t* words, int j) {
  const int n = j % 8;
  const uint32_t w = n < 5 ? words[j / 8] : words[j / 8] >> 20;
  return __uint_as_float(masked_or(w, 0xFu << (4 * prescale_place(j)), 0x4B000000u)) - 8388608.0f;
}

// The staged input [K] divided for prescaled codes, after its group sums (which stay the sums of
// the values themselves) were taken.
template <int K, int NT>
__device__ void prescale_staged(float* smem) {
  for (int k = threadIdx.x; k < K; k += NT) {
    staged(smem, k) *= __uint_as_float(static_cast<uint32_t>(127 - 4 * prescale_place(k % GROUP)) << 23);
  }
  __syncthreads();
}

// Group g of the staged input in registers, in four-value loads.
__device__ inline void staged_group(const float* smem, int g, float (&x)[GROUP]) {
  const float4* xg = reinterpret_cast<const float4*>(smem + g * GROUP_STRIDE);
#pragma unroll
  for (int i = 0; i < GROUP / 4; ++i) {
    const float4 v = xg[i];
    x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
  }
}

// out[r] = row rows[r] of an affine matrix with K columns times the staged input, for R rows at
// once, in every lane. A lane takes groups lane, lane + 32, ...; it loads the words, scales and
// biases of up to BATCH of its groups for all R rows (8 groups in all) before it computes, so
// those loads are in flight together. PRESCALED (4-bit codes only): the input was staged divided
// for prescaled_field.
template <int BITS, bool STORED_BIASES, int K, int R, bool PRESCALED = false, typename S>
__device__ void rows_dot(const uint32_t* w, const S* scales, const S* biases, const int* rows, const float* smem,
                         float* out) {
  constexpr int groups = K / GROUP, per_lane = (groups + 31) / 32, most = 8 / R > 0 ? 8 / R : 1;
  constexpr int BATCH = per_lane < most ? per_lane : most;
  const float* gsum = smem + groups * GROUP_STRIDE;
  const int lane = threadIdx.x % 32;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = 0.0f;
  }
#pragma unroll
  for (int base = 0; base < per_lane; base += BATCH) {
    uint32_t words[BATCH][R][BITS];
    float scale[BATCH][R], bias[BATCH][R];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int g = lane + 32 * (base + b);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (base + b < per_lane && g < groups) {
          load_group<BITS>(w + static_cast<size_t>(rows[r]) * (K / 32 * BITS) + g * BITS, words[b][r]);
          const size_t at = static_cast<size_t>(rows[r]) * groups + g;
          scale[b][r] = static_cast<float>(scales[at]);
          bias[b][r] = STORED_BIASES ? static_cast<float>(biases[at]) : -128.0f * scale[b][r];
        }
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const int g = lane + 32 * (base + b);
      if (base + b < per_lane && g < groups) {
        float x[GROUP];
        staged_group(smem, g, x);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float dot = 0.0f;
#pragma unroll
          for (int j = 0; j < GROUP; ++j) {
            if constexpr (PRESCALED) {
              static_assert(BITS == 4, "prescaled codes are 4-bit");
              dot += x[j] * prescaled_field(words[b][r], j);
            } else {
              dot += x[j] * field<BITS>(words[b][r], j);
            }
          }
          acc[r] += scale[b][r] * dot + bias[b][r] * gsum[g];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    out[r] = warp_sum(acc[r]);
  }
}

// Rows first, first + 1, ... first + R - 1 in `rows`; past the last row, the last row again
// (read, never written).
template <int R>
__device__ inline void rows_from(int first, int total_rows, int* rows) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rows[r] = min(first + r, total_rows - 1);
  }
}

// The output head: y = W RMSNorm(x), R consecutive rows a warp.
template <int BITS, bool STORED_BIASES, int K, int R, typename T, typename N, typename S, typename O>
__device__ void head_kernel(const T* x, const N* norm_w, const float* eps, const uint32_t* w, const S* scales,
                            const S* biases, int total_rows, O* y) {
  float* smem = shared_floats();
  stage_input<true, K>(x, norm_w, eps[0], smem);
  const int first = (blockIdx.x * (THREADS / 32) + threadIdx.x / 32) * R;
  if (first >= total_rows) {
    return;
  }
  int rows[R];
  rows_from<R>(first, total_rows, rows);
  float out[R];
  rows_dot<BITS, STORED_BIASES, K, R>(w, scales, biases, rows, smem, out);
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (first + r < total_rows) {
        y[first + r] = static_cast<O>(out[r]);
      }
    }
  }
}

// The dims of pair i of a head (HEAD_DIM / 2 pairs) and whether RoPE turns them. A pair is two
// rows that RoPE rotates together: adjacent ones (TRADITIONAL, llama's permuted weights) or
// ROPE_DIM / 2 apart (NeoX); a head's dims past ROPE_DIM, and all of V's (rope false), stay as they are.
template <int ROPE_DIM, bool TRADITIONAL>
__device__ inline bool pair_dims(int i, bool rope, int& d0, int& d1) {
  d0 = 2 * i, d1 = 2 * i + 1;
  if (!rope) {
    return false;
  }
  if (TRADITIONAL) {
    return d0 < ROPE_DIM;
  }
  if (i < ROPE_DIM / 2) {
    d0 = i, d1 = i + ROPE_DIM / 2;
    return true;
  }
  d0 = ROPE_DIM + 2 * (i - ROPE_DIM / 2), d1 = d0 + 1;
  return false;
}

// Pair i (dims d0, d1) of `head` of Q, K or V (part 0, 1, 2) made final from its products y0, y1:
// plus the rows' biases (BIAS), turned by RoPE at position `pos` (rotate). Q's go to q
// [HEADS * HEAD_DIM]; K's and V's to the sequence's new slot in `cache` (LayerCache::store).
template <bool BIAS, int HEAD_DIM, typename B, typename Cache>
__device__ inline void store_pair(int part, int head, int i, int d0, int d1, bool rotate, float y0, float y1, int pos,
                                  const B* bias_q, const B* bias_k, const B* bias_v, const float* inv_freq,
                                  const float* attn_factor, float* q, const Cache& cache, int seq) {
  if (BIAS) {
    const B* bias = part == 0 ? bias_q : (part == 1 ? bias_k : bias_v);
    y0 += static_cast<float>(bias[head * HEAD_DIM + d0]);
    y1 += static_cast<float>(bias[head * HEAD_DIM + d1]);
  }
  if (rotate) {
    float sin_t, cos_t;
    sincosf(static_cast<float>(pos) * inv_freq[i], &sin_t, &cos_t);
    cos_t *= attn_factor[0];
    sin_t *= attn_factor[0];
    const float a = y0 * cos_t - y1 * sin_t, b = y0 * sin_t + y1 * cos_t;
    y0 = a, y1 = b;
  }
  if (part == 0) {
    q[head * HEAD_DIM + d0] = y0;
    q[head * HEAD_DIM + d1] = y1;
  } else {
    cache.store(seq, part, head, d0, d1, y0, y1, pos);
  }
}

// Step 1 of layer_kernel for one warp: pair `pair` of rows of Q, K or V (pairs of Q's heads, then
// K's, then V's) times the staged normalized input, made final by store_pair.
template <int Q_BITS, bool Q_BIASES, int K_BITS, bool K_BIASES, int V_BITS, bool V_BIASES, bool BIAS, int HEADS,
          int KV_HEADS, int HEAD_DIM, int ROPE_DIM, bool TRADITIONAL, int K, typename S, typename B, typename Cache>
__device__ void qkv_rope_pair(int pair, const float* smem, const uint32_t* w_q, const S* s_q, const S* b_q,
                              const uint32_t* w_k, const S* s_k, const S* b_k, const uint32_t* w_v, const S* s_v,
                              const S* b_v, const B* bias_q, const B* bias_k, const B* bias_v,
                              const int32_t* position, const float* inv_freq, const float* attn_factor,
                              const Cache& cache, float* q) {
  constexpr int half = HEAD_DIM / 2;
  constexpr int q_pairs = HEADS * half, kv_pairs = KV_HEADS * half;
  const int part = pair < q_pairs ? 0 : (pair < q_pairs + kv_pairs ? 1 : 2);
  const int part_pair = pair - (part == 0 ? 0 : (part == 1 ? q_pairs : q_pairs + kv_pairs));
  const int head = part_pair / half, i = part_pair % half;
  int d0, d1;
  const bool rotate = pair_dims<ROPE_DIM, TRADITIONAL>(i, part < 2, d0, d1);
  const int rows[2] = {head * HEAD_DIM + d0, head * HEAD_DIM + d1};
  float y[2];
  if (part == 0) {
    rows_dot<Q_BITS, Q_BIASES, K, 2>(w_q, s_q, b_q, rows, smem, y);
  } else if (part == 1) {
    rows_dot<K_BITS, K_BIASES, K, 2>(w_k, s_k, b_k, rows, smem, y);
  } else {
    rows_dot<V_BITS, V_BIASES, K, 2>(w_v, s_v, b_v, rows, smem, y);
  }
  if (threadIdx.x % 32 == 0) {
    store_pair<BIAS, HEAD_DIM>(part, head, i, d0, d1, rotate, y[0], y[1], position[0], bias_q, bias_k, bias_v,
                               inv_freq, attn_factor, q, cache, 0);
  }
}

// ---------------------------------------------------------------------------------------------
// layer_kernel: a whole layer in one launch, its five steps separated by grid-wide barriers.

// One block an SM (step.py launches as many blocks as the GPU has SMs), so that every block
// is resident at once and a block waiting at a barrier never keeps another from running.
constexpr int LAYER_THREADS = 512, LAYER_WARPS = LAYER_THREADS / 32;

// The launch's warps counted across blocks first, so that consecutive work items go to different SMs.
__device__ inline int grid_warp() {
  return threadIdx.x / 32 * gridDim.x + blockIdx.x;
}

__device__ inline int grid_warps() {
  return LAYER_WARPS * gridDim.x;
}

// Every block waits until all have arrived. `arrivals` counts the arrivals of all launches since
// it was made zero; every launch using it has the same grid, so before each barrier it is a
// multiple of the grid size, and this barrier completes at the next multiple.
__device__ inline void grid_barrier(unsigned long long* arrivals) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long arrived = atomicAdd(arrivals, 1ull) + 1;
    const unsigned long long target = (arrived + gridDim.x - 1) / gridDim.x * gridDim.x;
    unsigned long long seen;
    do {
      asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(seen) : "l"(arrivals) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

__device__ inline float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, offset));
  }
  return v;
}

// Query heads one warp of attention takes at once: heads that share a KV head (grouped-query
// attention) read the same keys and values, so a warp scores each cached slot for all of them and
// the cache is read once for the group, not once a head. As many as the largest power of two
// dividing the heads a KV head serves allows, up to MAX_QUERY_HEADS: a warp keeps each head's
// accumulators, and 8 heads spilled registers and decoded slower than 4 (docs/benchmarks.md,
// "Attention at depth"). `fewer`: at most MAX_QUERY_HEADS_QUANTIZED, as layer_kernel takes them
// over a quantized cache that attention_run reads (not on tensor cores: tensor_runs_take): a run
// there needs more registers (codes, scales, value biases), and with 4 heads a chunk of 32 slots
// took a lone warp 2.5 times a plain chunk's time (about 19,500 cycles against 7,600; 12,300 with 2
// heads), which the other runs of its head group wait for (docs/benchmarks.md, "Quantized KV
// cache"). batch_layer_kernel keeps 4: at 16 sequences its warps are many, and 2 heads were not
// measured there.
constexpr int MAX_QUERY_HEADS = 4;
constexpr int MAX_QUERY_HEADS_QUANTIZED = 2;

__host__ __device__ constexpr int query_heads(int per_kv_head, bool fewer) {
  int n = 1;
  while (n < (fewer ? MAX_QUERY_HEADS_QUANTIZED : MAX_QUERY_HEADS) && per_kv_head % (2 * n) == 0) {
    n *= 2;
  }
  return n;
}

// The groups of query_heads heads that a layer's attention is cut into.
template <int HEADS, int KV_HEADS, bool FEWER_HEADS>
__device__ constexpr int head_groups() {
  return HEADS / query_heads(HEADS / KV_HEADS, FEWER_HEADS);
}

// Bytes a lane loads at once: its HEAD_DIM / 32 dims of a cached value.
template <int BYTES> struct Raw;
template <> struct Raw<1> { using type = unsigned char; };
template <> struct Raw<2> { using type = unsigned short; };
template <> struct Raw<4> { using type = unsigned int; };
template <> struct Raw<8> { using type = uint2; };
template <> struct Raw<16> { using type = uint4; };

// The words of a lane's raw bits, for field().
template <typename R>
__device__ inline void raw_words(const R& raw, uint32_t (&words)[2]) {
  if constexpr (sizeof(R) == 8) {
    words[0] = raw.x, words[1] = raw.y;
  } else {
    words[0] = raw, words[1] = 0;
  }
}

// A chunk's keys that a warp copies into shared memory ahead of scoring them (STAGED_KEYS): a row a
// lane of HEAD_DIM 16-bit values and 16 bytes of padding, so that the 8 lanes one 16-byte shared
// load serves, reading the same bytes of their rows, hit 8 different sets of banks. kernels.py's
// staged_key_floats mirrors this size.
template <int HEAD_DIM>
__device__ constexpr int staged_key_units() {
  static_assert(HEAD_DIM % 16 == 0, "an odd number of 16-byte units a row");
  return HEAD_DIM / 8 + 1;
}

// 16 bytes copied from global to shared memory without passing through registers (cp.async), read
// from L2 (.cg): other blocks of the launch wrote the newest slot. Done once copies_done returns.
__device__ inline void copy_to_shared(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}

__device__ inline void copies_done() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

constexpr int TENSOR_RUNS_MAX_HEAD_DIM = 64;

// Whether layer_kernel's runs are tensor_attention_run's for heads of head_dim over a plain cache
// (kv_group 0) or one quantized in groups of kv_group dims: groups of 32, a part of the run's rows each.
__host__ __device__ constexpr bool tensor_runs_take(int head_dim, int kv_group) {
  return head_dim % 32 == 0 && head_dim <= TENSOR_RUNS_MAX_HEAD_DIM && (kv_group == 0 || kv_group == 32);
}

// The rows of a KV head's keys or values as tensor_attention_run reads them: 8 dims of each part
// (HEAD_DIM / 32 parts) of a slot a lane, loaded as the cache stores them (load) and used as 16 bytes
// of float16 a part, 4 pairs of dims (halves). Which dims of a row lane t = lane % 4 holds as part e
// (part_of) and which two of them make pair m (pair_first, PAIR_SPREAD) is each kind of rows' own:
// tensor_attention_run takes a query's dims and writes its results the same way. Here dims 8t .. 8t
// + 7 of each 32, in pairs of neighbours. Read from L2: other blocks wrote the newest slot in this
// launch.
template <int HEAD_DIM, typename C>
struct PlainTensorRows {
  static constexpr int PARTS = HEAD_DIM / 32;
  struct Loaded {
    uint4 part[PARTS];
  };
  const C* rows;

  // The first of the 8 dims of part e of a row (`row`) that lane t holds.
  template <typename P>
  __device__ static P part_of(P row, int t, int e) {
    return row + 32 * e + 8 * t;
  }

  // Pair m of a part is its dims 2m and 2m + 1.
  static constexpr int PAIR_SPREAD = 1;
  __device__ static constexpr int pair_first(int m) {
    return 2 * m;
  }

  __device__ void load(size_t slot, Loaded& out) const {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int e = 0; e < PARTS; ++e) {
      // part_of's address written out: through part_of, ptxas spilled more in this step (12 stores
      // and 48 loads against 7 and 25, kernel_sass.py --sass).
      out.part[e] = __ldcg(reinterpret_cast<const uint4*>(rows + slot * HEAD_DIM + 32 * e + 8 * t));
    }
  }

  __device__ static uint4 halves(const Loaded& in, int e) {
    return in.part[e];
  }
};

__device__ inline __half2 as_half2(uint32_t bits) {
  return *reinterpret_cast<const __half2*>(&bits);
}

__device__ inline uint32_t half2_bits(__half2 pair) {
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The float16 pair that pair m of a 4-bit word's codes is placed under (QuantizedTensorRows): an
// even pair's nibbles are the low ones of their bytes, whose lowest bit the mantissa of 1024
// (0x6400) makes worth 1; an odd pair's sit a nibble higher, where that of 64 (0x5400) does.
__device__ constexpr uint32_t nibble_base(int m) {
  return m % 2 == 0 ? 0x64006400u : 0x54005400u;
}

// A cache quantized in groups of 32 dims (MLX's affine format along the head): a lane holds
// HEAD_DIM / 4 dims of a row in a row, so that their codes are one load and one group's, with one
// scale and one bias: 3 loads a row (8 dims of each 32 took 4: two of codes, the slot's scales, its
// biases), fewer bytes than a plain row, turned into float16 where they are used. A code c becomes
// the float16 1024 + c when placed in the mantissa of 1024 (0x6400), exactly; 1024 is taken off,
// also exactly, and scale * c + bias is one fused multiply-add, rounded once to float16
// (mx.dequantize's values, to within one float16 step). With the 4-bit pairs below, a step over a
// 4-bit cache is 671 instructions where it was 986, and one sequence at depth 8,192 decodes 1.02-1.03x
// as fast over a 4-bit cache as over a plain one (docs/benchmarks.md, "A quantized row's dims in a
// row", "4-bit pairs in place").
template <int HEAD_DIM, int BITS, typename KS>
struct QuantizedTensorRows {
  static_assert(sizeof(KS) == 2 && (BITS == 4 || BITS == 8), "float16 scales and biases, 4- or 8-bit codes");
  static constexpr int PARTS = HEAD_DIM / 32, WORDS = HEAD_DIM * BITS / 32, LANE_DIMS = HEAD_DIM / 4;
  static_assert(32 % LANE_DIMS == 0, "a lane's dims in one group");
  using Codes = typename Raw<LANE_DIMS * BITS / 8>::type;  // a lane's codes of a row
  struct Loaded {
    uint32_t words[LANE_DIMS * BITS / 32];
    unsigned short scale, bias;
  };
  const uint32_t* codes;
  const KS* scales;
  const KS* biases;

  template <typename P>
  __device__ static P part_of(P row, int t, int e) {
    return row + t * LANE_DIMS + 8 * e;
  }

  // Pair m of a part is its dims 2m and 2m + 1 at 8 bits (bytes 2m and 2m + 1 of its codes); at 4,
  // dims m and m + 4, nibbles m and m + 4 of its word: one LOP3 takes them out of the word (pairs 0
  // and 1) or of the word shifted by a byte (2 and 3), an odd pair's in place, a nibble up
  // (nibble_base). Neighbours took 8 instructions (two nibbles of one byte); a shift by 4m before
  // each pair took two shifts a word more.
  static constexpr int PAIR_SPREAD = BITS == 8 ? 1 : 4;
  __device__ static constexpr int pair_first(int m) {
    return BITS == 8 ? 2 * m : m;
  }

  __device__ void load(size_t slot, Loaded& out) const {
    const int t = threadIdx.x % 4;
    const unsigned char* row = reinterpret_cast<const unsigned char*>(codes + slot * WORDS);
    const Codes words = __ldcg(reinterpret_cast<const Codes*>(row + t * LANE_DIMS * BITS / 8));
    if constexpr (sizeof(Codes) == 16) {
      out.words[0] = words.x, out.words[1] = words.y, out.words[2] = words.z, out.words[3] = words.w;
    } else if constexpr (sizeof(Codes) == 8) {
      out.words[0] = words.x, out.words[1] = words.y;
    } else {
      out.words[0] = words;
    }
    const size_t group = slot * PARTS + t * LANE_DIMS / 32;
    out.scale = __ldcg(reinterpret_cast<const unsigned short*>(scales + group));
    out.bias = __ldcg(reinterpret_cast<const unsigned short*>(biases + group));
  }

  __device__ static uint4 halves(const Loaded& in, int e) {
    const __half2 scale = as_half2(__byte_perm(in.scale, 0, 0x1010));
    const __half2 bias = as_half2(__byte_perm(in.bias, 0, 0x1010));
    uint32_t pair[4];
    if constexpr (BITS == 8) {
      // Bytes 2m and 2m + 1 of the part's codes, each under the byte 0x64.
      pair[0] = __byte_perm(in.words[2 * e], 0x64, 0x4140);
      pair[1] = __byte_perm(in.words[2 * e], 0x64, 0x4342);
      pair[2] = __byte_perm(in.words[2 * e + 1], 0x64, 0x4140);
      pair[3] = __byte_perm(in.words[2 * e + 1], 0x64, 0x4342);
    } else {
      const uint32_t low = in.words[e], high = low >> 8;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        pair[m] = masked_or(m < 2 ? low : high, 0x000F000Fu << 4 * (m % 2), nibble_base(m));
      }
    }
    uint32_t out[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const __half2 offset = as_half2(BITS == 8 ? 0x64006400u : nibble_base(m));
      out[m] = half2_bits(__hfma2(__hsub2(as_half2(pair[m]), offset), scale, bias));
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
  }
};

// A 16-bit cache's slots of one KV head (keys and values [slots][HEAD_DIM]), as attention_run reads them.
// With `rows` (this warp's staged keys), each lane copies its slot's key of the next chunk into its
// row while the warp adds the current chunk's values: a key's loads are then all in flight at once,
// where loaded into registers as it is scored, ptxas issued them one or two at a time for want of
// registers (docs/benchmarks.md, "Attention at depth"). Without, a lane loads its key from L2.
template <int HEAD_DIM, int QH, typename C>
struct PlainSlots {
  static_assert(sizeof(C) == 2 && HEAD_DIM % 32 == 0, "16-bit cache values, HEAD_DIM / 32 dims a lane");
  static constexpr bool quantized = false;
  static constexpr int per_lane = HEAD_DIM / 32;
  // Slots whose dims a lane loads at once: all 32 of a chunk where registers allow.
  static constexpr int at_once = per_lane <= 2 ? 32 : 16;
  using Dims = typename Raw<per_lane * sizeof(C)>::type;
  const C* k;
  const C* v;
  uint4* rows;

  // Starts copying the key of `slot` into the lane's row.
  __device__ void stage_key(int slot) const {
    if (rows != nullptr) {
      const uint4* key = reinterpret_cast<const uint4*>(k + static_cast<size_t>(slot) * HEAD_DIM);
      uint4* row = rows + threadIdx.x % 32 * staged_key_units<HEAD_DIM>();
#pragma unroll
      for (int i = 0; i < HEAD_DIM / 8; ++i) {
        copy_to_shared(row + i, key + i);
      }
    }
  }

  __device__ void keys_staged() const {
    if (rows != nullptr) {
      copies_done();
    }
  }

  __device__ Dims dims(int s) const {
    return __ldcg(reinterpret_cast<const Dims*>(v + static_cast<size_t>(s) * HEAD_DIM + threadIdx.x % 32 * per_lane));
  }

  // score[h] += query h . key of `slot` (q: QH scaled queries in shared memory), the key staged
  // (stage_key, keys_staged) or read from L2.
  __device__ void score(int slot, const float* q, const float*, float (&score)[QH]) const {
    const uint4* key = rows != nullptr ? rows + threadIdx.x % 32 * staged_key_units<HEAD_DIM>()
                                       : reinterpret_cast<const uint4*>(k + static_cast<size_t>(slot) * HEAD_DIM);
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; ++i) {
      const uint4 packed = rows != nullptr ? key[i] : __ldcg(key + i);
      const C* eight = reinterpret_cast<const C*>(&packed);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float value = static_cast<float>(eight[j]);
#pragma unroll
        for (int h = 0; h < QH; ++h) {
          score[h] += q[h * HEAD_DIM + 8 * i + j] * value;
        }
      }
    }
  }

  // acc[h] += weight of slot t (lane t's p[h]) times the lane's dims of its value.
  __device__ void add_values(float (&acc)[QH][per_lane], const float (&p)[QH], int t, const Dims& dims) const {
    const C* value = reinterpret_cast<const C*>(&dims);
#pragma unroll
    for (int h = 0; h < QH; ++h) {
      const float p_t = __shfl_sync(0xffffffff, p[h], t);
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        acc[h][j] += p_t * static_cast<float>(value[j]);
      }
    }
  }

  __device__ void add_value_biases(int, const float (&)[QH]) {}
  __device__ void rescale(int, float) {}
  __device__ void finish(float (&)[QH][per_lane]) {}

  __device__ PlainTensorRows<HEAD_DIM, C> tensor_keys() const {
    return {k};
  }

  __device__ PlainTensorRows<HEAD_DIM, C> tensor_values() const {
    return {v};
  }
};

// A lane's PER_LANE dims of a new key or value (x, consecutive dims from lane * PER_LANE), quantized
// as MLX's affine_quantize would quantize them (mlx/backend/cuda/quantized/affine_quantize.cu), so
// that the kernels store what mx.quantize stores: codes, and the scale and bias of the lane's group
// of GS dims before rounding to the cache's type. A group's lanes are GS / PER_LANE consecutive ones;
// its largest value is taken with 0, its smallest not, as MLX's are; IEEE divisions whatever the
// compiler's flags.
template <int BITS, int GS, int PER_LANE>
__device__ inline void affine_quantize(const float (&x)[PER_LANE], uint32_t (&code)[PER_LANE], float& scale,
                                       float& bias) {
  constexpr float n_bins = (1 << BITS) - 1;
  float lo = x[0], hi = fmaxf(x[0], 0.0f);
#pragma unroll
  for (int j = 1; j < PER_LANE; ++j) {
    lo = fminf(lo, x[j]);
    hi = fmaxf(hi, x[j]);
  }
#pragma unroll
  for (int offset = GS / PER_LANE / 2; offset > 0; offset >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffff, lo, offset));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffff, hi, offset));
  }
  scale = fmaxf(__fdiv_rn(hi - lo, n_bins), 1e-7f);
  const bool low_side = fabsf(lo) > fabsf(hi);
  scale = low_side ? scale : -scale;
  const float edge = low_side ? lo : hi, q0 = roundf(__fdiv_rn(edge, scale));
  const bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : __fdiv_rn(edge, q0);
  bias = at_zero ? 0.0f : edge;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    code[j] = static_cast<uint32_t>(fminf(roundf(__fdiv_rn(x[j] - bias, scale)), n_bins));
  }
}

// A quantized cache's slots of one KV head (MLX's affine format along HEAD_DIM, GS values a scale
// and bias), as attention_run reads them, and the head's new key and value (fresh_k, fresh_v:
// floats), which the kernels quantize as they store them (LayerCache::store_fresh).
// A lane scores its slot's whole key: scale * sum(q * code) + bias * sum(q), the queries' group sums
// staged beside them. For values, a lane loads its dims' codes and their group's scale for every
// slot, and the bias term, the same for all dims of a group, is summed by the slot's own lane and
// added once at the end (finish).
template <int HEAD_DIM, int QH, int KEY_BITS, int VALUE_BITS, int GS, typename KS>
struct QuantizedSlots {
  static constexpr bool quantized = true;
  static constexpr int per_lane = HEAD_DIM / 32, groups = HEAD_DIM / GS;
  static constexpr int key_words = HEAD_DIM * KEY_BITS / 32, value_words = HEAD_DIM * VALUE_BITS / 32;
  // Slots whose values a lane loads at once: half a chunk. All 32, with codes and scale packed in
  // one register, spilled registers and decoded slower (docs/benchmarks.md, "Quantized KV cache").
  static constexpr int at_once = 16;
  static_assert(per_lane * VALUE_BITS % 8 == 0 && GS * KEY_BITS / 32 % 4 == 0, "whole bytes a lane, 16-byte key loads");
  using Bits = typename Raw<per_lane * VALUE_BITS / 8>::type;
  struct Dims {
    Bits bits;
    float scale;
  };
  const uint32_t* k;
  const KS* k_scales;
  const KS* k_biases;
  const uint32_t* v;
  const KS* v_scales;
  const KS* v_biases;
  const float* fresh_k;
  const float* fresh_v;
  float value_bias[QH][groups];

  __device__ static int lane_group() {
    return threadIdx.x % 32 * per_lane / GS;
  }

  // A lane loads its slot's key as it scores it: a group's words at once.
  __device__ void stage_key(int) const {}
  __device__ void keys_staged() const {}

  __device__ Dims dims(int s) const {
    const unsigned char* row = reinterpret_cast<const unsigned char*>(v + static_cast<size_t>(s) * value_words);
    return {__ldcg(reinterpret_cast<const Bits*>(row + threadIdx.x % 32 * per_lane * VALUE_BITS / 8)),
            load_fresh(v_scales + static_cast<size_t>(s) * groups + lane_group())};
  }

  __device__ void score(int slot, const float* q, const float* q_sums, float (&score)[QH]) const {
    constexpr int group_words = GS * KEY_BITS / 32;
    const uint4* key = reinterpret_cast<const uint4*>(k + static_cast<size_t>(slot) * key_words);
#pragma unroll
    for (int g = 0; g < groups; ++g) {
      uint32_t words[group_words];
#pragma unroll
      for (int i = 0; i < group_words / 4; ++i) {
        const uint4 packed = __ldcg(key + g * group_words / 4 + i);
        words[4 * i] = packed.x, words[4 * i + 1] = packed.y, words[4 * i + 2] = packed.z, words[4 * i + 3] = packed.w;
      }
      const float scale = load_fresh(k_scales + static_cast<size_t>(slot) * groups + g);
      const float bias = load_fresh(k_biases + static_cast<size_t>(slot) * groups + g);
      float dot[QH];
#pragma unroll
      for (int h = 0; h < QH; ++h) {
        dot[h] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < GS; ++j) {
        const float code = field<KEY_BITS>(words, j);
#pragma unroll
        for (int h = 0; h < QH; ++h) {
          dot[h] += q[h * HEAD_DIM + g * GS + j] * code;
        }
      }
#pragma unroll
      for (int h = 0; h < QH; ++h) {
        score[h] += scale * dot[h] + bias * q_sums[h * groups + g];
      }
    }
  }

  __device__ void add_values(float (&acc)[QH][per_lane], const float (&p)[QH], int t, const Dims& dims) const {
    uint32_t words[2];
    raw_words(dims.bits, words);
#pragma unroll
    for (int h = 0; h < QH; ++h) {
      const float weight = __shfl_sync(0xffffffff, p[h], t) * dims.scale;
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        acc[h][j] += weight * field<VALUE_BITS>(words, j);
      }
    }
  }

  // The lane's own slot's weights p times its value biases, a sum per group.
  __device__ void add_value_biases(int slot, const float (&p)[QH]) {
#pragma unroll
    for (int g = 0; g < groups; ++g) {
      const float bias = load_fresh(v_biases + static_cast<size_t>(slot) * groups + g);
#pragma unroll
      for (int h = 0; h < QH; ++h) {
        value_bias[h][g] += p[h] * bias;
      }
    }
  }

  __device__ void rescale(int h, float correction) {
#pragma unroll
    for (int g = 0; g < groups; ++g) {
      value_bias[h][g] *= correction;
    }
  }

  __device__ void finish(float (&acc)[QH][per_lane]) {
#pragma unroll
    for (int h = 0; h < QH; ++h) {
#pragma unroll
      for (int g = 0; g < groups; ++g) {
        const float total = warp_sum(value_bias[h][g]);
        if (lane_group() == g) {
#pragma unroll
          for (int j = 0; j < per_lane; ++j) {
            acc[h][j] += total;
          }
        }
      }
    }
  }

  // The lane's dims of the new key and value as the cache stores them: quantized, then dequantized.
  __device__ void fresh(float (&key)[per_lane], float (&value)[per_lane]) const {
    const int first = threadIdx.x % 32 * per_lane;
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      key[j] = load_fresh(fresh_k + first + j);
      value[j] = load_fresh(fresh_v + first + j);
    }
    round_trip<KEY_BITS>(key);
    round_trip<VALUE_BITS>(value);
  }

  __device__ QuantizedTensorRows<HEAD_DIM, KEY_BITS, KS> tensor_keys() const {
    return {k, k_scales, k_biases};
  }

  __device__ QuantizedTensorRows<HEAD_DIM, VALUE_BITS, KS> tensor_values() const {
    return {v, v_scales, v_biases};
  }

  template <int BITS>
  __device__ static void round_trip(float (&x)[per_lane]) {
    uint32_t code[per_lane];
    float scale, bias;
    affine_quantize<BITS, GS>(x, code, scale, bias);
    const float stored_scale = static_cast<float>(static_cast<KS>(scale));
    const float stored_bias = static_cast<float>(static_cast<KS>(bias));
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      x[j] = stored_scale * static_cast<float>(code[j]) + stored_bias;
    }
  }
};

// A query's score of the new slot's key (QuantizedSlots::fresh: the lane's HEAD_DIM / 32 dims of
// it), summed across the warp: every lane gets it.
template <int HEAD_DIM>
__device__ inline float fresh_score(const float* query, const float (&key)[HEAD_DIM / 32]) {
  constexpr int per_lane = HEAD_DIM / 32;
  const int lane = threadIdx.x % 32;
  float score = 0.0f;
#pragma unroll
  for (int j = 0; j < per_lane; ++j) {
    score += query[lane * per_lane + j] * key[j];
  }
  return warp_sum(score);
}

// One warp's attention of QH queries (q: QH * HEAD_DIM scaled values in shared memory, q_sums their
// group sums for a quantized cache) over the slots [begin, end) of their KV head: an online softmax
// over chunks of 32 slots, each lane scoring one slot of a chunk for every query. Where `fresh_last`,
// slot end - 1 is the step's new one, taken from `slots.fresh` (a quantized cache: the slot is
// written in the same launch). Query h's result goes to out + h * out_stride: its normalized output
// [HEAD_DIM] where `whole` (the run is all the slots), else its weighted values [HEAD_DIM], max
// score and sum of exponentials, for combine_runs.
// Each lane loads its dims of every slot of a chunk (or of half of one) before it adds the first:
// one wait for L2 a chunk, not one a slot. A plain cache's keys may come staged a chunk ahead (PlainSlots).
template <int HEAD_DIM, int QH, typename Slots>
__device__ void attention_run(const float* q, const float* q_sums, Slots slots, int begin, int end, bool fresh_last,
                              float* out, int out_stride, bool whole) {
  constexpr int per_lane = HEAD_DIM / 32, at_once = Slots::at_once;
  using Dims = typename Slots::Dims;
  const int lane = threadIdx.x % 32, cached_end = fresh_last ? end - 1 : end;
  float running_max[QH], sum_exp[QH], acc[QH][per_lane];
#pragma unroll
  for (int h = 0; h < QH; ++h) {
    running_max[h] = negative_infinity();
    sum_exp[h] = 0.0f;
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      acc[h][j] = 0.0f;
    }
  }
  if (begin < cached_end) {
    slots.stage_key(min(begin + lane, cached_end - 1));
  }
  for (int chunk = begin; chunk < cached_end; chunk += 32) {
    const int slot = chunk + lane;
    // Past the cached slots, the last one's values, which a weight of 0 leaves out.
    Dims dims[32];
#pragma unroll
    for (int t = 0; t < at_once; ++t) {
      dims[t] = slots.dims(min(chunk + t, cached_end - 1));
    }
    float score[QH];
#pragma unroll
    for (int h = 0; h < QH; ++h) {
      score[h] = slot < cached_end ? 0.0f : negative_infinity();
    }
    slots.keys_staged();
    if (slot < cached_end) {
      slots.score(slot, q, q_sums, score);
    }
    // A lane's row is its own: once it has scored its key, the next chunk's may overwrite it.
    if (chunk + 32 < cached_end) {
      slots.stage_key(min(chunk + 32 + lane, cached_end - 1));
    }
    float p[QH];
#pragma unroll
    for (int h = 0; h < QH; ++h) {
      const float new_max = fmaxf(running_max[h], warp_max(score[h]));
      const float correction = expf(running_max[h] - new_max);
      p[h] = slot < cached_end ? expf(score[h] - new_max) : 0.0f;
      sum_exp[h] = sum_exp[h] * correction + warp_sum(p[h]);
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        acc[h][j] *= correction;
      }
      slots.rescale(h, correction);
      running_max[h] = new_max;
    }
    if (slot < cached_end) {
      slots.add_value_biases(slot, p);
    }
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      if (t % at_once == 0 && t > 0) {
#pragma unroll
        for (int u = t; u < t + at_once; ++u) {
          dims[u] = slots.dims(min(chunk + u, cached_end - 1));
        }
      }
      slots.add_values(acc, p, t, dims[t]);
    }
  }
  if constexpr (Slots::quantized) {
    if (fresh_last) {
      float key[per_lane], value[per_lane];
      slots.fresh(key, value);
#pragma unroll
      for (int h = 0; h < QH; ++h) {
        const float score = fresh_score<HEAD_DIM>(q + h * HEAD_DIM, key);
        const float new_max = fmaxf(running_max[h], score);
        const float correction = expf(running_max[h] - new_max), p = expf(score - new_max);
        sum_exp[h] = sum_exp[h] * correction + p;
#pragma unroll
        for (int j = 0; j < per_lane; ++j) {
          acc[h][j] = acc[h][j] * correction + p * value[j];
        }
        slots.rescale(h, correction);
        running_max[h] = new_max;
      }
    }
  }
  slots.finish(acc);
#pragma unroll
  for (int h = 0; h < QH; ++h) {
    float* head_out = out + h * out_stride;
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      head_out[lane * per_lane + j] = whole ? acc[h][j] / sum_exp[h] : acc[h][j];
    }
    if (!whole && lane == 0) {
      head_out[HEAD_DIM] = running_max[h];
      head_out[HEAD_DIM + 1] = sum_exp[h];
    }
  }
}

// Bytes a warp asks L2 for at once (LayerCache::prefetch).
constexpr int PREFETCH_BYTES = 32768;

// Chunk `chunk` of PREFETCH_BYTES of the bytes [start, start + bytes), in whole 16-byte units, asked of
// L2 by one bulk prefetch (sm_90 on: one instruction and no register for it; before, a prefetch a
// 128-byte line), or nothing past the end.
__device__ inline void prefetch_l2(const char* start, size_t bytes, int chunk) {
  const size_t at = reinterpret_cast<size_t>(start), aligned = at & ~static_cast<size_t>(15);
  const size_t total = (bytes + at - aligned + 15) & ~static_cast<size_t>(15);
  const size_t offset = static_cast<size_t>(chunk) * PREFETCH_BYTES;
  if (offset >= total) {
    return;
  }
  const unsigned size = static_cast<unsigned>(min(total - offset, static_cast<size_t>(PREFETCH_BYTES)));
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(aligned + offset), "r"(size) : "memory");
#else
  for (unsigned line = 0; line < size; line += 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(aligned + offset + line));
  }
#endif
}

// A layer's cache as the layer kernels read and write it, for `seqs` sequences:
// - plain (KEY_BITS 0): 16-bit keys and values [seqs][KV_HEADS][capacity][HEAD_DIM]; step 1 writes
//   the new slot in place and attention reads it there after the barrier;
// - quantized: MLX's affine format along HEAD_DIM (mx.quantize, KV_GROUP values a scale and bias):
//   words [seqs][KV_HEADS][capacity][HEAD_DIM * BITS / 32], scales and biases
//   [seqs][KV_HEADS][capacity][HEAD_DIM / KV_GROUP]. A group is quantized from all its values, which
//   different warps compute, so step 1 leaves the new key and value in `fresh` (floats rounded to
//   the cache's type, [seqs][2][KV_HEADS][HEAD_DIM]); in step 2 a warp a group writes the slot
//   (store_fresh) while attention takes it from `fresh`, quantized the same way.
// Slot p holds position p (step.py sends other caches to the plain step). Sequence s of a launch
// is row rows[s] of the cache (rows null: row s): a check of drafted tokens gives several positions
// of one row, whose new slots step 1 writes before the barrier that attention waits behind.
template <int KV_HEADS, int HEAD_DIM, int KEY_BITS, int VALUE_BITS, int KV_GROUP, typename C, typename KS>
struct LayerCache {
  static constexpr bool quantized = KEY_BITS > 0;
  static constexpr int groups = quantized ? HEAD_DIM / KV_GROUP : 1;
  const C* keys;
  const C* values;
  const KS* key_scales;
  const KS* key_biases;
  const KS* value_scales;
  const KS* value_biases;
  int capacity;
  float* fresh;
  const int32_t* rows;

  // The row of `keys` (and of values, scales, biases) holding slot 0 of a sequence's KV head.
  __device__ size_t head_row(int seq, int kv_head) const {
    const int row = rows == nullptr ? seq : rows[seq];
    return (static_cast<size_t>(row) * KV_HEADS + kv_head) * capacity;
  }

  __device__ float* fresh_of(int seq, int part, int kv_head) const {
    return fresh + ((static_cast<size_t>(seq) * 2 + part) * KV_HEADS + kv_head) * HEAD_DIM;
  }

  // Dims d0, d1 of the new key (part 1) or value (part 2) of `head` at position `pos`.
  __device__ void store(int seq, int part, int head, int d0, int d1, float y0, float y1, int pos) const {
    if constexpr (quantized) {
      float* dst = fresh_of(seq, part - 1, head);
      dst[d0] = static_cast<float>(static_cast<KS>(y0));
      dst[d1] = static_cast<float>(static_cast<KS>(y1));
    } else {
      C* cache = const_cast<C*>(part == 1 ? keys : values);
      const size_t slot = (head_row(seq, head) + pos) * HEAD_DIM;
      cache[slot + d0] = static_cast<C>(y0);
      cache[slot + d1] = static_cast<C>(y1);
    }
  }

  // Asks L2 for a sequence's cached slots [0, slots) of every KV head (keys and values; a quantized
  // cache's words, scales and biases), a chunk of PREFETCH_BYTES a warp, from the launch's last warps
  // on: issued at the start of layer_kernel, the reads overlap step 1, whose weights leave HBM idle
  // most of the time, and attention then finds the slots in L2.
  __device__ void prefetch(int seq, int slots) const {
    constexpr int PARTS = quantized ? 6 : 2;
    const size_t row = head_row(seq, 0);
    const int widest = slots * HEAD_DIM * (quantized ? max(KEY_BITS, VALUE_BITS) / 8 : static_cast<int>(sizeof(C)));
    const int chunks = (widest + PREFETCH_BYTES - 1) / PREFETCH_BYTES;
    if (threadIdx.x % 32 != 0) {
      return;
    }
    for (int item = grid_warps() - 1 - grid_warp(); item < KV_HEADS * PARTS * chunks; item += grid_warps()) {
      const int chunk = item % chunks, part = item / chunks % PARTS, kv_head = item / (chunks * PARTS);
      const size_t first = row + static_cast<size_t>(kv_head) * capacity;
      const char* start;
      size_t bytes;
      if constexpr (quantized) {
        const int bits = part % 2 == 0 ? KEY_BITS : VALUE_BITS;
        if (part < 2) {
          start = reinterpret_cast<const char*>((part == 0 ? keys : values) + first * (HEAD_DIM * bits / 32));
          bytes = static_cast<size_t>(slots) * HEAD_DIM * bits / 8;
        } else {
          const KS* table[4] = {key_scales, value_scales, key_biases, value_biases};
          start = reinterpret_cast<const char*>(table[part - 2] + first * groups);
          bytes = static_cast<size_t>(slots) * groups * sizeof(KS);
        }
      } else {
        start = reinterpret_cast<const char*>((part == 0 ? keys : values) + first * HEAD_DIM);
        bytes = static_cast<size_t>(slots) * HEAD_DIM * sizeof(C);
      }
      prefetch_l2(start, bytes, chunk);
    }
  }

  // The KV head's slots as attention_run reads them; a plain cache's keys staged in `rows` (PlainSlots).
  template <int QH>
  __device__ auto slots(int seq, int kv_head, uint4* rows) const {
    const size_t row = head_row(seq, kv_head);
    if constexpr (quantized) {
      return QuantizedSlots<HEAD_DIM, QH, KEY_BITS, VALUE_BITS, KV_GROUP, KS>{
          keys + row * (HEAD_DIM * KEY_BITS / 32), key_scales + row * groups, key_biases + row * groups,
          values + row * (HEAD_DIM * VALUE_BITS / 32), value_scales + row * groups, value_biases + row * groups,
          fresh_of(seq, 0, kv_head), fresh_of(seq, 1, kv_head), {}};
    } else {
      return PlainSlots<HEAD_DIM, QH, C>{keys + row * HEAD_DIM, values + row * HEAD_DIM, rows};
    }
  }

  // Quantized: each sequence's new slot written from `fresh`, a warp a key or value of a KV head,
  // a lane HEAD_DIM / 32 dims (in whole bytes: kernels.takes_quantized_cache), taken by the launch's
  // last warps (the first take attention's first items).
  __device__ void store_fresh(int seqs, const int32_t* positions) const {
    if constexpr (quantized) {
      for (int item = grid_warps() - 1 - grid_warp(); item < seqs * 2 * KV_HEADS; item += grid_warps()) {
        const int kv_head = item % KV_HEADS, part = item / KV_HEADS % 2, seq = item / (2 * KV_HEADS);
        const size_t row = head_row(seq, kv_head) + positions[seq];
        if (part == 0) {
          store_dims<KEY_BITS>(fresh_of(seq, 0, kv_head), keys, key_scales, key_biases, row);
        } else {
          store_dims<VALUE_BITS>(fresh_of(seq, 1, kv_head), values, value_scales, value_biases, row);
        }
      }
    }
  }

  template <int BITS>
  __device__ void store_dims(const float* src, const C* words, const KS* scales, const KS* biases, size_t row) const {
    constexpr int per_lane = HEAD_DIM / 32;
    using Bits = typename Raw<per_lane * BITS / 8>::type;
    const int lane = threadIdx.x % 32;
    float x[per_lane];
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      x[j] = load_fresh(src + lane * per_lane + j);
    }
    uint32_t code[per_lane];
    float scale, bias;
    affine_quantize<BITS, KV_GROUP>(x, code, scale, bias);
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      packed[j * BITS / 32] |= code[j] << (j * BITS % 32);
    }
    unsigned char* row_bytes = reinterpret_cast<unsigned char*>(const_cast<C*>(words) + row * (HEAD_DIM * BITS / 32));
    Bits* dst = reinterpret_cast<Bits*>(row_bytes + lane * per_lane * BITS / 8);
    if constexpr (sizeof(Bits) == 8) {
      *dst = make_uint2(packed[0], packed[1]);
    } else {
      *dst = static_cast<Bits>(packed[0]);
    }
    if (lane % (KV_GROUP / per_lane) == 0) {
      const int g = lane * per_lane / KV_GROUP;
      const_cast<KS*>(scales)[row * groups + g] = static_cast<KS>(scale);
      const_cast<KS*>(biases)[row * groups + g] = static_cast<KS>(bias);
    }
  }
};

// The calling warp waits until `count` reaches `target`: lane 0 polls it with acquire loads, so the
// writes made before each increment are seen after it.
__device__ inline void wait_for_count(const unsigned int* count, int target) {
  if (threadIdx.x % 32 == 0) {
    unsigned int seen;
    do {
      asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
    } while (seen < static_cast<unsigned int>(target));
  }
  __syncwarp();
}

// Sets of runs combine_runs splits a warp's lanes into: as many as keep a lane's dims at 8 or fewer.
__host__ __device__ constexpr int combine_sets(int head_dim) {
  int sets = 1;
  while (sets < 32 && head_dim * sets * 2 / 32 <= 8) {
    sets *= 2;
  }
  return sets;
}

// The largest score over a head's runs (partials [splits][HEAD_DIM + 2]) and the sum of
// exponentials scaled to it, in one pass, reduced across the warp: every lane gets both.
template <int HEAD_DIM>
__device__ void largest_score_and_sum(const float* partials, int splits, float& top, float& den) {
  constexpr int stride = HEAD_DIM + 2;
  const int lane = threadIdx.x % 32;
  top = negative_infinity();
  den = 0.0f;
  for (int s = lane; s < splits; s += 32) {
    const float m = __ldcg(partials + s * stride + HEAD_DIM), l = __ldcg(partials + s * stride + HEAD_DIM + 1);
    const float new_top = fmaxf(top, m);
    den = den * expf(top - new_top) + l * expf(m - new_top);
    top = new_top;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_top = __shfl_xor_sync(0xffffffff, top, offset);
    const float other_den = __shfl_xor_sync(0xffffffff, den, offset);
    const float new_top = fmaxf(top, other_top);
    // A lane that saw no run holds (-inf, 0): its term is 0, never inf - inf.
    den = (den > 0.0f ? den * expf(top - new_top) : 0.0f) + (other_den > 0.0f ? other_den * expf(other_top - new_top) : 0.0f);
    top = new_top;
  }
}

// One warp combines a head's runs (partials [splits][HEAD_DIM + 2], none empty) into its output.
// The lanes are split into sets that each take every sets-th run, a lane a few dims of them, so
// that a lane's loads of several runs are in flight together; the sets' sums are added by shuffles.
template <int HEAD_DIM>
__device__ void combine_runs(const float* partials, int splits, float* out) {
  constexpr int stride = HEAD_DIM + 2, sets = combine_sets(HEAD_DIM), dims = HEAD_DIM * sets / 32;
  static_assert(dims % 2 == 0, "dims in pairs (float2 loads)");
  const int lane = threadIdx.x % 32, set = lane / (32 / sets), first = lane % (32 / sets) * dims;
  float top, den;
  largest_score_and_sum<HEAD_DIM>(partials, splits, top, den);
  float num[dims];
#pragma unroll
  for (int j = 0; j < dims; ++j) {
    num[j] = 0.0f;
  }
#pragma unroll 8
  for (int s = set; s < splits; s += sets) {
    const float* run = partials + s * stride;
    const float weight = expf(__ldcg(run + HEAD_DIM) - top);
#pragma unroll
    for (int j = 0; j < dims; j += 2) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(run + first + j));
      num[j] += weight * v.x;
      num[j + 1] += weight * v.y;
    }
  }
#pragma unroll
  for (int j = 0; j < dims; ++j) {
#pragma unroll
    for (int offset = 16; offset >= 32 / sets; offset >>= 1) {
      num[j] += __shfl_xor_sync(0xffffffff, num[j], offset);
    }
  }
  if (set == 0) {
#pragma unroll
    for (int j = 0; j < dims; ++j) {
      out[first + j] = num[j] / den;
    }
  }
}

// One sequence's run over a plain cache, or one quantized in groups of 32 (KeyRows, ValueRows:
// PlainTensorRows, QuantizedTensorRows), on tensor cores (mma.sync m16n8k16: float16 operands,
// float32 sums), computing what attention_run computes: the warp's query heads are rows of A (rows
// QH to 15 zero, their results unused) and 8 slots the columns of a product, so 32 slots are 16
// products for their scores and 16 for their values, where attention_run has a lane score its slot
// by HEAD_DIM multiply-adds a head and take every slot's weight by a shuffle. A product's k order
// is free as long as both operands follow it: lane t of a quad holds the same 8 dims of each part
// of a query and of a key (the key rows' part_of), its first k step a part's pairs 0 and 1, the
// second pairs 2 and 3 (pair_first), so a lane reads its dims of a key row together, as the cache
// stores them. Values are read the same way, as rows of 8x8 matrices (slots by dims), and made B
// operands by movmatrix's transpose; the output's columns follow, lane t of a quad ending with the
// value rows' dims of each part of its head. Scores and the online softmax stay in the products'
// accumulators; a head's largest score and sum take two shuffles across its quad. A step takes 4
// groups of 8 slots, each lane a key and a value row of each. The next step's keys are loaded once
// this step's are scored, its values once this step's are added: one sequence at depth 8,192
// decoded 1.13x as fast as with each step's rows loaded at its start, though ptxas spills 120 bytes
// a thread for it (docs/benchmarks.md, "One sequence's attention on tensor cores"); over an 8- or
// 4-bit cache one sequence at depth 8,192 decoded 1.18x as fast as through attention_run, level
// with the plain cache ("Quantized caches on tensor cores"). Heads of up to 64 dims
// (TENSOR_RUNS_MAX_HEAD_DIM): for 128 the rows would spill far more, and attention_run takes them.
// layer_kernel only: in batch_layer_kernel, whose runs are longer and whose registers are fewer, it
// decoded slower than attention_run.
__device__ inline uint32_t half_pair(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

__device__ inline uint32_t transposed(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// c0, c1 += row lane / 4 of A * B, for an A whose rows 8-15 are zero (a0, a2 given).
__device__ inline void mma_rows_0_7(float& c0, float& c1, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  [[maybe_unused]] float unused0, unused1;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %5}, {%7, %8}, "
      "{%0, %1, %9, %9};"
      : "+f"(c0), "+f"(c1), "=f"(unused0), "=f"(unused1)
      : "r"(a0), "r"(0u), "r"(a2), "r"(b0), "r"(b1), "f"(0.0f));
}

// A lane's row (lane / 4) of each of the 4 groups of 8 slots of a tensor_attention_run step from
// `first` (Rows::load); past the last slot the last one's, which a weight of 0 leaves out.
template <typename Rows>
__device__ inline void step_rows(const Rows& rows, int first, int end, typename Rows::Loaded (&loaded)[4]) {
  const int g = threadIdx.x % 32 / 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    rows.load(min(first + 8 * j + g, end - 1), loaded[j]);
  }
}

template <int HEAD_DIM, int QH, typename KeyRows, typename ValueRows>
__device__ void tensor_attention_run(const float* q, const KeyRows& keys, const ValueRows& values, int begin, int end,
                                     float* out, int out_stride, bool whole) {
  static_assert(KeyRows::PARTS * 32 == HEAD_DIM && ValueRows::PARTS * 32 == HEAD_DIM && tensor_runs_take(HEAD_DIM, 0)
                && QH <= 8, "8 rows of A");
  constexpr int PARTS = HEAD_DIM / 32, SLOT_GROUPS = 4;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t query[PARTS][4];
#pragma unroll
  for (int e = 0; e < PARTS; ++e) {
    const float* dims = KeyRows::part_of(q + g * HEAD_DIM, t, e);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int first = KeyRows::pair_first(i);
      query[e][i] = g < QH ? half_pair(dims[first], dims[first + KeyRows::PAIR_SPREAD]) : 0u;
    }
  }
  float running_max = negative_infinity(), sum_exp = 0.0f, acc[PARTS][4][2];
#pragma unroll
  for (int e = 0; e < PARTS; ++e) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      acc[e][m][0] = acc[e][m][1] = 0.0f;
    }
  }
  typename KeyRows::Loaded key[SLOT_GROUPS];
  typename ValueRows::Loaded value[SLOT_GROUPS];
  step_rows(keys, begin, end, key);
  step_rows(values, begin, end, value);
  for (int first = begin; first < end; first += 8 * SLOT_GROUPS) {
    const int next = first + 8 * SLOT_GROUPS;
    float score[SLOT_GROUPS][2], top = negative_infinity();
#pragma unroll
    for (int j = 0; j < SLOT_GROUPS; ++j) {
      score[j][0] = score[j][1] = 0.0f;
#pragma unroll
      for (int e = 0; e < PARTS; ++e) {
        const uint4 k = KeyRows::halves(key[j], e);
        mma_rows_0_7(score[j][0], score[j][1], query[e][0], query[e][1], k.x, k.y);
        mma_rows_0_7(score[j][0], score[j][1], query[e][2], query[e][3], k.z, k.w);
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (first + 8 * j + 2 * t + i >= end) {
          score[j][i] = negative_infinity();
        }
        top = fmaxf(top, score[j][i]);
      }
    }
    if (next < end) {
      step_rows(keys, next, end, key);
    }
    top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, 2));
    const float new_max = fmaxf(running_max, top), correction = expf(running_max - new_max);
    running_max = new_max;
    sum_exp *= correction;
    uint32_t weights[SLOT_GROUPS];
#pragma unroll
    for (int j = 0; j < SLOT_GROUPS; ++j) {
      const float p0 = expf(score[j][0] - new_max), p1 = expf(score[j][1] - new_max);
      sum_exp += p0 + p1;
      weights[j] = half_pair(p0, p1);
    }
    // k step s: slots 16s .. 16s + 15 of the step, weighted from the score columns of groups 2s
    // and 2s + 1, with the values of the same groups' rows.
#pragma unroll
    for (int e = 0; e < PARTS; ++e) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        acc[e][m][0] *= correction;
        acc[e][m][1] *= correction;
      }
#pragma unroll
      for (int s = 0; s < SLOT_GROUPS / 2; ++s) {
        const uint4 low = ValueRows::halves(value[2 * s], e), high = ValueRows::halves(value[2 * s + 1], e);
        const uint32_t lows[4] = {low.x, low.y, low.z, low.w}, highs[4] = {high.x, high.y, high.z, high.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          mma_rows_0_7(acc[e][m][0], acc[e][m][1], weights[2 * s], weights[2 * s + 1], transposed(lows[m]),
                       transposed(highs[m]));
        }
      }
    }
    if (next < end) {
      step_rows(values, next, end, value);
    }
  }
  sum_exp += __shfl_xor_sync(0xffffffff, sum_exp, 1);
  sum_exp += __shfl_xor_sync(0xffffffff, sum_exp, 2);
  if (g < QH) {
    float* head_out = out + g * out_stride;
#pragma unroll
    for (int e = 0; e < PARTS; ++e) {
      float* dims = ValueRows::part_of(head_out, t, e);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float y0 = whole ? acc[e][m][0] / sum_exp : acc[e][m][0];
        const float y1 = whole ? acc[e][m][1] / sum_exp : acc[e][m][1];
        const int first = ValueRows::pair_first(m);
        if constexpr (ValueRows::PAIR_SPREAD == 1) {
          // float2: a run's partials are HEAD_DIM + 2 floats apart, so only 8-byte aligned.
          *reinterpret_cast<float2*>(dims + first) = make_float2(y0, y1);
        } else {
          dims[first] = y0;
          dims[first + ValueRows::PAIR_SPREAD] = y1;
        }
      }
    }
    if (!whole && t == 0) {
      head_out[HEAD_DIM] = running_max;
      head_out[HEAD_DIM + 1] = sum_exp;
    }
  }
}

// A quantized cache's new slot as a run of its own, beside tensor_attention_run's over the cached
// slots (team_attention): the slot's key and value as the cache stores them (QuantizedSlots::fresh,
// which quantizes them from `fresh`), scored for the warp's QH queries. out as the runs write it:
// the value itself where `whole` (the only slot), else the value at weight 1, its score the largest.
template <int HEAD_DIM, int QH, typename Slots>
__device__ void fresh_slot_run(const float* q, const Slots& slots, float* out, int out_stride, bool whole) {
  constexpr int per_lane = HEAD_DIM / 32;
  const int lane = threadIdx.x % 32;
  float key[per_lane], value[per_lane];
  slots.fresh(key, value);
#pragma unroll
  for (int h = 0; h < QH; ++h) {
    const float score = fresh_score<HEAD_DIM>(q + h * HEAD_DIM, key);
    float* head_out = out + h * out_stride;
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      head_out[lane * per_lane + j] = value[j];
    }
    if (!whole && lane == 0) {
      head_out[HEAD_DIM] = score;
      head_out[HEAD_DIM + 1] = 1.0f;
    }
  }
}

// Whether a quantized cache's new slot is a run of its own (fresh_slot_run, team_attention's last
// run), as over one on tensor cores.
__host__ __device__ constexpr bool fresh_run(bool tensor_runs, bool quantized) {
  return tensor_runs && quantized;
}

// The sum of group g of the staged queries (groups of SIZE values), which a quantized cache's bias
// multiplies in a score (QuantizedSlots::score's q_sums).
template <int SIZE>
__device__ inline float group_sum(const float* q_scaled, int g) {
  float sum = 0.0f;
  for (int d = 0; d < SIZE; ++d) {
    sum += q_scaled[g * SIZE + d];
  }
  return sum;
}

// Step 2 of batch_layer_kernel: attention of `seqs` sequences, sequence s at positions[s] with its
// query in q [seqs][HEADS * HEAD_DIM] (RoPE applied) and its keys and values in `cache` (LayerCache:
// the new slot written, or for a quantized cache in `fresh`, stored here). A head group is the QH
// query heads a warp takes (query_heads). Each group's slots are cut into runs of whole chunks of 32
// slots, as few chunks a run as MAX_RUNS runs allow; a warp takes a (sequence, group, run) item. A
// group of one run writes its outputs to attn [seqs][HEADS * HEAD_DIM] at once; otherwise the last
// min(QH, runs) warps done with a group's runs each wait for the others and combine some of its heads.
// partials: [seqs][HEADS][runs a head][HEAD_DIM + 2]; runs_done: a count for each sequence and group,
// zero before, made zero again by reset_runs_done after the next grid barrier. Waiting is safe because
// step.py sizes MAX_RUNS so that every item has a warp of its own (all resident) wherever a group has
// more than one run. STAGED_KEYS: a plain cache's keys are staged in shared memory after the queries
// (PlainSlots), where step.py found room for them (kernels.attention_floats). (One sequence's
// attention, layer_kernel's, is team_attention's, below.)
template <int HEADS, int KV_HEADS, int HEAD_DIM, int MAX_RUNS, bool STAGED_KEYS, typename Cache>
__device__ void attention_items(int seqs, const int32_t* positions, const float* q, float* partials, float* attn,
                                const Cache& cache, unsigned int* runs_done, float* smem) {
  constexpr int QH = query_heads(HEADS / KV_HEADS, false);
  constexpr int GROUPS = head_groups<HEADS, KV_HEADS, false>();
  constexpr int stride = MAX_RUNS * (HEAD_DIM + 2), q_groups = Cache::groups;
  cache.store_fresh(seqs, positions);
  const int warp = grid_warp(), warps = grid_warps(), lane = threadIdx.x % 32;
  float* q_scaled = smem + threadIdx.x / 32 * QH * HEAD_DIM;
  float* q_sums = smem + LAYER_WARPS * QH * HEAD_DIM + threadIdx.x / 32 * QH * q_groups;
  uint4* key_rows = nullptr;
  if constexpr (STAGED_KEYS && !Cache::quantized) {
    key_rows = reinterpret_cast<uint4*>(smem + LAYER_WARPS * QH * (HEAD_DIM + HEAD_DIM / 32)) +
               threadIdx.x / 32 * 32 * staged_key_units<HEAD_DIM>();
  }
  const float scale = rsqrtf(static_cast<float>(HEAD_DIM));
  for (int item = warp; item < seqs * GROUPS * MAX_RUNS; item += warps) {
    const int r = item / (seqs * GROUPS), seq = item % (seqs * GROUPS) / GROUPS, group = item % GROUPS;
    const int slots = positions[seq] + 1, chunks = (slots + 31) / 32;
    const int run = (chunks + MAX_RUNS - 1) / MAX_RUNS * 32, runs = (slots + run - 1) / run;
    if (r >= runs) {
      continue;
    }
    const int head = group * QH, kv_head = head / (HEADS / KV_HEADS), seq_head = seq * HEADS + head;
#pragma unroll
    for (int d = lane; d < QH * HEAD_DIM; d += 32) {
      q_scaled[d] = load_fresh(q + seq_head * HEAD_DIM + d) * scale;
    }
    __syncwarp();
    if (Cache::quantized && lane < QH * q_groups) {
      q_sums[lane] = group_sum<HEAD_DIM / q_groups>(q_scaled, lane);
    }
    __syncwarp();
    const auto head_slots = cache.template slots<QH>(seq, kv_head, key_rows);
    const int end = min(r * run + run, slots);
    float* group_partials = partials + static_cast<size_t>(seq_head) * stride;
    if (runs == 1) {
      attention_run<HEAD_DIM, QH>(q_scaled, q_sums, head_slots, 0, slots, Cache::quantized,
                                  attn + seq_head * HEAD_DIM, HEAD_DIM, true);
      continue;
    }
    attention_run<HEAD_DIM, QH>(q_scaled, q_sums, head_slots, r * run, end, Cache::quantized && end == slots,
                                group_partials + r * (HEAD_DIM + 2), stride, false);
    __threadfence();
    __syncwarp();
    unsigned int* done = runs_done + seq * GROUPS + group;
    unsigned int arrived = 0;
    if (lane == 0) {
      arrived = atomicAdd(done, 1u) + 1;
    }
    const int rank = runs - static_cast<int>(__shfl_sync(0xffffffff, arrived, 0)), combiners = min(QH, runs);
    if (rank >= combiners) {
      continue;
    }
    wait_for_count(done, runs);
    __threadfence();
    for (int h = rank; h < QH; h += combiners) {
      combine_runs<HEAD_DIM>(group_partials + h * stride, runs, attn + (seq_head + h) * HEAD_DIM);
    }
  }
}

// Dim d of one head's `count` results (runs' or teams'), result i at row(i) as a run writes it (weighted
// values [HEAD_DIM], largest score, sum of exponentials), each float read by `read`, merged: their
// largest score (top), their sums scaled to it (den) and dim d's weighted values too (num).
template <int HEAD_DIM, typename Row, typename Read>
__device__ inline void merge_results(int count, int d, Row row, Read read, float& top, float& den, float& num) {
  top = negative_infinity();
  for (int i = 0; i < count; ++i) {
    top = fmaxf(top, read(row(i) + HEAD_DIM));
  }
  den = num = 0.0f;
  for (int i = 0; i < count; ++i) {
    const float* result = row(i);
    const float weight = expf(read(result + HEAD_DIM) - top);
    den += weight * read(result + HEAD_DIM + 1);
    num += weight * read(result + d);
  }
}

// Step 2 of layer_kernel: one sequence's attention (its query q [HEADS * HEAD_DIM], RoPE applied; the
// cache as attention_items takes it), cut so that a head group's runs are combined where they are
// computed. A block takes a (head group, team) item: its warps take LAYER_WARPS consecutive runs of the
// group's slots, a run each, write their results to shared memory and, after a block barrier, combine
// them into one partial result a head. A group has as few teams as its runs allow (one where they fit
// a block, which then writes the heads' outputs to attn); of several, the last done, counted in
// teams_done (made zero by reset_runs_done), combines their partials, read from L2. Nothing waits for
// another block, so any grid is safe. Runs are as short as a block a group allows, one chunk of 32
// slots at least (one chunk up to 8,192 slots on a 132-SM GPU). Before, a warp took a run of whole
// chunks anywhere in the grid and the last warps done with a group's 128 runs waited for the others
// and combined a head's runs each, alone: one sequence decoded 1.06x as fast at depth 8,192 and 1.10x
// at depth 0 this way (docs/benchmarks.md, "Attention in teams"). Runs as over attention_items: on
// tensor cores where TENSOR_RUNS (a quantized cache's new slot a run of its own, fresh_slot_run), else
// attention_run's (FEWER_HEADS: query_heads' `fewer`; STAGED_KEYS: a plain cache's keys staged).
// Shared memory: the group's scaled queries (and their group sums), the block's runs' results
// [LAYER_WARPS][QH][HEAD_DIM + 2], then the staged keys (kernels.team_attention_floats).
template <int HEADS, int KV_HEADS, int HEAD_DIM, int MAX_RUNS, bool FEWER_HEADS, bool STAGED_KEYS, bool TENSOR_RUNS,
          typename Cache>
__device__ void team_attention(const int32_t* position, const float* q, float* partials, float* attn,
                               const Cache& cache, unsigned int* teams_done, float* smem) {
  constexpr int QH = query_heads(HEADS / KV_HEADS, FEWER_HEADS);
  constexpr int GROUPS = head_groups<HEADS, KV_HEADS, FEWER_HEADS>();
  constexpr bool FRESH_RUN = fresh_run(TENSOR_RUNS, Cache::quantized);
  constexpr int ROW = HEAD_DIM + 2, stride = MAX_RUNS * ROW, q_groups = Cache::groups;
  constexpr int RESULTS = (QH * (HEAD_DIM + q_groups) + 3) / 4 * 4;
  cache.store_fresh(1, position);
  const int warp = threadIdx.x / 32;
  float* q_scaled = smem;
  float* q_sums = smem + QH * HEAD_DIM;
  float* results = smem + RESULTS;
  uint4* key_rows = nullptr;
  if constexpr (STAGED_KEYS && !Cache::quantized) {
    key_rows = reinterpret_cast<uint4*>(results + LAYER_WARPS * QH * ROW) + warp * 32 * staged_key_units<HEAD_DIM>();
  }
  __shared__ unsigned int arrived;
  const int slots = position[0] + 1, cached = slots - FRESH_RUN, chunks = (cached + 31) / 32;
  const int most_teams = max(1, min(MAX_RUNS, static_cast<int>(gridDim.x) / GROUPS));
  const int most_runs = most_teams * LAYER_WARPS - FRESH_RUN;
  const int run = max(1, (chunks + most_runs - 1) / most_runs) * 32, runs = (cached + run - 1) / run + FRESH_RUN;
  const int teams = (runs + LAYER_WARPS - 1) / LAYER_WARPS;
  const float scale = rsqrtf(static_cast<float>(HEAD_DIM));
  for (int item = blockIdx.x; item < GROUPS * teams; item += gridDim.x) {
    const int group = item % GROUPS, team = item / GROUPS, head = group * QH, kv_head = head / (HEADS / KV_HEADS);
    __syncthreads();  // the block's previous item has read its queries and results
    for (int d = threadIdx.x; d < QH * HEAD_DIM; d += blockDim.x) {
      q_scaled[d] = load_fresh(q + head * HEAD_DIM + d) * scale;
    }
    __syncthreads();
    if constexpr (Cache::quantized && !TENSOR_RUNS) {
      if (threadIdx.x < QH * q_groups) {
        q_sums[threadIdx.x] = group_sum<HEAD_DIM / q_groups>(q_scaled, threadIdx.x);
      }
      __syncthreads();
    }
    const int r = team * LAYER_WARPS + warp, begin = r * run, end = min(begin + run, cached);
    if (r < runs) {
      const auto head_slots = cache.template slots<QH>(0, kv_head, key_rows);
      const bool whole = runs == 1;
      float* out = whole ? attn + head * HEAD_DIM : results + warp * QH * ROW;
      const int out_stride = whole ? HEAD_DIM : ROW;
      if (FRESH_RUN && r == runs - 1) {
        if constexpr (FRESH_RUN) {  // compiled only where the slots have a fresh one
          fresh_slot_run<HEAD_DIM, QH>(q_scaled, head_slots, out, out_stride, whole);
        }
      } else if constexpr (TENSOR_RUNS) {
        tensor_attention_run<HEAD_DIM, QH>(q_scaled, head_slots.tensor_keys(), head_slots.tensor_values(), begin, end,
                                           out, out_stride, whole);
      } else {
        attention_run<HEAD_DIM, QH>(q_scaled, q_sums, head_slots, begin, end, Cache::quantized && end == slots, out,
                                    out_stride, whole);
      }
    }
    if (runs == 1) {
      continue;
    }
    __syncthreads();
    const int members = min(LAYER_WARPS, runs - team * LAYER_WARPS);
    const bool last = teams == 1;
    float* group_partials = partials + static_cast<size_t>(head) * stride + team * ROW;
    for (int i = threadIdx.x; i < QH * HEAD_DIM; i += blockDim.x) {
      const int h = i / HEAD_DIM, d = i % HEAD_DIM;
      float top, den, num;
      merge_results<HEAD_DIM>(
          members, d, [=](int m) { return results + (m * QH + h) * ROW; }, [](const float* p) { return *p; }, top, den,
          num);
      if (last) {
        attn[(head + h) * HEAD_DIM + d] = num / den;
      } else {
        float* partial = group_partials + h * stride;
        partial[d] = num;
        if (d == 0) {
          partial[HEAD_DIM] = top;
          partial[HEAD_DIM + 1] = den;
        }
      }
    }
    if (last) {
      continue;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      arrived = atomicAdd(teams_done + group, 1u) + 1;
    }
    __syncthreads();
    if (arrived < static_cast<unsigned int>(teams)) {
      continue;
    }
    __threadfence();
    for (int i = threadIdx.x; i < QH * HEAD_DIM; i += blockDim.x) {
      const int h = i / HEAD_DIM, d = i % HEAD_DIM;
      float top, den, num;
      const float* head_partials = partials + static_cast<size_t>(head + h) * stride;
      merge_results<HEAD_DIM>(
          teams, d, [=](int t) { return head_partials + t * ROW; }, [](const float* p) { return __ldcg(p); }, top, den,
          num);
      attn[(head + h) * HEAD_DIM + d] = num / den;
    }
  }
}

// After the grid barrier that follows attention_items or team_attention: their counts made zero for the next launch.
template <int HEADS, int KV_HEADS, bool FEWER_HEADS>
__device__ void reset_runs_done(int seqs, unsigned int* runs_done) {
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < seqs * head_groups<HEADS, KV_HEADS, FEWER_HEADS>(); i += blockDim.x) {
      runs_done[i] = 0;
    }
  }
}

// One layer of one sequence's decode step, y = the layer's output for input x (both float32):
//   1. RMSNorm, Q/K/V, RoPE; the new key and value into the cache buffers in place (qkv_rope_pair);
//   2. attention, a block's warps runs of one head group's slots, combined by the block and across
//      blocks by the last done (team_attention), the cached slots asked of L2 at the launch's start;
//   3. output projection + residual -> h;
//   4. RMSNorm, gate and up -> gate, up;
//   5. SiLU(gate) * up, down projection + residual -> y.
// `scratch` holds what one step hands the next: q, partials [HEADS][MAX_RUNS][HEAD_DIM + 2] (a team's
// row each), attn, h, gate, up and a quantized cache's fresh key and value [2][KV_HEADS * HEAD_DIM]
// (float32 each). It and `sync` are inputs that the kernel writes: step.py allocates them once for all
// layers, since every output costs MLX an allocation a launch. `sync`: arrivals (an unsigned 64-bit
// count, words 0-1) and from word 32 on, for each head group, its teams done so far (made zero again
// after the barrier that follows attention); all zero when first used.
template <int Q_BITS, bool Q_BIASES, int K_BITS, bool K_BIASES, int V_BITS, bool V_BIASES, bool BIAS, int HEADS,
          int KV_HEADS, int HEAD_DIM, int ROPE_DIM, bool TRADITIONAL, int HIDDEN, int O_BITS, bool O_BIASES,
          int GATE_BITS, bool GATE_BIASES, int UP_BITS, bool UP_BIASES, int DOWN_BITS, bool DOWN_BIASES, int FFN,
          int KEY_BITS, int VALUE_BITS, int KV_GROUP, int FFN_ROWS, int MAX_RUNS, bool STAGED_KEYS, typename N,
          typename S, typename B, typename C, typename KS>
__device__ void layer_kernel(const float* x, const N* attn_norm, const float* eps, const uint32_t* w_q, const S* s_q,
                             const S* b_q, const uint32_t* w_k, const S* s_k, const S* b_k, const uint32_t* w_v,
                             const S* s_v, const S* b_v, const B* bias_q, const B* bias_k, const B* bias_v,
                             const int32_t* position, const float* inv_freq, const float* attn_factor,
                             const C* keys, const C* values, const KS* key_scales, const KS* key_biases,
                             const KS* value_scales, const KS* value_biases, int capacity, const uint32_t* w_o,
                             const S* s_o, const S* b_o, const N* ffn_norm, const uint32_t* w_gate, const S* s_gate,
                             const S* b_gate, const uint32_t* w_up, const S* s_up, const S* b_up,
                             const uint32_t* w_down, const S* s_down, const S* b_down, const uint32_t* sync,
                             const float* scratch, float* y) {
  float* q = const_cast<float*>(scratch);
  float* partials = q + HEADS * HEAD_DIM;
  constexpr bool TENSOR_RUNS = tensor_runs_take(HEAD_DIM, KV_GROUP);
  constexpr bool FEWER_HEADS = KEY_BITS > 0 && !TENSOR_RUNS;
  float* attn = partials + HEADS * MAX_RUNS * (HEAD_DIM + 2);
  float* h = attn + HEADS * HEAD_DIM;
  float* gate = h + HIDDEN;
  float* up = gate + FFN;
  const LayerCache<KV_HEADS, HEAD_DIM, KEY_BITS, VALUE_BITS, KV_GROUP, C, KS> cache{
      keys, values, key_scales, key_biases, value_scales, value_biases, capacity, up + FFN, nullptr};
  float* smem = shared_floats();
  unsigned long long* arrivals = reinterpret_cast<unsigned long long*>(const_cast<uint32_t*>(sync));
  unsigned int* teams_done = const_cast<uint32_t*>(sync) + 32;
  const int warp = grid_warp(), warps = grid_warps(), lane = threadIdx.x % 32;

  cache.prefetch(0, position[0]);
  stage_input<true, HIDDEN, LAYER_THREADS>(x, attn_norm, eps[0], smem);
  for (int pair = warp; pair < (HEADS + 2 * KV_HEADS) * HEAD_DIM / 2; pair += warps) {
    qkv_rope_pair<Q_BITS, Q_BIASES, K_BITS, K_BIASES, V_BITS, V_BIASES, BIAS, HEADS, KV_HEADS, HEAD_DIM, ROPE_DIM,
                  TRADITIONAL, HIDDEN>(pair, smem, w_q, s_q, b_q, w_k, s_k, b_k, w_v, s_v, b_v, bias_q, bias_k,
                                       bias_v, position, inv_freq, attn_factor, cache, q);
  }
  grid_barrier(arrivals);

  team_attention<HEADS, KV_HEADS, HEAD_DIM, MAX_RUNS, FEWER_HEADS, STAGED_KEYS, TENSOR_RUNS>(
      position, q, partials, attn, cache, teams_done, smem);
  grid_barrier(arrivals);
  reset_runs_done<HEADS, KV_HEADS, FEWER_HEADS>(1, teams_done);

  // Where a step's matrices are all 4-bit, its staged input is divided for their prescaled codes.
  constexpr bool O_PRESCALED = O_BITS == 4, FFN_PRESCALED = GATE_BITS == 4 && UP_BITS == 4;
  constexpr bool DOWN_PRESCALED = DOWN_BITS == 4;
  stage_input<false, HEADS * HEAD_DIM, LAYER_THREADS>(attn, attn_norm, 0.0f, smem);
  if constexpr (O_PRESCALED) {
    prescale_staged<HEADS * HEAD_DIM, LAYER_THREADS>(smem);
  }
  for (int row = warp; row < HIDDEN; row += warps) {
    float dot;
    rows_dot<O_BITS, O_BIASES, HEADS * HEAD_DIM, 1, O_PRESCALED>(w_o, s_o, b_o, &row, smem, &dot);
    if (lane == 0) {
      h[row] = x[row] + dot;
    }
  }
  grid_barrier(arrivals);

  // Gate and up rows as separate items of FFN_ROWS rows each, whose loads a warp issues together.
  stage_input<true, HIDDEN, LAYER_THREADS>(h, ffn_norm, eps[0], smem);
  if constexpr (FFN_PRESCALED) {
    prescale_staged<HIDDEN, LAYER_THREADS>(smem);
  }
  constexpr int ffn_items = (FFN + FFN_ROWS - 1) / FFN_ROWS;
  for (int item = warp; item < 2 * ffn_items; item += warps) {
    const bool is_up = item >= ffn_items;
    const int first = (item - (is_up ? ffn_items : 0)) * FFN_ROWS;
    int rows[FFN_ROWS];
    rows_from<FFN_ROWS>(first, FFN, rows);
    float out[FFN_ROWS];
    if (is_up) {
      rows_dot<UP_BITS, UP_BIASES, HIDDEN, FFN_ROWS, FFN_PRESCALED>(w_up, s_up, b_up, rows, smem, out);
    } else {
      rows_dot<GATE_BITS, GATE_BIASES, HIDDEN, FFN_ROWS, FFN_PRESCALED>(w_gate, s_gate, b_gate, rows, smem, out);
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < FFN_ROWS; ++r) {
        if (first + r < FFN) {
          (is_up ? up : gate)[first + r] = out[r];
        }
      }
    }
  }
  grid_barrier(arrivals);

  stage_swiglu<FFN, LAYER_THREADS>(gate, up, smem);
  if constexpr (DOWN_PRESCALED) {
    prescale_staged<FFN, LAYER_THREADS>(smem);
  }
  for (int row = warp; row < HIDDEN; row += warps) {
    float dot;
    rows_dot<DOWN_BITS, DOWN_BIASES, FFN, 1, DOWN_PRESCALED>(w_down, s_down, b_down, &row, smem, &dot);
    if (lane == 0) {
      y[row] = load_fresh(h + row) + dot;
    }
  }
}

// MLX writes the kernel's __global__ function and gives it no launch bounds, so the compiler may use
// more than the 128 registers a thread that 512-thread blocks allow, and the launch then fails (the
// layer kernels' attention, with its accumulators for several query heads, would take more). Every
// __global__ function after this header gets them. (Spelled as the attribute the qualifier stands
// for: NVRTC takes no macro around the qualifier.)
#undef __global__
#define __global__ __attribute__((global)) __attribute__((launch_bounds(512)))
