"""The decode step as one CUDA kernel a layer, for native-mode models on MLX's CUDA backend.

Why: MLX's CUDA backend spends 5-10 µs of host time on every operation however small
(benchmarks/op_cost.py), and the plain step (model.Transformer.step) is about 17 operations a
layer, so one token costs far more than reading the weights does (docs/benchmarks.md). Here a
layer is one launch (decode_step.cu's layer_kernel), one block on every SM, in five steps with
grid-wide barriers between them: RMSNorm + Q/K/V + RoPE + the cache's new slot; attention in runs
of slots, combined; output projection + residual; RMSNorm + gate/up; SiLU + down projection +
residual. Five launches a layer measured 1.4-1.7 times slower (docs/benchmarks.md).
Several sequences (2 to MAX_BATCH, as bench and batch.py decode them) go through
decode_batch.cu's batch_layer_kernel: the same five steps, with the projections on tensor cores,
each weight loaded once for all the sequences. Prefill stays on the plain path.

`build(model)` returns a `KernelStep` for a model whose every projection keeps an affine weight
(quantized_model.NativeLinear) and whose shapes the kernels take, else None.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from functools import cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .cache import BatchKVCache, KVCache
from .config import ModelConfig
from .fusion import FUSED
from .model import Transformer, rope_periods
from .quantized_model import NativeLinear


def _source(name: str) -> str:
    """A kernel file without comments and blank lines: MLX hashes the source at every launch."""
    return "\n".join(line for line in Path(__file__).with_name(name).read_text().splitlines()
                     if line.strip() and not line.lstrip().startswith("//"))


_HEADER = _source("decode_step.cu")
_BATCH_HEADER = _HEADER + "\n" + _source("decode_batch.cu")
HEAD_WARPS = 8  # warps a block of head_kernel: decode_step.cu's THREADS / 32
LAYER_THREADS = 512  # decode_step.cu's LAYER_THREADS
FFN_ROWS = 4  # rows of the gate or up projection a warp takes at once in layer_kernel (1, 2 and 8: no faster)
SEQ_TILE = 8  # decode_batch.cu's SEQ_TILE: sequences of one tensor-core product
MAX_BATCH = 16  # sequences batch_layer_kernel takes at once (its shared memory holds all their inputs)
# Set to 0 to decode through the plain path on CUDA too, or to "uncompiled" to launch the kernels
# without mx.compile (for comparisons).
ENV_SWITCH = "MLXLLAMA_CUDA_KERNELS"


# The layer kernels' inputs after x (decode_step.cu's layer_kernel, decode_batch.cu's batch_layer_kernel).
_LAYER_INPUTS = ("attn_norm", "eps", "w_q", "s_q", "b_q", "w_k", "s_k", "b_k", "w_v", "s_v", "b_v", "bias_q", "bias_k",
                 "bias_v", "position", "inv_freq", "attn_factor", "keys", "values", "w_o", "s_o", "b_o", "ffn_norm",
                 "w_gate", "s_gate", "b_gate", "w_up", "s_up", "b_up", "w_down", "s_down", "b_down", "sync", "scratch")


def _staged_floats(k: int) -> int:
    """decode_step.cu's shared memory for an input of k values: staged values, group sums, scratch."""
    return k // 32 * 36 + k // 32 + 33


def _batch_stride(k: int) -> int:
    """decode_batch.cu's batch_stride."""
    return k + (32 if k % 64 == 0 else 0)


def _batch_shared_floats(c: ModelConfig, tiles: int) -> int:
    """batch_layer_kernel's shared memory for `tiles` * 8 sequences: two matrices' fragments of
    every warp, then the largest staged input (float16 values, float32 group sums) or the attention's queries."""
    seqs = tiles * SEQ_TILE
    staged = max(seqs * _batch_stride(k) // 2 + seqs * k // 32 for k in (c.hidden_size, c.n_heads * c.head_dim, c.ffn_size))
    return 2 * LAYER_THREADS * tiles * 4 + max(staged, LAYER_THREADS // 32 * c.head_dim)


@cache
def _kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], call: str, shared_floats: int,
            batch: bool = False):
    return mx.fast.cuda_kernel(name=name, input_names=list(inputs), output_names=list(outputs), source=call,
                               header=_BATCH_HEADER if batch else _HEADER, shared_memory=4 * shared_floats)


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
    device = _device_limits()
    return KernelStep(model, *device) if device else None


class KernelStep:
    """model.step for one token of each of 1 to MAX_BATCH sequences: tokens [rows, 1] -> logits
    [rows, vocab] (float32).

    Each layer's new keys and values are written into the cache's buffers (a KVCache's rows all at
    its offset, a BatchKVCache's each at its own length); the caller advances the cache
    (model.Transformer.step).
    """

    def __init__(self, model: Transformer, blocks: int, shared_bytes: int = 0):
        c = self.config = model.config
        # layer_kernel's grid: one block an SM (decode_step.cu says why), and so each head's attention
        # may be split into this many runs of slots.
        self.blocks = blocks
        self.max_runs = _max_runs(blocks, c.n_heads)
        self.sync = _on_device(mx.zeros((32 + MAX_BATCH * c.n_heads,), mx.uint32))
        # Not the model itself, which holds this step: a cycle would keep both alive until the cycle collector ran.
        self.embed, self.compute_dtype = model.token_embd, model.compute_dtype
        self.head_norm = model.output_norm
        self.head_linear = model.token_embd.as_linear if c.tied_output else model.output
        # batch_layer_kernel takes whole tiles of 16 rows and must hold 16 sequences' inputs.
        self.batches = (c.hidden_size % 16 == 0 and c.ffn_size % 16 == 0
                        and 4 * _batch_shared_floats(c, MAX_BATCH // SEQ_TILE) <= shared_bytes)
        self._batch_scratch: dict[int, mx.array] = {}
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        # decode_step.cu's layer_kernel: q, partials, attn, h, gate, up.
        self.scratch = _on_device(mx.zeros((2 * q_dim + c.n_heads * self.max_runs * (c.head_dim + 2) + c.hidden_size
                                            + 2 * c.ffn_size,), mx.float32))
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
        uncompiled = os.environ.get(ENV_SWITCH) == "uncompiled"
        self._compiled = None if uncompiled else _compiled(self, "_forward")
        self._compiled_batch = None if uncompiled else _compiled(self, "_batch_forward")

    def takes(self, rows: int) -> bool:
        """Whether this step decodes `rows` sequences at once."""
        return rows == 1 or (self.batches and rows <= MAX_BATCH)

    def __call__(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        rows = tokens.shape[0]
        offsets = cache[0].lengths if isinstance(cache[0], BatchKVCache) else [cache[0].offset] * rows
        if max(offsets) >= self.positions.size:
            self.positions = _on_device(mx.arange(2 * max(offsets), dtype=mx.int32))
        buffers = [a for layer in cache for a in (layer.keys, layer.values)]
        if rows == 1:
            position = self.positions[offsets[0] : offsets[0] + 1]  # a view: no host data for the kernels to read
            return (self._compiled or self._forward)(tokens, position, *buffers)
        # A gather from the device's positions: the kernels read them once a layer, host data every time across the bus.
        positions = self.positions[mx.array(offsets, mx.int32)]
        tiles = -(-rows // SEQ_TILE)
        if tiles not in self._batch_scratch:  # made here, not while mx.compile traces _batch_forward
            c, seqs = self.config, tiles * SEQ_TILE
            q_dim, max_runs = c.n_heads * c.head_dim, self._batch_max_runs(tiles)
            # decode_batch.cu's batch_layer_kernel: q, partials, attn, h, and act (float16, two a float).
            size = seqs * (2 * q_dim + c.n_heads * max_runs * (c.head_dim + 2) + c.hidden_size + c.ffn_size // 2)
            self._batch_scratch[tiles] = _on_device(mx.zeros((size,), mx.float32))
        return (self._compiled_batch or self._batch_forward)(tokens, positions, *buffers)

    def _forward(self, tokens: mx.array, position: mx.array, *buffers: mx.array) -> mx.array:
        # As in the plain step (model.py): a float32 residual stream, sublayers' values in the compute type.
        x = self.embed(tokens).astype(mx.float32).reshape(-1)
        for layer, keys, values in zip(self.layers, buffers[::2], buffers[1::2]):
            x = self._layer(x, layer, position, keys, values)
        return self._head(x).reshape(1, -1)

    def _layer(self, x: mx.array, layer: dict, position: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        """The layer's output for input x (float32); the new key and value go into the cache's buffers in place.

        In place, because the alternative, mx.slice_update, copied the whole buffer every step (MLX
        cannot reuse a buffer that the cache still holds). It is safe because nothing reads a slot
        before this step writes it: the kernel's attention reads the cache only after a grid-wide
        barrier that follows the write, and earlier steps read only earlier slots.
        The layers' launches share `self.sync` (the barrier's count) and `self.scratch` (what the
        kernel's steps hand on) and never overlap: each takes the previous one's output.
        """
        c = self.config
        template, arrays = self._layer_arguments(layer)
        template += [("FFN_ROWS", FFN_ROWS), ("MAX_RUNS", self.max_runs)]
        inputs = ["x", *_LAYER_INPUTS]
        arguments = inputs[:20] + ["keys_shape[2]"] + inputs[20:] + ["y"]
        call = f"layer_kernel<{', '.join(n for n, _ in template)}>({', '.join(arguments)});"
        shared = max(_staged_floats(c.hidden_size), _staged_floats(c.ffn_size), _staged_floats(c.n_heads * c.head_dim),
                     LAYER_THREADS // 32 * c.head_dim)
        kernel = _kernel("layer", tuple(inputs), ("y",), call, shared)
        return kernel(inputs=[x, *arrays(position, keys, values), self.sync, self.scratch], template=template,
                      grid=(LAYER_THREADS * self.blocks, 1, 1), threadgroup=(LAYER_THREADS, 1, 1),
                      output_shapes=[x.shape], output_dtypes=[mx.float32])[0]

    def _layer_arguments(self, layer: dict):
        """The template arguments both layer kernels take, and a function of (position(s), keys,
        values) giving their inputs from attn_norm to b_down (_LAYER_INPUTS, less sync and scratch)."""
        c = self.config
        q, k, v, o, gate, up, down = (layer[n] for n in ("q", "k", "v", "o", "gate", "up", "down"))
        biases = [p.bias for p in (q, k, v)] if q.bias is not None else [self.eps] * 3
        template = [("Q_BITS", q.bits), ("Q_BIASES", q.stored_biases), ("K_BITS", k.bits),
                    ("K_BIASES", k.stored_biases), ("V_BITS", v.bits), ("V_BIASES", v.stored_biases),
                    ("BIAS", q.bias is not None), ("HEADS", c.n_heads), ("KV_HEADS", c.n_kv_heads),
                    ("HEAD_DIM", c.head_dim), ("ROPE_DIM", c.rope_dim), ("TRADITIONAL", c.rope_traditional),
                    ("HIDDEN", q.cols), ("O_BITS", o.bits), ("O_BIASES", o.stored_biases), ("GATE_BITS", gate.bits),
                    ("GATE_BIASES", gate.stored_biases), ("UP_BITS", up.bits), ("UP_BIASES", up.stored_biases),
                    ("DOWN_BITS", down.bits), ("DOWN_BIASES", down.stored_biases), ("FFN", gate.rows)]

        def arrays(position: mx.array, keys: mx.array, values: mx.array) -> list[mx.array]:
            return [layer["attn_norm"], self.eps, *q.arrays(), *k.arrays(), *v.arrays(), *biases, position,
                    self.inv_freq, self.attn_factor, keys, values, *o.arrays(), layer["ffn_norm"], *gate.arrays(),
                    *up.arrays(), *down.arrays()]

        return template, arrays

    def _batch_forward(self, tokens: mx.array, positions: mx.array, *buffers: mx.array) -> mx.array:
        x = self.embed(tokens).astype(mx.float32).reshape(tokens.shape[0], -1)
        for layer, keys, values in zip(self.layers, buffers[::2], buffers[1::2]):
            x = self._batch_layer(x, layer, positions, keys, values)
        # The head as the plain step computes it (model.Transformer.head): for several rows MLX's own
        # quantized product reads the head's weights once for all of them.
        return self.head_linear(self.head_norm(x)).astype(mx.float32)

    def _batch_layer(self, x: mx.array, layer: dict, positions: mx.array, keys: mx.array,
                     values: mx.array) -> mx.array:
        """_layer for x [rows, hidden], through batch_layer_kernel with enough 8-sequence tiles for the rows."""
        c = self.config
        tiles = -(-x.shape[0] // SEQ_TILE)
        template, arrays = self._layer_arguments(layer)
        template = [("NT", tiles)] + template + [("MAX_RUNS", self._batch_max_runs(tiles))]
        inputs = ["x", *_LAYER_INPUTS]
        arguments = ["x", "x_shape[0]"] + inputs[1:20] + ["keys_shape[2]"] + inputs[20:] + ["y"]
        call = f"batch_layer_kernel<{', '.join(n for n, _ in template)}>({', '.join(arguments)});"
        kernel = _kernel("batch_layer", tuple(inputs), ("y",), call, _batch_shared_floats(c, tiles), batch=True)
        return kernel(inputs=[x, *arrays(positions, keys, values), self.sync, self._batch_scratch[tiles]],
                      template=template, grid=(LAYER_THREADS * self.blocks, 1, 1), threadgroup=(LAYER_THREADS, 1, 1),
                      output_shapes=[x.shape], output_dtypes=[mx.float32])[0]

    def _batch_max_runs(self, tiles: int) -> int:
        """batch_layer_kernel's MAX_RUNS for `tiles` * 8 sequences, which its scratch input is sized by."""
        return _max_runs(self.blocks, tiles * SEQ_TILE * self.config.n_heads)

    def _head(self, x: mx.array) -> mx.array:
        """Logits (float32) of the last layer's output x."""
        p = self.head
        rows_per_warp = 2 if p.rows >= 16384 else 1
        kernel = _kernel("head", ("x", "norm_w", "eps", "w", "scales", "biases"), ("y",),
                         "head_kernel<BITS, STORED_BIASES, K, R>(x, norm_w, eps, w, scales, biases, ROWS, y);",
                         _staged_floats(p.cols))
        template = [("BITS", p.bits), ("STORED_BIASES", p.stored_biases), ("K", p.cols), ("R", rows_per_warp),
                    ("ROWS", p.rows)]
        return kernel(inputs=[x, self.output_norm, self.eps, *p.arrays()], template=template,
                      grid=(32 * _round_up(-(-p.rows // rows_per_warp), HEAD_WARPS), 1, 1),
                      threadgroup=(32 * HEAD_WARPS, 1, 1), output_shapes=[(p.rows,)], output_dtypes=[mx.float32])[0]


def _compiled(step: KernelStep, method: str):
    """mx.compile of a method of the step (_forward or _batch_forward), which then costs one call
    from Python instead of building the step's graph (about 25 operations) every token; it holds
    the step weakly, as model._compiled_step holds its model."""
    step_ref = weakref.ref(step)
    return mx.compile(lambda *args: getattr(step_ref(), method)(*args))


def _max_runs(blocks: int, items: int) -> int:
    """Runs of slots a head's attention may be cut into, so that `items` (sequence, head) pairs
    give each warp of the grid at least one run."""
    return max(1, blocks * (LAYER_THREADS // 32) // items)


def _device_limits() -> tuple[int, int] | None:
    """The GPU's number of SMs and the shared memory bytes a block may have (CUDA's driver API: MLX
    reports neither), or None."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, count, shared = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    multiprocessor_count, max_shared_per_block_optin = 16, 97  # CU_DEVICE_ATTRIBUTE_*
    if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0)
            or cuda.cuDeviceGetAttribute(ctypes.byref(count), multiprocessor_count, device)
            or cuda.cuDeviceGetAttribute(ctypes.byref(shared), max_shared_per_block_optin, device)):
        return None
    return count.value, shared.value


def _on_device(a: mx.array) -> mx.array:
    """A copy in the GPU's own memory. MLX keeps arrays made from host data in CUDA managed memory
    (and arrays of 8 bytes or less always), which every kernel launch would read across the bus."""
    out = a * 1
    assert out.nbytes > 8, "MLX keeps arrays of 8 bytes or less in managed memory"
    mx.eval(out)
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
