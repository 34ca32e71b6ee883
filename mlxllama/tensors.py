"""One GGUF tensor as MLX arrays, in the form the model keeps it: the per-tensor conversion of weights.py.

Dequantized mode expands every tensor to the compute type. Native mode keeps each quantized matrix
quantized: re-expressed in MLX's affine format (quants.to_affine), or, for a token table that is
only looked up, in the file's own blocks. Norm weights stay float32 in both modes: they are tiny
and scale every activation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import MlxLlamaError
from .gguf_file import tensor_shape
from .quants import (AFFINE_GROUP_SIZE, AFFINE_TYPES, REQUANTIZED_TYPES, SUPPORTED_TYPES, AffineWeight, SubBlockWeight,
                     dequantize, narrowed, sub_block_form_fits, to_affine, to_sub_blocks)


class Blocks(NamedTuple):
    """A tensor as the file stores it: uint8 [rows, bytes per row] of `qtype` blocks."""

    data: mx.array
    qtype: GGMLQuantizationType


Weight = mx.array | AffineWeight | SubBlockWeight | Blocks


class Piece(NamedTuple):
    """The part of a tensor that one rank of a tensor-parallel run holds (sharding.py): ranges of
    its rows (the second-last axis) joined in order, or one range of its columns (the last axis)."""

    rows: tuple[tuple[int, int], ...] | None = None
    columns: tuple[int, int] | None = None


class TensorPart(NamedTuple):
    """A cut of a file's tensor with the fields the conversion reads: `data` holds only the cut."""

    name: str
    tensor_type: Any
    data: np.ndarray


def tensor_to_mlx(path: str, tensor, dtype: mx.Dtype, shape: tuple[int, ...] | None = None) -> mx.array:
    """The tensor's values as a `dtype` array of its row-major shape (or of `shape`, a cut's);
    `path` names the file in errors."""
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        type_name = qtype.name if isinstance(qtype, GGMLQuantizationType) else str(qtype)
        raise MlxLlamaError(f"{path}: tensor {tensor.name!r} has unsupported type {type_name}")
    shape = shape or tensor_shape(tensor)
    block, _ = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise MlxLlamaError(
            f"{path}: tensor {tensor.name!r} row length {shape[-1]} is not a multiple of the {qtype.name} block ({block})")
    return dequantize(tensor.data, qtype, shape).astype(dtype)


def convert(path: str, tensor, shape: tuple[int, ...], dtype: mx.Dtype, native: bool,
            as_blocks: bool = False, piece: Piece | None = None, requantize: bool = True,
            sub_blocks: bool = False, wide: bool = False) -> Weight:
    """The tensor in the form the model keeps it, evaluated.

    native: a quantized matrix stays quantized, as its Blocks when `as_blocks` (a token table
    that is not also the output layer, or an output layer a backend multiplies in its blocks:
    weights.py), as a SubBlockWeight where `sub_blocks` (the CPU's form) and its type has one
    (Q2_K, Q3_K, Q4_K, Q6_K), else as an AffineWeight; dequantized mode, and every float
    tensor, give a plain array. With a `piece`, only that part of the tensor is read and kept.
    Without `requantize`, a matrix of a type the affine form holds only approximately (Q2_K, Q6_K:
    quants.REQUANTIZED_TYPES) is expanded to `dtype` instead, so the model holds the file's values.
    `wide`: an AffineWeight in its type's wide form where it has one (quants.to_affine); a piece
    (cut and trimmed in groups of 32) holds the wide form's values in groups of 32 (quants.narrowed),
    so that a split model computes what one process does.
    """
    if piece is not None:
        tensor, shape, trim = cut(tensor, shape, piece)
        weight = convert(path, tensor, shape, dtype, native, requantize=requantize, sub_blocks=sub_blocks, wide=wide)
        weight = narrowed(weight) if isinstance(weight, AffineWeight) else weight
        return trim_columns(weight, trim) if trim else weight
    quantized = native and len(shape) in (2, 3) and tensor.tensor_type in AFFINE_TYPES
    if quantized and as_blocks:  # the file's own blocks: exact whatever the type
        weight = Blocks(mx.array(tensor.data).reshape(shape[0], -1), tensor.tensor_type)
    elif quantized and not requantize and tensor.tensor_type in REQUANTIZED_TYPES:
        weight = tensor_to_mlx(path, tensor, dtype, shape)
    elif quantized and sub_blocks and sub_block_form_fits(tensor.tensor_type, shape):
        return to_sub_blocks(tensor.data, tensor.tensor_type, shape)  # evaluated slice by slice
    elif quantized and len(shape) == 3:  # a mixture's experts [experts, out, in]: rows of every expert in turn
        flat = to_affine(tensor.data, tensor.tensor_type, (shape[0] * shape[1], shape[2]), wide)
        return flat._replace(**{part: getattr(flat, part).reshape(*shape[:2], -1)
                                for part in ("weight", "scales", "biases") if getattr(flat, part) is not None})
    elif quantized:
        return to_affine(tensor.data, tensor.tensor_type, shape, wide)  # evaluated slice by slice
    else:
        # Norm weights too: a float32 weight would make each norm's output float32, and casting it
        # back is a kernel a norm (models.transformer.RMSNorm).
        weight = tensor_to_mlx(path, tensor, dtype, shape)
    mx.eval(weight)
    return weight


def cut(tensor, shape: tuple[int, ...], piece: Piece) -> tuple[TensorPart, tuple[int, ...], tuple[int, int] | None]:
    """The part of `tensor` (row-major `shape`) that `piece` names, read from the file alone, its
    shape, and the columns of it to keep after conversion: a quantized row is cut along whole
    blocks, so a cut inside a block reads that block and trims the converted weight."""
    data = tensor.data
    if piece.rows is not None and len(shape) == 1:  # a bias: one value a row
        data = np.concatenate([data[a:b] for a, b in piece.rows])
        shape = (len(data),)
    elif piece.rows is not None:
        data = np.concatenate([data[..., a:b, :] for a, b in piece.rows], axis=-2)
        shape = (*shape[:-2], sum(b - a for a, b in piece.rows), shape[-1])
    trim = None
    if piece.columns is not None:
        a, b = piece.columns
        if data.shape[-1] == shape[-1]:  # a float tensor: one array element a value
            data = data[..., a:b]
            shape = (*shape[:-1], b - a)
        else:
            block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
            first, last = a // block, -(-b // block)
            data = data[..., first * block_bytes : last * block_bytes]
            shape = (*shape[:-1], (last - first) * block)
            if (a, b) != (first * block, last * block):
                trim = (a - first * block, b - first * block)
    return TensorPart(tensor.name, tensor.tensor_type, data), shape, trim


def trim_columns(weight: Weight, columns: tuple[int, int]) -> Weight:
    """Columns [a, b) of a converted weight, copied, so that the rest of the block it was read in is
    freed; an AffineWeight's must fall on whole groups, a SubBlockWeight's on whole sub-blocks
    (sharding.py only asks for groups of 32, which are both)."""
    a, b = columns
    if isinstance(weight, SubBlockWeight):
        trimmed = _trim_sub_blocks(weight, a, b)
    elif isinstance(weight, AffineWeight):
        group = AFFINE_GROUP_SIZE
        assert a % group == 0 and b % group == 0, (a, b)
        words = group * weight.bits // 32
        parts = {"weight": (a // group * words, b // group * words), "scales": (a // group, b // group),
                 "biases": (a // group, b // group)}
        trimmed = weight._replace(**{name: mx.contiguous(getattr(weight, name)[..., lo:hi])
                                     for name, (lo, hi) in parts.items() if getattr(weight, name) is not None})
    else:
        trimmed = mx.contiguous(weight[..., a:b])
    mx.eval(trimmed)
    return trimmed


def _trim_sub_blocks(weight: SubBlockWeight, a: int, b: int) -> SubBlockWeight:
    """Input columns [a, b) of a sub-block form (its codes' rows). A cut inside a 256-value block
    leaves d and dmin one a sub-block instead of one a block (SubBlockLinear reads either)."""
    size = weight.codes.shape[0] // weight.sub_scales.shape[0]
    assert a % size == 0 and b % size == 0, (a, b)
    per_block = weight.sub_scales.shape[0] // weight.d.shape[0]  # sub-blocks a d
    if a % 256 or b % 256:
        def factors(f: mx.array) -> mx.array:
            return mx.repeat(f, per_block, axis=0)[a // size : b // size]
    else:
        def factors(f: mx.array) -> mx.array:
            return f[a // 256 : b // 256]
    subs = slice(a // size, b // size)
    parts = {"codes": weight.codes[a:b], "sub_scales": weight.sub_scales[subs], "d": factors(weight.d)}
    if weight.sub_mins is not None:
        parts.update(sub_mins=weight.sub_mins[subs], dmin=factors(weight.dmin))
    return weight._replace(**{name: mx.contiguous(value) for name, value in parts.items()})
