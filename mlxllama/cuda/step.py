"""The decode step as one CUDA kernel a layer, for native-mode models on MLX's CUDA backend.

Why: MLX's CUDA backend spends 5-10 µs of host time on every operation however small
(benchmarks/op_cost.py), and the plain step (models/transformer.py) is about 17 operations a
layer, so one token costs far more than reading the weights does (docs/benchmarks.md). Here a
layer is one launch (decode_step.cu's layer_kernel), one block on every SM, in five steps with
grid-wide barriers between them: RMSNorm + Q/K/V + RoPE + the cache's new slot; attention in runs
of slots, combined; output projection + residual; RMSNorm + gate/up; SiLU + down projection +
residual. Five launches a layer measured 1.4-1.7 times slower (docs/benchmarks.md).
Several sequences (2 to MAX_BATCH, as bench and batching.py decode them) go through
decode_batch.cu's batch_layer_kernel: the same five steps, with the projections on tensor cores,
each weight loaded once for all the sequences. Prefill stays on the plain path.
"""

from __future__ import annotations

import ctypes
import os
import weakref

import mlx.core as mx
import mlx.nn as nn

from ..cache import BatchKVCache, KVCache, kv_arrays, rotates
from ..fusion import FUSED
from ..models.transformer import DecodeStep, Transformer, rope_periods
from ..quantized_layers import BlockLinear, NativeLinear
from . import kernels
from .kernels import LAYER_THREADS, MAX_BATCH, SEQ_TILE

# Set to "uncompiled" to launch the kernels without mx.compile (for comparisons); "0" turns them off
# (runtime.py reads that).
ENV_SWITCH = "MLXLLAMA_CUDA_KERNELS"


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
    """The projections fusion.py stacks as `fused`, in order, whether the block has them stacked or not
    (or Q and K stacked as attn_qk, and V alone)."""
    if fused in block:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [Projection(block[fused], slice(s, s + n)) for s, n in zip(starts, sizes)]
    if fused == "attn_qkv" and "attn_qk" in block:
        return _projections(block, "attn_qk", sizes[:2]) + [Projection(block.attn_v)]
    return [Projection(block[p]) for p in FUSED[fused]]


class KernelStep:
    """The model's decode step through the kernels (model.decode_step): one token of each of 1 to
    MAX_BATCH sequences, tokens [rows, 1] -> logits [rows, vocab] (float32); and speculative
    decoding's check, a few tokens of each row, tokens [rows, n] -> logits [rows, n, vocab], through
    the batch kernel with each (row, position) one of its sequences (check_drafts).

    Each layer's new keys and values are written into the cache's buffers in place (a KVCache's
    rows all at its offset, a BatchKVCache's each at its own length), then the cache advances.
    What the kernels do not take (prefill, an empty cache, more rows than MAX_BATCH or than fit
    the device's shared memory) goes to `fallback`, the plain step.
    """

    uses_kernels = True
    # Whether attention may stage keys in shared memory (benchmarks/attention_depth.py turns it off
    # to measure what staging buys).
    stage_keys = True

    def __init__(self, model: Transformer, fallback: DecodeStep, blocks: int, shared_bytes: int = 0):
        c = self.config = model.config
        self.fallback = fallback
        # layer_kernel's grid: one block an SM (decode_step.cu says why).
        self.blocks = blocks
        self.sync = _on_device(mx.zeros((32 + MAX_BATCH * c.n_heads,), mx.uint32))
        # Not the model itself, which holds this step: a cycle would keep both alive until the cycle collector ran.
        self.embed, self.compute_dtype = model.token_embd, model.compute_dtype
        self.head_norm = model.output_norm
        self.head_linear = model.token_embd.as_linear if c.tied_output else model.output
        # Attention stages a plain cache's keys in shared memory where there is room for them
        # (decode_step.cu's PlainSlots says why); a quantized cache's it never does, nor one
        # sequence's attention on tensor cores (kernels.tensor_runs).
        self.staged_keys = (self.stage_keys and not kernels.tensor_runs(c)
                            and 4 * kernels.layer_shared_floats(c, staged_keys=True) <= shared_bytes)
        tiles = MAX_BATCH // SEQ_TILE
        self.batch_staged_keys = (self.stage_keys
                                  and 4 * kernels.batch_shared_floats(c, tiles, staged_keys=True) <= shared_bytes)
        # batch_layer_kernel takes whole tiles of 16 rows and must hold 16 sequences' inputs.
        self.batches = (c.hidden_size % 16 == 0 and c.ffn_size % 16 == 0
                        and 4 * kernels.batch_shared_floats(c, tiles, self.batch_staged_keys) <= shared_bytes)
        self._batch_scratch: dict[int, mx.array] = {}
        # Sized by a plain cache's rows of partial results a head (kernels.max_runs), which a
        # quantized cache's never exceed.
        self.scratch = _on_device(mx.zeros((kernels.layer_scratch_floats(c, kernels.max_runs(blocks, c)),),
                                           mx.float32))
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.layers = []
        for block in model.blk:
            q, k, v = _projections(block, "attn_qkv", [q_dim, kv_dim, kv_dim])
            gate, up = _projections(block, "ffn_gate_up", [c.ffn_size, c.ffn_size])
            self.layers.append(dict(attn_norm=_on_device(block.attn_norm.weight), q=q, k=k, v=v,
                                    o=Projection(block.attn_output), ffn_norm=_on_device(block.ffn_norm.weight),
                                    gate=gate, up=up, down=Projection(block.ffn_down)))
        self.output_norm = _on_device(model.output_norm.weight)
        head = model.token_embd if c.tied_output else model.output
        self.head = head if isinstance(head, BlockLinear) else Projection(head)
        self.eps = _on_device(mx.array([c.rms_eps] * 4, mx.float32))
        # RoPE's angle for pair i at position p is p * inv_freq[i], as MLX's RoPE turns it.
        self.inv_freq = _on_device(c.rope_scale / rope_periods(c))
        self.attn_factor = _on_device(mx.array([c.rope_attn_factor] * 4, mx.float32))
        self.positions = _on_device(mx.arange(c.context_length, dtype=mx.int32))
        self.cache_rows = _on_device(mx.arange(MAX_BATCH, dtype=mx.int32))
        mx.eval([p.arrays() for layer in self.layers for p in layer.values() if isinstance(p, Projection)])
        uncompiled = os.environ.get(ENV_SWITCH) == "uncompiled"
        self._compiled = None if uncompiled else _compiled(self, "_forward")
        self._compiled_batch = None if uncompiled else _compiled(self, "_batch_forward")

    def takes(self, rows: int) -> bool:
        """Whether the kernels decode `rows` sequences at once."""
        return rows == 1 or (self.batches and rows <= MAX_BATCH)

    def __call__(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        # The kernels write position p to slot p: a cache that drops positions goes the plain way.
        if (cache[0].keys is None or tokens.shape[1] != 1 or not self.takes(tokens.shape[0]) or rotates(cache)
                or not self.takes_storage(cache[0])):
            return self.fallback(tokens, cache)
        for layer in cache:
            layer.make_room(1)
        return self._written(self._launch(tokens, cache), cache, 1)

    def check_drafts(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        """tokens [rows, n] after what each row of the cache holds -> logits [rows, n, vocab], as the
        model's forward pass gives them (Transformer.check_drafts). The n positions of a row are n
        sequences of the batch kernel that share the row's cache, so up to MAX_BATCH of them in all.
        Not over a quantized cache: there step 2 writes each new slot while the others' attention
        would read it."""
        rows, n = tokens.shape
        if n == 1:
            return self(tokens, cache)[:, None]
        if (cache[0].keys is None or not self.batches or rows * n > MAX_BATCH or rotates(cache)
                or cache[0].stores_quantized(n)):
            return self.fallback.check_drafts(tokens, cache)
        for layer in cache:
            layer.make_room(n)
        return self._written(self._launch(tokens, cache), cache, n).reshape(rows, n, -1)

    def _written(self, logits: mx.array, cache: list[KVCache] | list[BatchKVCache], new: int) -> mx.array:
        """The launch's logits, queued, with the cache advanced past the `new` positions it wrote."""
        # The kernels write the cache in place, which MLX's graph does not see: they run only once
        # their output is evaluated. Queued now, so that a caller who has no use for the logits (a
        # prompt's rest fed a token a step, the last id of a reply) still finds its cache written.
        mx.async_eval(logits)
        for layer in cache:
            layer.advance(new)
        return logits

    def takes_storage(self, layer: KVCache | BatchKVCache) -> bool:
        """Whether the kernels read and write a cache stored as `layer` (every layer alike) stores
        this step's slot: plainly, or quantized as they read it (kernels.takes_quantized_cache).
        Not at the step where a cache starts quantizing (--quantized-kv-start): the plain step
        quantizes what it held."""
        if layer.stores_quantized(1) != layer.quantized:
            return False
        return not layer.quantized or kernels.takes_quantized_cache(self.config, layer.quantization)

    def _launch(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        """Logits [rows * n, vocab] of tokens [rows, n], the n consecutive new tokens of each row."""
        rows, n = tokens.shape
        offsets = cache[0].lengths if isinstance(cache[0], BatchKVCache) else [cache[0].offset] * rows
        if max(offsets) + n > self.positions.size:
            self.positions = _on_device(mx.arange(2 * (max(offsets) + n), dtype=mx.int32))
        # Each layer's keys then values: one array each, or a quantized cache's three each.
        buffers = [a for layer in cache for buffer in (layer.keys, layer.values) for a in kv_arrays(buffer)]
        if rows * n == 1:
            position = self.positions[offsets[0] : offsets[0] + 1]  # a view: no host data for the kernels to read
            return (self._compiled or self._forward)(tokens, position, *buffers)
        # Gathers from the device's positions and rows: the kernels read them once a layer, host data
        # every time across the bus.
        if n == 1:
            positions, cache_rows = self.positions[mx.array(offsets, mx.int32)], self.cache_rows[:rows]
        else:
            positions = self.positions[mx.array([o + j for o in offsets for j in range(n)], mx.int32)]
            cache_rows = self.cache_rows[mx.array([r for r in range(rows) for _ in range(n)], mx.int32)]
        tiles = -(-rows * n // SEQ_TILE)
        if tiles not in self._batch_scratch:  # made here, not while mx.compile traces _batch_forward
            size = kernels.batch_scratch_floats(self.config, tiles, self._batch_max_runs(tiles))
            self._batch_scratch[tiles] = _on_device(mx.zeros((size,), mx.float32))
        return (self._compiled_batch or self._batch_forward)(tokens.reshape(-1, 1), positions, cache_rows, *buffers)

    def _forward(self, tokens: mx.array, position: mx.array, *buffers: mx.array) -> mx.array:
        # As in the plain step (models/transformer.py): a float32 residual stream, sublayers' values in the compute type.
        x = self.embed(tokens).astype(mx.float32).reshape(-1)
        for layer, arrays in zip(self.layers, self._cache_arrays(buffers)):
            x = self._layer(x, layer, position, arrays)
        return self._head(x).reshape(1, -1)

    def _cache_arrays(self, buffers: tuple[mx.array, ...]) -> list[dict[str, mx.array]]:
        """Each layer's cache arrays by the kernels' names (kernels.CACHE), from _launch's flat list;
        a plain cache has no scales or biases, and the kernels read none (eps stands in their place)."""
        per_layer = len(buffers) // len(self.layers)
        layers = []
        for i in range(0, len(buffers), per_layer):
            arrays = buffers[i : i + per_layer]
            if per_layer == 2:
                arrays = (arrays[0], arrays[1]) + (self.eps,) * 4
            else:  # keys, key scales, key biases, values, value scales, value biases
                arrays = (arrays[0], arrays[3], arrays[1], arrays[2], arrays[4], arrays[5])
            layers.append(dict(zip(kernels.CACHE, arrays)))
        return layers

    def _layer(self, x: mx.array, layer: dict, position: mx.array, cache: dict[str, mx.array]) -> mx.array:
        """The layer's output for input x (float32); the new key and value go into the cache's buffers in place.

        In place, because the alternative, mx.slice_update, copied the whole buffer every step (MLX
        cannot reuse a buffer that the cache still holds). It is safe because nothing reads a slot
        before this step writes it: the kernel's attention reads the cache only after a grid-wide
        barrier that follows the write, and earlier steps read only earlier slots.
        The layers' launches share `self.sync` (the barrier's count) and `self.scratch` (what the
        kernel's steps hand on) and never overlap: each takes the previous one's output.
        """
        template = self._layer_template(layer, cache)
        runs = kernels.max_runs(self.blocks, self.config, kv_group=dict(template)["KV_GROUP"])
        template += [("FFN_ROWS", kernels.FFN_ROWS), ("MAX_RUNS", runs), ("STAGED_KEYS", self.staged_keys)]
        inputs = self._layer_inputs(layer, x=x, position=position, scratch=self.scratch, **cache)
        return self._launch_layer("layer_kernel", kernels.LAYER_PARAMETERS, template, inputs,
                                  kernels.layer_shared_floats(self.config, self.staged_keys), batch=False)

    def _batch_forward(self, tokens: mx.array, positions: mx.array, cache_rows: mx.array,
                       *buffers: mx.array) -> mx.array:
        x = self.embed(tokens).astype(mx.float32).reshape(tokens.shape[0], -1)
        for layer, arrays in zip(self.layers, self._cache_arrays(buffers)):
            x = self._batch_layer(x, layer, positions, cache_rows, arrays)
        # The head as the plain step computes it (Transformer.head): for several rows MLX's own
        # quantized product reads the head's weights once for all of them.
        return self.head_linear(self.head_norm(x)).astype(mx.float32)

    def _batch_layer(self, x: mx.array, layer: dict, positions: mx.array, cache_rows: mx.array,
                     cache: dict[str, mx.array]) -> mx.array:
        """_layer for x [sequences, hidden], through batch_layer_kernel with enough 8-sequence tiles
        for them, sequence s at positions[s] in row cache_rows[s] of the cache."""
        tiles = -(-x.shape[0] // SEQ_TILE)
        template = [("NT", tiles)] + self._layer_template(layer, cache) + [("MAX_RUNS", self._batch_max_runs(tiles)),
                                                                           ("STAGED_KEYS", self.batch_staged_keys)]
        inputs = self._layer_inputs(layer, x=x, position=positions, cache_rows=cache_rows,
                                    scratch=self._batch_scratch[tiles], **cache)
        return self._launch_layer("batch_layer_kernel", kernels.BATCH_LAYER_PARAMETERS, template, inputs,
                                  kernels.batch_shared_floats(self.config, tiles, self.batch_staged_keys), batch=True)

    def _launch_layer(self, function: str, parameters: tuple[str, ...], template: list[tuple[str, object]],
                      inputs: dict[str, mx.array], shared_floats: int, batch: bool) -> mx.array:
        kernel = kernels.kernel(function, parameters, tuple(n for n, _ in template), shared_floats,
                                "batch" if batch else "step")
        x = inputs["x"]
        return kernel(inputs=[inputs[n] for n in kernels.inputs_of(parameters)], template=template,
                      grid=(LAYER_THREADS * self.blocks, 1, 1), threadgroup=(LAYER_THREADS, 1, 1),
                      output_shapes=[x.shape], output_dtypes=[mx.float32])[0]

    def _layer_template(self, layer: dict, cache: dict[str, mx.array]) -> list[tuple[str, object]]:
        """The template arguments both layer kernels take (kernels.LAYER_TEMPLATE), by name; a
        quantized cache's bits and group size are those its arrays' shapes say."""
        c = self.config
        q, k, v, o, gate, up, down = (layer[n] for n in ("q", "k", "v", "o", "gate", "up", "down"))
        values = dict(BIAS=q.bias is not None, HEADS=c.n_heads, KV_HEADS=c.n_kv_heads, HEAD_DIM=c.head_dim,
                      ROPE_DIM=c.rope_dim, TRADITIONAL=c.rope_traditional, HIDDEN=q.cols, FFN=gate.rows,
                      KEY_BITS=0, VALUE_BITS=0, KV_GROUP=0)
        if _quantized(cache):
            values.update(KEY_BITS=cache["keys"].shape[-1] * 32 // c.head_dim,
                          VALUE_BITS=cache["values"].shape[-1] * 32 // c.head_dim,
                          KV_GROUP=c.head_dim // cache["key_scales"].shape[-1])
        for name, p in (("Q", q), ("K", k), ("V", v), ("O", o), ("GATE", gate), ("UP", up), ("DOWN", down)):
            values[f"{name}_BITS"], values[f"{name}_BIASES"] = p.bits, p.stored_biases
        return [(name, values[name]) for name in kernels.LAYER_TEMPLATE]

    def _layer_inputs(self, layer: dict, **given: mx.array) -> dict[str, mx.array]:
        """Every input of the layer kernels by name: the layer's weights and the step's constants,
        with `given` (x, position, scratch and the cache's arrays)."""
        inputs = dict(attn_norm=layer["attn_norm"], eps=self.eps, inv_freq=self.inv_freq,
                      attn_factor=self.attn_factor, ffn_norm=layer["ffn_norm"], sync=self.sync, **given)
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            p = layer[name]
            inputs[f"w_{name}"], inputs[f"s_{name}"], inputs[f"b_{name}"] = p.arrays()
        for name in ("q", "k", "v"):
            # Without biases the kernel reads none; it still needs an array in that place.
            inputs[f"bias_{name}"] = layer[name].bias if layer[name].bias is not None else self.eps
        return inputs

    def _batch_max_runs(self, tiles: int) -> int:
        """batch_layer_kernel's MAX_RUNS for `tiles` * 8 sequences, which its scratch input is sized by."""
        return kernels.max_runs(self.blocks, self.config, tiles * SEQ_TILE)

    def _head(self, x: mx.array) -> mx.array:
        """Logits (float32) of the last layer's output x."""
        p = self.head
        if isinstance(p, BlockLinear):
            return p.product.head(x, self.output_norm, self.eps, p.weight)
        rows_per_warp = 2 if p.rows >= 16384 else 1
        template = [("BITS", p.bits), ("STORED_BIASES", p.stored_biases), ("K", p.cols), ("R", rows_per_warp)]
        kernel = kernels.kernel("head_kernel", kernels.HEAD_PARAMETERS, kernels.HEAD_TEMPLATE,
                                kernels.staged_floats(p.cols))
        warps = kernels.HEAD_THREADS // 32
        return kernel(inputs=[x, self.output_norm, self.eps, *p.arrays()], template=template + [("ROWS", p.rows)],
                      grid=(32 * _round_up(-(-p.rows // rows_per_warp), warps), 1, 1),
                      threadgroup=(kernels.HEAD_THREADS, 1, 1), output_shapes=[(p.rows,)],
                      output_dtypes=[mx.float32])[0]


def _compiled(step: KernelStep, method: str):
    """mx.compile of a method of the step (_forward or _batch_forward), which then costs one call
    from Python instead of building the step's graph (about 25 operations) every token; it holds
    the step weakly, as the model's PlainStep holds its model."""
    step_ref = weakref.ref(step)
    return mx.compile(lambda *args: getattr(step_ref(), method)(*args))


def device_limits() -> tuple[int, int] | None:
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


def _quantized(cache: dict[str, mx.array]) -> bool:
    """Whether a layer's cache arrays (by the kernels' names) are a quantized cache's packed words."""
    return cache["keys"].dtype == mx.uint32
