"""GGML tensor data as MLX arrays: vectorized dequantization, and MLX's affine quantized format.

Block layouts follow ggml (ggml-common.h / ggml-quants.c); FORMATS below has one row a type: its
block cut into named fields (gguf-py's and ggml's names), how a block decodes to its exact
values, and how it maps onto MLX's affine format. A decoder takes the fields of n blocks and
returns (n, block_size) float32, doing the float arithmetic in the same order as ggml so results
are bit-exact.

`to_affine` re-expresses quantized blocks in the layout `mx.quantized_matmul` takes: groups of 32
values along a row (Q6_K's of 64 where MLX's own products read it: `wide`), w = scale * q + bias
with unsigned q packed into uint32 words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# IQ4's codebook, in numpy until a weight is converted: importing the package makes no MLX array,
# so a process that only reads files and serves HTTP (server/engine_process.py) never touches the device.
_IQ4_KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)
# The codebook is integers in [-127, 113], so shifted by 128 it is an exact 8-bit grid.
_IQ4_KVALUES_U8 = (_IQ4_KVALUES + 128).astype(np.uint8)


# The fields that hold a float16 (every one at an even offset of a block of even size).
HALF_FIELDS = frozenset({"d", "dmin", "m"})


class Fields(dict):
    """The blocks (n, type_size) uint8 of one type, cut into its named fields: fields["qs"] is (n,
    its bytes), a float16 field such as fields["d"] (n, 1) uint16."""

    def __init__(self, blocks: mx.array, layout: tuple[tuple[str, int], ...]):
        super().__init__()
        # The float16 fields come from the blocks as 16-bit words: a view of a whole contiguous
        # array, where viewing each 2-byte slice as float16 would copy it (a kernel a field, and
        # a token's embedding lookup decodes its blocks on every decode step).
        words = mx.view(blocks, mx.uint16) if any(name in HALF_FIELDS for name, _ in layout) else None
        offset = 0
        for name, size in layout:
            in_words = offset // 2
            self[name] = words[:, in_words : in_words + 1] if name in HALF_FIELDS else blocks[:, offset : offset + size]
            offset += size
        self.n = blocks.shape[0]


def _f16(field: mx.array) -> mx.array:
    """A float16 field of every block (Fields), as (n, 1) float32."""
    return mx.view(field, mx.float16).astype(mx.float32)


def _nibbles(qs: mx.array) -> mx.array:
    """Split bytes along the last axis into all low nibbles followed by all high nibbles (by
    shifts on a new axis, where a concatenation would copy both halves)."""
    return _bits(qs, 2, 4).reshape(*qs.shape[:-1], -1)


def _bits(b: mx.array, count: int, width: int) -> mx.array:
    """Fields of `width` bits from each byte, least significant first, on a new axis -2."""
    # From numpy: a constant, where mx.arange would be a kernel in a compiled decoder's every call.
    shifts = mx.array(np.arange(0, count * width, width, dtype=np.uint8).reshape(count, 1))
    return (mx.expand_dims(b, -2) >> shifts) & ((1 << width) - 1)


def _f32(q: mx.array) -> mx.array:
    return q.astype(mx.float32)


def _q4_0(f: Fields) -> mx.array:
    return _f16(f["d"]) * (_f32(_nibbles(f["qs"])) - 8)


def _q4_1(f: Fields) -> mx.array:
    return _f16(f["d"]) * _f32(_nibbles(f["qs"])) + _f16(f["m"])


def _q5_high(qh: mx.array) -> mx.array:
    # The 4 qh bytes are one little-endian uint32 whose bit j is bit 4 of value j.
    return _bits(qh, 8, 1).swapaxes(-1, -2).reshape(-1, 32) << 4


def _q5_0(f: Fields) -> mx.array:
    q = _nibbles(f["qs"]) | _q5_high(f["qh"])
    return _f16(f["d"]) * (_f32(q) - 16)


def _q5_1(f: Fields) -> mx.array:
    q = _nibbles(f["qs"]) | _q5_high(f["qh"])
    return _f16(f["d"]) * _f32(q) + _f16(f["m"])


def _q8_0(f: Fields) -> mx.array:
    return _f32(mx.view(f["qs"], mx.int8)) * _f16(f["d"])


def _crumbs(qs: mx.array) -> mx.array:
    """Q2_K/Q3_K low bits: each 32-byte half of qs holds 128 values as 4 shifted 2-bit planes."""
    n = qs.shape[0]
    return _bits(qs.reshape(n, 2, 32), 4, 2).reshape(n, 16, 16)


def _q2_k(f: Fields) -> mx.array:
    n, scales = f.n, f["scales"]
    dl = (_f16(f["d"]) * _f32(scales & 0xF)).reshape(n, 16, 1)
    ml = (_f16(f["dmin"]) * _f32(scales >> 4)).reshape(n, 16, 1)
    return (dl * _f32(_crumbs(f["qs"])) - ml).reshape(n, 256)


def _q3_k_parts(f: Fields) -> tuple[mx.array, mx.array, mx.array]:
    """d (n, 1), the 16 sub-block scales (n, 16) and q in [-4, 3] (n, 16, 16), all float32."""
    n, packed = f.n, f["scales"]
    # 16 signed 6-bit scales: low nibbles from bytes 0-7 (low then high
    # nibbles), top 2 bits from bytes 8-11 in 2-bit steps.
    low = _nibbles(packed[:, :8])
    high = _bits(packed[:, 8:], 4, 2).reshape(n, 16)
    scales = _f32(low | (high << 4)) - 32
    # A clear hmask bit means the value is offset by -4.
    offset = _f32(1 - _bits(f["hmask"], 8, 1)).reshape(n, 16, 16) * 4
    return _f16(f["d"]), scales, _f32(_crumbs(f["qs"])) - offset


def _q3_k(f: Fields) -> mx.array:
    d, scales, q = _q3_k_parts(f)
    dl = (d * scales).reshape(-1, 16, 1)
    return (dl * q).reshape(-1, 256)


# A K-type's 8 sub-blocks j = 4a + 2b + c on three axes of two (a, b, c). Sub-block j's scale and
# min are built from byte j % 4 of the packed scales' 4-byte groups (a picks how: get_scale_min_k4);
# its values are the low (c = 0) or high (c = 1) nibbles of qs's 32-byte chunk j // 2 = 2a + b. With
# every field shaped to these axes before any arithmetic (a reshape that needs no copy), a compiled
# decoder is one kernel: a reshape between two element-wise steps would split it in two, and a
# concatenation copies.
# (In numpy, as _IQ4_KVALUES: constants to a compiled decoder, and no MLX array made at import.)
_K_AXES = (2, 2, 2, 1)
_K_SUB_BLOCK = np.arange(8, dtype=np.uint8).reshape(_K_AXES)
_K_LAST_FOUR = _K_SUB_BLOCK >= 4


def _k_scales_mins(packed: mx.array) -> tuple[mx.array, mx.array]:
    """The 8 six-bit scales and mins packed into 12 bytes (ggml's get_scale_min_k4), float32 (n,
    *_K_AXES)."""
    n = packed.shape[0]
    s = packed.reshape(n, 3, 1, 2, 2, 1)
    a, m, c = s[:, 0], s[:, 1], s[:, 2]
    last_four = mx.array(_K_LAST_FOUR)
    scales = mx.where(last_four, (c & 0xF) | ((a >> 6) << 4), a & 0x3F)
    mins = mx.where(last_four, (c >> 4) | ((m >> 6) << 4), m & 0x3F)
    return _f32(scales), _f32(mins)


def _k_low_nibbles(f: Fields) -> mx.array:
    """Q4_K/Q5_K's 4 low bits of each value, (n, *_K_AXES[:-1], 32)."""
    return _bits(f["qs"].reshape(f.n, 2, 2, 32), 2, 4)


def _q5_k_q(f: Fields) -> mx.array:
    # Bit j of qh byte l is bit 4 of value l in sub-block j.
    high = (f["qh"].reshape(f.n, 1, 1, 1, 32) >> mx.array(_K_SUB_BLOCK)) & 1
    return _k_low_nibbles(f) | (high << 4)


def _k_decode(q: Callable[[Fields], mx.array]) -> Callable[[Fields], mx.array]:
    """Q4_K/Q5_K: d x scale x q - dmin x min per 32-value sub-block, q given by `q`."""

    def decode(f: Fields) -> mx.array:
        n = f.n
        scales, mins = _k_scales_mins(f["scales"])
        d = _f16(f["d"].reshape(n, 1, 1, 1, 1)) * scales
        m = _f16(f["dmin"].reshape(n, 1, 1, 1, 1)) * mins
        return (d * _f32(q(f)) - m).reshape(n, 256)

    return decode


# Q6_K's values on axes (half, nibble, chunk, sub-block, 16): value 128 half + 32 quarter + l of a
# block, quarter = 2 nibble + chunk, l = 16 sub-block + its place. Its low 4 bits are the low
# (nibble 0) or high nibbles of ql byte 64 half + 32 chunk + l, its top 2 bits those at 2 quarter in
# qh byte 32 half + l, and its scale is scales[8 half + 2 quarter + sub-block]. Every field shaped so
# before any arithmetic, a compiled decoder is one kernel (as _K_AXES).
_Q6_K_NIBBLE_SHIFTS = np.array([0, 4], np.uint8).reshape(2, 1, 1, 1)
_Q6_K_QUARTER_SHIFTS = np.array([[0, 2], [4, 6]], np.uint8).reshape(2, 2, 1, 1)


def _q6_k_fields(f: Fields) -> tuple[mx.array, mx.array, mx.array]:
    """d, the scales and q in [-32, 31], float32, on Q6_K's value axes (n, 2, 2, 2, 2, 16)."""
    n = f.n
    low = (f["ql"].reshape(n, 2, 1, 2, 2, 16) >> mx.array(_Q6_K_NIBBLE_SHIFTS)) & 0xF
    high = (f["qh"].reshape(n, 2, 1, 1, 2, 16) >> mx.array(_Q6_K_QUARTER_SHIFTS)) & 3
    scales = _f32(mx.view(f["scales"], mx.int8).reshape(n, 2, 2, 2, 2, 1))
    return _f16(f["d"].reshape(n, 1, 1, 1, 1, 1)), scales, _f32(low | (high << 4)) - 32


def _q6_k_parts(f: Fields) -> tuple[mx.array, mx.array, mx.array]:
    """d (n, 1), the 16 sub-block scales (n, 16) and q in [-32, 31] (n, 16, 16), all float32."""
    n = f.n
    d, scales, q = _q6_k_fields(f)
    return d.reshape(n, 1), scales.reshape(n, 16), q.reshape(n, 16, 16)


def _q6_k(f: Fields) -> mx.array:
    d, scales, q = _q6_k_fields(f)
    return (d * scales * q).reshape(-1, 256)


def _iq4_nl(f: Fields) -> mx.array:
    return _f16(f["d"]) * mx.take(mx.array(_IQ4_KVALUES), _nibbles(f["qs"]))


def _iq4_xs_scales(f: Fields) -> mx.array:
    """The (n, 8) scales of the 32-value sub-blocks: d times a six-bit scale minus 32."""
    n = f.n
    # Low 4 bits in scales_l (low nibble first), top 2 bits in the little-endian uint16
    # scales_h, 2 bits per sub-block.
    low = _bits(f["scales_l"], 2, 4).swapaxes(-1, -2).reshape(n, 8)
    high = _bits(f["scales_h"], 4, 2).swapaxes(-1, -2).reshape(n, 8)
    return _f16(f["d"]) * (_f32(low | (high << 4)) - 32)


def _iq4_xs(f: Fields) -> mx.array:
    n = f.n
    q = mx.take(mx.array(_IQ4_KVALUES), _nibbles(f["qs"].reshape(n, 8, 16)))
    return (_iq4_xs_scales(f).reshape(n, 8, 1) * q).reshape(n, 256)


# --- MLX's affine form of each type: blocks -> (q uint8 [n, block_size], scales [n, groups],
# biases [n, groups] or None for a symmetric 8-bit grid) ------------------------------------------

def _affine_q4_0(f: Fields):
    d = _f16(f["d"])
    return _nibbles(f["qs"]), d, -8 * d


def _affine_q4_1(f: Fields):
    return _nibbles(f["qs"]), _f16(f["d"]), _f16(f["m"])


def _affine_q5_0(f: Fields):
    d = _f16(f["d"])
    return _nibbles(f["qs"]) | _q5_high(f["qh"]), d, -16 * d


def _affine_q5_1(f: Fields):
    return _nibbles(f["qs"]) | _q5_high(f["qh"]), _f16(f["d"]), _f16(f["m"])


def _affine_q8_0(f: Fields):
    d = _f16(f["d"])
    # Flipping the sign bit turns int8 q into q + 128.
    return f["qs"] ^ 0x80, d, -128 * d


def _k_affine(q: Callable[[Fields], mx.array]):
    def encode(f: Fields):
        n = f.n
        scales, mins = (x.reshape(n, 8) for x in _k_scales_mins(f["scales"]))
        return q(f).reshape(n, 256), _f16(f["d"]) * scales, -(_f16(f["dmin"]) * mins)

    return encode


def _affine_iq4_nl(f: Fields):
    d = _f16(f["d"])
    return mx.take(mx.array(_IQ4_KVALUES_U8), _nibbles(f["qs"])), d, -128 * d


def _affine_iq4_xs(f: Fields):
    scale = _iq4_xs_scales(f)
    q = mx.take(mx.array(_IQ4_KVALUES_U8), _nibbles(f["qs"].reshape(f.n, 8, 16)))
    return q, scale, -128 * scale


def _affine_q3_k(f: Fields):
    # scale x q is an integer in [-124, 128] and -(scale x q) one in [-128, 124]: with the
    # scale -d every value sits exactly on an 8-bit grid, and the bias is 128 d.
    d, scales, q = _q3_k_parts(f)
    n = f.n
    v = 128 - scales.reshape(n, 16, 1) * q
    return v.astype(mx.uint8).reshape(n, 256), mx.broadcast_to(-d, (n, 8)), None


def _q6_k_on_shared_grids(f: Fields, sub_blocks: int, steps: int) -> tuple[mx.array, mx.array]:
    """Q6_K's values on one grid every `sub_blocks` 16-value sub-blocks: signed v (n, groups,
    sub_blocks, 16) and the grid's step (n, groups), `steps` of it to one step of the group's
    largest |scale|, so that sub-block's values land exactly on the grid (v = steps x q) and the
    others' are rounded to it."""
    d, scales, q = _q6_k_parts(f)
    n, groups = f.n, 16 // sub_blocks
    shared = scales.reshape(n, groups, sub_blocks)
    largest = mx.take_along_axis(shared, mx.argmax(mx.abs(shared), axis=-1, keepdims=True), axis=-1)[..., 0]
    ratio = shared / mx.where(largest == 0, 1, largest)[..., None]
    return mx.round(steps * ratio[..., None] * q.reshape(n, groups, sub_blocks, 16)), d * largest / steps


def _affine_q6_k(f: Fields):
    """Q6_K's 16-value sub-blocks (d x scale x q, q in [-32, 31]) re-quantized to 8 bits on a symmetric grid.

    Of the two sub-blocks in a group, the one with the larger |scale| sets the step, a quarter of
    its own, so its values land exactly on the grid (v = 4 q); the other's are rounded to it, off
    by at most 1/8 of the larger sub-block's step. The bias is -128 x scale, so it is not stored.
    """
    v, step = _q6_k_on_shared_grids(f, 2, 4)
    # Only v = 128 (opposite scales of equal size, q at its minimum) can fall off the grid.
    q8 = (mx.clip(v, -128, 127) + 128).astype(mx.uint8)
    return q8.reshape(f.n, 256), step, None


def _wide_affine_q6_k(f: Fields):
    """Q6_K as _affine_q6_k holds it, but on one grid every four sub-blocks (WIDE_GROUP_SIZE
    values), with the bias, -128 x scale, stored: the same 8.5 bits a weight, and no bias for a
    product to derive on each call (a launch a projection a step). The largest |scale| of the four
    sets the step; the others' values are off by at most 1/8 of its step. Measured against
    llama.cpp on the fixtures (docs/benchmarks.md, "Bytes a weight"): mean KL up to 1.25x the pairs'
    form's, no argmax flipped."""
    v, step = _q6_k_on_shared_grids(f, 4, 4)
    q8 = (mx.clip(v, -128, 127) + 128).astype(mx.uint8)
    scale = step.astype(AFFINE_SCALE_DTYPE)  # the bias from the scale as stored, so the grid stays exact
    return q8.reshape(f.n, 256), scale, symmetric_biases(scale)


def _requantized(decode: Callable[[Fields], mx.array]):
    """An encoder for Q2_K, whose 16-value sub-blocks each have their own scale and min, so no
    32-value affine group holds them exactly.

    The exact values are re-quantized to 8 bits per group of 32 (min to max in 255 steps). The
    scale and bias are rounded to their storage type first and q rounded against those, so the
    stored weight is within half a step (1/510 of the group's range) of the original.
    """

    def encode(f: Fields):
        n = f.n
        w = decode(f).reshape(-1, AFFINE_GROUP_SIZE)
        low, high = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
        bias = low.astype(AFFINE_SCALE_DTYPE).astype(mx.float32)
        scale = ((high - bias) / 255).astype(AFFINE_SCALE_DTYPE).astype(mx.float32)
        # An all-equal group has no range: any scale works, q = 0.
        steps = mx.where(scale > 0, (w - bias) / mx.where(scale > 0, scale, 1), 0)
        q = mx.clip(mx.round(steps), 0, 255).astype(mx.uint8)
        return q.reshape(n, -1), scale.reshape(n, -1), bias.reshape(n, -1)

    return encode


AFFINE_GROUP_SIZE = 32
# The groups of a type's wide form (BlockFormat.wide): MLX's products take groups of 32, 64 or 128.
WIDE_GROUP_SIZE = 64
# Scales and biases are stored as float16 on every device: it keeps a Q4_K weight at 5 bits
# (float32 would make it 6). MLX's CPU products cast them to a float32 input's type on every call,
# 6-8% of a one-row product there (docs/benchmarks.md): memory was chosen over that.
AFFINE_SCALE_DTYPE = mx.float16


@dataclass(frozen=True)
class BlockFormat:
    """One quantized type: its block's fields in byte order (name, bytes), its exact decoder, and
    its affine form (bits, encoder)."""

    layout: tuple[tuple[str, int], ...]
    decode: Callable[[Fields], mx.array]
    bits: int
    encode: Callable[[Fields], tuple]
    # Its values are re-quantized in the affine form (held only approximately; see _affine_q6_k,
    # _requantized); the others are exact up to the float16 rounding of a K-type's scale and min.
    requantized: bool = False
    # On a symmetric 8-bit grid: its AffineWeight stores no biases.
    symmetric: bool = False
    # An encoder to groups of WIDE_GROUP_SIZE values with their biases stored, for MLX's own
    # products (to_affine's `wide`); None: the type keeps groups of 32.
    wide: Callable[[Fields], tuple] | None = None

    def fields(self, blocks: mx.array) -> Fields:
        return Fields(blocks, self.layout)


QT = GGMLQuantizationType
_D, _QS16 = ("d", 2), ("qs", 16)
FORMATS: dict[GGMLQuantizationType, BlockFormat] = {
    QT.Q4_0: BlockFormat((_D, _QS16), _q4_0, 4, _affine_q4_0),
    QT.Q4_1: BlockFormat((_D, ("m", 2), _QS16), _q4_1, 4, _affine_q4_1),
    QT.Q5_0: BlockFormat((_D, ("qh", 4), _QS16), _q5_0, 5, _affine_q5_0),
    QT.Q5_1: BlockFormat((_D, ("m", 2), ("qh", 4), _QS16), _q5_1, 5, _affine_q5_1),
    QT.Q8_0: BlockFormat((_D, ("qs", 32)), _q8_0, 8, _affine_q8_0),
    QT.Q2_K: BlockFormat((("scales", 16), ("qs", 64), _D, ("dmin", 2)), _q2_k, 8, _requantized(_q2_k),
                         requantized=True),
    QT.Q3_K: BlockFormat((("hmask", 32), ("qs", 64), ("scales", 12), _D), _q3_k, 8, _affine_q3_k, symmetric=True),
    QT.Q4_K: BlockFormat((_D, ("dmin", 2), ("scales", 12), ("qs", 128)), _k_decode(_k_low_nibbles), 4,
                         _k_affine(_k_low_nibbles)),
    QT.Q5_K: BlockFormat((_D, ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)), _k_decode(_q5_k_q), 5,
                         _k_affine(_q5_k_q)),
    QT.Q6_K: BlockFormat((("ql", 128), ("qh", 64), ("scales", 16), _D), _q6_k, 8, _affine_q6_k, requantized=True,
                         symmetric=True, wide=_wide_affine_q6_k),
    QT.IQ4_NL: BlockFormat((_D, _QS16), _iq4_nl, 8, _affine_iq4_nl),
    QT.IQ4_XS: BlockFormat((_D, ("scales_h", 2), ("scales_l", 4), ("qs", 128)), _iq4_xs, 8, _affine_iq4_xs),
}

# How the unquantized types' raw bytes are reinterpreted; BF16 needs a
# uint16 detour because numpy has no bfloat16.
_FLOAT_VIEWS: dict[GGMLQuantizationType, tuple[np.dtype, mx.Dtype | None]] = {
    QT.F32: (np.dtype(np.float32), None),
    QT.F16: (np.dtype(np.float16), None),
    QT.BF16: (np.dtype(np.uint16), mx.bfloat16),
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(FORMATS) | frozenset(_FLOAT_VIEWS)
AFFINE_TYPES: frozenset[GGMLQuantizationType] = frozenset(FORMATS)
REQUANTIZED_TYPES: frozenset[GGMLQuantizationType] = frozenset(t for t, f in FORMATS.items() if f.requantized)


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
    return decode_blocks(blocks, qtype).reshape(shape)


# --- MLX's affine quantized layout -------------------------------------------------------------

# Rows are converted in slices of about this many values so that the unpacked intermediates
# (up to 8 bytes a value) stay small next to the weights already loaded.
_CHUNK_VALUES = 1 << 17


class AffineWeight(NamedTuple):
    """One 2-D tensor in MLX's affine format: every group_size values of a row share a scale and a bias."""

    weight: mx.array  # uint32 [rows, cols * bits / 32]
    scales: mx.array  # float16 [rows, cols / group_size]
    # float16 [rows, cols / group_size]; None for a symmetric grid, whose bias is always -128 x
    # scale (8 bits): leaving it out keeps such a weight at 8.5 bits instead of 9.
    biases: mx.array | None
    bits: int
    qtype: GGMLQuantizationType
    group_size: int = AFFINE_GROUP_SIZE

    def full_biases(self) -> mx.array:
        return self.biases if self.biases is not None else symmetric_biases(self.scales)


def symmetric_biases(scales: mx.array) -> mx.array:
    """The biases of an 8-bit symmetric grid, q = v + 128 for signed v: exact, a power-of-two multiple."""
    return scales * -128


def _pack(q: mx.array, bits: int) -> mx.array:
    """uint8 values [n, k] as MLX packs them: one little-endian stream of `bits`-bit fields, in uint32 words."""
    n = q.shape[0]
    if bits == 8:
        packed = q
    elif bits == 4:
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
    else:
        # 8 values of `bits` bits are exactly `bits` bytes: build them in a uint64 and keep its low bytes.
        shifts = mx.arange(8, dtype=mx.uint64) * bits
        words = (q.reshape(n, -1, 8).astype(mx.uint64) << shifts).sum(axis=-1)
        packed = mx.view(words, mx.uint8).reshape(n, -1, 8)[:, :, :bits]
    return mx.view(mx.contiguous(packed.reshape(n, -1)), mx.uint32)


def to_affine(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int],
              wide: bool = False) -> AffineWeight:
    """One 2-D quantized tensor's raw data (as GGUFReader gives it) in MLX's affine format, evaluated;
    `wide`: in the type's wide form where it has one (BlockFormat.wide: Q6_K in groups of 64 with
    its biases stored), for MLX's own products. The CUDA kernels read groups of 32 only."""
    if qtype not in AFFINE_TYPES:
        name = getattr(qtype, "name", qtype)
        raise ValueError(f"GGML type {name} has no affine form")
    qtype = GGMLQuantizationType(qtype)
    rows, cols = (int(s) for s in shape)
    raw, type_size = _block_rows(data, qtype, rows, cols)
    form = FORMATS[qtype]
    bits = form.bits
    wide = wide and form.wide is not None
    encode, group_size = (form.wide, WIDE_GROUP_SIZE) if wide else (form.encode, AFFINE_GROUP_SIZE)
    groups = cols // group_size
    out = AffineWeight(
        mx.zeros((rows, cols * bits // 32), mx.uint32),
        mx.zeros((rows, groups), AFFINE_SCALE_DTYPE),
        None if form.symmetric and not wide else mx.zeros((rows, groups), AFFINE_SCALE_DTYPE),
        bits,
        qtype,
        group_size,
    )
    step = max(1, _CHUNK_VALUES // cols)
    for start in range(0, rows, step):
        chunk = raw[start : start + step]
        q, scales, biases = encode(form.fields(mx.array(chunk).reshape(-1, type_size)))
        n = chunk.shape[0]
        # Each slice is written in place, so the tensor is never held twice.
        out.weight[start : start + n] = _pack(q.reshape(n, cols), bits)
        out.scales[start : start + n] = scales.reshape(n, groups).astype(AFFINE_SCALE_DTYPE)
        if biases is not None:
            out.biases[start : start + n] = biases.reshape(n, groups).astype(AFFINE_SCALE_DTYPE)
        mx.eval([a for a in out[:3] if a is not None])
        # On CUDA, MLX frees a computation's inputs on a worker thread after the GPU is done, so
        # without this the host runs ahead and many slices' raw blocks are held at once (a load
        # peak of up to 1.47x the weights was measured); synchronize waits for those frees.
        mx.synchronize()
    return out


def narrowed(weight: AffineWeight) -> AffineWeight:
    """A weight of the wide form (groups of WIDE_GROUP_SIZE) with the same values in groups of 32,
    each half of a group taking its scale, and the biases of a symmetric grid left to be derived:
    what a piece cut along groups of 32 holds (tensors.convert), in 8.5 bits a weight again."""
    if weight.group_size == AFFINE_GROUP_SIZE:
        return weight
    halves = weight.group_size // AFFINE_GROUP_SIZE
    scales = mx.repeat(weight.scales, halves, axis=-1)
    symmetric = FORMATS[weight.qtype].symmetric
    biases = None if symmetric else mx.repeat(weight.biases, halves, axis=-1)
    narrow = weight._replace(scales=scales, biases=biases, group_size=AFFINE_GROUP_SIZE)
    mx.eval([a for a in narrow[:3] if a is not None])
    return narrow


def _block_rows(data: np.ndarray, qtype: GGMLQuantizationType, rows: int, cols: int) -> tuple[np.ndarray, int]:
    """A matrix's raw data as uint8 rows of blocks, checked against its shape, and the block's size."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.asarray(data).reshape(-1).view(np.uint8)
    if cols % block_size or raw.nbytes != rows * cols // block_size * type_size:
        raise ValueError(f"{raw.nbytes} bytes of {qtype.name} data do not match shape {(rows, cols)}")
    return raw.reshape(rows, -1), type_size


# --- The sub-block form: K-types exactly, as the CPU multiplies them ------------------------------

class SubBlockWeight(NamedTuple):
    """A matrix [rows, cols] of a K-type, whose 256-value blocks hold sub-blocks of 16 or 32
    integer codes, each sub-block with an integer scale (and, for Q4_K and Q2_K, an integer min)
    and each block with a float16 d (and dmin): value = d x scale x (code - offset) - dmin x min.
    Kept as those parts, it holds the file's values exactly.

    The codes are stored transposed, [cols, padded * bits / 32], packed along each of those rows as
    MLX packs a quantized row: then each sub-block's input positions are a [sub-block, rows]
    matrix that MLX's non-transposed quantized matmul takes with scale 1 and bias -offset, which no
    affine group of 32 values along the original rows can do where the scale changes every 16.
    That product takes a multiple of 32 outputs, so the rows are padded to one (`padded`) with
    rows of zeros (codes, scales and mins 0).
    """

    codes: mx.array  # uint32 [cols, padded * bits / 32]
    sub_scales: mx.array  # int8 [cols / sub-block, padded]
    d: mx.array  # float16 [cols / 256, padded]; [cols / sub-block, padded] where a split cut a block
    sub_mins: mx.array | None  # int8 [cols / sub-block, padded], or None for a type without mins
    dmin: mx.array | None  # float16, as d, or None
    rows: int  # of the matrix, without the padding
    bits: int
    offset: int
    qtype: GGMLQuantizationType


class _SubBlockForm(NamedTuple):
    bits: int  # a code's width as held: MLX's CPU unpacks 3- and 5-bit fields 5 times slower than 4
    offset: int  # code = q + offset for q as `parts` gives it
    size: int  # values a sub-block
    mins: bool  # whether the type has a min a sub-block (and a dmin a block)
    # d (n, 1), scales (n, subs), q (n, subs, size), dmin (n, 1) and mins (n, subs) or None, float32
    parts: Callable[[Fields], tuple[mx.array, ...]]


def _q4_k_parts(f: Fields) -> tuple[mx.array, ...]:
    n = f.n
    scales, mins = (x.reshape(n, 8) for x in _k_scales_mins(f["scales"]))
    return _f16(f["d"]), scales, _f32(_k_low_nibbles(f)).reshape(n, 8, 32), _f16(f["dmin"]), mins


def _q2_k_parts(f: Fields) -> tuple[mx.array, ...]:
    scales = f["scales"]
    return _f16(f["d"]), _f32(scales & 0xF), _f32(_crumbs(f["qs"])), _f16(f["dmin"]), _f32(scales >> 4)


SUB_BLOCK_FORMS: dict[GGMLQuantizationType, _SubBlockForm] = {
    QT.Q6_K: _SubBlockForm(6, 32, 16, False, lambda f: (*_q6_k_parts(f), None, None)),
    QT.Q3_K: _SubBlockForm(4, 4, 16, False, lambda f: (*_q3_k_parts(f), None, None)),
    QT.Q4_K: _SubBlockForm(4, 0, 32, True, _q4_k_parts),
    QT.Q2_K: _SubBlockForm(2, 0, 16, True, _q2_k_parts),
}
# Rows are padded to a multiple of this (MLX's quantized products take groups of 32 outputs), and
# converted a multiple of it at a time, so that each slice of packed codes is whole words.
_SUB_BLOCK_ROW_STEP = 32


def sub_block_form_fits(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of `qtype` and row-major `shape` has a sub-block form (SubBlockWeight)."""
    return qtype in SUB_BLOCK_FORMS and len(shape) == 2


def to_sub_blocks(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> SubBlockWeight:
    """One 2-D tensor's raw data in the sub-block form (a type of SUB_BLOCK_FORMS), evaluated."""
    qtype = GGMLQuantizationType(qtype)
    rows, cols = (int(s) for s in shape)
    if not sub_block_form_fits(qtype, (rows, cols)):
        raise ValueError(f"a {qtype.name} tensor of shape {shape} has no sub-block form")
    raw, type_size = _block_rows(data, qtype, rows, cols)
    form, (bits, offset, size, has_mins, parts) = FORMATS[qtype], SUB_BLOCK_FORMS[qtype]
    padded = -(-rows // _SUB_BLOCK_ROW_STEP) * _SUB_BLOCK_ROW_STEP

    def zeros(per_row: int, dtype: mx.Dtype, present: bool = True) -> mx.array | None:
        return mx.zeros((per_row, padded), dtype) if present else None

    out = SubBlockWeight(mx.zeros((cols, padded * bits // 32), mx.uint32), zeros(cols // size, mx.int8),
                         zeros(cols // 256, mx.float16), zeros(cols // size, mx.int8, has_mins),
                         zeros(cols // 256, mx.float16, has_mins), rows, bits, offset, qtype)
    step = max(1, _CHUNK_VALUES // cols // _SUB_BLOCK_ROW_STEP) * _SUB_BLOCK_ROW_STEP
    for start in range(0, rows, step):
        chunk = raw[start : start + step]
        n = chunk.shape[0]
        d, scales, q, dmin, mins = parts(form.fields(mx.array(chunk).reshape(-1, type_size)))
        # The last slice's codes padded to whole words with zeros; its other parts are left at zero.
        codes = mx.pad((q + offset).astype(mx.uint8).reshape(n, cols), ((0, -n % _SUB_BLOCK_ROW_STEP), (0, 0))).T
        # Each slice is written in place, so the tensor is never held twice.
        out.codes[:, start * bits // 32 : (start + codes.shape[1]) * bits // 32] = _pack(mx.contiguous(codes), bits)
        for part, value in ((out.sub_scales, scales), (out.d, d), (out.sub_mins, mins), (out.dmin, dmin)):
            if part is not None:
                part[:, start : start + n] = value.reshape(n, -1).T.astype(part.dtype)
        mx.eval([a for a in out[:5] if a is not None])
    return out


def decode_blocks(blocks: mx.array, qtype: GGMLQuantizationType) -> mx.array:
    """Quantized blocks (n, type_size) uint8 as their exact values (n, block_size) float32."""
    form = FORMATS[GGMLQuantizationType(qtype)]
    return form.decode(form.fields(blocks))
