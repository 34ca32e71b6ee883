"""Vectorized dequantization of GGML tensor data into float32 MLX arrays.

Block layouts follow ggml (ggml-common.h / ggml-quants.c). Each decoder takes
a (n_blocks, type_size) uint8 array and returns (n_blocks, block_size) float32,
doing the float arithmetic in the same order as ggml so results are bit-exact.
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_IQ4_KVALUES = mx.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
    dtype=mx.float32,
)


def _f16(b: mx.array, offset: int) -> mx.array:
    """The little-endian fp16 at byte `offset` of every block, as (n, 1) float32."""
    return mx.view(b[:, offset : offset + 2], mx.float16).astype(mx.float32)


def _nibbles(qs: mx.array) -> mx.array:
    """Split bytes along the last axis into all low nibbles followed by all high nibbles."""
    return mx.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(b: mx.array, count: int, width: int) -> mx.array:
    """Fields of `width` bits from each byte, least significant first, on a new axis -2."""
    shifts = mx.arange(0, count * width, width, dtype=mx.uint8).reshape(count, 1)
    return (mx.expand_dims(b, -2) >> shifts) & ((1 << width) - 1)


def _f32(q: mx.array) -> mx.array:
    return q.astype(mx.float32)


def _q4_0(b: mx.array) -> mx.array:
    return _f16(b, 0) * (_f32(_nibbles(b[:, 2:])) - 8)


def _q4_1(b: mx.array) -> mx.array:
    return _f16(b, 0) * _f32(_nibbles(b[:, 4:])) + _f16(b, 2)


def _q5_high(qh: mx.array) -> mx.array:
    # The 4 qh bytes are one little-endian uint32 whose bit j is bit 4 of value j.
    return _bits(qh, 8, 1).swapaxes(-1, -2).reshape(-1, 32) << 4


def _q5_0(b: mx.array) -> mx.array:
    q = _nibbles(b[:, 6:]) | _q5_high(b[:, 2:6])
    return _f16(b, 0) * (_f32(q) - 16)


def _q5_1(b: mx.array) -> mx.array:
    q = _nibbles(b[:, 8:]) | _q5_high(b[:, 4:8])
    return _f16(b, 0) * _f32(q) + _f16(b, 2)


def _q8_0(b: mx.array) -> mx.array:
    return _f32(mx.view(b[:, 2:], mx.int8)) * _f16(b, 0)


def _crumbs(qs: mx.array) -> mx.array:
    """Q2_K/Q3_K low bits: each 32-byte half of qs holds 128 values as 4 shifted 2-bit planes."""
    n = qs.shape[0]
    return _bits(qs.reshape(n, 2, 32), 4, 2).reshape(n, 16, 16)


def _q2_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * _f32(scales & 0xF)).reshape(n, 16, 1)
    ml = (_f16(b, 82) * _f32(scales >> 4)).reshape(n, 16, 1)
    return (dl * _f32(_crumbs(b[:, 16:80])) - ml).reshape(n, 256)


def _q3_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    hmask, qs, packed = b[:, :32], b[:, 32:96], b[:, 96:108]
    # 16 signed 6-bit scales: low nibbles from bytes 0-7 (low then high
    # nibbles), top 2 bits from bytes 8-11 in 2-bit steps.
    low = _nibbles(packed[:, :8])
    high = _bits(packed[:, 8:], 4, 2).reshape(n, 16)
    scales = _f32(low | (high << 4)) - 32
    dl = (_f16(b, 108) * scales).reshape(n, 16, 1)
    # A clear hmask bit means the value is offset by -4.
    offset = _f32(1 - _bits(hmask, 8, 1)).reshape(n, 16, 16) * 4
    q = _f32(_crumbs(qs)) - offset
    return (dl * q).reshape(n, 256)


def _k_scales_mins(packed: mx.array) -> tuple[mx.array, mx.array]:
    """The 8 six-bit scales and mins packed into 12 bytes (ggml's get_scale_min_k4)."""
    n = packed.shape[0]
    s = packed.reshape(n, 3, 4)
    a, m, c = s[:, 0], s[:, 1], s[:, 2]
    scales = mx.concatenate([a & 0x3F, (c & 0xF) | ((a >> 6) << 4)], axis=-1)
    mins = mx.concatenate([m & 0x3F, (c >> 4) | ((m >> 6) << 4)], axis=-1)
    return _f32(scales), _f32(mins)


def _k_low_nibbles(qs: mx.array) -> mx.array:
    """Q4_K/Q5_K: each 32-byte chunk of qs holds two 32-value sub-blocks (low, then high nibbles)."""
    n = qs.shape[0]
    return _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)


def _q4_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    scales, mins = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * scales).reshape(n, 8, 1)
    m = (_f16(b, 2) * mins).reshape(n, 8, 1)
    return (d * _f32(_k_low_nibbles(b[:, 16:])) - m).reshape(n, 256)


def _q5_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    scales, mins = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * scales).reshape(n, 8, 1)
    m = (_f16(b, 2) * mins).reshape(n, 8, 1)
    # Bit j of qh byte l is bit 4 of value l in sub-block j.
    q = _k_low_nibbles(b[:, 48:]) | (_bits(b[:, 16:48], 8, 1) << 4)
    return (d * _f32(q) - m).reshape(n, 256)


def _q6_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    # Each 128-value half uses 64 ql bytes (low nibbles give values 0-63,
    # high nibbles 64-127) and 32 qh bytes (four 2-bit planes, one per 32 values).
    ql = _nibbles(b[:, :128].reshape(n, 2, 64))
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), 4, 2).reshape(n, 2, 128)
    q = (_f32(ql | (qh << 4)) - 32).reshape(n, 16, 16)
    scales = _f32(mx.view(b[:, 192:208], mx.int8))
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    return (d * q).reshape(n, 256)


def _iq4_nl(b: mx.array) -> mx.array:
    return _f16(b, 0) * mx.take(_IQ4_KVALUES, _nibbles(b[:, 2:]))


def _iq4_xs(b: mx.array) -> mx.array:
    n = b.shape[0]
    # 8 six-bit scales: low 4 bits in bytes 4-7 (low nibble first), top 2
    # bits in the little-endian uint16 at bytes 2-3, 2 bits per sub-block.
    low = _bits(b[:, 4:8], 2, 4).swapaxes(-1, -2).reshape(n, 8)
    high = _bits(b[:, 2:4], 4, 2).swapaxes(-1, -2).reshape(n, 8)
    dl = (_f16(b, 0) * (_f32(low | (high << 4)) - 32)).reshape(n, 8, 1)
    q = mx.take(_IQ4_KVALUES, _nibbles(b[:, 8:].reshape(n, 8, 16)))
    return (dl * q).reshape(n, 256)


_DECODERS: dict[GGMLQuantizationType, Callable[[mx.array], mx.array]] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q2_K: _q2_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
    GGMLQuantizationType.IQ4_NL: _iq4_nl,
    GGMLQuantizationType.IQ4_XS: _iq4_xs,
}

# How the unquantized types' raw bytes are reinterpreted; BF16 needs a
# uint16 detour because numpy has no bfloat16.
_FLOAT_VIEWS: dict[GGMLQuantizationType, tuple[np.dtype, mx.Dtype | None]] = {
    GGMLQuantizationType.F32: (np.dtype(np.float32), None),
    GGMLQuantizationType.F16: (np.dtype(np.float16), None),
    GGMLQuantizationType.BF16: (np.dtype(np.uint16), mx.bfloat16),
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_DECODERS) | frozenset(_FLOAT_VIEWS)


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> mx.array:
    """Decode one tensor's raw data (as GGUFReader gives it) into a float32 array of `shape`.

    `shape` is row-major (GGUF's `ne` reversed); blocks run along the last axis.
    """
    if qtype not in SUPPORTED_TYPES:
        name = getattr(qtype, "name", qtype)
        raise ValueError(f"unsupported GGML tensor type {name}")
    qtype = GGMLQuantizationType(qtype)
    shape = tuple(int(s) for s in shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block_size:
        raise ValueError(f"{qtype.name} rows must be a multiple of {block_size} values, got shape {shape}")
    # The reader hands F32/F16 over as typed arrays but BF16 and quantized
    # data as uint8 rows, so flatten and view uniformly.
    flat = np.asarray(data).reshape(-1)
    n_values = math.prod(shape)
    if flat.nbytes != n_values // block_size * type_size:
        raise ValueError(f"{flat.nbytes} bytes of {qtype.name} data do not match shape {shape}")
    if qtype in _FLOAT_VIEWS:
        np_dtype, mx_dtype = _FLOAT_VIEWS[qtype]
        values = mx.array(flat.view(np_dtype))
        if mx_dtype is not None:
            values = mx.view(values, mx_dtype)
        return values.astype(mx.float32).reshape(shape)
    blocks = mx.array(flat.view(np.uint8)).reshape(-1, type_size)
    return _DECODERS[qtype](blocks).reshape(shape)
