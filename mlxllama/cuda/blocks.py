"""Products with an output layer kept in the file's Q6_K blocks (q6_k.cu), on MLX's CUDA backend.

Why: MLX's affine format holds a Q6_K matrix only at 8.5 bits a value (quants.py), against the
file's 6.5625, and the output layer is a model's largest matrix: Qwen3-0.6B's tied 151,936 x 1,024
table is a quarter of its weights. Kept as blocks (weights.py, quantized_layers.BlockLinear), it is
held at the file's size and read at it every token, with the file's exact values.
"""

from __future__ import annotations

import mlx.core as mx

from . import kernels
from .kernels import HEAD_THREADS

WARPS = HEAD_THREADS // 32  # warps of a block of either kernel, a row at a time each
BLOCKS_AN_SM = 2048 // HEAD_THREADS  # an SM holds 2,048 threads


class Q6KProduct:
    """quantized_layers.BlockProduct for Q6_K: x [n, K] times the rows of a Q6_K matrix [N, K / 256
    blocks of 210 bytes] -> [n, N] in x's type, n at most rows_taken(K), on a GPU of `sms` SMs
    whose blocks may have `shared_bytes` of shared memory."""

    def __init__(self, sms: int, shared_bytes: int):
        self.sms, self.shared_bytes = sms, shared_bytes

    def rows_taken(self, k: int) -> int:
        """Input rows of K values one call takes: each is copied to shared memory (float32 at most)."""
        return min(kernels.Q6_K_MAX_INPUTS, self.shared_bytes // (4 * k))

    def __call__(self, x: mx.array, blocks: mx.array) -> mx.array:
        n, k = x.shape
        shared = -(-n * k * x.dtype.size // 4)
        kernel = kernels.kernel("q6_k_product_kernel", kernels.Q6_K_PRODUCT_PARAMETERS, ("K", "M", "R"), shared, "q6_k")
        # Several inputs: two rows a warp at a time, so each input value read serves both.
        rows, r = blocks.shape[0], 1 if n == 1 else 2
        return kernel(inputs=[x, blocks], template=[("K", k), ("M", n), ("R", r), ("ROWS", rows)],
                      grid=(HEAD_THREADS * self.grid_blocks(-(-rows // r), shared), 1, 1),
                      threadgroup=(HEAD_THREADS, 1, 1), output_shapes=[(n, rows)], output_dtypes=[x.dtype])[0]

    def head(self, x: mx.array, norm_w: mx.array, eps: mx.array, blocks: mx.array) -> mx.array:
        """step.py's head over a Q6_K matrix: float32 logits [N] of RMSNorm(x) (x [K] float32, eps
        as step.py passes it)."""
        k, rows = x.shape[-1], blocks.shape[0]
        shared = kernels.staged_floats(k)
        kernel = kernels.kernel("q6_k_head_kernel", kernels.Q6_K_HEAD_PARAMETERS, ("K",), shared, "q6_k")
        return kernel(inputs=[x, norm_w, eps, blocks], template=[("K", k), ("ROWS", rows)],
                      grid=(HEAD_THREADS * self.grid_blocks(rows, shared), 1, 1), threadgroup=(HEAD_THREADS, 1, 1),
                      output_shapes=[(rows,)], output_dtypes=[mx.float32])[0]

    def grid_blocks(self, rows: int, shared_floats: int) -> int:
        """Blocks of a launch: as many as the SMs hold at once (q6_k.cu says why), or one for every
        WARPS of `rows` (a warp's rows at a time)."""
        resident = max(1, min(BLOCKS_AN_SM, self.shared_bytes // (4 * shared_floats)))
        return min(-(-rows // WARPS), self.sms * resident)
