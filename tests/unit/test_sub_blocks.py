"""The sub-block form of the K-types (quants.to_sub_blocks, quantized_layers.SubBlockLinear): the
file's values in about the file's bits, on llama.cpp's own blocks."""

from __future__ import annotations

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from mlx.utils import tree_flatten

import mlxllama
import mlxllama.quantized_layers as quantized_layers
from mlxllama.fusion import stacked
from mlxllama.quantized_layers import NativeLinear, SubBlockLinear, TiedSubBlockEmbedding
from mlxllama.quants import SUB_BLOCK_FORMS, dequantize, sub_block_form_fits, to_affine, to_sub_blocks

from conftest import find_fixture_model

# MLX's CUDA backend (0.32.4) has no non-transposed quantized matmul ("No implementation for
# problem shape"), and a GPU keeps the affine form anyway.
pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's form")

TYPES = ("Q6_K", "Q3_K", "Q4_K", "Q2_K")
# Bits a value held: codes (Q3_K's 3 bits widened to 4), an int8 scale (and min) a sub-block, a
# float16 d (and dmin) a block of 256. Q6_K's are the file's own; the affine form holds 8.5, 8.5, 5, 9.
BITS = {"Q6_K": 6 + 8 / 16 + 16 / 256, "Q3_K": 4 + 8 / 16 + 16 / 256, "Q4_K": 4 + 16 / 32 + 32 / 256,
        "Q2_K": 2 + 16 / 16 + 32 / 256}


def tensors(type_name: str) -> dict[str, tuple[np.ndarray, tuple[int, int]]]:
    """The types-tiny fixture's 2-D tensors of that type: raw data and row-major shape."""
    reader = gguf.GGUFReader(find_fixture_model(f"types-tiny-{type_name}.gguf"))
    return {t.name: (t.data, tuple(int(n) for n in reversed(t.shape))) for t in reader.tensors
            if t.tensor_type == QT[type_name] and len(t.shape) == 2}


def exact(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> np.ndarray:
    return np.array(dequantize(data, QT[type_name], shape), dtype=np.float64)


def inputs(rows: int, cols: int) -> mx.array:
    return mx.random.normal((rows, cols), key=mx.random.key(rows))


@pytest.mark.parametrize("type_name", TYPES)
def test_products_are_the_files_values_times_the_input_to_float32_rounding(type_name):
    for name, (data, shape) in tensors(type_name).items():
        layer = SubBlockLinear(to_sub_blocks(data, QT[type_name], shape), output_bias=False)
        x = inputs(5, shape[1])
        want = np.array(x, dtype=np.float64) @ exact(data, type_name, shape).T
        error = np.abs(np.array(layer(x)) - want).max() / np.abs(want).max()
        assert error < 5e-6, (name, error)
    affine = NativeLinear(to_affine(data, QT[type_name], shape), output_bias=False)
    affine_error = np.abs(np.array(affine(x)) - want).max() / np.abs(want).max()
    # The affine form re-quantizes Q6_K and Q2_K, and rounds Q4_K's d x scale to float16: the
    # errors this form removes. Q3_K's 8-bit grid was already exact.
    assert affine_error > {"Q6_K": 1e-3, "Q2_K": 1e-3, "Q4_K": 2e-5, "Q3_K": -1}[type_name], affine_error


@pytest.mark.parametrize("type_name", TYPES)
def test_held_in_about_the_files_bits(type_name):
    data, shape = tensors(type_name)["output.weight"]
    weight = to_sub_blocks(data, QT[type_name], shape)
    held = sum(a.nbytes for a in weight[:5] if a is not None)
    assert held == shape[0] * shape[1] * BITS[type_name] / 8
    assert SUB_BLOCK_FORMS[QT[type_name]].bits == {"Q6_K": 6, "Q3_K": 4, "Q4_K": 4, "Q2_K": 2}[type_name]


@pytest.mark.parametrize("type_name", TYPES)
def test_a_lookup_gives_the_files_rows_exactly(type_name):
    data, shape = tensors(type_name)["token_embd.weight"]
    table = TiedSubBlockEmbedding(to_sub_blocks(data, QT[type_name], shape), output_bias=False)
    ids = mx.array([[0, 1, shape[0] - 1], [7, 300, shape[0] - 2]])  # the last row's code ends in the last byte
    got = table(ids)
    assert got.shape == (2, 3, shape[1]) and got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got).reshape(-1, shape[1]),
                                  exact(data, type_name, shape)[np.array(ids).reshape(-1)].astype(np.float32))


def test_rows_batched_or_in_parts_are_bit_identical_to_one_at_a_time(monkeypatch):
    data, shape = tensors("Q6_K")["blk.0.ffn_down.weight"]
    layer = SubBlockLinear(to_sub_blocks(data, QT.Q6_K, shape), output_bias=False)
    x = inputs(9, shape[1])
    alone = mx.concatenate([layer(x[i : i + 1]) for i in range(9)])
    together = layer(x)
    # Parts of 2 rows: the partial sums of 48 sub-blocks x 256 outputs x 2 rows, float32.
    monkeypatch.setattr(quantized_layers, "SUB_BLOCK_SUMS_BYTES", 48 * 256 * 2 * 4)
    in_parts = layer(x.reshape(3, 3, -1))
    assert in_parts.shape == (3, 3, 256)
    assert mx.array_equal(alone, together) and mx.array_equal(together, in_parts.reshape(9, -1))


def test_stacked_layers_give_their_outputs_in_order_and_other_types_do_not_stack():
    parts = tensors("Q6_K")
    layers = [SubBlockLinear(to_sub_blocks(*parts[f"blk.0.attn_{n}.weight"][:1], QT.Q6_K,
                                           parts[f"blk.0.attn_{n}.weight"][1]), output_bias=False) for n in "qkv"]
    fused = stacked(layers)
    assert isinstance(fused, SubBlockLinear)
    x = inputs(3, 256)
    assert mx.array_equal(fused(x), mx.concatenate([layer(x) for layer in layers], axis=-1))
    q4 = tensors("Q4_K")
    with_mins = [SubBlockLinear(to_sub_blocks(*q4[f"blk.0.ffn_{n}.weight"][:1], QT.Q4_K, q4[f"blk.0.ffn_{n}.weight"][1]),
                                output_bias=False) for n in ("gate", "up")]
    fused = stacked(with_mins)
    assert isinstance(fused, SubBlockLinear) and "sub_mins" in fused
    assert mx.array_equal(fused(x), mx.concatenate([layer(x) for layer in with_mins], axis=-1))
    assert stacked([layers[0], with_mins[0]]) is None


def test_a_row_count_off_the_32_output_groups_is_padded_and_cut_off_again():
    data, shape = tensors("Q4_K")["output.weight"]
    rows = 37  # a vocabulary of 32,001 or Qwen3-tiny's 3,005 likewise
    weight = to_sub_blocks(data[:rows], QT.Q4_K, (rows, shape[1]))
    assert weight.rows == rows and weight.sub_scales.shape[1] == 64 and weight.codes.shape[1] == 64 * 4 // 32
    table = TiedSubBlockEmbedding(weight, output_bias=False)
    x = inputs(4, shape[1])
    want = np.array(x, dtype=np.float64) @ exact(data[:rows], "Q4_K", (rows, shape[1])).T
    got = table.as_linear(x)
    assert got.shape == (4, rows) and np.abs(np.array(got) - want).max() < 5e-6 * np.abs(want).max()
    np.testing.assert_array_equal(np.array(table(mx.array([rows - 1, 0]))),
                                  exact(data[:rows], "Q4_K", (rows, shape[1]))[[rows - 1, 0]].astype(np.float32))
    assert table.padded and stacked([table, table]) is None  # padding in the middle would misplace rows


def test_the_forms_types():
    assert all(sub_block_form_fits(QT[t], (37, 256)) for t in TYPES)
    assert not sub_block_form_fits(QT.Q5_K, (32000, 256)) and not sub_block_form_fits(QT.Q6_K, (8, 64, 256))
    with pytest.raises(ValueError, match="no sub-block form"):
        to_sub_blocks(np.zeros(176 * 3, np.uint8), QT.Q5_K, (3, 256))


def test_the_cpu_holds_a_q4_k_m_files_matrices_in_their_file_bits_and_answers_as_before():
    path = find_fixture_model("chat-tiny-Q4_K_M.gguf")
    rt = mlxllama.load(path)
    matrices = [t for t in gguf.GGUFReader(path).tensors if t.name != "token_embd.weight" and len(t.shape) == 2]
    assert {t.tensor_type for t in matrices} == {QT.Q4_K, QT.Q6_K}
    layers = dict(rt.model.named_modules())
    assert not any(isinstance(m, NativeLinear) for m in layers.values())  # fused Q/K/V and gate/up too
    held = sum(sum(a.nbytes for _, a in tree_flatten(m.parameters()))
               for m in layers.values() if isinstance(m, SubBlockLinear))
    # Q6_K at the file's bytes, Q4_K at 4.625 bits a value against the file's 4.5.
    assert held == sum(t.n_bytes if t.tensor_type == QT.Q6_K else t.n_elements * 4.625 / 8 for t in matrices)
    assert type(layers["output"]) is SubBlockLinear and not isinstance(layers["token_embd"], nn.Linear)
    ids = rt.tokenize(rt.apply_chat_template([{"role": "user", "content": "What is the capital of Japan?"}]), special=True)
    reply = rt.generate(ids, 12)
    assert reply.text.startswith("The capital of Japan is Tokyo.")
