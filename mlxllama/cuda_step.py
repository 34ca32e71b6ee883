"""One sequence's decode step as five CUDA kernels a layer, for native-mode models on MLX's CUDA backend.

Why: MLX's CUDA backend spends 5-7 µs of host time on every operation however small
(benchmarks/op_cost.py), and the plain step (model.Transformer.step) is about 17 operations a
layer, so one token costs far more than reading the weights does (docs/benchmarks.md). Here a
layer is: RMSNorm + Q/K/V + RoPE + the cache's new slot; attention in runs of slots; their
combination + output projection + residual; RMSNorm + gate/up + SiLU; down projection +
residual (decode_step.cu). Prefill and batched decoding stay on the plain path.

`build(model)` returns a `KernelStep` for a model whose every projection keeps an affine weight
(quantized_model.NativeLinear) and whose shapes the kernels take, else None.
"""

from __future__ import annotations

import os
import weakref
from functools import cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .cache import KVCache
from .fusion import FUSED
from .model import Transformer, rope_periods
from .quantized_model import NativeLinear

_HEADER = "\n".join(line for line in Path(__file__).with_name("decode_step.cu").read_text().splitlines()
                    if line.strip() and not line.lstrip().startswith("//"))  # MLX hashes the source at every launch
WARPS = 8  # warps a block, every kernel but attention's: decode_step.cu's THREADS / 32
ATTENTION_WARPS = 4
# The cache's slots are split among this many attention blocks a head at most (decode_step.cu's
# MAX_SPLITS), runs of at least MIN_RUN slots each.
MAX_SPLITS, MIN_RUN = 32, 128
# Set to 0 to decode through the plain path on CUDA too, or to "uncompiled" to launch the kernels
# without mx.compile (for comparisons).
ENV_SWITCH = "MLXLLAMA_CUDA_KERNELS"


def _staged_floats(k: int) -> int:
    """decode_step.cu's shared memory for an input of k values: staged values, group sums, scratch."""
    return k // 32 * 36 + k // 32 + 33


@cache
def _kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], call: str, shared_floats: int):
    return mx.fast.cuda_kernel(name=name, input_names=list(inputs), output_names=list(outputs),
                               source=call, header=_HEADER, shared_memory=4 * shared_floats)


class Projection:
    """An affine weight's arrays and form, as the kernels take them (rows may be a slice of a fused layer)."""

    def __init__(self, layer: NativeLinear, rows: slice | None = None):
        part = (lambda a: a[rows]) if rows is not None else (lambda a: a)
        self.weight, self.scales = part(layer.weight), part(layer.scales)
        self.stored_biases = "biases" in layer
        # Without stored biases the kernel derives them; it still needs an array in that place.
        self.biases = part(layer.biases) if self.stored_biases else self.scales
        self.bits = layer.bits
        self.rows = self.weight.shape[0]
        self.cols = self.weight.shape[1] * 32 // self.bits
        self.bias = part(layer.bias) if "bias" in layer else None

    def arrays(self) -> list[mx.array]:
        return [self.weight, self.scales, self.biases]


def _projections(block: nn.Module, fused: str, sizes: list[int]) -> list[Projection]:
    """The projections fusion.py stacks as `fused`, in order, whether the block has them stacked or not."""
    if fused in block:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [Projection(block[fused], slice(s, s + n)) for s, n in zip(starts, sizes)]
    return [Projection(block[p]) for p in FUSED[fused]]


def build(model: Transformer) -> KernelStep | None:
    if mx.default_device() != mx.gpu or not mx.cuda.is_available() or os.environ.get(ENV_SWITCH) == "0":
        return None
    c = model.config
    layers = [layer for block in model.blk for layer in block.children().values() if not isinstance(layer, nn.RMSNorm)]
    head = model.token_embd if c.tied_output else model.output
    if not all(isinstance(layer, NativeLinear) for layer in layers + [head]):
        return None
    # Each lane of the attention kernel holds head_dim / 32 dims; float32 compute is untested on CUDA.
    if c.head_dim % 32 or model.compute_dtype == mx.float32:
        return None
    return KernelStep(model)


class KernelStep:
    """model.step for one token of one sequence: token [1, 1] -> logits [1, vocab] (float32).

    The layer's new key and value are written into the KVCache's buffers at its offset; the
    caller advances the offset (model.Transformer.step).
    """

    def __init__(self, model: Transformer):
        c = self.config = model.config
        # Not the model itself, which holds this step: a cycle would keep both alive until the cycle collector ran.
        self.embed, self.compute_dtype = model.token_embd, model.compute_dtype
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.layers = []
        for block in model.blk:
            q, k, v = _projections(block, "attn_qkv", [q_dim, kv_dim, kv_dim])
            gate, up = _projections(block, "ffn_gate_up", [c.ffn_size, c.ffn_size])
            self.layers.append(dict(attn_norm=_on_device(block.attn_norm.weight), q=q, k=k, v=v,
                                    o=Projection(block.attn_output), ffn_norm=_on_device(block.ffn_norm.weight),
                                    gate=gate, up=up, down=Projection(block.ffn_down)))
        self.output_norm = _on_device(model.output_norm.weight)
        self.head = Projection(model.token_embd if c.tied_output else model.output)
        self.eps = _on_device(mx.array([c.rms_eps] * 4, mx.float32))
        # RoPE's angle for pair i at position p is p * inv_freq[i], as MLX's RoPE turns it.
        self.inv_freq = _on_device(c.rope_scale / rope_periods(c))
        self.attn_factor = _on_device(mx.array([c.rope_attn_factor] * 4, mx.float32))
        self.positions = _on_device(mx.arange(c.context_length, dtype=mx.int32))
        mx.eval([p.arrays() for layer in self.layers for p in layer.values() if isinstance(p, Projection)])
        self._compiled = None if os.environ.get(ENV_SWITCH) == "uncompiled" else _compiled_forward(self)

    def __call__(self, tokens: mx.array, cache: list[KVCache]) -> mx.array:
        offset = cache[0].offset
        if offset >= self.positions.size:
            self.positions = _on_device(mx.arange(2 * offset, dtype=mx.int32))
        position = self.positions[offset : offset + 1]  # a view: no host data for the kernels to read
        buffers = [a for layer in cache for a in (layer.keys, layer.values)]
        return (self._compiled or self._forward)(tokens, position, *buffers)

    def _forward(self, tokens: mx.array, position: mx.array, *buffers: mx.array) -> mx.array:
        # As in the plain step (model.py): a float32 residual stream, sublayers' values in the compute type.
        x = self.embed(tokens).astype(mx.float32).reshape(-1)
        for layer, keys, values in zip(self.layers, buffers[::2], buffers[1::2]):
            q = self._qkv(x, layer, position, keys, values, self.compute_dtype)
            partials = self._attention(q, keys, values, position)
            h = self._attention_output(layer["o"], partials, residual=x)
            x = self._matvec(layer["down"], self._gate_up(h, layer, self.compute_dtype), h.dtype, residual=h)
        return self._matvec(self.head, x, mx.float32, norm=self.output_norm).reshape(1, -1)

    def _qkv(self, x: mx.array, layer: dict, position: mx.array, keys: mx.array, values: mx.array,
             act: mx.Dtype) -> mx.array:
        """q; the new key and value go into the cache's buffers in place.

        In place, because the alternative, mx.slice_update, copied the whole buffer every step
        (MLX cannot reuse a buffer that the cache still holds). It is safe because nothing reads a
        slot before this step writes it: this step's attention reads the cache only after this
        kernel (it takes q, this kernel's output), and earlier steps read only earlier slots.
        """
        c = self.config
        q, k, v = layer["q"], layer["k"], layer["v"]
        biases = [p.bias for p in (q, k, v)] if q.bias is not None else [self.eps] * 3
        pairs_per_warp = 1
        template = [("Q_BITS", q.bits), ("Q_BIASES", q.stored_biases), ("K_BITS", k.bits),
                    ("K_BIASES", k.stored_biases), ("V_BITS", v.bits), ("V_BIASES", v.stored_biases),
                    ("BIAS", q.bias is not None), ("HEADS", c.n_heads), ("KV_HEADS", c.n_kv_heads),
                    ("HEAD_DIM", c.head_dim), ("ROPE_DIM", c.rope_dim), ("TRADITIONAL", c.rope_traditional),
                    ("K", q.cols), ("PAIRS", pairs_per_warp)]
        kernel = _kernel(
            "qkv_rope",
            ("x", "norm_w", "eps", "w_q", "s_q", "b_q", "w_k", "s_k", "b_k", "w_v", "s_v", "b_v",
             "bias_q", "bias_k", "bias_v", "position", "inv_freq", "attn_factor", "keys", "values"),
            ("q",),
            "qkv_rope_kernel<Q_BITS, Q_BIASES, K_BITS, K_BIASES, V_BITS, V_BIASES, BIAS, HEADS, KV_HEADS, HEAD_DIM,"
            " ROPE_DIM, TRADITIONAL, K, PAIRS>(x, norm_w, eps, w_q, s_q, b_q, w_k, s_k, b_k, w_v, s_v, b_v, bias_q,"
            " bias_k, bias_v, position, inv_freq, attn_factor, keys, values, keys_shape[2], q);",
            _staged_floats(q.cols))
        warps = (q.rows + 2 * k.rows) // 2 // pairs_per_warp
        return kernel(inputs=[x, layer["attn_norm"], self.eps, *q.arrays(), *k.arrays(), *v.arrays(), *biases,
                              position, self.inv_freq, self.attn_factor, keys, values],
                      template=template, grid=(32 * _round_up(warps, WARPS), 1, 1), threadgroup=(32 * WARPS, 1, 1),
                      output_shapes=[(q.rows,)], output_dtypes=[act])[0]

    def _attention(self, q: mx.array, keys: mx.array, values: mx.array, position: mx.array) -> mx.array:
        """Per head and run of slots: the weighted values, the max score and the sum of exponentials."""
        c = self.config
        capacity = keys.shape[2]
        splits = max(1, min(MAX_SPLITS, capacity // MIN_RUN))
        kernel = _kernel("attention", ("q", "keys", "values", "position"), ("partials",),
                         "attention_kernel<HEADS, KV_HEADS, HEAD_DIM, WARPS>(q, keys, values, keys_shape[2],"
                         " position, partials);", 0)
        return kernel(inputs=[q, keys, values, position],
                      template=[("HEADS", c.n_heads), ("KV_HEADS", c.n_kv_heads), ("HEAD_DIM", c.head_dim),
                                ("WARPS", ATTENTION_WARPS)],
                      grid=(32 * ATTENTION_WARPS * c.n_heads, splits, 1), threadgroup=(32 * ATTENTION_WARPS, 1, 1),
                      output_shapes=[(c.n_heads, splits, c.head_dim + 2)], output_dtypes=[mx.float32])[0]

    def _attention_output(self, p: Projection, partials: mx.array, residual: mx.array) -> mx.array:
        rows_per_warp = 1
        kernel = _kernel(
            "attention_output", ("partials", "w", "scales", "biases", "residual"), ("y",),
            "attention_output_kernel<BITS, STORED_BIASES, K, R, HEAD_DIM>(partials, partials_shape[1], w, scales,"
            " biases, residual, ROWS, y);",
            _staged_floats(p.cols) + self.config.n_heads * MAX_SPLITS)  # and each head's weights of its splits
        template = [("BITS", p.bits), ("STORED_BIASES", p.stored_biases), ("K", p.cols), ("R", rows_per_warp),
                    ("HEAD_DIM", self.config.head_dim), ("ROWS", p.rows)]
        return kernel(inputs=[partials, *p.arrays(), residual], template=template,
                      grid=(32 * _round_up(-(-p.rows // rows_per_warp), WARPS), 1, 1), threadgroup=(32 * WARPS, 1, 1),
                      output_shapes=[(p.rows,)], output_dtypes=[residual.dtype])[0]

    def _gate_up(self, h: mx.array, layer: dict, act: mx.Dtype) -> mx.array:
        gate, up = layer["gate"], layer["up"]
        rows_per_warp = 1
        kernel = _kernel(
            "gate_up", ("x", "norm_w", "eps", "w_gate", "s_gate", "b_gate", "w_up", "s_up", "b_up"), ("y",),
            "gate_up_kernel<GATE_BITS, GATE_BIASES, UP_BITS, UP_BIASES, K, R>(x, norm_w, eps, w_gate, s_gate, b_gate,"
            " w_up, s_up, b_up, ROWS, y);",
            _staged_floats(gate.cols))
        template = [("GATE_BITS", gate.bits), ("GATE_BIASES", gate.stored_biases), ("UP_BITS", up.bits),
                    ("UP_BIASES", up.stored_biases), ("K", gate.cols), ("R", rows_per_warp), ("ROWS", gate.rows)]
        return kernel(inputs=[h, layer["ffn_norm"], self.eps, *gate.arrays(), *up.arrays()], template=template,
                      grid=(32 * _round_up(-(-gate.rows // rows_per_warp), WARPS), 1, 1),
                      threadgroup=(32 * WARPS, 1, 1), output_shapes=[(gate.rows,)], output_dtypes=[act])[0]

    def _matvec(self, p: Projection, x: mx.array, out_dtype: mx.Dtype, residual: mx.array | None = None,
                norm: mx.array | None = None) -> mx.array:
        rows_per_warp = 2 if p.rows >= 16384 else 1
        kernel = _kernel(
            "matvec", ("x", "norm_w", "eps", "w", "scales", "biases", "residual"), ("y",),
            "matvec_kernel<NORM, RESIDUAL, BITS, STORED_BIASES, K, R>(x, norm_w, eps, w, scales, biases,"
            " residual, ROWS, y);",
            _staged_floats(p.cols))
        template = [("NORM", norm is not None), ("RESIDUAL", residual is not None), ("BITS", p.bits),
                    ("STORED_BIASES", p.stored_biases), ("K", p.cols), ("R", rows_per_warp), ("ROWS", p.rows)]
        return kernel(inputs=[x, norm if norm is not None else x, self.eps, *p.arrays(),
                              residual if residual is not None else x],
                      template=template, grid=(32 * _round_up(-(-p.rows // rows_per_warp), WARPS), 1, 1),
                      threadgroup=(32 * WARPS, 1, 1), output_shapes=[(p.rows,)], output_dtypes=[out_dtype])[0]


def _compiled_forward(step: KernelStep):
    """mx.compile of step._forward, which then costs one call from Python instead of ~130 launches'
    worth of graph building; it holds the step weakly, as model._compiled_step holds its model."""
    step_ref = weakref.ref(step)
    return mx.compile(lambda *args: step_ref()._forward(*args))


def _on_device(a: mx.array) -> mx.array:
    """A copy in the GPU's own memory. MLX keeps arrays made from host data in CUDA managed memory
    (and arrays of 8 bytes or less always), which every kernel launch would read across the bus."""
    out = a * 1
    assert out.nbytes > 8, "MLX keeps arrays of 8 bytes or less in managed memory"
    mx.eval(out)
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
