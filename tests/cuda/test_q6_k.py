"""q6_k.cu's kernels (mlxllama.cuda.blocks) against the exact values of the blocks they read, and
the output layers that use them on MLX's CUDA backend (the routing around them: tests/parity/test_block_output.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import mlxllama
from mlxllama.cuda import KernelStep, block_products, kernels
from mlxllama.cuda.blocks import Q6KProduct
from mlxllama.quantized_layers import BlockLinear, TiedBlockEmbedding
from mlxllama.quants import decode_blocks

from conftest import find_fixture_model

on_cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernels run on MLX's CUDA backend only")
H100 = (132, 232448)  # SMs, and the shared memory bytes a block may have


def random_q6_k(rows: int, k: int, seed: int) -> tuple[mx.array, np.ndarray]:
    """Q6_K blocks [rows, k / 256 * 210] of random bits with d in [-0.01, 0.01], and their exact values."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * k // 256, 210), dtype=np.uint8)
    raw[:, 208:] = rng.uniform(-0.01, 0.01, rows * k // 256).astype(np.float16).view(np.uint8).reshape(-1, 2)
    values = np.array(decode_blocks(mx.array(raw), QT.Q6_K)).reshape(rows, k)
    return mx.array(raw.reshape(rows, -1)), values


@on_cuda
@pytest.mark.parametrize("k", [256, 1024, 2048])
@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("sms", [132, 2])
def test_product_kernel_computes_the_exact_values_product(k, n, dtype, sms):
    """1,001 rows: on 132 SMs a warp a row, the last block's only; as if on 2, a warp takes up to 8
    rows in turn. Float32 sums of k products, then the result in x's type."""
    blocks, values = random_q6_k(1001, k, seed=k + n)
    x = mx.random.normal((n, k), key=mx.random.key(n)).astype(dtype)
    y = Q6KProduct(sms, H100[1])(x, blocks)
    assert y.shape == (n, 1001) and y.dtype == dtype
    want = np.array(x.astype(mx.float32)) @ values.T
    tolerance = 2e-3 if dtype == mx.float16 else 1e-5
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), want, rtol=tolerance, atol=tolerance * np.abs(want).max())


@on_cuda
def test_head_kernel_normalizes_then_multiplies():
    k, eps = 1024, 1e-5
    blocks, values = random_q6_k(3005, k, seed=1)
    x = mx.random.normal((k,), key=mx.random.key(2)) * 3
    norm = mx.random.uniform(0.5, 1.5, (k,), key=mx.random.key(3)).astype(mx.float16)
    y = Q6KProduct(*H100).head(x, norm, mx.array([eps] * 4, mx.float32), blocks)
    xs = np.array(x, np.float64)
    normalized = xs / np.sqrt(np.mean(xs**2) + eps) * np.array(norm.astype(mx.float32))
    want = normalized @ values.T
    assert y.dtype == mx.float32
    np.testing.assert_allclose(np.array(y), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_inputs_a_call_takes_fit_the_shared_memory():
    product = Q6KProduct(*H100)
    assert product.rows_taken(1024) == kernels.Q6_K_MAX_INPUTS == 16
    # Qwen3-8B's 4,096 columns: 14 inputs (float32 at most: 16 KB each) fit in an H100's 227 KB, 3 in
    # 48 KB; 16,384 columns 3 there and none in 48 KB (BlockLinear then takes the dense product).
    assert product.rows_taken(4096) == 14 and product.rows_taken(16384) == 3
    assert Q6KProduct(132, 48 * 1024).rows_taken(4096) == 3 and Q6KProduct(132, 48 * 1024).rows_taken(16384) == 0


@on_cuda
def test_q6_k_outputs_keep_the_files_blocks_on_cuda():
    assert set(block_products()) == {QT.Q6_K}
    untied = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    assert isinstance(untied.model.output, BlockLinear)
    assert isinstance(untied.model.decode_step, KernelStep)  # its head is q6_k_head_kernel
    tied = mlxllama.load(find_fixture_model("qwen3-tiny-Q4_K_M.gguf"))
    assert isinstance(tied.model.token_embd, TiedBlockEmbedding)
