"""The pre-norm decoder with a gated FFN that the supported architectures share (Llama 1/2/3,
Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), and its decode step.

Module and parameter names mirror GGUF tensor names (`blk.0.attn_q.weight`), so the loader's
weights load by name and a tensor can be followed from the file to the layer that uses it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from functools import cache, partial
from typing import TYPE_CHECKING, Iterator, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cache import (BatchKVCache, Buffer, KVCache, KVQuantization, causal_mask, make_batch_cache, make_cache,
                     visible)
from .config import ModelConfig

if TYPE_CHECKING:
    from ..sharding import Shard


class RMSNorm(nn.RMSNorm):
    """RMSNorm whose output is in the compute type.

    A float32 weight or input would otherwise promote what follows to float32: on a GPU every
    product would run as float32 instead of float16 on tensor cores (pp512 on an H100:
    docs/benchmarks.md). The loader gives the weight in the compute type, and a block's norms read
    the residual stream as the residual add already cast it (residual_add), so a norm is one kernel
    where an input in another type would take a cast more. The stream itself stays float32, as
    llama.cpp keeps it.
    """

    def __init__(self, dims: int, eps: float, compute_dtype: mx.Dtype):
        super().__init__(dims, eps=eps)
        self.compute_dtype = compute_dtype

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self["weight"], self.eps).astype(self.compute_dtype)


# Element-wise steps of a layer as one kernel each: uncompiled, MLX would launch the cast of y, and
# the activation apart from its product, as kernels of their own, and a decode step on a GPU is
# bound by the number of its launches (docs/benchmarks.md).
@partial(mx.compile, shapeless=True)
def residual_add(x: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
    """y added to the residual stream x, in x's type (float32, as llama.cpp keeps it), and the sum
    in y's (the compute type), which the next norm reads: the cast rides in this kernel."""
    h = x + y.astype(x.dtype)
    return h, h.astype(y.dtype)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """Gemma's gated FFN: GELU by its tanh approximation."""
    return nn.gelu_approx(gate) * up


def batch_and_length(x: mx.array) -> tuple[int, int]:
    """The sequences and positions a layer's input [batch, length, hidden] holds; a decode step's
    [batch, hidden] holds one position each (Transformer.hidden_states)."""
    return (x.shape[0], 1) if x.ndim == 2 else x.shape[:2]


def as_heads(x: mx.array, batch: int, length: int, heads: int, head_dim: int) -> mx.array:
    """x [batch, length, heads × head_dim] (or [batch, length, heads, head_dim], or for one position
    [batch, heads × head_dim]) as [batch, heads, length, head_dim]. One position's heads are already
    in that order, so a decode step reshapes them without a transpose: one node fewer in its graph,
    and each node costs the host time."""
    if length == 1:
        return x.reshape(batch, heads, 1, head_dim)
    return x.reshape(batch, length, heads, head_dim).transpose(0, 2, 1, 3)


def from_heads(x: mx.array, like: mx.array) -> mx.array:
    """Attention's output [batch, heads, length, head_dim] laid out as the layer's input `like` is,
    heads × head_dim last. Transposed first even for one position: MLX's attention may lay its
    output out in another order (its cuDNN path follows the queries' strides), and then only the
    transposed array reshapes without a copy."""
    return x.transpose(0, 2, 1, 3).reshape(*like.shape[:-1], -1)


class Block(nn.Module):
    """One layer. Its calls reach their modules by item (self["attn_norm"]), not as attributes: a
    module's children are attributes only by way of nn.Module.__getattr__, ten times as slow, and a
    decode step's graph is built a few hundred such calls at a time while the host's time bounds it."""

    def __init__(self, config: ModelConfig, compute_dtype: mx.Dtype, index: int = 0, group=None):
        super().__init__()
        self.config = config
        # Tensor parallel: this rank holds a share of the heads and FFN width (sharding.py), and
        # the attention's and FFN's partial outputs are summed over `group` before they are added.
        self._group = group
        hidden, head_dim = config.hidden_size, config.head_dim
        # Underscored: constants derived from the config, not weights to load.
        self._window = config.window(index)
        self.attn_norm = RMSNorm(hidden, config.rms_eps, compute_dtype)
        q_dim, kv_dim = config.n_heads * head_dim, config.n_kv_heads * head_dim
        # A file that fuses Q/K/V or gate/up (Phi-3) loads into the fused layer; fusion.py stacks
        # the separate ones of other files where their weights share one form.
        if config.fused_qkv:
            self.attn_qkv = nn.Linear(hidden, q_dim + 2 * kv_dim, bias=config.attn_bias)
        else:
            self.attn_q = nn.Linear(hidden, q_dim, bias=config.attn_bias)
            self.attn_k = nn.Linear(hidden, kv_dim, bias=config.attn_bias)
            self.attn_v = nn.Linear(hidden, kv_dim, bias=config.attn_bias)
        self.attn_output = nn.Linear(config.n_heads * head_dim, hidden, bias=False)
        self.ffn_norm = RMSNorm(hidden, config.rms_eps, compute_dtype)
        if config.n_experts:
            # The router, then each expert's gate, up and down, stacked: [experts, out, in].
            self.ffn_gate_inp = nn.Linear(hidden, config.n_experts, bias=False)
            self.ffn_gate_exps = Experts(config.n_experts, hidden, config.expert_ffn_size)
            self.ffn_up_exps = Experts(config.n_experts, hidden, config.expert_ffn_size)
            self.ffn_down_exps = Experts(config.n_experts, config.expert_ffn_size, hidden)
        elif config.fused_gate_up:
            self.ffn_gate_up = nn.Linear(hidden, 2 * config.ffn_size, bias=False)
        else:
            self.ffn_gate = nn.Linear(hidden, config.ffn_size, bias=False)
            self.ffn_up = nn.Linear(hidden, config.ffn_size, bias=False)
        self.ffn_down = nn.Linear(config.ffn_size, hidden, bias=False)
        if config.qk_norm:
            self.attn_q_norm = RMSNorm(head_dim, config.rms_eps, compute_dtype)
            self.attn_k_norm = RMSNorm(head_dim, config.rms_eps, compute_dtype)
        if config.post_norms:
            self.post_attention_norm = RMSNorm(hidden, config.rms_eps, compute_dtype)
            self.post_ffw_norm = RMSNorm(hidden, config.rms_eps, compute_dtype)
        # A sliding layer's RoPE: its own base, no position scaling and no per-pair factors. (Plain
        # numbers: a dict here would be taken for a child module.)
        local = self._window > 0
        self._rope_freqs = None if local else rope_freqs(config)
        self._rope_base = config.rope_base_local if local else config.rope_base
        self._rope_scale = 1.0 if local else config.rope_scale
        self._rope_attn_scale = rope_attn_scale(config)
        self._attention_scale = config.attention_scale or head_dim**-0.5
        self._gated = geglu if config.ffn_activation == "gelu" else swiglu
        # How a prefill attends (Transformer.attend_prefill; runtime.load chooses), and the shapes
        # it has met, for EXPLICIT_FIRST.
        self._prefill_attention = FUSED
        self._prefill_shapes = ShapesMet()
        # `trace --attention`: a list that each pass's attention weights are appended to, computed
        # by an explicit softmax (the fused kernel does not expose them); None: the fused kernel.
        self._attention_probe: list | None = None

    @property
    def window(self) -> int:
        """The attention window of this layer (0: every earlier position)."""
        return self._window

    def queries_keys_values(self, x: mx.array) -> tuple[mx.array, mx.array | None, mx.array]:
        """Queries, keys [batch, heads, length, head_dim] (normed where the model norms them, not yet
        turned by RoPE) and values. Where the queries and keys come out of one product and need no
        norms of their own, they stay together, as one array of n_heads + n_kv_heads heads with keys
        None, so that RoPE turns them in one kernel: a decode step on a GPU is bound by its launches."""
        c = self.config
        batch, length = batch_and_length(x)
        qk_dim = (c.n_heads + c.n_kv_heads) * c.head_dim
        if "attn_qkv" in self:
            qk, v = mx.split(self["attn_qkv"](x), [qk_dim], axis=-1)
        elif "attn_qk" in self:
            qk, v = self["attn_qk"](x), self["attn_v"](x)
        else:
            qk, v = None, self["attn_v"](x)
        v = as_heads(v, batch, length, c.n_kv_heads, c.head_dim)
        if qk is not None and "attn_q_norm" not in self:
            return as_heads(qk, batch, length, c.n_heads + c.n_kv_heads, c.head_dim), None, v
        if qk is not None:
            q, k = mx.split(qk, [c.n_heads * c.head_dim], axis=-1)
        else:
            q, k = self["attn_q"](x), self["attn_k"](x)
        q = q.reshape(batch, length, c.n_heads, c.head_dim)
        k = k.reshape(batch, length, c.n_kv_heads, c.head_dim)
        if "attn_q_norm" in self:
            q, k = self["attn_q_norm"](q), self["attn_k_norm"](k)
        q, k = as_heads(q, batch, length, c.n_heads, c.head_dim), as_heads(k, batch, length, c.n_kv_heads, c.head_dim)
        return q, k, v

    def attention(self, x: mx.array, mask, cache: KVCache | BatchKVCache | None) -> mx.array:
        c = self.config
        length = batch_and_length(x)[1]
        q, k, v = self.queries_keys_values(x)
        # A BatchKVCache's offset is an array: one position per row.
        position = cache.offset if cache is not None else 0
        if k is None:  # q holds the queries' heads, then the keys': one RoPE kernel turns both
            qk = self.rope(q, position)
            q, k = mx.split(qk, [c.n_heads], axis=1)
        else:
            q, k = self.rope(q, position), self.rope(k, position)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if isinstance(k, tuple) and (self._attention_probe is not None
                                     or not quantized_products_run(q.shape[-1], cache.quantization)):
            # Stored quantized where no quantized product takes them (or the probe needs the weights):
            # the values decoded, then attended as a plain cache's are (the cache stays small; the
            # step reads more). An explicit product here would hold every score of a long prefill
            # at depth in float32.
            k, v = cache.quantization.decode(k, v)
        if self._attention_probe is not None:
            weights = attention_weights(q, k, self._attention_scale, mask)
            self._attention_probe.append(weights)
            out = weights_times_values(weights, v)
        elif isinstance(k, tuple):  # stored quantized, which the fused kernel does not read: quantized products do
            out = explicit_attention(q, k, v, self._attention_scale, mask, cache.quantization)
        elif 1 < length and self._prefill_attention != FUSED and self.attends_explicitly(q, k, mask):
            out = explicit_attention(q, k, v, self._attention_scale, mask)
        else:  # the fused kernel handles grouped-query attention (fewer KV heads) itself
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self._attention_scale, mask=mask)
        return self["attn_output"](from_heads(out, x))

    def attends_explicitly(self, q: mx.array, k: mx.array, mask) -> bool:
        """Whether a prefill attends by explicit products: within EXPLICIT_PREFILL_MAX_KEYS and
        EXPLICIT_PREFILL_MAX_SCORES, always (EXPLICIT), or (EXPLICIT_FIRST) the first time its shape
        is met and always where it has fewer than FUSED_WHEN_MET_AGAIN_MIN_LENGTH new tokens."""
        batch, heads, length = q.shape[:3]
        keys = k.shape[2]
        if keys > EXPLICIT_PREFILL_MAX_KEYS or batch * heads * length * keys > EXPLICIT_PREFILL_MAX_SCORES:
            return False
        return (self._prefill_attention == EXPLICIT or length < FUSED_WHEN_MET_AGAIN_MIN_LENGTH
                or self._prefill_shapes.first_met((batch, length, keys, isinstance(mask, str))))

    def rope(self, x: mx.array, position) -> mx.array:
        """Heads [batch, heads, length, head_dim] turned for their positions (from `position` on)."""
        c = self.config
        base = self._rope_base if self._rope_freqs is None else None  # MLX takes one or the other
        x = mx.fast.rope(x, c.rope_dim, traditional=c.rope_traditional, base=base, scale=self._rope_scale,
                         offset=position, freqs=self._rope_freqs)
        return x * self._rope_attn_scale.astype(x.dtype) if self._rope_attn_scale is not None else x

    def __call__(self, x: mx.array, mask, cache: KVCache | BatchKVCache | None,
                 x_compute: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """The residual stream x (float32) after this block, and the same in the compute type, which
        is what the next block's norm reads; `x_compute`: x so, where the block before gave it."""
        h, h_compute = residual_add(x, self.attention_residual(x if x_compute is None else x_compute, mask, cache))
        return residual_add(h, self.mlp_residual(h_compute))

    def attention_residual(self, x: mx.array, mask, cache: KVCache | BatchKVCache | None) -> mx.array:
        """What attention adds to the residual stream x."""
        out = self.sum_shards(self.attention(self["attn_norm"](x), mask, cache))
        return self["post_attention_norm"](out) if "post_attention_norm" in self else out

    def mlp_residual(self, h: mx.array) -> mx.array:
        """What the FFN adds to the residual stream h."""
        out = self.sum_shards(self.mlp(self["ffn_norm"](h)))
        return self["post_ffw_norm"](out) if "post_ffw_norm" in self else out

    def sum_shards(self, out: mx.array) -> mx.array:
        """The whole projection's output from this rank's partial one (tensor parallel), else `out`."""
        return out if self._group is None else mx.distributed.all_sum(out, group=self._group)

    def mlp(self, x: mx.array) -> mx.array:
        if "ffn_gate_inp" in self:
            return self.mixture(x)
        if "ffn_gate_up" in self:
            gate, up = mx.split(self["ffn_gate_up"](x), 2, axis=-1)
        else:
            gate, up = self["ffn_gate"](x), self["ffn_up"](x)
        return self["ffn_down"](self._gated(gate, up))


    def mixture(self, x: mx.array) -> mx.array:
        """The mixture-of-experts FFN, as llama.cpp computes it: softmax over the router's logits
        (float32), the top n_experts_used, their weights renormalized; the sum of those experts'
        SwiGLU outputs, each times its weight."""
        probs = mx.softmax(self["ffn_gate_inp"](x).astype(mx.float32), axis=-1)
        k = self.config.n_experts_used
        chosen = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]  # [..., k], in no order
        weights = mx.take_along_axis(probs, chosen, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        out = expert_outputs(self["ffn_gate_exps"], self["ffn_up_exps"], self["ffn_down_exps"], self._gated, x, chosen)
        return (out.astype(mx.float32) * weights[..., None]).sum(axis=-2).astype(x.dtype)


# From this many (token, expert) pairs on, Metal sorts them by expert before the gathered products,
# so that MLX runs each expert's rows as one product, as mlx-lm does there (untested here: no Mac).
# benchmarks/moe_prefill.py found no gain on the CPU (0.96-1.04x) nor on CUDA (0.84-0.98x, an
# H100, MLX 0.32.4, Qwen3-30B-A3B's shape), so those keep the pairs in token order
# (docs/benchmarks.md, "Mixture-of-experts prefill").
SORT_EXPERTS_MIN_PAIRS = 64


def expert_outputs(gate, up, down, gated, x: mx.array, chosen: mx.array,
                   sort: bool | None = None) -> mx.array:
    """The chosen experts' gated FFNs of each row: x [..., hidden], chosen [..., k] -> [..., k, hidden].
    `sort` (default: by SORT_EXPERTS_MIN_PAIRS on Metal) runs the pairs in expert order."""
    if sort is None:
        sort = chosen.size >= SORT_EXPERTS_MIN_PAIRS and mx.default_device() == mx.gpu and mx.metal.is_available()
    if not sort:
        x = x[..., None, None, :]  # [..., 1, 1, hidden]: one row, for each of the k experts
        h = gated(gate(x, chosen), up(x, chosen))  # [..., k, 1, width]
        return down(h, chosen)[..., 0, :]
    k = chosen.shape[-1]
    flat = chosen.reshape(-1)
    order = mx.argsort(flat)
    experts = flat[order]
    rows = x.reshape(-1, x.shape[-1])[order // k][:, None, :]  # [pairs, 1, hidden], in expert order
    h = gated(gate(rows, experts, sorted_indices=True), up(rows, experts, sorted_indices=True))
    out = down(h, experts, sorted_indices=True)[:, 0, :]
    return out[mx.argsort(order)].reshape(*chosen.shape, -1)


class Experts(nn.Module):
    """A mixture's experts' projections, stacked: weight [experts, out, in]. Each row of x is
    multiplied by the experts `chosen` for it only (MLX's gathered matmul), never by all of them.
    In native mode quantized_layers.NativeExperts takes its place, its weights kept quantized."""

    def __init__(self, experts: int, inputs: int, outputs: int):
        super().__init__()
        self.weight = mx.zeros((experts, outputs, inputs))

    def __call__(self, x: mx.array, chosen: mx.array, sorted_indices: bool = False) -> mx.array:
        """x [..., k or 1, 1, in] and chosen [..., k] -> [..., k, 1, out]; `sorted_indices`: chosen is
        in expert order (and x one row a pair), which MLX runs as a product an expert."""
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=chosen, sorted_indices=sorted_indices)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, compute_dtype: mx.Dtype = mx.float32, shard: Shard | None = None):
        super().__init__()
        self.config = config
        self.compute_dtype = compute_dtype
        # Under mlx.launch, the part of the model this rank holds (sharding.py): in a pipeline,
        # `blk` holds its stage's blocks only; split by tensor, every block's share.
        self.shard = shard
        self.token_embd = nn.Embedding(config.vocab_size, config.hidden_size)
        layers = shard.layers if shard else range(config.n_layers)
        block_config = shard.block_config(config) if shard else config
        group = shard.group if shard and shard.mode == "tensor" else None
        self.blk = [Block(block_config, compute_dtype, i, group) for i in layers]
        # How the caches made for this model store keys and values (store_kv_quantized).
        self.kv_quantization: KVQuantization | None = None
        # Whether the loader put Q6_K's affine form on its wide grids (weights.load_model's `wide`).
        self.wide_q6_k = False
        self.output_norm = RMSNorm(config.hidden_size, config.rms_eps, compute_dtype)
        if not config.tied_output:
            self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # What serves `step`: the plain MLX step below, unless runtime.load chose a backend's own
        # (mlxllama.cuda's kernels), which hands what it does not take back to this one.
        self.decode_step: DecodeStep = PlainStep(self)

    @property
    def compute_dtype_name(self) -> str:
        """compute_dtype as --dtype spells it ("bfloat16"), for reports and saved prompt caches."""
        return str(self.compute_dtype).removeprefix("mlx.core.")

    @property
    def sampling_group(self):
        """The ranks this model is split over (all of them sample rank 0's tokens), or None."""
        return self.shard.group if self.shard else None

    def attend_prefill(self, how: str) -> None:
        """How a prefill (more than one new token) attends: FUSED, by MLX's fused kernel, as on
        every backend but CUDA; EXPLICIT, by matrix products and a softmax; EXPLICIT_FIRST, CUDA's
        (runtime.load), by products the first time a shape of (rows, new tokens, cached tokens) is
        met and by the fused kernel when it is met again (with FUSED_WHEN_MET_AGAIN_MIN_LENGTH new
        tokens or more). MLX's CUDA build plans the fused kernel anew for every such shape (40-150
        ms a shape on an H100, 52-130 on an H200, and 0.6-1.2 s for the first in a process), which
        one-off prompts and nearly every request a server sees would pay, while the products cost
        2 ms more a 512-token chunk and 15 ms more a 2,048-token one once compiled
        (docs/benchmarks.md, "Prefill in chunks of 2,048"). A shape that recurs (a benchmark's, a
        long prompt's full chunks, equal prompts of a batch) pays its plan once and then prefills
        at the fused kernel's speed."""
        if how not in (FUSED, EXPLICIT, EXPLICIT_FIRST):
            raise ValueError(f"prefill attention {how!r}: {FUSED!r}, {EXPLICIT!r} or {EXPLICIT_FIRST!r}")
        for block in self.blk:
            block._prefill_attention = how

    @property
    def prefill_attention(self) -> str:
        return self.blk[0]._prefill_attention

    @contextmanager
    def attending_prefill(self, how: str) -> Iterator[None]:
        """attend_prefill(how) inside the block, the model's own choice again after it (benchmarks
        and tests that time or compare one way of attending)."""
        chosen = self.prefill_attention
        self.attend_prefill(how)
        try:
            yield
        finally:
            self.attend_prefill(chosen)

    def store_kv_quantized(self, quantization: KVQuantization | None) -> None:
        """Make every cache made from now on store keys and values so (None: at full precision)."""
        self.kv_quantization = quantization and quantization.for_heads(self.config.head_dim)

    def make_cache(self, bounded: bool = True, max_kv_size: int = 0, keep: int = 0) -> list[KVCache]:
        """A fresh cache for one sequence, one entry a layer; a sliding layer's keeps only its window
        unless `bounded` is False, and with a `max_kv_size` the others keep their first `keep`
        positions and the rest of max_kv_size last ones (cache.make_cache)."""
        return make_cache([block.window for block in self.blk], bounded, max_kv_size, keep, self.kv_quantization)

    def make_batch_cache(self, max_kv_size: int = 0, keep: int = 0, spare: int = 0) -> list[BatchKVCache]:
        """A fresh cache for rows of different lengths (batching.py), one entry a layer; with a
        `max_kv_size`, rings keeping each row's first `keep` and last positions (cache.RingKVCache),
        and `spare` slots more for speculative decoding's drafts."""
        return make_batch_cache([block.window for block in self.blk], self.kv_quantization, max_kv_size, keep, spare)

    def __call__(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache] | None = None) -> mx.array:
        """tokens [batch, length] -> logits [batch, length, vocab] (float32).

        With a BatchKVCache every row continues from its own length (its own positions and mask).
        """
        return self.head(self.hidden_states(tokens, cache))

    def hidden_states(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache] | None = None) -> mx.array:
        """The last layer's output [batch, length, hidden], for callers that need logits of a few rows only.

        A decode step's (one position a sequence) goes through the layers as rows [batch, hidden]:
        each projection then takes them as they are, where [batch, 1, hidden] would be reshaped to
        rows and back around every product (as one product of `batch` rows is the fast one), two
        graph nodes a product that cost the host time."""
        batch, length = tokens.shape
        h = self.embed(tokens)
        if length == 1:
            h = h.reshape(batch, -1)
        masks = self.masks(length, cache)

        def own_blocks(h: mx.array) -> mx.array:
            h_compute = None
            for i, block in enumerate(self.blk):
                h, h_compute = block(h, masks[block.window], cache[i] if cache else None, h_compute)
            return h

        stage = self.shard if self.shard and self.shard.mode == "pipeline" else None
        h = pipeline(h, stage, own_blocks) if stage else own_blocks(h)
        return h.reshape(batch, 1, -1) if length == 1 else h

    def embed(self, tokens: mx.array) -> mx.array:
        """tokens [batch, length] -> the residual stream's start [batch, length, hidden] (float32)."""
        h = self.token_embd(tokens).astype(mx.float32)
        return h * self.config.embedding_scale if self.config.embedding_scale != 1.0 else h

    def masks(self, length: int, cache=None) -> dict[int, object]:
        """The attention mask of `length` new tokens for each window the layers use (0: none),
        from the cache of the first layer with that window."""
        masks = {}
        for i, block in enumerate(self.blk):
            if block.window not in masks:
                masks[block.window] = cache[i].mask(length, block.window) if cache else causal_mask(
                    length, 0, block.window)
        return masks

    def step(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        """One decode step: tokens [batch, 1] after what the cache holds -> logits [batch, vocab]
        (float32), the same as `self(tokens, cache)[:, -1]`; the cache advances by one position."""
        return self.decode_step(tokens, cache)

    def check_drafts(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        """Speculative decoding's check: tokens [batch, n] (each row's last token and its drafts) after
        what the cache holds -> logits [batch, n, vocab] (float32), the same as `self(tokens, cache)`
        up to rounding, through the decode step (a backend's kernels take a few positions a row)."""
        return self.decode_step.check_drafts(tokens, cache)

    def head(self, h: mx.array) -> mx.array:
        """The last layer's hidden states -> logits (float32)."""
        h = self.output_norm(h)
        logits = (self.token_embd.as_linear(h) if self.config.tied_output else self.output(h)).astype(mx.float32)
        cap = self.config.final_logit_softcap
        return cap * mx.tanh(logits / cap) if cap else logits


def pipeline(h: mx.array, stage: Shard, own_blocks) -> mx.array:
    """The last stage's output on every rank (each computes the head, so that all of them hold the
    same logits and run the same loop), from the embedding `h` and this stage's `own_blocks`."""
    if stage.hand_over == "send":
        if not stage.first:  # a later stage starts from the one before's output
            h = mx.distributed.recv_like(h, stage.rank - 1, group=stage.group)
        h = own_blocks(h)
        if stage.rank < stage.size - 1:
            h = mx.depends(mx.zeros_like(h), mx.distributed.send(h, stage.rank + 1, group=stage.group))
        return mx.distributed.all_sum(h, group=stage.group)
    # Collectives only: each hand-over is an all-sum of the stage that ran and the others' zeros.
    # Every rank joins every hand-over, in order: each zero is computed after the hand-over before.
    for k in range(stage.size):
        mine = own_blocks(h) if k == stage.rank else mx.depends(mx.zeros_like(h), h)
        h = mx.distributed.all_sum(mine, group=stage.group)
    return h


# How a prefill attends (Transformer.attend_prefill).
FUSED, EXPLICIT, EXPLICIT_FIRST = "fused", "explicit", "explicit-first"
# Past this many keys, or scores ([batch, heads, new tokens, keys], float16: 512 MiB, a TinyLlama-shape
# chunk of 2,048 after 2,048 others), an explicit prefill would hold too much memory at once, and the
# fused kernel's one plan is cheap next to the prefill it serves.
EXPLICIT_PREFILL_MAX_KEYS = 4096
EXPLICIT_PREFILL_MAX_SCORES = 1 << 28
# EXPLICIT_FIRST attends fewer new tokens than this explicitly even in a shape met before: a chat
# turn's or a check of drafts' scores are few, so the fused kernel saves them less than a
# millisecond, and its plan would cost 70-130 ms each time a (new, cached) pair recurs, as the
# checks' pairs do from one request to the next.
FUSED_WHEN_MET_AGAIN_MIN_LENGTH = 512
# The prefill shapes a layer remembers having met (the least recently met forgotten first): as many
# as MLX's CUDA build keeps fused-kernel plans by default (MLX_CUDA_SDPA_CACHE_SIZE).
SHAPES_REMEMBERED = 256


class ShapesMet:
    """The shapes a layer has prefilled, the latest SHAPES_REMEMBERED of them."""

    def __init__(self):
        self._met: dict[tuple, None] = {}

    def first_met(self, shape: tuple) -> bool:
        """Whether `shape` is new (it is remembered from now on)."""
        if shape in self._met:
            self._met[shape] = self._met.pop(shape)  # the latest met goes last
            return False
        self._met[shape] = None
        while len(self._met) > SHAPES_REMEMBERED:
            del self._met[next(iter(self._met))]
        return True


def explicit_attention(q: mx.array, k: Buffer, v: Buffer, scale: float, mask,
                       quantization: KVQuantization | None = None) -> mx.array:
    """Softmax attention as matrix products: q [batch, heads, length, head_dim] against k and v
    [batch, kv_heads, keys, head_dim], or against keys and values stored with `quantization` (by
    MLX's quantized products, as mlx-lm attends its quantized cache, where quantized_products_run);
    `mask` as the fused kernel takes it (None, "causal", or booleans broadcasting to [batch, heads,
    length, keys]).

    Scores in q's type, the softmax computed in float32: as MLX attends where it has no fused
    kernel, and as llama.cpp's CUDA build takes its KQ product. Scores in float32 cost CUDA's
    prefill three casts a layer and twice the bytes in the mask and the softmax, where it is bound
    by its launches (docs/benchmarks.md, "CUDA's explicit prefill in the compute type")."""
    batch, heads, length, head_dim = q.shape
    kv_heads, keys = (k[0] if quantization else k).shape[1:3]
    groups = heads // kv_heads
    # Each KV head serves `groups` query heads, whose rows go into one product with it: [batch,
    # kv_heads, groups × length, head_dim]. Kept apart as a batch axis against keys broadcast along
    # it, they made MLX's CUDA build batch each product by an array of pointers, which a kernel of
    # its own writes first.
    q = (q * scale).reshape(batch, kv_heads, groups * length, head_dim)
    if quantization:
        scores = mx.quantized_matmul(q, *k, transpose=True, group_size=quantization.group_size,
                                     bits=quantization.bits_of_keys)
    else:
        scores = q @ k.swapaxes(-1, -2)
    mask = grouped_mask(mask, kv_heads, groups, length, keys)
    if mask is not None:
        scores = mx.where(mask, scores.reshape(batch, kv_heads, groups, length, keys), -mx.inf)
    weights = mx.softmax(scores.reshape(batch, kv_heads, groups * length, keys), axis=-1, precise=True)
    if quantization:
        out = mx.quantized_matmul(weights, *v, transpose=False, group_size=quantization.group_size, bits=quantization.bits)
    else:
        out = weights @ v
    return out.reshape(batch, heads, length, head_dim)


def attention_weights(q: mx.array, k: mx.array, scale: float, mask) -> mx.array:
    """softmax(q kᵀ × scale + mask) in float32, [batch, heads, length, keys]: what each query
    position's heads give each key (k may have fewer heads: grouped-query attention)."""
    batch, heads, length, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    q = q.reshape(batch, kv_heads, heads // kv_heads, length, head_dim).astype(mx.float32)
    scores = (q * scale) @ k[:, :, None].astype(mx.float32).swapaxes(-1, -2)
    mask = grouped_mask(mask, kv_heads, heads // kv_heads, length, keys)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    return mx.softmax(scores, axis=-1).reshape(batch, heads, length, keys)


def grouped_mask(mask, kv_heads: int, groups: int, length: int, keys: int):
    """The fused kernel's mask (None, "causal", or booleans broadcasting to [batch, heads, length,
    keys]) as booleans for scores grouped [batch, kv_heads, groups, length, keys], or None."""
    if isinstance(mask, str):  # "causal": the queries are the last `length` keys
        if keys <= EXPLICIT_PREFILL_MAX_KEYS:
            return causal_table()[keys - length : keys, :keys]
        return visible(keys - length + mx.arange(length)[:, None], mx.arange(keys)[None, :], 0)
    if mask is not None and mask.ndim == 4:  # [batch or 1, heads or 1, length, keys]
        return mask.reshape(mask.shape[0], -1, 1, length, keys) if mask.shape[1] == 1 else mask.reshape(
            mask.shape[0], kv_heads, groups, length, keys)
    return mask


@cache
def causal_table() -> mx.array:
    """[EXPLICIT_PREFILL_MAX_KEYS, EXPLICIT_PREFILL_MAX_KEYS] booleans, position i seeing 0 .. i: made
    once on the host (16 MiB), so that every layer's causal mask in an explicit prefill is a view of
    it. Built from positions, each layer's took four operations: a TinyLlama-shape pp512 on an H200
    launched 770 kernels so and 668 with the table (scores then in float32), and CUDA's prefill is
    bound by its launches (docs/benchmarks.md, "CUDA's explicit prefill in the compute type")."""
    return mx.array(np.tri(EXPLICIT_PREFILL_MAX_KEYS, dtype=bool))


def weights_times_values(weights: mx.array, v: mx.array) -> mx.array:
    """Attention's output from its weights [batch, heads, length, keys] and values [batch, kv_heads, keys, head_dim]."""
    batch, heads, length, keys = weights.shape
    kv_heads = v.shape[1]
    grouped = weights.reshape(batch, kv_heads, heads // kv_heads, length, keys).astype(v.dtype)
    return (grouped @ v[:, :, None]).reshape(batch, heads, length, v.shape[-1])


def quantized_products_run(head_dim: int, quantization: KVQuantization) -> bool:
    """Whether MLX's quantized products take keys and values stored so. Its CUDA build (0.32) has
    no kernel for many of attention's shapes (a single key, a head of one group: "No implementation
    for problem shape"), so there, and for heads of one group anywhere, they are dequantized first.
    So are keys stored by channel: MLX's product reads them only a block of 32 positions at a time,
    which on the CPU took 7-8 times as long (docs/benchmarks.md, "Quantized KV cache")."""
    return (quantization.group_size < head_dim and not quantization.keys_by_channel
            and not (mx.default_device() == mx.gpu and mx.cuda.is_available()))


class DecodeStep(Protocol):
    uses_kernels: bool  # a backend's own kernels (mlxllama.cuda) rather than MLX's operations

    def __call__(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array: ...

    def takes(self, rows: int) -> bool:
        """Whether this step is the fast way to decode `rows` sequences of one cache at once."""

    def check_drafts(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        """tokens [rows, n] -> logits [rows, n, vocab]; the cache advances by n positions a row."""


class PlainStep:
    """The plain MLX decode step: the forward pass over what the cache holds, for any number of rows.

    It is not compiled. A compiled step (mx.compile over the cache's fixed-size buffers, this
    project's step until November 2026) had to attend over every slot of those buffers under a
    mask, which MLX's CUDA backend runs as five kernels instead of its fused one, and copied each
    cache buffer every step; measured side by side it was slower than this forward pass on an
    H100 and no faster on the CPU (docs/benchmarks.md, "The plain step against mlx-lm").
    It holds the model weakly: a model that held a function holding the model would live until
    Python's cycle collector ran, keeping its weights in memory.
    """

    uses_kernels = False

    def __init__(self, model: Transformer):
        self.model = weakref.ref(model)

    def takes(self, rows: int) -> bool:
        return True

    def __call__(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        return self.model()(tokens, cache)[:, -1]

    def check_drafts(self, tokens: mx.array, cache: list[KVCache] | list[BatchKVCache]) -> mx.array:
        return self.model()(tokens, cache)


def rope_freqs(config: ModelConfig) -> mx.array | None:
    """MLX's `freqs` for RoPE with per-pair factors (rope_periods); None for plain RoPE, which MLX
    computes from the base itself.

    Evaluated here, in the loading thread: left lazy (it is no parameter, so loading does not
    evaluate it), it would be computed on the stream of the thread that made it, which the server's
    engine thread cannot use ("There is no Stream(cpu, 0) in current thread").
    """
    if config.rope_freq_factors is None:
        return None
    freqs = rope_periods(config)
    mx.eval(freqs)
    return freqs


def rope_periods(config: ModelConfig) -> mx.array:
    """Pair i turns by position / periods[i] (before the position scale): base ** (2i / rope_dim),
    times llama.cpp's per-pair factor i where the file has them (llama.cpp divides the angle by it)."""
    exponents = mx.arange(0, config.rope_dim, 2, dtype=mx.float32) / config.rope_dim
    periods = config.rope_base**exponents
    if config.rope_freq_factors is not None:
        periods = periods * mx.array(config.rope_freq_factors, dtype=mx.float32)
    return periods


def rope_attn_scale(config: ModelConfig) -> mx.array | None:
    """llama.cpp scales the rotated dims' cos/sin by the attention factor; the other dims stay as they are."""
    if config.rope_attn_factor == 1.0:
        return None
    rest = config.head_dim - config.rope_dim
    return mx.array([config.rope_attn_factor] * config.rope_dim + [1.0] * rest, dtype=mx.float32)
