"""Projections that read the same input, fused into one matmul: Q/K/V, and gate/up.

A decode step on a GPU is bound by the number of kernels it launches, not by the bytes it reads
(docs/benchmarks.md), so one product over the stacked rows beats two or three. Layers fuse only
when their weights share one form: all float, or all of one affine bit width, with or without
stored biases alike. A Q4_K_M layer whose attn_v is Q6_K stacks Q and K only (`attn_qk`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .models.transformer import Block

# In order of preference: attn_qk is tried where attn_qkv's three differ in form.
FUSED = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "attn_qk": ("attn_q", "attn_k"),
         "ffn_gate_up": ("ffn_gate", "ffn_up")}


def fuse_block(block: Block) -> None:
    """Give the block `attn_qkv` and `ffn_gate_up` in place of the layers they stack, where it can."""
    for fused, parts in FUSED.items():
        if fused in block or any(p not in block for p in parts):  # stored fused (Phi-3), stacked, or a mixture's
            continue
        layer = stacked([block[p] for p in parts])
        if layer is not None:
            for p in parts:
                del block[p]
            block[fused] = layer
    mx.eval(block.parameters())  # so the unfused weights are freed now


def stacked(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing the layers' outputs concatenated, or None if their weights differ in form.

    Float layers stack here; a quantized layer type stacks its own kind (NativeLinear.stack).
    """
    bias = [layer["bias"] for layer in layers if "bias" in layer]
    if len(bias) not in (0, len(layers)) or len({type(layer) for layer in layers}) != 1:
        return None
    kind = type(layers[0])
    if kind is nn.Linear:
        weight = mx.concatenate([layer.weight for layer in layers])
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=bool(bias))
        out.weight = weight
    elif hasattr(kind, "stack"):
        out = kind.stack(layers)
    else:
        return None
    if out is not None and bias:
        out.bias = mx.concatenate(bias)
    return out
