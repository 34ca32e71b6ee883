"""Dequantization checked against gguf-py's reference on files written by llama.cpp."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as reference

from mlxllama.quants import FORMATS, SUPPORTED_TYPES, _iq4_xs_scales, dequantize, to_affine

TYPE_NAMES = [
    "F32", "F16", "BF16",
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS",
]


def logical_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))


def load_tensors(fixture_model, type_name: str) -> list[gguf.ReaderTensor]:
    reader = gguf.GGUFReader(fixture_model(f"types-tiny-{type_name}.gguf"))
    return list(reader.tensors)


def test_supported_types_are_exactly_the_listed_ones():
    assert SUPPORTED_TYPES == frozenset(QT[name] for name in TYPE_NAMES)


@pytest.mark.parametrize("type_name", TYPE_NAMES)
def test_matches_gguf_reference_exactly(fixture_model, type_name):
    tensors = load_tensors(fixture_model, type_name)
    qtype = QT[type_name]
    assert any(t.tensor_type == qtype for t in tensors), f"no {type_name} tensor in fixture"
    # The files' F32 norm vectors are checked too, as every loader meets them.
    for tensor in tensors:
        shape = logical_shape(tensor)
        expected = reference.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        got = dequantize(tensor.data, tensor.tensor_type, shape)
        assert got.dtype == mx.float32
        np.testing.assert_array_equal(
            np.array(got), expected.astype(np.float32), strict=True, err_msg=tensor.name
        )


def test_result_has_requested_shape_and_dtype(fixture_model):
    tensor = next(t for t in load_tensors(fixture_model, "Q8_0") if t.name == "token_embd.weight")
    rows, cols = logical_shape(tensor)
    # Any leading dims work as long as the last one is whole blocks.
    shape = (2, rows // 2, cols)
    got = dequantize(tensor.data, tensor.tensor_type, shape)
    assert got.shape == shape
    assert got.dtype == mx.float32
    flat = dequantize(tensor.data, tensor.tensor_type, (rows, cols))
    assert mx.array_equal(got.reshape(rows, cols), flat).item()


@pytest.mark.parametrize("qtype", [QT.Q8_1, QT.Q8_K, QT.IQ2_XXS, QT.TQ1_0, QT.MXFP4, QT.F64, QT.I32])
def test_unsupported_type_raises_value_error(qtype):
    assert qtype not in SUPPORTED_TYPES
    with pytest.raises(ValueError, match=qtype.name):
        dequantize(np.zeros((1, 64), dtype=np.uint8), qtype, (1, 32))


def test_shape_that_does_not_match_data_raises_value_error():
    data = np.zeros((2, 34), dtype=np.uint8)  # two Q8_0 blocks
    with pytest.raises(ValueError):
        dequantize(data, QT.Q8_0, (3, 32))
    with pytest.raises(ValueError):
        dequantize(data, QT.Q8_0, (4, 16))


def test_iq4_xs_scales_unpack_as_ggml_does():
    """IQ4_XS's sub-block scales, decoded once (_iq4_xs_scales) for both the exact and the affine form."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(16, 136), dtype=np.uint8)
    blocks[:, :2] = rng.uniform(-1, 1, (16, 1)).astype(np.float16).view(np.uint8)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    scales_h = blocks[:, 2:4].copy().view("<u2")[:, 0].astype(np.int64)
    # ggml's dequantize_row_iq4_xs: a nibble of scales_l, and two bits of scales_h above it, minus 32.
    ls = np.stack([((blocks[:, 4 + ib // 2] >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4)
                   for ib in range(8)], axis=1)
    expected = d * (ls - 32).astype(np.float32)
    np.testing.assert_array_equal(np.array(_iq4_xs_scales(FORMATS[QT.IQ4_XS].fields(mx.array(blocks)))), expected)
    affine = to_affine(blocks, QT.IQ4_XS, (1, 16 * 256))
    np.testing.assert_array_equal(np.array(affine.scales), expected.astype(np.float16).reshape(1, -1))


def test_each_block_layout_covers_exactly_the_types_block():
    """The named fields of each type's block add up to ggml's block size for that type, in byte order."""
    from gguf import GGML_QUANT_SIZES

    for qtype, form in FORMATS.items():
        assert sum(size for _, size in form.layout) == GGML_QUANT_SIZES[qtype][1], qtype.name
        assert len({name for name, _ in form.layout}) == len(form.layout), qtype.name
