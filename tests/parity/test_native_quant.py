"""Native mode: GGML blocks in MLX's affine format, checked value by value and against llama.cpp.

The default load is native, so test_llama_parity.py holds native mode to llama.cpp on every
fixture; here the conversion itself is checked, and the --dequantize mode keeps its parity.
"""

from __future__ import annotations

from collections import Counter

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import mlxllama
import mlxllama.fusion
import mlxllama.runtime
from mlxllama.fusion import stacked
from mlxllama.quantized_layers import BlockEmbedding, BlockLinear, NativeLinear, SubBlockLinear, TiedEmbedding, quantized_layer
from mlxllama.tensors import Blocks
from mlxllama.quants import AFFINE_TYPES, REQUANTIZED_TYPES, WIDE_GROUP_SIZE, dequantize, to_affine
from mlxllama.step_cost import launches

from conftest import find_fixture_model, load_as_on_cuda
from test_llama_parity import PROMPTS, REFERENCES, assert_logits_match, reference

QUANT_NAMES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
# Types whose scale is a file float16 as it is (and whose bias a power-of-two multiple of it or a file float16).
EXACT = {QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.IQ4_NL, QT.Q3_K}
FP16_HALF_ULP = 2.0**-11  # relative rounding of a normal float16
FP16_SUBNORMAL_STEP = 2.0**-24


def test_every_quantized_type_has_an_affine_form():
    assert AFFINE_TYPES == {QT[name] for name in QUANT_NAMES}


@pytest.mark.parametrize("type_name", QUANT_NAMES)
def test_affine_form_holds_the_ggml_values(fixture_model, type_name):
    qtype = QT[type_name]
    for tensor in gguf.GGUFReader(fixture_model(f"types-tiny-{type_name}.gguf")).tensors:
        if tensor.tensor_type != qtype:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))
        exact = np.array(dequantize(tensor.data, qtype, shape))
        affine = to_affine(tensor.data, qtype, shape)
        biases = affine.full_biases()
        got = np.array(mx.dequantize(affine.weight, affine.scales.astype(mx.float32),
                                     biases.astype(mx.float32), group_size=32, bits=affine.bits))
        error = np.abs(got - exact).reshape(shape[0], -1, 32)
        scales = np.abs(np.array(affine.scales, np.float32))[..., None]
        biases = np.abs(np.array(biases, np.float32))[..., None]
        if qtype in EXACT:
            np.testing.assert_array_equal(got, exact, err_msg=tensor.name)
        elif qtype == QT.Q6_K:
            # Half a step, one step where v = 128 is clipped, plus the float16 rounding of the scale
            # times |v| <= 128 (1/16 step).
            assert (error <= 1.07 * scales).all(), tensor.name
        elif qtype in REQUANTIZED_TYPES:
            # Half a step, plus the top value's overshoot from rounding the scale (< 0.13 step).
            assert (error <= 0.63 * scales + 1e-7).all(), tensor.name
        else:
            # Only the float16 rounding of the scale (times q) and of the bias.
            bound = FP16_HALF_ULP * (scales * (2**affine.bits - 1) + biases) + 2**affine.bits * FP16_SUBNORMAL_STEP
            assert (error <= bound).all(), tensor.name


def test_requantized_error_is_a_small_part_of_the_type_own_error(fixture_model):
    """Q6_K re-quantized to 8 bits adds well under half of Q6_K's own rounding error (RMS)."""
    reader = gguf.GGUFReader(fixture_model("types-tiny-Q6_K.gguf"))
    tensor = next(t for t in reader.tensors if t.tensor_type == QT.Q6_K)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    exact = np.array(dequantize(tensor.data, QT.Q6_K, shape))
    affine = to_affine(tensor.data, QT.Q6_K, shape)
    got = np.array(mx.dequantize(affine.weight, affine.scales, affine.full_biases(), group_size=32, bits=8), np.float32)
    # A Q6_K step is 1/63 of a 16-value sub-block's range; uniform rounding error is step / sqrt(12).
    sub_blocks = exact.reshape(-1, 16)
    own_rms = np.sqrt(np.mean(((sub_blocks.max(1) - sub_blocks.min(1)) / 63) ** 2 / 12))
    added_rms = np.sqrt(np.mean((got - exact) ** 2))
    assert added_rms < 0.5 * own_rms


def test_wide_q6_k_holds_the_pairs_bytes_with_its_biases_stored(fixture_model):
    """Q6_K's wide form: groups of 64, each a scale and its bias (-128 x scale, stored exactly), in the
    8.5 bits a weight of the pairs' form; within half its step of the file's values (one step where
    v = 128 is clipped), and what it adds to Q6_K's own error well under half of it (RMS)."""
    for tensor in gguf.GGUFReader(fixture_model("types-tiny-Q6_K.gguf")).tensors:
        if tensor.tensor_type != QT.Q6_K:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))
        exact = np.array(dequantize(tensor.data, QT.Q6_K, shape))
        pairs, wide = to_affine(tensor.data, QT.Q6_K, shape), to_affine(tensor.data, QT.Q6_K, shape, wide=True)
        assert (wide.group_size, pairs.group_size) == (WIDE_GROUP_SIZE, 32) == (64, 32)
        assert wide.scales.shape == (shape[0], shape[1] // 64) and wide.biases.shape == wide.scales.shape
        assert sum(a.nbytes for a in wide[:3]) == sum(a.nbytes for a in pairs[:3] if a is not None)
        np.testing.assert_array_equal(np.array(wide.biases, np.float32), -128 * np.array(wide.scales, np.float32))
        got = np.array(mx.dequantize(wide.weight, wide.scales.astype(mx.float32), wide.biases.astype(mx.float32),
                                     group_size=64, bits=8))
        scales = np.abs(np.array(wide.scales, np.float32))[..., None]
        assert (np.abs(got - exact).reshape(shape[0], -1, 64) <= 1.07 * scales).all(), tensor.name
        sub_blocks = exact.reshape(-1, 16)
        own_rms = np.sqrt(np.mean(((sub_blocks.max(1) - sub_blocks.min(1)) / 63) ** 2 / 12))
        assert np.sqrt(np.mean((got - exact) ** 2)) < 0.5 * own_rms, tensor.name


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_a_wide_q6_k_product_is_one_launch(fixture_model, dtype):
    """With its biases stored, a wide Q6_K projection in float16 (a GPU's) is the quantized product
    alone (the pairs' form adds a multiply, test_a_symmetric_weight_derives_its_biases_in_the_input_type),
    and a stack of wide layers stays one product."""
    reader = gguf.GGUFReader(fixture_model("types-tiny-Q6_K.gguf"))
    parts = {t.name: t for t in reader.tensors}
    layers = [NativeLinear(to_affine(parts[f"blk.0.attn_{n}.weight"].data, QT.Q6_K,
                                     tuple(int(d) for d in reversed(parts[f"blk.0.attn_{n}.weight"].shape)), wide=True),
                           output_bias=False) for n in ("q", "k")]
    x = mx.random.normal((2, layers[0].weight.shape[1] * 4), key=mx.random.key(2)).astype(dtype)
    mx.eval(x)
    # A float32 input (the CPU's) has MLX cast the stored scales and biases, as for every stored-bias type.
    extra = Counter({"AsType": 2} if dtype == mx.float32 else {})
    assert launches([layers[0](x)]) == Counter({"QuantizedMatmul": 1}) + extra
    stacked_layer = NativeLinear.stack(layers)
    assert stacked_layer.group_size == 64
    np.testing.assert_array_equal(np.array(stacked_layer(x)), np.array(mx.concatenate([layer(x) for layer in layers], -1)))
    pairs = NativeLinear(to_affine(parts["blk.0.attn_k.weight"].data, QT.Q6_K,
                                   tuple(int(d) for d in reversed(parts["blk.0.attn_k.weight"].shape))), output_bias=False)
    assert NativeLinear.stack([layers[0], pairs]) is None  # groups of 64 and of 32 make no one product


@pytest.mark.parametrize("name", [n for n in REFERENCES if n.startswith("chat-tiny") and n.split("-")[-1] in
                                  ("Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")])
def test_wide_q6_k_matches_llama_cpp(name):
    """The mixes that hold Q6_K, in MLX's affine form with Q6_K wide (as Metal, and CUDA without the
    kernels, hold them): the parity bars of the other forms."""
    m, ref = load_as_on_cuda(find_fixture_model(f"{name}.gguf"), wide=True), reference(name)
    assert any(getattr(layer, "group_size", 32) == 64 for _, layer in m.model.named_modules())
    for prompt in PROMPTS:
        assert_logits_match(m, ref, prompt, f"{name} {prompt} (Q6_K wide)")


def outputs(layer: NativeLinear | SubBlockLinear) -> int:
    return layer.weight.shape[0] if isinstance(layer, NativeLinear) else layer.sub_scales.shape[1]


def test_native_model_uses_quantized_layers_per_tensor_type():
    m = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"))
    layers = dict(m.model.named_modules())
    assert isinstance(layers["token_embd"], BlockEmbedding)
    # On the CPU the K-types take their exact sub-block form, Q4_K's codes in 4 bits and Q6_K's in 6;
    # on a GPU MLX's affine form, Q6_K re-quantized to 8 bits on a symmetric grid.
    cpu = mx.default_device() == mx.cpu
    kind, q6_k_bits = (SubBlockLinear, 6) if cpu else (NativeLinear, 8)
    # Q/K/V and gate/up are Q4_K and fused (fusion.py); layer 2's attn_v is Q6_K, so Q and K stack without it.
    assert isinstance(layers["blk.0.attn_qkv"], kind) and layers["blk.0.attn_qkv"].bits == 4
    assert outputs(layers["blk.0.attn_qkv"]) == 256 + 2 * 64 and "attn_q" not in layers["blk.0"]
    assert layers["blk.2.attn_qk"].bits == 4 and "attn_qkv" not in layers["blk.2"]
    assert outputs(layers["blk.2.attn_qk"]) == 256 + 64 and "attn_q" not in layers["blk.2"]
    assert isinstance(layers["blk.2.ffn_gate_up"], kind)
    assert isinstance(layers["blk.2.attn_v"], kind) and layers["blk.2.attn_v"].bits == q6_k_bits
    if cpu or not mlxllama.runtime.cuda_kernels_wanted():
        assert isinstance(layers["output"], kind) and layers["output"].bits == q6_k_bits
        # MLX's own products take Q6_K's wide form: groups of 64, their biases stored.
        assert cpu or "biases" in layers["output"] and layers["output"].group_size == 64
    else:  # the CUDA kernels' Q6_K output in the file's blocks (test_block_output.py)
        assert isinstance(layers["output"], BlockLinear)
    dense = dict(mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), dequantize=True).model.named_modules())
    assert type(dense["blk.0.attn_qkv"]) is nn.Linear and type(dense["blk.2.attn_qkv"]) is nn.Linear
    # As trace loads: Q6_K expanded to the file's values, Q4_K native.
    exact = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), requantize=False)
    layers = dict(exact.model.named_modules())
    assert isinstance(layers["blk.0.attn_qkv"], kind) and layers["blk.0.attn_qkv"].bits == 4
    assert type(layers["blk.2.attn_v"]) is nn.Linear and type(layers["output"]) is nn.Linear
    tensor = next(t for t in gguf.GGUFReader(exact.path).tensors if t.name == "blk.2.attn_v.weight")
    assert tensor.tensor_type == QT.Q6_K
    expanded = layers["blk.2.attn_v"].weight  # in the compute type: float16 on a GPU
    np.testing.assert_array_equal(np.array(expanded),
                                  np.array(dequantize(tensor.data, QT.Q6_K, expanded.shape).astype(expanded.dtype)))


@pytest.mark.parametrize("quant", ["Q4_K", "Q6_K", "Q5_0", "F16"])
def test_stacked_projections_compute_their_parts_outputs(fixture_model, quant, monkeypatch):
    path = fixture_model(f"types-tiny-{quant}.gguf")
    fused = mlxllama.load(path, dequantize=quant == "F16")
    monkeypatch.setattr(mlxllama.fusion, "stacked", lambda layers: None)
    apart = mlxllama.load(path, dequantize=quant == "F16")
    block = apart.model.blk[0]
    x = mx.random.normal((3, apart.config.hidden_size), key=mx.random.key(0))
    for parts in ([block.attn_q, block.attn_k, block.attn_v], [block.ffn_gate, block.ffn_up]):
        expected = np.concatenate([np.array(p(x)) for p in parts], axis=-1)
        np.testing.assert_allclose(np.array(stacked(parts)(x)), expected, rtol=0, atol=1e-5)
    ids = [1, 5, 9, 300, 4]
    np.testing.assert_allclose(fused.logits(ids), apart.logits(ids), rtol=0, atol=1e-4)
    assert "attn_qkv" in fused.model.blk[0] and "attn_qkv" not in block



# A lookup's kernels for the token tables of published files (Q4_K_M's Q4_K, Q5_K_M's Q5_K, Q6_K,
# Q8_0): the gather and one compiled decoder. A decode step launches them every step; before the
# decoders were shaped for it, Q4_K's took 13 (18 kernels on CUDA, with the copies of its
# concatenations and float16 views).
ONE_KERNEL_DECODERS = {"Q4_K", "Q5_K", "Q6_K", "Q8_0"}


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                                       "IQ4_NL", "IQ4_XS"])
def test_block_embedding_looks_up_the_exact_rows(fixture_model, type_name):
    tensor = next(t for t in gguf.GGUFReader(fixture_model(f"types-tiny-{type_name}.gguf")).tensors
                  if t.name == "token_embd.weight")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    table = Blocks(mx.array(tensor.data).reshape(shape[0], -1), tensor.tensor_type)
    ids = mx.array([[3, 0, 511], [7, 7, 1]])
    exact = np.array(dequantize(tensor.data, tensor.tensor_type, shape))
    looked_up = BlockEmbedding(table)(ids)
    counted = launches([looked_up])
    if type_name in ONE_KERNEL_DECODERS:
        assert counted.pop("Gather") == 1 and list(counted.values()) == [1], counted
        assert next(iter(counted)).startswith("Compiled")
    np.testing.assert_array_equal(np.array(looked_up), exact[np.array(ids)])


def tied_table(path) -> tuple[TiedEmbedding, np.ndarray]:
    """The file's token table made into a table tied to the output layer, and the values it holds
    (the exact ones for Q3_K, see test_affine_form_holds_the_ggml_values)."""
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    affine = to_affine(tensor.data, tensor.tensor_type, shape)
    dense = mx.dequantize(affine.weight, affine.scales.astype(mx.float32), affine.full_biases().astype(mx.float32),
                          group_size=32, bits=affine.bits)
    return quantized_layer(nn.Embedding(*shape), affine), np.array(dense)


@pytest.mark.parametrize("quant", ["Q6_K", "Q3_K"])
def test_tied_embedding_looks_up_rows_and_computes_the_output(fixture_model, quant):
    """A table that is also the output layer: a lookup gives its rows, as_linear the product with the whole table."""
    layer, values = tied_table(fixture_model(f"types-tiny-{quant}.gguf"))
    assert isinstance(layer, TiedEmbedding)
    ids = mx.array([[3, 0, 511], [7, 7, 1]])
    rows = layer(ids)
    # Exactly, in float32: dequantized in the float16 of the scales, a row is rounded by up to 2^-11.
    assert rows.dtype == mx.float32
    np.testing.assert_array_equal(np.array(rows), values[np.array(ids)])
    x = mx.random.normal((2, 1, values.shape[1]), key=mx.random.key(0))
    np.testing.assert_allclose(np.array(layer.as_linear(x)), np.array(x) @ values.T, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("quant, quantized_matmuls", [("Q3_K", 0), ("Q6_K", 1)])
def test_tied_output_honours_gpu_expanded_types(fixture_model, monkeypatch, quant, quantized_matmuls):
    """On a GPU a tied Q3_K output layer, like any Q3_K projection, multiplies by its expanded float
    weight even for one row; other types keep the quantized matmul for a few rows."""
    layer, values = tied_table(fixture_model(f"types-tiny-{quant}.gguf"))
    x = mx.random.normal((1, 1, values.shape[1]), key=mx.random.key(0))
    calls = []
    quantized_matmul = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **kw: calls.append(a) or quantized_matmul(*a, **kw))
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    out = np.array(layer.as_linear(x))
    assert len(calls) == quantized_matmuls
    # As in test_native_linear_paths_agree: an expanded weight is rounded to float16.
    np.testing.assert_allclose(out, np.array(x) @ values.T, rtol=1e-2, atol=5e-3)


def test_float_files_stay_dense_in_native_mode():
    m = mlxllama.load(find_fixture_model("types-tiny-F16.gguf"))
    assert not any(isinstance(layer, (NativeLinear, BlockEmbedding)) for _, layer in m.model.named_modules())


@pytest.mark.parametrize("name", [n for n in REFERENCES if n.startswith("chat-tiny") and not n.endswith("F16")])
def test_dequantized_mode_matches_llama_cpp(name):
    """--dequantize keeps the core parity (argmax where decided, mean KL) on the quantized files."""
    m, ref = mlxllama.load(find_fixture_model(f"{name}.gguf"), dequantize=True), reference(name)
    for prompt in PROMPTS:
        assert_logits_match(m, ref, prompt, f"{name} {prompt} (dequantized)")


def test_native_linear_paths_agree(monkeypatch):
    """The quantized matmul (one row) and, on a GPU, the expanded float weight (several rows) give one function."""
    tensor = next(t for t in gguf.GGUFReader(find_fixture_model("types-tiny-Q6_K.gguf")).tensors
                  if t.name == "blk.0.ffn_up.weight")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    layer = NativeLinear(to_affine(tensor.data, tensor.tensor_type, shape), output_bias=False)
    x = mx.random.normal((1, 3, shape[1]))
    quantized = np.array(layer(x))
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    layer.expand_rows = 3
    # The expanded weight is float16 (the GPU's compute type), so each weight is rounded to it.
    np.testing.assert_allclose(np.array(layer(x)), quantized, rtol=1e-2, atol=5e-3)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_a_symmetric_weight_derives_its_biases_in_the_input_type(dtype):
    """Q6_K's 8-bit grid stores no biases: derived from the scales cast to the input's type, they cost a
    cast and a multiply (none of the cast in float16), not a multiply and the two casts MLX's product
    would add, and give the product of the stored form to the last bit."""
    tensor = next(t for t in gguf.GGUFReader(find_fixture_model("types-tiny-Q6_K.gguf")).tensors
                  if t.name == "blk.0.ffn_up.weight")
    shape = tuple(int(n) for n in reversed(tensor.shape))
    affine = to_affine(tensor.data, tensor.tensor_type, shape)
    x = mx.random.normal((2, shape[1]), key=mx.random.key(1)).astype(dtype)
    mx.eval(x)
    y = NativeLinear(affine, output_bias=False)(x)
    extra = Counter({"AsType": 1} if dtype == mx.float32 else {})
    assert launches([y]) == Counter({"QuantizedMatmul": 1, "Multiply": 1}) + extra
    stored = mx.quantized_matmul(x, affine.weight, affine.scales.astype(dtype), affine.full_biases().astype(dtype),
                                 transpose=True, group_size=32, bits=8)
    np.testing.assert_array_equal(np.array(y), np.array(stored))
