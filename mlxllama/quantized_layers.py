"""Native mode's layers: projections and embeddings that keep the file's quantized weights.

Each quantized matrix is re-expressed in MLX's affine format (quants.to_affine) and the nn.Linear
that uses it becomes a NativeLinear with that tensor's bits, so one model mixes types the way the
file does (a Q4_K_M file holds Q4_K and Q6_K). On the CPU a matrix of a K-type other than Q5_K
becomes a SubBlockLinear instead (quants.to_sub_blocks: the file's values, in about its bits).
The token embedding is only ever looked up, so unless it doubles as the output layer it keeps the
file's own blocks (tensors.Blocks) and decodes the rows it needs, bit-exactly. weights.py swaps
these in; the model classes stay plain.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .quants import AFFINE_GROUP_SIZE, AffineWeight, SubBlockWeight, decode_blocks, symmetric_biases
from .tensors import Blocks

# On a GPU, from this many rows on (prefill) a call expands its weight to float16 and uses the dense
# matmul: on an H100, MLX's (0.32) quantized matmul is the faster one up to 64 rows and 2.5 times
# slower at 512 (benchmarks/matmul_paths.py, dispatch_sweep.py; docs/benchmarks.md).
DENSE_MIN_ROWS = 128
# Types whose weights a GPU always expands: decoding a Q3_K model through MLX's CUDA quantized matmul
# drifted from llama.cpp (the greedy and "Rome" parity tests failed) while the expanded weight passes.
GPU_EXPANDED_TYPES = frozenset({GGMLQuantizationType.Q3_K})


# Rows of a block-kept output layer decoded at once where its product takes more input rows than a
# backend's kernel does (a prompt's logits): a float16 slice of 16 MB for Qwen3's 1,024 columns.
DECODED_ROWS = 8192


class BlockEmbedding(nn.Module):
    """An embedding table kept in the file's blocks; a lookup decodes only the rows it gathers."""

    def __init__(self, table: Blocks):
        super().__init__()
        self.weight = table.data
        self.block_bytes = GGML_QUANT_SIZES[table.qtype][1]
        # Compiled, the decoder's dozen elementwise steps run as a few fused kernels.
        self._decode = mx.compile(partial(decode_blocks, qtype=table.qtype))

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self.weight[ids]
        return self._decode(rows.reshape(-1, self.block_bytes)).reshape(*ids.shape, -1)


class BlockProduct(Protocol):
    """A backend's kernel for products with a matrix kept in one type's blocks (mlxllama.cuda.blocks)."""

    def rows_taken(self, k: int) -> int:
        """Input rows of k values that one call takes."""

    def __call__(self, x: mx.array, blocks: mx.array) -> mx.array:
        """x [n, k] (n at most rows_taken(k)) times the matrix's rows -> [n, rows] in x's type."""


class BlockLinear(BlockEmbedding):
    """An output layer kept in the file's blocks (weights.py keeps it so where a backend has a
    kernel for its type): held at the file's size, with its exact values.

    Up to twice the rows the kernel takes at once (a decode step's sequences) go through the kernel;
    more (a prompt's logits) through the dense product, a slice of DECODED_ROWS rows decoded at a
    time, so no full-size copy of the matrix is ever made.
    """

    def __init__(self, table: Blocks, product: BlockProduct):
        super().__init__(table)
        self.qtype = table.qtype
        self.product = product

    def __call__(self, x: mx.array) -> mx.array:
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        taken = self.product.rows_taken(k)
        if rows.shape[0] <= 2 * taken:
            y = _joined([self.product(rows[i : i + taken], self["weight"]) for i in range(0, rows.shape[0], taken)], 0)
        else:
            table = self["weight"]
            y = _joined([rows @ self._decode(table[i : i + DECODED_ROWS].reshape(-1, self.block_bytes))
                         .reshape(-1, k).astype(x.dtype).T for i in range(0, table.shape[0], DECODED_ROWS)], 1)
        return y.reshape(*x.shape[:-1], -1)


def _joined(parts: list[mx.array], axis: int) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


class TiedBlockEmbedding(BlockLinear):
    """A token table kept in the file's blocks that is also the output layer (the model's head
    calls as_linear): a lookup decodes the rows it gathers, the output is BlockLinear's product."""

    as_linear = BlockLinear.__call__
    __call__ = BlockEmbedding.__call__


def input_typed(x: mx.array, scales: mx.array, biases: mx.array | None) -> tuple[mx.array, mx.array]:
    """A product's scales and biases; a symmetric grid's biases (None) derived from the scales in
    x's type.

    MLX's quantized products cast scales and biases to the input's type on every call: on the CPU,
    where the input is float32, deriving the biases from the float16 scales first made a multiply
    and two casts, 15% of the time of chat-tiny's output layer there; cast first, it is one cast
    and the multiply. In float16 (a GPU) the cast is no operation at all.
    """
    if biases is not None:
        return scales, biases
    scales = scales.astype(x.dtype)
    return scales, symmetric_biases(scales)


class NativeLinear(nn.Module):
    """A projection whose weight stays in MLX's affine format (quants.AffineWeight).

    Without stored biases (the 8-bit symmetric grid of Q3_K, and of Q6_K in the CUDA kernels'
    groups of 32) the biases, -128 x scales, are derived on each call, which keeps the weight at
    8.5 bits instead of 9. Q6_K in its wide form (groups of 64) stores them in those 8.5 bits.
    """

    def __init__(self, weight: AffineWeight, output_bias: bool):
        super().__init__()
        self.weight, self.scales, self.bits, self.qtype = weight.weight, weight.scales, weight.bits, weight.qtype
        self.group_size = weight.group_size
        self.expand_rows = 1 if weight.qtype in GPU_EXPANDED_TYPES else DENSE_MIN_ROWS
        if weight.biases is not None:
            self.biases = weight.biases
        if output_bias:
            self.bias = mx.zeros((weight.weight.shape[0],))

    @classmethod
    def stack(cls, layers: list[NativeLinear]) -> NativeLinear | None:
        """One layer whose output rows are the layers' outputs, in order; None unless their weights
        have one form (bits, stored biases or not, device path)."""
        first = layers[0]
        if any(layer.bits != first.bits or layer.group_size != first.group_size or layer.expand_rows != first.expand_rows
               or ("biases" in layer) != ("biases" in first) for layer in layers):
            return None
        arrays = [mx.concatenate([layer[n] for layer in layers]) if n in first else None
                  for n in ("weight", "scales", "biases")]
        return cls(AffineWeight(*arrays, first.bits, first.qtype, first.group_size), output_bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        # The arrays by item: a decode step makes about a hundred of these calls, and attribute
        # access to a module's arrays goes the slow way round (nn.Module.__getattr__).
        scales, biases = input_typed(x, self["scales"], self["biases"] if "biases" in self else None)
        # As one 2-D product: on an H100 a [batch, 1, in] input made batched decoding 3.8 times
        # slower than the same rows as [batch, in], and on an H200 with MLX 0.32.4 16 sequences still
        # decoded at 0.60-0.69x without these two reshapes (docs/benchmarks.md). Rows (a decode
        # step's, Transformer.hidden_states) and a single row go as they are.
        shape = x.shape
        rows = x if x.ndim == 2 or x.size == shape[-1] else x.reshape(-1, shape[-1])
        if rows.shape[0] >= self.expand_rows and mx.default_device() == mx.gpu:
            w = mx.dequantize(self["weight"], scales, biases, group_size=self.group_size, bits=self.bits)
            y = rows @ w.astype(x.dtype).T
        else:
            y = mx.quantized_matmul(rows, self["weight"], scales, biases, transpose=True,
                                    group_size=self.group_size, bits=self.bits)
        if rows is not x:
            y = y.reshape(*shape[:-1], -1)
        return y + self["bias"] if "bias" in self else y


class TiedEmbedding(NativeLinear):
    """A quantized token table that is also the output layer (the model's head calls as_linear).

    The output is NativeLinear's product, so it takes the same device paths as every other
    projection (GPU_EXPANDED_TYPES included); a lookup dequantizes only the rows it gathers.
    """

    as_linear = NativeLinear.__call__

    def __call__(self, ids: mx.array) -> mx.array:
        # float32 like BlockEmbedding's rows: the residual stream starts in float32, and MLX
        # dequantizes in the scales' type, so float16 scales would round every value by up to 1/2048.
        scales = self.scales[ids].astype(mx.float32)
        biases = self.biases[ids].astype(mx.float32) if "biases" in self else symmetric_biases(scales)
        return mx.dequantize(self.weight[ids], scales, biases, group_size=self.group_size, bits=self.bits)


# The partial sums a sub-block product holds at once (sub-blocks x rows x outputs, float32): a
# prompt's rows go through in parts of this size, one after another. With parts of 64 MB the
# Qwen3-0.6B shape's prefill peaked 64 MB higher and ran 15% slower than with 4, 8 or 16.
SUB_BLOCK_SUMS_BYTES = 16 << 20


class SubBlockLinear(nn.Module):
    """A projection whose weight is in the sub-block form (quants.SubBlockWeight): the file's
    values, held in about the file's bits (Q4_K 4.625 a value, Q6_K 6.5625), where the affine form
    holds Q4_K at 5 bits with float16 products of its scales, and re-quantizes Q6_K to 8.5 bits.

    A product is MLX's batched quantized matmul over the sub-blocks (each input's sub-block of
    values times that sub-block's [sub-block, rows] codes), then the sums weighted by each
    sub-block's d x scale and added, less each input's sub-block sums times its dmin x min. On the
    CPU that is 1.0-3.2x as fast as the affine form's product of the same matrix (docs/benchmarks.md,
    "The sub-block form (CPU)"): MLX's non-transposed CPU product reads its weight along the output
    rows. Its partial sums are a sub-block count times larger than the output, so many input rows
    go through in parts (SUB_BLOCK_SUMS_BYTES).
    """

    def __init__(self, weight: SubBlockWeight, output_bias: bool):
        super().__init__()
        self.codes, self.sub_scales, self.d = weight.codes, weight.sub_scales, weight.d
        if weight.sub_mins is not None:
            self.sub_mins, self.dmin = weight.sub_mins, weight.dmin
        self.rows, self.bits, self.offset, self.qtype = weight.rows, weight.bits, weight.offset, weight.qtype
        if output_bias:
            self.bias = mx.zeros((weight.rows,))

    @property
    def padded(self) -> bool:
        return self.rows != self.sub_scales.shape[1]

    @classmethod
    def stack(cls, layers: list[SubBlockLinear]) -> SubBlockLinear | None:
        """One layer whose output rows are the layers' outputs, in order; None unless they are of one
        type, unpadded."""
        first = layers[0]
        if any(layer.qtype != first.qtype or layer.padded for layer in layers):
            return None
        parts = [mx.concatenate([layer[n] for layer in layers], axis=1) if n in first else None
                 for n in ("codes", "sub_scales", "d", "sub_mins", "dmin")]
        return cls(SubBlockWeight(*parts, sum(layer.rows for layer in layers), first.bits, first.offset, first.qtype),
                   output_bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        k = x.shape[-1]
        rows = x.reshape(-1, k)
        per_part = max(1, SUB_BLOCK_SUMS_BYTES // (4 * self["sub_scales"].size))
        parts = []
        for start in range(0, rows.shape[0], per_part):
            part = rows[start : start + per_part]
            # After the part before it: MLX would otherwise hold every part's partial sums at once.
            parts.append(self._product(mx.depends(part, parts[-1]) if parts else part))
        y = _joined(parts, 0)
        y = (y[:, : self.rows] if self.padded else y).reshape(*x.shape[:-1], -1)
        return y + self["bias"] if "bias" in self else y

    def _product(self, x: mx.array) -> mx.array:
        n, k = x.shape
        subs, outputs = self["sub_scales"].shape
        size = k // subs
        grid = (subs, size, outputs // AFFINE_GROUP_SIZE)  # one scale and bias for every code: q = code - offset
        sums = mx.quantized_matmul(x.T.reshape(subs, size, n).swapaxes(1, 2), self["codes"].reshape(subs, size, -1),
                                   mx.broadcast_to(mx.array(1, x.dtype), grid),
                                   mx.broadcast_to(mx.array(-self.offset, x.dtype), grid),
                                   transpose=False, group_size=AFFINE_GROUP_SIZE, bits=self.bits)
        # d x scale is formed at each call: held, it would add 32 bits a sub-block (2 a value for Q6_K).
        y = (sums * self._per_block("sub_scales", "d", x.dtype)[:, None]).sum(axis=0)
        if "sub_mins" in self:
            y = y - x.reshape(n, subs, size).sum(axis=-1) @ self._per_block("sub_mins", "dmin", x.dtype)
        return y

    def _per_block(self, integers: str, factor: str, dtype: mx.Dtype,
                   columns: mx.array | slice = slice(None)) -> mx.array:
        """Each sub-block's scale (or min) times its block's d (or dmin): [subs, len(columns)], exact
        in float32 (an int8 times a float16)."""
        values, factors = self[integers][:, columns], self[factor][:, columns]
        return (values.reshape(factors.shape[0], -1, values.shape[-1]).astype(dtype) * factors[:, None].astype(dtype)
                ).reshape(values.shape)


class TiedSubBlockEmbedding(SubBlockLinear):
    """A token table in the sub-block form that is also the output layer (the model's head calls
    as_linear): a lookup unpacks each input position's code of the rows it gathers."""

    as_linear = SubBlockLinear.__call__

    def __call__(self, ids: mx.array) -> mx.array:
        flat = ids.reshape(-1).astype(mx.uint32)
        codes = mx.view(self["codes"], mx.uint8)  # [cols, rows * bits / 8]: row t's code starts at bit t * bits
        first_bit = flat * self.bits
        byte = first_bit // 8
        # A code spans at most two bytes; the last row's may end in the last byte.
        after = mx.minimum(byte + 1, codes.shape[1] - 1)
        pair = codes[:, byte].astype(mx.uint16) | (codes[:, after].astype(mx.uint16) << 8)
        q = ((pair >> (first_bit % 8).astype(mx.uint16)) & ((1 << self.bits) - 1)).astype(mx.float32) - self.offset
        # float32 like BlockEmbedding's rows: the residual stream starts in float32.
        scales = self._per_block("sub_scales", "d", mx.float32, flat)
        values = q.reshape(scales.shape[0], -1, flat.size) * scales[:, None]
        if "sub_mins" in self:
            values = values - self._per_block("sub_mins", "dmin", mx.float32, flat)[:, None]
        return values.reshape(codes.shape[0], -1).T.reshape(*ids.shape, -1)


class NativeExperts(nn.Module):
    """A mixture's experts (models.transformer.Experts) whose stacked weights stay in MLX's affine
    format, [experts, out, in * bits / 32]: each row is multiplied by its chosen experts' quantized
    weights (MLX's gathered quantized matmul), never dequantized as a whole."""

    def __init__(self, weight: AffineWeight):
        super().__init__()
        self.weight, self.scales, self.bits, self.qtype = weight.weight, weight.scales, weight.bits, weight.qtype
        self.group_size = weight.group_size
        if weight.biases is not None:
            self.biases = weight.biases

    def __call__(self, x: mx.array, chosen: mx.array, sorted_indices: bool = False) -> mx.array:
        scales, biases = input_typed(x, self.scales, self.biases if "biases" in self else None)
        return mx.gather_qmm(x, self.weight, scales, biases, rhs_indices=chosen, transpose=True,
                             group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices)


def quantized_layer(module: nn.Module, weight: AffineWeight | SubBlockWeight | Blocks,
                    product: BlockProduct | None = None) -> nn.Module:
    """The layer that takes `weight` in place of `module` (an nn.Linear, nn.Embedding or the
    experts of a mixture); a matrix kept in blocks for its product needs the backend's `product`."""
    if isinstance(weight, Blocks) and product is not None:
        return TiedBlockEmbedding(weight, product) if isinstance(module, nn.Embedding) else BlockLinear(weight, product)
    if isinstance(weight, Blocks):
        return BlockEmbedding(weight)
    if isinstance(weight, SubBlockWeight):
        return TiedSubBlockEmbedding(weight, output_bias=False) if isinstance(module, nn.Embedding) else (
            SubBlockLinear(weight, "bias" in module))
    if weight.weight.ndim == 3:
        return NativeExperts(weight)
    if isinstance(module, nn.Embedding):
        return TiedEmbedding(weight, output_bias=False)
    return NativeLinear(weight, "bias" in module)
