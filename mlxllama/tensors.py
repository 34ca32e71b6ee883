"""One GGUF tensor as MLX arrays, in the form the model keeps it: the per-tensor conversion of weights.py.

Dequantized mode expands every tensor to the compute type. Native mode keeps each quantized matrix
quantized: re-expressed in MLX's affine format (quants.to_affine), or, for a token table that is
only looked up, in the file's own blocks. Norm weights stay float32 in both modes: they are tiny
and scale every activation.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import MlxLlamaError
from .gguf_file import tensor_shape
from .quants import AFFINE_TYPES, SUPPORTED_TYPES, AffineWeight, dequantize, to_affine


class Blocks(NamedTuple):
    """A tensor as the file stores it: uint8 [rows, bytes per row] of `qtype` blocks."""

    data: mx.array
    qtype: GGMLQuantizationType


Weight = mx.array | AffineWeight | Blocks


def tensor_to_mlx(path: str, tensor, dtype: mx.Dtype) -> mx.array:
    """The tensor's values as a `dtype` array of its row-major shape; `path` names the file in errors."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        type_name = qtype.name if isinstance(qtype, GGMLQuantizationType) else str(qtype)
        raise MlxLlamaError(f"{path}: tensor {tensor.name!r} has unsupported type {type_name}")
    shape = tensor_shape(tensor)
    block, _ = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise MlxLlamaError(
            f"{path}: tensor {tensor.name!r} row length {shape[-1]} is not a multiple of the {qtype.name} block ({block})")
    return dequantize(tensor.data, qtype, shape).astype(dtype)


def weight_dtype(name: str, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.Dtype:
    """Norm weights stay float32 (they are tiny and scale every activation); the rest take dtype."""
    return mx.float32 if len(shape) == 1 and not name.endswith(".bias") else dtype


def convert(path: str, tensor, shape: tuple[int, ...], dtype: mx.Dtype, native: bool,
            lookup_only: bool = False) -> Weight:
    """The tensor in the form the model keeps it, evaluated.

    native: a quantized matrix stays quantized, as its Blocks when `lookup_only` (a token table
    that is not also the output layer), else as an AffineWeight; dequantized mode, and every float
    tensor, give a plain array.
    """
    quantized = native and len(shape) in (2, 3) and tensor.tensor_type in AFFINE_TYPES
    if quantized and lookup_only:
        weight = Blocks(mx.array(tensor.data).reshape(shape[0], -1), tensor.tensor_type)
    elif quantized and len(shape) == 3:  # a mixture's experts [experts, out, in]: rows of every expert in turn
        flat = to_affine(tensor.data, tensor.tensor_type, (shape[0] * shape[1], shape[2]))
        return flat._replace(**{part: getattr(flat, part).reshape(*shape[:2], -1)
                                for part in ("weight", "scales", "biases") if getattr(flat, part) is not None})
    elif quantized:
        return to_affine(tensor.data, tensor.tensor_type, shape)  # evaluated slice by slice
    else:
        weight = tensor_to_mlx(path, tensor, weight_dtype(tensor.name, shape, dtype))
    mx.eval(weight)
    return weight
