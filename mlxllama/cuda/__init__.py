"""The CUDA backend: the decode step as one kernel a layer (README.md beside this file).

Imported only by runtime.load, when MLX runs on CUDA and the kernels are not turned off, so a
Metal or CPU user never reads a .cu file or loads the CUDA driver.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType

from ..models.transformer import DecodeStep, Transformer
from ..quantized_layers import BlockLinear, BlockProduct, NativeLinear
from ..quants import AFFINE_GROUP_SIZE
from .blocks import Q6KProduct
from .step import KernelStep, device_limits


def block_products() -> dict[GGMLQuantizationType, BlockProduct]:
    """The types whose output layer weights.py keeps in the file's blocks here, with their kernels."""
    device = device_limits()
    return {GGMLQuantizationType.Q6_K: Q6KProduct(*device)} if device else {}


def kernel_step(model: Transformer, fallback: DecodeStep) -> KernelStep | None:
    """The kernels' decode step for a model whose every projection keeps an affine weight in groups
    of 32 (quantized_layers.NativeLinear; the output layer may keep Q6_K blocks, BlockLinear) and
    whose shapes the kernels take, else None."""
    c = model.config
    if not implemented(c):
        return None
    layers = [layer for block in model.blk for layer in block.children().values() if not isinstance(layer, nn.RMSNorm)]
    head = model.token_embd if c.tied_output else model.output
    if not all(isinstance(layer, NativeLinear) and layer.group_size == AFFINE_GROUP_SIZE for layer in layers):
        return None
    if not (isinstance(head, NativeLinear) or isinstance(head, BlockLinear) and isinstance(head.product, Q6KProduct)):
        return None
    # Each lane of the attention kernel holds head_dim / 32 dims; the kernels stage and return float16.
    if c.head_dim % 32 or model.compute_dtype != mx.float16:
        return None
    device = device_limits()
    return KernelStep(model, fallback, *device) if device else None


def implemented(c) -> bool:
    """Whether the kernels compute this config's layer exactly: a Llama-style block (pre-norms,
    SwiGLU, full attention with 1/sqrt(head size), plain embeddings and logits); Q/K norms, post
    norms, GeGLU, sliding windows, mixtures of experts and the rest go to the plain MLX step."""
    return (not c.qk_norm and not c.post_norms and c.ffn_activation == "silu" and c.embedding_scale == 1.0
            and c.attention_scale is None and not c.final_logit_softcap and not c.sliding_window and not c.n_experts)


__all__ = ["KernelStep", "block_products", "kernel_step"]
