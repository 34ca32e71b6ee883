// Kernels of step.py for several sequences at once (2 to 16): batch_layer_kernel, one launch a
// layer, in the same five steps as decode_step.cu's layer_kernel (which this file follows in the
// header). The projections run on tensor cores (mma.sync m16n8k16, float16 inputs, float32
// sums): a warp multiplies 16 weight rows by the staged inputs of 8 or 16 sequences, so each weight
// is loaded and unpacked once for all of them.

// Sequences of one MMA's N dimension; a launch takes NT * 8 of them.
constexpr int SEQ_TILE = 8;

// The staged inputs (stage_batch) of one sequence are this many float16 values apart: 32 more
// than K where K * 2 bytes is a multiple of 128, so that the 8 lanes of one 16-byte shared load
// (two sequences, four blocks each) hit different banks.
template <int K>
__host__ __device__ constexpr int batch_stride() {
  return K + (K % 64 == 0 ? 32 : 0);
}

// stage_batch's group sums of an input of K values, after NT * 8 sequences' staged values.
template <int K, int NT>
__device__ inline float* batch_group_sums(const __half* xs) {
  return reinterpret_cast<float*>(const_cast<__half*>(xs) + NT * SEQ_TILE * batch_stride<K>());
}

// Float16 bits of two integers below 1024, q0 in the low half: 1024 + q as a float16 has q in its
// mantissa, and subtracting 1024 is exact.
__device__ inline uint32_t int_pair(uint32_t with_exponent) {
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&with_exponent), __half2half2(__ushort_as_half(0x6400)));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A lane's 8 values of one group of one row, as four float16 pairs (c0, c4), (c1, c5), (c2, c6),
// (c3, c7): c = the columns 8t .. 8t + 7 of the group, t = lane % 4. `raw` holds the words that
// load_lane_words read.
template <int BITS>
__device__ inline void lane_pairs(const uint32_t (&raw)[2], int t, uint32_t (&pairs)[4]) {
  if constexpr (BITS == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pairs[i] = int_pair(((raw[0] >> (4 * i)) & 0x000F000Fu) | 0x64006400u);
    }
  } else if constexpr (BITS == 8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pairs[i] = int_pair((__byte_perm(raw[0], raw[1], 0x0400 + 0x0101 * i) & 0x00FF00FFu) | 0x64006400u);
    }
  } else {
    const int shift = (8 * BITS * t) % 32;
    const unsigned long long bits = ((static_cast<unsigned long long>(raw[1]) << 32) | raw[0]) >> shift;
    constexpr uint32_t mask = (1u << BITS) - 1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t low = static_cast<uint32_t>(bits >> (BITS * i)) & mask;
      const uint32_t high = static_cast<uint32_t>(bits >> (BITS * (i + 4))) & mask;
      pairs[i] = int_pair(low | (high << 16) | 0x64006400u);
    }
  }
}

// The words holding a lane's 8 values of group `g` of a row (`row` points at the row's first word).
template <int BITS>
__device__ inline void load_lane_words(const uint32_t* row, int g, int t, uint32_t (&raw)[2]) {
  const uint32_t* group = row + g * BITS;
  if constexpr (BITS == 4) {
    raw[0] = __ldg(group + t);
    raw[1] = 0;
  } else if constexpr (BITS == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(group) + t);
    raw[0] = v.x, raw[1] = v.y;
  } else {
    const int bit = 8 * BITS * t, word = bit / 32;
    raw[0] = __ldg(group + word);
    raw[1] = bit % 32 + 8 * BITS > 32 ? __ldg(group + word + 1) : 0;
  }
}

__device__ inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Stages rows [0, seqs) of src [seqs][K] (float32, or float16 values in order) for tile_dot, times
// 1 / rms(row) * norm_w when NORM; rows seqs .. NT * 8 - 1 are zeros. Warp w stages row w. xs holds
// each row's values as float16 in blocks of 8 columns, each block the pairs (c0, c4), (c1, c5),
// (c2, c6), (c3, c7); gsums [NT * 8][K / 32] the sums of each group's staged (rounded) values.
template <bool NORM, int K, int NT, typename T, typename N>
__device__ void stage_batch(const T* src, int seqs, const N* norm_w, float eps, __half* xs) {
  static_assert(K % GROUP == 0, "whole groups");
  constexpr int blocks = K / 8, stride = batch_stride<K>();
  float* gsums = batch_group_sums<K, NT>(xs);
  const int seq = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (seq < NT * SEQ_TILE) {
    const T* row = src + static_cast<size_t>(seq) * K;
    float inv_rms = 1.0f;
    if (NORM && seq < seqs) {
      float squares = 0.0f;
#pragma unroll 4
      for (int k = lane * 4; k < K; k += 128) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(row + k));
        squares += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
      }
      inv_rms = rsqrtf(warp_sum(squares) / K + eps);
    }
#pragma unroll 4
    for (int b = lane; b < (blocks + 31) / 32 * 32; b += 32) {
      float v[8];
      if (seq < seqs && b < blocks) {
        if constexpr (sizeof(T) == 4) {
          const float4 lo = __ldcg(reinterpret_cast<const float4*>(row + 8 * b));
          const float4 hi = __ldcg(reinterpret_cast<const float4*>(row + 8 * b) + 1);
          v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
        } else {
          const uint4 packed = __ldcg(reinterpret_cast<const uint4*>(row + 8 * b));
          const __half* h = reinterpret_cast<const __half*>(&packed);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            v[i] = __half2float(h[i]);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          v[i] = 0.0f;
        }
      }
      float sum = 0.0f;
      uint32_t pairs[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float scale_lo = NORM && b < blocks ? inv_rms * static_cast<float>(norm_w[8 * b + i]) : 1.0f;
        const float scale_hi = NORM && b < blocks ? inv_rms * static_cast<float>(norm_w[8 * b + i + 4]) : 1.0f;
        const __half2 h = __floats2half2_rn(v[i] * scale_lo, v[i + 4] * scale_hi);
        const float2 rounded = __half22float2(h);
        sum += rounded.x + rounded.y;
        pairs[i] = *reinterpret_cast<const uint32_t*>(&h);
      }
      sum += __shfl_xor_sync(0xffffffff, sum, 1);
      sum += __shfl_xor_sync(0xffffffff, sum, 2);
      if (b < blocks) {
        *reinterpret_cast<uint4*>(xs + seq * stride + 8 * b) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
        if (b % 4 == 0) {
          gsums[seq * (K / GROUP) + b / 4] = sum;
        }
      }
    }
  }
  __syncthreads();
}

// This warp's share of 16 rows of an affine matrix with K columns times the staged inputs of NT * 8
// sequences: the warp takes a contiguous run of the groups (the block's 16 warps split them), so
// the block's warps together cover the whole row. Lane (g = lane / 4, t = lane % 4) unpacks its 8
// columns of each group of rows row_a (tile row g) and row_b (tile row g + 8); acc[j] is the MMA
// fragment of sequences 8j .. 8j + 7: (row_a, seq 2t), (row_a, 2t + 1), (row_b, 2t), (row_b, 2t + 1).
// Each group's sum is scaled and offset by its row's scale and bias, which multiplies the group's
// input sum.
template <int BITS, bool STORED_BIASES, int K, int NT, typename S>
__device__ void tile_dot(const uint32_t* w, const S* scales, const S* biases, int row_a, int row_b,
                         const __half* xs, float (&acc)[NT][4]) {
  constexpr int groups = K / GROUP, per_warp = (groups + LAYER_WARPS - 1) / LAYER_WARPS;
  constexpr int BATCH = per_warp < 6 ? per_warp : 6, stride = batch_stride<K>();
  const int lane = threadIdx.x % 32, t = lane % 4, n = lane / 4;
  const int first = threadIdx.x / 32 * per_warp, last = min(first + per_warp, groups);
  const float* gsums = batch_group_sums<K, NT>(xs);
  const uint32_t* words_a = w + static_cast<size_t>(row_a) * (K / 32 * BITS);
  const uint32_t* words_b = w + static_cast<size_t>(row_b) * (K / 32 * BITS);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[j][i] = 0.0f;
    }
  }
  for (int base = first; base < last; base += BATCH) {
    uint32_t raw_a[BATCH][2], raw_b[BATCH][2];
    float scale_a[BATCH], scale_b[BATCH], bias_a[BATCH], bias_b[BATCH];
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int g = base + i;
      if (g < last) {
        load_lane_words<BITS>(words_a, g, t, raw_a[i]);
        load_lane_words<BITS>(words_b, g, t, raw_b[i]);
        const size_t at_a = static_cast<size_t>(row_a) * groups + g, at_b = static_cast<size_t>(row_b) * groups + g;
        scale_a[i] = static_cast<float>(scales[at_a]);
        scale_b[i] = static_cast<float>(scales[at_b]);
        bias_a[i] = STORED_BIASES ? static_cast<float>(biases[at_a]) : -128.0f * scale_a[i];
        bias_b[i] = STORED_BIASES ? static_cast<float>(biases[at_b]) : -128.0f * scale_b[i];
      }
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const int g = base + i;
      if (g < last) {
        uint32_t pa[4], pb[4];
        lane_pairs<BITS>(raw_a[i], t, pa);
        lane_pairs<BITS>(raw_b[i], t, pb);
        const uint32_t a_lo[4] = {pa[0], pb[0], pa[1], pb[1]}, a_hi[4] = {pa[2], pb[2], pa[3], pb[3]};
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 x = *reinterpret_cast<const uint4*>(xs + (SEQ_TILE * j + n) * stride + g * GROUP + 8 * t);
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_16816(c, a_lo, x.x, x.y);
          mma_16816(c, a_hi, x.z, x.w);
          const float sum_0 = gsums[(SEQ_TILE * j + 2 * t) * groups + g];
          const float sum_1 = gsums[(SEQ_TILE * j + 2 * t + 1) * groups + g];
          acc[j][0] += scale_a[i] * c[0] + bias_a[i] * sum_0;
          acc[j][1] += scale_a[i] * c[1] + bias_a[i] * sum_1;
          acc[j][2] += scale_b[i] * c[2] + bias_b[i] * sum_0;
          acc[j][3] += scale_b[i] * c[3] + bias_b[i] * sum_1;
        }
      }
    }
  }
}

// After every warp of the block wrote its tile_dot fragments to red [LAYER_WARPS][32][NT * 4]
// (MATRICES such arrays, one after another), the whole rows' values for thread `pair` of
// 32 * NT * 2: lane L = pair / (NT * 2) of the fragments, sequence 8j + 2 (L % 4) + i; value[m][0]
// of tile row L / 4, value[m][1] of tile row L / 4 + 8, for matrix m.
template <int NT, int MATRICES>
__device__ void reduce_tile(const float* red, int pair, int& tile_row, int& seq, float (&value)[MATRICES][2]) {
  const int lane = pair / (NT * 2), j = pair / 2 % NT, i = pair % 2;
  tile_row = lane / 4;
  seq = SEQ_TILE * j + 2 * (lane % 4) + i;
#pragma unroll
  for (int m = 0; m < MATRICES; ++m) {
    float a = 0.0f, b = 0.0f;
    const float* fragments = red + m * LAYER_WARPS * 32 * NT * 4 + lane * NT * 4 + j * 4;
#pragma unroll
    for (int w = 0; w < LAYER_WARPS; ++w) {
      a += fragments[w * 32 * NT * 4 + i];
      b += fragments[w * 32 * NT * 4 + 2 + i];
    }
    value[m][0] = a, value[m][1] = b;
  }
}

template <int NT>
__device__ inline void store_fragments(const float (&acc)[NT][4], float* red) {
  float* mine = red + (threadIdx.x / 32 * 32 + threadIdx.x % 32) * NT * 4;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      mine[4 * j + i] = acc[j][i];
    }
  }
}

// Every tile of a projection this block takes (tile blockIdx.x, then + gridDim.x ...): multiply(tile)
// leaves the block's tile_dot fragments of MATRICES matrices in red, then finish(tile, tile_row,
// seq, value) takes the sums (reduce_tile) for each sequence and each pair of tile rows.
template <int NT, int MATRICES, typename Multiply, typename Finish>
__device__ void for_each_tile(int tiles, const float* red, Multiply multiply, Finish finish) {
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    multiply(tile);
    __syncthreads();
    if (threadIdx.x < 32 * NT * 2) {
      int tile_row, seq;
      float value[MATRICES][2];
      reduce_tile<NT, MATRICES>(red, threadIdx.x, tile_row, seq, value);
      finish(tile, tile_row, seq, value);
    }
    __syncthreads();
  }
}

// out [seqs][ROWS] = residual + the matrix (ROWS x K) times the staged inputs xs (steps 3 and 5
// of batch_layer_kernel), in tiles of 16 rows. The residual is read from L2: step 5's was written
// earlier in the same launch.
template <int BITS, bool STORED_BIASES, int K, int NT, int ROWS, typename S>
__device__ void residual_tiles(const uint32_t* w, const S* scales, const S* biases, const __half* xs, float* red,
                               int seqs, const float* residual, float* out) {
  const int g = threadIdx.x % 32 / 4;
  for_each_tile<NT, 1>(ROWS / 16, red, [&](int tile) {
    float acc[NT][4];
    tile_dot<BITS, STORED_BIASES, K, NT>(w, scales, biases, tile * 16 + g, tile * 16 + g + 8, xs, acc);
    store_fragments<NT>(acc, red);
  }, [&](int tile, int tile_row, int seq, const float (&value)[1][2]) {
    for (int r = 0; r < 2 && seq < seqs; ++r) {
      const int at = seq * ROWS + tile * 16 + tile_row + 8 * r;
      out[at] = load_fresh(residual + at) + value[0][r];
    }
  });
}

// One layer of NT * 8 sequences' decode step (the first `seqs` real), y [seqs][HIDDEN] = the
// layer's output for x [seqs][HIDDEN] (float32), each sequence at its own position in its own row
// of the cache, cache_rows[s] (a check of drafts gives one row several sequences, at consecutive
// positions: each attends to the slots the ones before it write in step 1). The steps are
// layer_kernel's; each projection is cut into tiles of 16 rows, one a block at a time, and the
// block's warps split a tile's columns (tile_dot), then sum their parts in shared memory:
//   1. RMSNorm, Q/K/V, RoPE; q, and the new key and value into the cache buffers in place. A Q/K/V
//      tile is 8 RoPE pairs: tile rows g and g + 8 are a pair's two rows.
//   2. attention, a warp for each sequence, head group and run of slots (attention_items);
//   3. output projection + residual -> h;
//   4. RMSNorm, gate and up: a block takes a tile of both -> act = SiLU(gate) * up (float16);
//   5. down projection + residual -> y.
// The cache: as LayerCache says, for `seqs` sequences. scratch: q [NT * 8][HEADS * HEAD_DIM],
// partials [NT * 8][HEADS][MAX_RUNS][HEAD_DIM + 2], attn [NT * 8][HEADS * HEAD_DIM], h [NT * 8][HIDDEN],
// act (float16) [NT * 8][FFN], a quantized cache's fresh keys and values [NT * 8][2][KV_HEADS * HEAD_DIM].
// sync: as layer_kernel's, with a count for each sequence and head group.
template <int NT, int Q_BITS, bool Q_BIASES, int K_BITS, bool K_BIASES, int V_BITS, bool V_BIASES, bool BIAS,
          int HEADS, int KV_HEADS, int HEAD_DIM, int ROPE_DIM, bool TRADITIONAL, int HIDDEN, int O_BITS, bool O_BIASES,
          int GATE_BITS, bool GATE_BIASES, int UP_BITS, bool UP_BIASES, int DOWN_BITS, bool DOWN_BIASES, int FFN,
          int KEY_BITS, int VALUE_BITS, int KV_GROUP, int MAX_RUNS, bool STAGED_KEYS, typename N, typename S,
          typename B, typename C, typename KS>
__device__ void batch_layer_kernel(const float* x, int seqs, const int32_t* cache_rows, const N* attn_norm,
                                   const float* eps,
                                   const uint32_t* w_q, const S* s_q, const S* b_q, const uint32_t* w_k,
                                   const S* s_k, const S* b_k, const uint32_t* w_v, const S* s_v, const S* b_v,
                                   const B* bias_q, const B* bias_k, const B* bias_v, const int32_t* positions,
                                   const float* inv_freq, const float* attn_factor, const C* keys, const C* values,
                                   const KS* key_scales, const KS* key_biases, const KS* value_scales,
                                   const KS* value_biases, int capacity, const uint32_t* w_o, const S* s_o, const S* b_o, const N* ffn_norm,
                                   const uint32_t* w_gate, const S* s_gate, const S* b_gate, const uint32_t* w_up,
                                   const S* s_up, const S* b_up, const uint32_t* w_down, const S* s_down,
                                   const S* b_down, const uint32_t* sync, const float* scratch, float* y) {
  constexpr int SEQS = NT * SEQ_TILE, Q_DIM = HEADS * HEAD_DIM;
  float* q = const_cast<float*>(scratch);
  float* partials = q + SEQS * Q_DIM;
  float* attn = partials + SEQS * HEADS * MAX_RUNS * (HEAD_DIM + 2);
  float* h = attn + SEQS * Q_DIM;
  __half* act = reinterpret_cast<__half*>(h + SEQS * HIDDEN);
  const LayerCache<KV_HEADS, HEAD_DIM, KEY_BITS, VALUE_BITS, KV_GROUP, C, KS> cache{
      keys, values, key_scales, key_biases, value_scales, value_biases, capacity,
      reinterpret_cast<float*>(act + SEQS * FFN), cache_rows};
  unsigned long long* arrivals = reinterpret_cast<unsigned long long*>(const_cast<uint32_t*>(sync));
  unsigned int* runs_done = const_cast<uint32_t*>(sync) + 32;
  // Shared memory: the warps' fragments (two matrices' worth), then the staged inputs and their group sums.
  float* red = shared_floats();
  __half* xs = reinterpret_cast<__half*>(red + 2 * LAYER_WARPS * 32 * NT * 4);
  const int g = threadIdx.x % 32 / 4;
  float acc[NT][4], acc_up[NT][4];

  // 1. Q/K/V tiles of 8 pairs each (pairs counted as qkv_rope_pair counts them).
  stage_batch<true, HIDDEN, NT>(x, seqs, attn_norm, eps[0], xs);
  constexpr int half = HEAD_DIM / 2, q_pairs = HEADS * half, kv_pairs = KV_HEADS * half;
  const auto part_of = [&](int tile, int& first) {
    const int pair = tile * 8, part = pair < q_pairs ? 0 : (pair < q_pairs + kv_pairs ? 1 : 2);
    first = pair - (part == 0 ? 0 : (part == 1 ? q_pairs : q_pairs + kv_pairs));
    return part;
  };
  for_each_tile<NT, 1>((q_pairs + 2 * kv_pairs) / 8, red, [&](int tile) {
    int first, d0, d1;
    const int part = part_of(tile, first), head = (first + g) / half;
    pair_dims<ROPE_DIM, TRADITIONAL>((first + g) % half, part < 2, d0, d1);
    if (part == 0) {
      tile_dot<Q_BITS, Q_BIASES, HIDDEN, NT>(w_q, s_q, b_q, head * HEAD_DIM + d0, head * HEAD_DIM + d1, xs, acc);
    } else if (part == 1) {
      tile_dot<K_BITS, K_BIASES, HIDDEN, NT>(w_k, s_k, b_k, head * HEAD_DIM + d0, head * HEAD_DIM + d1, xs, acc);
    } else {
      tile_dot<V_BITS, V_BIASES, HIDDEN, NT>(w_v, s_v, b_v, head * HEAD_DIM + d0, head * HEAD_DIM + d1, xs, acc);
    }
    store_fragments<NT>(acc, red);
  }, [&](int tile, int tile_row, int seq, const float (&value)[1][2]) {
    int first, d0, d1;
    const int part = part_of(tile, first), head = (first + tile_row) / half, i = (first + tile_row) % half;
    const bool rotate = pair_dims<ROPE_DIM, TRADITIONAL>(i, part < 2, d0, d1);
    if (seq < seqs) {
      store_pair<BIAS, HEAD_DIM>(part, head, i, d0, d1, rotate, value[0][0], value[0][1], positions[seq], bias_q,
                                 bias_k, bias_v, inv_freq, attn_factor, q + seq * Q_DIM, cache, seq);
    }
  });
  grid_barrier(arrivals);

  // 2. Attention, each sequence over its own length.
  attention_items<HEADS, KV_HEADS, HEAD_DIM, MAX_RUNS, STAGED_KEYS>(
      seqs, positions, q, partials, attn, cache, runs_done, reinterpret_cast<float*>(xs));
  grid_barrier(arrivals);
  reset_runs_done<HEADS, KV_HEADS, false>(seqs, runs_done);

  // 3. Output projection + residual.
  stage_batch<false, Q_DIM, NT>(attn, seqs, attn_norm, 0.0f, xs);
  residual_tiles<O_BITS, O_BIASES, Q_DIM, NT, HIDDEN>(w_o, s_o, b_o, xs, red, seqs, x, h);
  grid_barrier(arrivals);

  // 4. RMSNorm, gate and up: a block takes the same 16 rows of both.
  stage_batch<true, HIDDEN, NT>(h, seqs, ffn_norm, eps[0], xs);
  for_each_tile<NT, 2>(FFN / 16, red, [&](int tile) {
    tile_dot<GATE_BITS, GATE_BIASES, HIDDEN, NT>(w_gate, s_gate, b_gate, tile * 16 + g, tile * 16 + g + 8, xs, acc);
    tile_dot<UP_BITS, UP_BIASES, HIDDEN, NT>(w_up, s_up, b_up, tile * 16 + g, tile * 16 + g + 8, xs, acc_up);
    store_fragments<NT>(acc, red);
    store_fragments<NT>(acc_up, red + LAYER_WARPS * 32 * NT * 4);
  }, [&](int tile, int tile_row, int seq, const float (&value)[2][2]) {
    for (int r = 0; r < 2 && seq < seqs; ++r) {
      const float gate = value[0][r];
      act[seq * FFN + tile * 16 + tile_row + 8 * r] = __float2half(gate / (1.0f + expf(-gate)) * value[1][r]);
    }
  });
  grid_barrier(arrivals);

  // 5. Down projection + residual.
  stage_batch<false, FFN, NT>(act, seqs, ffn_norm, 0.0f, xs);
  residual_tiles<DOWN_BITS, DOWN_BIASES, FFN, NT, HIDDEN>(w_down, s_down, b_down, xs, red, seqs, h, y);
}
