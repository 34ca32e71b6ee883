// Products with a matrix kept as the file stores it in Q6_K blocks (blocks.py): an output layer
// that MLX's affine format holds only at 8.5 bits a value, against Q6_K's 6.5625 (quants.py).
// Follows decode_step.cu in its kernels' header and uses its staging (stage_input, staged) and
// small_float.
//
// A Q6_K row of K values is K / 256 blocks of 210 bytes (llama.cpp's block_q6_K). A block's 256
// values are two halves of 128: in half h, byte l of ql (64 bytes a half) holds the low 4 bits of
// values l and l + 64 (low and high nibble), byte l + 32 those of values l + 32 and l + 96; byte l
// of qh (32 a half) their high 2 bits, two bits a value in that order. Then 16 int8 scales, one a
// 16 values, and a float16 d: value = (d * scale) * (q - 32).

constexpr int Q6_K_VALUES = 256;
constexpr int Q6_K_BYTES = 210;
// Input rows q6_k_product_kernel takes at once, each copied to shared memory: a batch kernel step's
// 16 sequences in one launch, which reads the weights once for all of them.
constexpr int Q6_K_MAX_INPUTS = 16;

// Input m's value k, where the head kernel stages its one input (decode_step.cu's layout, normalized).
struct StagedInput {
  float* smem;
  __device__ float operator()(int, int k) const {
    return staged(smem, k);
  }
};

// Input m's value k, where the product kernel copies its M inputs [M][K] as they are.
template <int K, typename T>
struct CopiedInputs {
  const T* xs;
  __device__ float operator()(int m, int k) const {
    return static_cast<float>(xs[m * K + k]);
  }
};

// A value of a block: (d * scale) * (q - 32), as quants.py rounds it, for the 6-bit q and the
// int8 scale's byte. The scale s as (s + 128) - 128: its byte with the top bit flipped is s + 128.
__device__ inline float q6_k_value(float d, uint8_t scale, unsigned q) {
  return d * (small_float(scale ^ 128u) - 128.0f) * (small_float(q) - 32.0f);
}

// out[r][m] = the dot of row rows[r] of w with input m (`x`: StagedInput or CopiedInputs), in
// every lane. A lane takes values l, l + 32, l + 64 and l + 96 of each half of each block: lanes
// read consecutive bytes, and a value is computed as quants.py decodes it (the same float
// rounding). Each input value is read from shared memory once for the R rows: with several inputs,
// those reads are most of a row's instructions.
template <int K, int M, int R, typename Inputs>
__device__ void q6_k_rows_dot(const uint8_t* w, const int* rows, Inputs x, float (&out)[R][M]) {
  constexpr int blocks = K / Q6_K_VALUES;
  const int lane = threadIdx.x % 32;
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      acc[r][m] = 0.0f;
    }
  }
#pragma unroll
  for (int b = 0; b < blocks; ++b) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float v[R][4];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint8_t* block = w + (static_cast<size_t>(rows[r]) * blocks + b) * Q6_K_BYTES;
        const float d = __half2float(*reinterpret_cast<const __half*>(block + 208));
        const uint8_t* ql = block + 64 * half;
        const uint8_t* scale = block + 192 + 8 * half + lane / 16;
        const unsigned low = ql[lane], low_next = ql[lane + 32], high = block[128 + 32 * half + lane];
        v[r][0] = q6_k_value(d, scale[0], (low & 15) | (high & 3) << 4);
        v[r][1] = q6_k_value(d, scale[2], (low_next & 15) | (high >> 2 & 3) << 4);
        v[r][2] = q6_k_value(d, scale[4], low >> 4 | (high >> 4 & 3) << 4);
        v[r][3] = q6_k_value(d, scale[6], low_next >> 4 | (high >> 6) << 4);
      }
      const int k = b * Q6_K_VALUES + half * 128 + lane;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float x0 = x(m, k), x1 = x(m, k + 32), x2 = x(m, k + 64), x3 = x(m, k + 96);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[r][m] += v[r][0] * x0 + v[r][1] * x1 + v[r][2] * x2 + v[r][3] * x3;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      out[r][m] = warp_sum(acc[r][m]);
    }
  }
}

// The kernels' grid is as many blocks as the GPU holds at once (blocks.py), each warp taking R
// rows at a time, the next R rows_apart<R>() on: a block stages its inputs once for all its rows,
// where a block for every 8 rows read the inputs again for each (twice the weights' own bytes for
// 8 inputs).
template <int R>
__device__ inline int first_row() {
  return (blockIdx.x * (THREADS / 32) + threadIdx.x / 32) * R;
}

template <int R>
__device__ inline int rows_apart() {
  return gridDim.x * (THREADS / 32) * R;
}

// y [M][total_rows] = x [M][K] times w's rows, R rows a warp at a time. The inputs are copied to
// shared memory in their own type (float16 on a GPU): half the bytes of staged floats, so more
// blocks fit on an SM (16 inputs of 2,048: 64 KB a block, 3 blocks, against 1 of staged floats).
template <int K, int M, int R, typename T, typename O>
__device__ void q6_k_product_kernel(const T* x, const uint8_t* w, int total_rows, O* y) {
  static_assert(M * K * sizeof(T) % 16 == 0, "inputs copied in 16-byte pieces");
  T* xs = reinterpret_cast<T*>(shared_floats());
  for (int i = threadIdx.x; i < M * K * sizeof(T) / 16; i += THREADS) {
    reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(x)[i];
  }
  __syncthreads();
  for (int first = first_row<R>(); first < total_rows; first += rows_apart<R>()) {
    int rows[R];
    rows_from<R>(first, total_rows, rows);
    float out[R][M];
    q6_k_rows_dot<K, M, R>(w, rows, CopiedInputs<K, T>{xs}, out);
    if (threadIdx.x % 32 == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (first + r < total_rows) {
            y[static_cast<size_t>(m) * total_rows + first + r] = static_cast<O>(out[r][m]);
          }
        }
      }
    }
  }
}

// The output head of step.py's kernels over a Q6_K matrix: y = W RMSNorm(x), a warp a row.
template <int K, typename T, typename N, typename O>
__device__ void q6_k_head_kernel(const T* x, const N* norm_w, const float* eps, const uint8_t* w, int total_rows,
                                 O* y) {
  float* smem = shared_floats();
  stage_input<true, K>(x, norm_w, eps[0], smem);
  for (int row = first_row<1>(); row < total_rows; row += rows_apart<1>()) {
    float out[1][1];
    q6_k_rows_dot<K, 1, 1>(w, &row, StagedInput{smem}, out);
    if (threadIdx.x % 32 == 0) {
      y[row] = static_cast<O>(out[0][0]);
    }
  }
}
