// Kernels of cuda_step.py: one decode step of one sequence, five launches a layer.
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

// Threads a block of every kernel but attention_kernel's (cuda_step.py launches them so): as a
// constant, the staging loops unroll and issue all their loads at once.
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
template <int K>
__device__ void stage_group_sums(float* smem) {
  __syncthreads();
  float* gsum = smem + K / GROUP * GROUP_STRIDE;
  for (int g = threadIdx.x; g < K / GROUP; g += THREADS) {
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

// The input x (times 1 / rms(x) * norm_w when NORM).
template <bool NORM, int K, typename T, typename N>
__device__ void stage_input(const T* x, const N* norm_w, float eps, float* smem) {
  constexpr int per_thread = (K + THREADS - 1) / THREADS;
  float v[per_thread], w[per_thread];
#pragma unroll
  for (int i = 0; i < per_thread; ++i) {
    const int k = threadIdx.x + i * THREADS;
    v[i] = k < K ? static_cast<float>(x[k]) : 0.0f;
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
    for (int i = 0; i < THREADS / 32; ++i) {
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
    const int k = threadIdx.x + i * THREADS;
    if (k < K) {
      staged(smem, k) = v[i];
    }
  }
  stage_group_sums<K>(smem);
}

// Most runs of slots a head's attention is split into (cuda_step.py's MAX_SPLITS).
constexpr int MAX_SPLITS = 32;

// The attention output: each head's partial results [splits][HEAD_DIM + 2] (weighted values, their
// max score, their sum of exponentials; attention_kernel) combined into one softmax. Each head's
// weights of its splits are found once, then every value is a sum of independent loads.
template <int HEAD_DIM, int K>
__device__ void stage_attention(const float* partials, int splits, float* smem) {
  constexpr int heads = K / HEAD_DIM, stride = HEAD_DIM + 2;
  float* weights = smem + K / GROUP * (GROUP_STRIDE + 1) + 33;  // [heads][MAX_SPLITS]
  for (int h = threadIdx.x; h < heads; h += THREADS) {
    const float* p = partials + static_cast<size_t>(h) * splits * stride;
    float m[MAX_SPLITS], l[MAX_SPLITS], top = negative_infinity();
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; ++s) {
      m[s] = s < splits ? p[s * stride + HEAD_DIM] : negative_infinity();
      l[s] = s < splits ? p[s * stride + HEAD_DIM + 1] : 0.0f;
    }
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; ++s) {
      top = fmaxf(top, m[s]);
    }
    float den = 0.0f;
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; ++s) {
      m[s] = m[s] == negative_infinity() ? 0.0f : expf(m[s] - top);  // a split that saw no slot: 0
      den += l[s] * m[s];
    }
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; ++s) {
      weights[h * MAX_SPLITS + s] = m[s] / den;
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < K; k += THREADS) {
    const int h = k / HEAD_DIM;
    const float* p = partials + static_cast<size_t>(h) * splits * stride + k % HEAD_DIM;
    float value = 0.0f;
#pragma unroll
    for (int s = 0; s < MAX_SPLITS; ++s) {
      if (s < splits) {
        value += p[s * stride] * weights[h * MAX_SPLITS + s];
      }
    }
    staged(smem, k) = value;
  }
  stage_group_sums<K>(smem);
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

// Value j of a group whose BITS-bit fields fill `words` (indices are compile-time once unrolled),
// made a float by placing it in the mantissa of 2^23: two integer operations and an add instead
// of a quarter-rate conversion.
template <int BITS>
__device__ inline float field(const uint32_t* words, int j) {
  const int bit = j * BITS, word = bit / 32, shift = bit % 32;
  uint32_t v = words[word] >> shift;
  if (shift + BITS > 32) {
    v |= words[word + 1] << (32 - shift);
  }
  return __uint_as_float(0x4B000000u | (v & ((1u << BITS) - 1))) - 8388608.0f;
}

// out[r] = row rows[r] of an affine matrix with K columns times the staged input, for R rows at
// once, in every lane. A lane takes groups lane, lane + 32, ...; it loads the words, scales and
// biases of up to BATCH of its groups for all R rows before it computes, so those loads are in
// flight together.
template <int BITS, bool STORED_BIASES, int K, int R, typename S>
__device__ void rows_dot(const uint32_t* w, const S* scales, const S* biases, const int* rows, const float* smem,
                         float* out) {
  constexpr int groups = K / GROUP, per_lane = (groups + 31) / 32, BATCH = per_lane < 4 ? per_lane : 4;
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
        const float4* xg = reinterpret_cast<const float4*>(smem + g * GROUP_STRIDE);
#pragma unroll
        for (int i = 0; i < GROUP / 4; ++i) {
          const float4 v = xg[i];
          x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float dot = 0.0f;
#pragma unroll
          for (int j = 0; j < GROUP; ++j) {
            dot += x[j] * field<BITS>(words[b][r], j);
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

// The first of this warp's R consecutive output rows, and in `rows` the rows it reads: past the
// last row, the last row again (read, never written).
template <int R>
__device__ inline int warp_rows(int total_rows, int* rows) {
  const int first = (blockIdx.x * (THREADS / 32) + threadIdx.x / 32) * R;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rows[r] = min(first + r, total_rows - 1);
  }
  return first;
}

// After staging: each warp's R consecutive rows of W times the input (+ residual) into y.
template <int BITS, bool STORED_BIASES, int K, int R, bool RESIDUAL, typename S, typename Res, typename O>
__device__ void project(const uint32_t* w, const S* scales, const S* biases, const Res* residual, int total_rows,
                        const float* smem, O* y) {
  int rows[R];
  const int first = warp_rows<R>(total_rows, rows);
  if (first >= total_rows) {
    return;
  }
  float out[R];
  rows_dot<BITS, STORED_BIASES, K, R>(w, scales, biases, rows, smem, out);
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (first + r < total_rows) {
        y[first + r] = static_cast<O>(out[r] + (RESIDUAL ? static_cast<float>(residual[first + r]) : 0.0f));
      }
    }
  }
}

// y = W x (+ residual), after RMSNorm of x when NORM.
template <bool NORM, bool RESIDUAL, int BITS, bool STORED_BIASES, int K, int R, typename T, typename N, typename S,
          typename Res, typename O>
__device__ void matvec_kernel(const T* x, const N* norm_w, const float* eps, const uint32_t* w, const S* scales,
                              const S* biases, const Res* residual, int rows, O* y) {
  float* smem = shared_floats();
  stage_input<NORM, K>(x, norm_w, eps[0], smem);
  project<BITS, STORED_BIASES, K, R, RESIDUAL>(w, scales, biases, residual, rows, smem, y);
}

// y = residual + W_o attention, the attention combined from attention_kernel's partial results.
template <int BITS, bool STORED_BIASES, int K, int R, int HEAD_DIM, typename S, typename Res, typename O>
__device__ void attention_output_kernel(const float* partials, int splits, const uint32_t* w, const S* scales,
                                        const S* biases, const Res* residual, int rows, O* y) {
  float* smem = shared_floats();
  stage_attention<HEAD_DIM, K>(partials, splits, smem);
  project<BITS, STORED_BIASES, K, R, true>(w, scales, biases, residual, rows, smem, y);
}

// RMSNorm, then R rows of the gate and of the up projection a warp: y = silu(gate x) * (up x).
template <int GATE_BITS, bool GATE_BIASES, int UP_BITS, bool UP_BIASES, int K, int R, typename T, typename N,
          typename S, typename O>
__device__ void gate_up_kernel(const T* x, const N* norm_w, const float* eps, const uint32_t* w_gate,
                               const S* s_gate, const S* b_gate, const uint32_t* w_up, const S* s_up,
                               const S* b_up, int total_rows, O* y) {
  float* smem = shared_floats();
  stage_input<true, K>(x, norm_w, eps[0], smem);
  int rows[R];
  const int first = warp_rows<R>(total_rows, rows);
  if (first >= total_rows) {
    return;
  }
  float gate[R], up[R];
  rows_dot<GATE_BITS, GATE_BIASES, K, R>(w_gate, s_gate, b_gate, rows, smem, gate);
  rows_dot<UP_BITS, UP_BIASES, K, R>(w_up, s_up, b_up, rows, smem, up);
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (first + r < total_rows) {
        y[first + r] = static_cast<O>(gate[r] / (1.0f + expf(-gate[r])) * up[r]);
      }
    }
  }
}

// RMSNorm, then the Q, K and V projections (and their biases when BIAS), RoPE on Q and K. A warp
// computes PAIRS pairs of rows that RoPE rotates together: adjacent ones (TRADITIONAL, llama's
// permuted weights) or ROPE_DIM / 2 apart (NeoX); a head's dims past ROPE_DIM stay as they are.
// Q goes to q [HEADS * HEAD_DIM]; the new key and value are written into the cache buffers
// keys/values [KV_HEADS, capacity, HEAD_DIM] at `position`, in place (cuda_step.py says why).
template <int Q_BITS, bool Q_BIASES, int K_BITS, bool K_BIASES, int V_BITS, bool V_BIASES, bool BIAS, int HEADS,
          int KV_HEADS, int HEAD_DIM, int ROPE_DIM, bool TRADITIONAL, int K, int PAIRS, typename T, typename N,
          typename S, typename B, typename C, typename O>
__device__ void qkv_rope_kernel(const T* x, const N* norm_w, const float* eps, const uint32_t* w_q, const S* s_q,
                                const S* b_q, const uint32_t* w_k, const S* s_k, const S* b_k, const uint32_t* w_v,
                                const S* s_v, const S* b_v, const B* bias_q, const B* bias_k, const B* bias_v,
                                const int32_t* position, const float* inv_freq, const float* attn_factor,
                                const C* keys, const C* values, int capacity, O* q) {
  float* smem = shared_floats();
  stage_input<true, K>(x, norm_w, eps[0], smem);
  constexpr int half = HEAD_DIM / 2;
  constexpr int q_pairs = HEADS * half, kv_pairs = KV_HEADS * half;
  static_assert(kv_pairs % PAIRS == 0, "a warp's pairs lie in one of Q, K, V");
  const int first = (blockIdx.x * (THREADS / 32) + threadIdx.x / 32) * PAIRS;
  if (first >= q_pairs + 2 * kv_pairs) {
    return;
  }
  const int part = first < q_pairs ? 0 : (first < q_pairs + kv_pairs ? 1 : 2);
  const int part_first = first - (part == 0 ? 0 : (part == 1 ? q_pairs : q_pairs + kv_pairs));
  int rows[2 * PAIRS];
  bool rotate[PAIRS];
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int pair = part_first + p, head = pair / half, i = pair % half;
    int d0 = 2 * i, d1 = 2 * i + 1;
    rotate[p] = false;
    if (part < 2) {
      if (TRADITIONAL) {
        rotate[p] = d0 < ROPE_DIM;
      } else if (i < ROPE_DIM / 2) {
        d0 = i, d1 = i + ROPE_DIM / 2, rotate[p] = true;
      } else {
        d0 = ROPE_DIM + 2 * (i - ROPE_DIM / 2), d1 = d0 + 1;
      }
    }
    rows[2 * p] = head * HEAD_DIM + d0;
    rows[2 * p + 1] = head * HEAD_DIM + d1;
  }
  float y[2 * PAIRS];
  if (part == 0) {
    rows_dot<Q_BITS, Q_BIASES, K, 2 * PAIRS>(w_q, s_q, b_q, rows, smem, y);
  } else if (part == 1) {
    rows_dot<K_BITS, K_BIASES, K, 2 * PAIRS>(w_k, s_k, b_k, rows, smem, y);
  } else {
    rows_dot<V_BITS, V_BIASES, K, 2 * PAIRS>(w_v, s_v, b_v, rows, smem, y);
  }
  if (threadIdx.x % 32 != 0) {
    return;
  }
  const int pos = position[0];
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    const int r0 = rows[2 * p], r1 = rows[2 * p + 1];
    float y0 = y[2 * p], y1 = y[2 * p + 1];
    if (BIAS) {
      const B* bias = part == 0 ? bias_q : (part == 1 ? bias_k : bias_v);
      y0 += static_cast<float>(bias[r0]);
      y1 += static_cast<float>(bias[r1]);
    }
    if (rotate[p]) {
      float sin_t, cos_t;
      sincosf(static_cast<float>(pos) * inv_freq[(part_first + p) % half], &sin_t, &cos_t);
      cos_t *= attn_factor[0];
      sin_t *= attn_factor[0];
      const float a = y0 * cos_t - y1 * sin_t, b = y0 * sin_t + y1 * cos_t;
      y0 = a, y1 = b;
    }
    if (part == 0) {
      q[r0] = static_cast<O>(y0);
      q[r1] = static_cast<O>(y1);
    } else {
      C* cache = const_cast<C*>(part == 1 ? keys : values);
      const size_t slot = (static_cast<size_t>(r0 / HEAD_DIM) * capacity + pos) * HEAD_DIM;
      cache[slot + r0 % HEAD_DIM] = static_cast<C>(y0);
      cache[slot + r1 % HEAD_DIM] = static_cast<C>(y1);
    }
  }
}

// Attention of one new query per head over cache slots 0..position, split: block (head, split)
// takes the split-th of gridDim.y equal runs of the cache's slots, in chunks of 32 slots, one chunk
// a warp at a time. Each lane scores its own slot of the chunk (so a chunk's key loads are in
// flight together), then the warp adds the chunk's values to an online softmax. The block
// combines its warps and writes partials[head][split] = (weighted values [HEAD_DIM], max score,
// sum of exponentials), which attention_output_kernel combines.
// keys/values: [KV_HEADS, capacity, HEAD_DIM].
template <int HEADS, int KV_HEADS, int HEAD_DIM, int WARPS, typename Q, typename C>
__device__ void attention_kernel(const Q* q, const C* keys, const C* values, int capacity,
                                 const int32_t* position, float* partials) {
  static_assert(HEAD_DIM % 32 == 0, "each lane holds HEAD_DIM / 32 dims");
  constexpr int per_lane = HEAD_DIM / 32;
  __shared__ float q_shared[HEAD_DIM], warp_max[WARPS], warp_sum_exp[WARPS], warp_acc[WARPS][HEAD_DIM];
  const int head = blockIdx.x, kv_head = head / (HEADS / KV_HEADS);
  const int split = blockIdx.y, splits = gridDim.y;
  const int run = (capacity + splits - 1) / splits;
  const int begin = split * run, end = min(begin + run, position[0] + 1);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float scale = rsqrtf(static_cast<float>(HEAD_DIM));
  for (int d = threadIdx.x; d < HEAD_DIM; d += WARPS * 32) {
    q_shared[d] = static_cast<float>(q[head * HEAD_DIM + d]) * scale;
  }
  __syncthreads();
  const C* k_head = keys + static_cast<size_t>(kv_head) * capacity * HEAD_DIM;
  const C* v_head = values + static_cast<size_t>(kv_head) * capacity * HEAD_DIM;
  float running_max = negative_infinity(), sum_exp = 0.0f, acc[per_lane];
#pragma unroll
  for (int j = 0; j < per_lane; ++j) {
    acc[j] = 0.0f;
  }
  for (int chunk = begin + 32 * warp; chunk < end; chunk += 32 * WARPS) {
    const int slot = chunk + lane;
    float score = negative_infinity();
    if (slot < end) {
      const C* k = k_head + static_cast<size_t>(slot) * HEAD_DIM;
      score = 0.0f;
#pragma unroll
      for (int d = 0; d < HEAD_DIM; ++d) {
        score += q_shared[d] * static_cast<float>(k[d]);
      }
    }
    float chunk_max = score;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffff, chunk_max, offset));
    }
    const float new_max = fmaxf(running_max, chunk_max);
    const float correction = expf(running_max - new_max);
    const float p = slot < end ? expf(score - new_max) : 0.0f;
    sum_exp = sum_exp * correction + warp_sum(p);
#pragma unroll
    for (int j = 0; j < per_lane; ++j) {
      acc[j] *= correction;
    }
    // Unrolled, so that the 32 slots' value loads are in flight together.
#pragma unroll
    for (int t = 0; t < 32; ++t) {
      const float p_t = __shfl_sync(0xffffffff, p, t);
      if (chunk + t < end) {
        const C* v = v_head + static_cast<size_t>(chunk + t) * HEAD_DIM + lane * per_lane;
#pragma unroll
        for (int j = 0; j < per_lane; ++j) {
          acc[j] += p_t * static_cast<float>(v[j]);
        }
      }
    }
    running_max = new_max;
  }
  if (lane == 0) {
    warp_max[warp] = running_max;
    warp_sum_exp[warp] = sum_exp;
  }
#pragma unroll
  for (int j = 0; j < per_lane; ++j) {
    warp_acc[warp][lane * per_lane + j] = acc[j];
  }
  __syncthreads();
  float top = negative_infinity();
  for (int w = 0; w < WARPS; ++w) {
    top = fmaxf(top, warp_max[w]);
  }
  float* out = partials + (static_cast<size_t>(head) * splits + split) * (HEAD_DIM + 2);
  for (int d = threadIdx.x; d < HEAD_DIM + 2; d += WARPS * 32) {
    float num = 0.0f, den = 0.0f;
    for (int w = 0; w < WARPS; ++w) {
      // A warp that saw no slot has max -inf and adds nothing.
      const float weight = warp_max[w] == negative_infinity() ? 0.0f : expf(warp_max[w] - top);
      num += (d < HEAD_DIM ? warp_acc[w][d] : 0.0f) * weight;
      den += warp_sum_exp[w] * weight;
    }
    out[d] = d < HEAD_DIM ? num : (d == HEAD_DIM ? top : den);
  }
}
