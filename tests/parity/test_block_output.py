"""An output layer kept in the file's Q6_K blocks (quantized_layers.BlockLinear), as weights.py
keeps it where a backend has a kernel for its product (mlxllama.cuda: a Q6_K output layer).

On the CPU the kernel is a stand-in that computes the exact product and counts its calls, so these
check what does not depend on it: which rows go to the kernel and which to the dense product over
decoded slices, the loader's choice of layer, the bytes held, and llama.cpp's parity through both
paths. tests/cuda/test_q6_k.py checks the CUDA kernel itself.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import mlxllama
import mlxllama.quantized_layers
import mlxllama.runtime
from mlxllama.quantized_layers import (BlockLinear, NativeLinear, TiedBlockEmbedding, TiedEmbedding, TiedSubBlockEmbedding,
                                       quantized_layer)
from mlxllama.quants import decode_blocks, dequantize
from mlxllama.tensors import Blocks

from conftest import find_fixture_model, load_as_on_cuda
from test_arch_parity import MIN_DECIDED
from test_arch_parity import reference as arch_reference
from test_llama_parity import PROMPTS, assert_greedy_matches, assert_logits_match, reference


class ExactProduct:
    """A stand-in for a backend's Q6_K kernel: the exact values' product, with the input rows of each call."""

    def __init__(self, rows: int):
        self.rows, self.calls = rows, []

    def rows_taken(self, k: int) -> int:
        return self.rows

    def __call__(self, x: mx.array, blocks: mx.array) -> mx.array:
        assert x.ndim == 2 and x.shape[0] <= self.rows
        self.calls.append(x.shape[0])
        values = decode_blocks(blocks.reshape(-1, 210), QT.Q6_K)  # 210 bytes a block of 256 values
        return (x.astype(mx.float32) @ values.reshape(blocks.shape[0], -1).T).astype(x.dtype)


def q6_k_table(name: str = "token_embd.weight") -> tuple[Blocks, np.ndarray]:
    """A Q6_K matrix of types-tiny-Q6_K (512 rows of 256) as its blocks, and its exact values."""
    tensor = next(t for t in gguf.GGUFReader(find_fixture_model("types-tiny-Q6_K.gguf")).tensors if t.name == name)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return (Blocks(mx.array(tensor.data).reshape(shape[0], -1), QT.Q6_K),
            np.array(dequantize(tensor.data, QT.Q6_K, shape)))


@pytest.mark.parametrize("rows, calls", [(1, [1]), (2, [2]), (3, [2, 1]), (4, [2, 2]), (5, []), (12, [])])
def test_few_rows_go_to_the_kernel_and_more_to_decoded_slices(monkeypatch, rows, calls):
    """Up to twice the rows the kernel takes, in calls of at most that many; more, the dense
    product a slice of rows at a time (200 here: 512 rows in three slices, the last short)."""
    monkeypatch.setattr(mlxllama.quantized_layers, "DECODED_ROWS", 200)
    table, values = q6_k_table("output.weight")
    product = ExactProduct(2)
    layer = quantized_layer(nn.Linear(256, 512, bias=False), table, product)
    assert isinstance(layer, BlockLinear)
    x = mx.random.normal((1, rows, 256), key=mx.random.key(rows))
    y = layer(x)
    assert product.calls == calls
    assert y.shape == (1, rows, 512) and y.dtype == mx.float32
    np.testing.assert_allclose(np.array(y), np.array(x) @ values.T, rtol=1e-5, atol=1e-5)


def test_a_tied_table_in_blocks_looks_up_rows_exactly_and_multiplies_through_the_kernel():
    table, values = q6_k_table()
    product = ExactProduct(8)
    layer = quantized_layer(nn.Embedding(512, 256), table, product)
    assert isinstance(layer, TiedBlockEmbedding)
    ids = mx.array([[3, 0, 511], [7, 7, 1]])
    np.testing.assert_array_equal(np.array(layer(ids)), values[np.array(ids)])
    x = mx.random.normal((2, 1, 256), key=mx.random.key(0))
    np.testing.assert_allclose(np.array(layer.as_linear(x)), np.array(x) @ values.T, rtol=1e-5, atol=1e-5)
    assert product.calls == [2]


def load_with_product(path, **options):
    """mlxllama.load as on a backend with a Q6_K kernel (the stand-in), and that kernel. Such a
    backend (CUDA) holds the other matrices in MLX's affine form, not the CPU's sub-block form."""
    product = ExactProduct(2)
    return load_as_on_cuda(path, block_products={QT.Q6_K: product}, **options), product


def test_the_loader_keeps_a_q6_k_output_in_the_files_blocks_at_the_files_size():
    path = find_fixture_model("chat-tiny-Q4_K_M.gguf")
    runtime, _ = load_with_product(path)
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "output.weight")
    assert tensor.tensor_type == QT.Q6_K
    assert isinstance(runtime.model.output, BlockLinear)
    assert runtime.model.output.weight.nbytes == tensor.n_bytes
    # The layers keep MLX's affine form, and the untied token table its own blocks for lookups.
    assert isinstance(runtime.model.blk[0].ffn_down, NativeLinear)
    assert not isinstance(runtime.model.token_embd, BlockLinear)


def test_the_loader_keeps_other_outputs_and_dequantized_models_as_before(monkeypatch):
    # Without a backend's kernel (CUDA with MLXLLAMA_CUDA_KERNELS=0), a tied Q6_K table stays in
    # MLX's affine form; on the CPU it takes the sub-block form.
    monkeypatch.setattr(mlxllama.runtime, "cuda_kernels_wanted", lambda: False)
    table = mlxllama.load(find_fixture_model("qwen3-tiny-Q4_K_M.gguf")).model.token_embd
    assert isinstance(table, TiedSubBlockEmbedding if mx.default_device() == mx.cpu else TiedEmbedding)
    q8_0, _ = load_with_product(find_fixture_model("types-tiny-Q8_0.gguf"))
    assert isinstance(q8_0.model.output, NativeLinear)
    dense, _ = load_with_product(find_fixture_model("chat-tiny-Q4_K_M.gguf"), dequantize=True)
    assert isinstance(dense.model.output, nn.Linear) and not isinstance(dense.model.output, BlockLinear)


def test_a_q6_k_output_in_blocks_matches_llama_cpp():
    """Logits over whole prompts (the decoded slices) and greedy decoding (the kernel) against llama.cpp."""
    runtime, product = load_with_product(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    ref = reference("chat-tiny-Q4_K_M")
    for prompt in PROMPTS:
        assert_logits_match(runtime, ref, prompt, f"{prompt} (output in blocks)")
    assert not product.calls
    assert_greedy_matches(runtime, ref, PROMPTS[0], "greedy (output in blocks)")
    assert product.calls and set(product.calls) == {1}


def test_a_tied_q6_k_table_in_blocks_matches_llama_cpp():
    runtime, product = load_with_product(find_fixture_model("qwen3-tiny-Q4_K_M.gguf"),
                                         context_length=512)
    assert isinstance(runtime.model.token_embd, TiedBlockEmbedding)
    ref = arch_reference("qwen3-tiny-Q4_K_M")
    for prompt in ("chat", "plain"):
        assert_logits_match(runtime, ref, prompt, f"qwen3 {prompt} (tied table in blocks)", MIN_DECIDED)
    assert_greedy_matches(runtime, ref, "chat", "qwen3 greedy (tied table in blocks)")
    assert product.calls
