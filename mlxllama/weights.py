"""The one weight loader: a GGUF file's tensors into its architecture's model, block by block.

Native and dequantized modes share this path and differ only in the per-tensor conversion
(tensors.convert): native mode keeps quantized matrices quantized and swaps the layers that use
them for their quantized counterparts (quantized_layers.py). A tensor the file fuses (Phi-3's Q/K/V)
loads into the model's fused layer as it is; separate Q/K/V and gate/up are stacked by fusion.py
as soon as their block is complete, since a decode step on a GPU is bound by its kernel launches.

Each tensor is converted and evaluated before the next is read, and a block's parts and their
fused copy never sit next to all the other weights, so the load peak stays at the finished
weights plus one tensor's intermediates.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType
from mlx.utils import tree_map_with_path

from .fusion import fuse_block
from .gguf_file import GGUFFile
from .models import Architecture, ModelConfig, Transformer
from .quantized_layers import BlockProduct, quantized_layer
from .quants import AffineWeight, SubBlockWeight
from .sharding import Shard
from .tensors import Blocks, Weight, convert


def load_model(gguf: GGUFFile, architecture: Architecture, config: ModelConfig, dtype: mx.Dtype,
               native: bool = True, shard: Shard | None = None, requantize: bool = True,
               block_products: Mapping[GGMLQuantizationType, BlockProduct] | None = None,
               sub_blocks: bool = False, wide: bool = False) -> Transformer:
    """The model of `config` (architecture.read_config's, which checked every tensor's shape) with
    its weights loaded in the compute type `dtype`; `native` keeps quantized matrices quantized
    (`requantize`: tensors.convert).
    With a `shard`, only the tensors and pieces of tensors that rank holds are read.
    `block_products`: a backend's kernels by type; in native mode an output layer of one of those
    types stays in the file's blocks (quantized_layers.BlockLinear), unless it is split over ranks.
    `sub_blocks` (the CPU's choice): in native mode, Q2_K, Q3_K, Q4_K and Q6_K matrices are held in
    their sub-block form (quantized_layers.SubBlockLinear: the file's values, in about its bits).
    `wide` (where MLX's own products read the affine form, not the CUDA kernels): Q6_K matrices in
    its wide form (quants.to_affine), groups of 64 with their biases stored; a split model's pieces
    hold the same values in groups of 32 (tensors.convert)."""
    kernels = block_products if native and block_products and shard is None else {}
    head = "token_embd.weight" if config.tied_output else "output.weight"
    lookup_table = None if config.tied_output else "token_embd.weight"  # only looked up: kept in its blocks

    def product_for(name: str) -> BlockProduct | None:
        return kernels.get(gguf.tensors[name].tensor_type) if name == head else None

    model = architecture.build(config, dtype, shard)
    model.wide_q6_k = native and wide
    layers = shard.layers if shard else range(config.n_layers)
    # The tensors of each block ("blk.N."), then the rest: the embedding and output, larger than a block.
    blocks: list[dict] = [{} for _ in layers]
    rest: dict = {}
    for name, (parameter, shape) in architecture.tensors(config).items():
        if shard is not None and not shard.holds(name):
            continue  # another pipeline stage's block
        if not name.startswith("blk."):
            rest[name] = (parameter, shape)
            continue
        local = int(name.split(".")[1]) - layers.start  # a pipeline stage's blocks are its model's blk.0, blk.1, ...
        blocks[local][name] = (f"blk.{local}." + parameter.split(".", 2)[2], shape)

    def load(part: dict) -> None:
        products = {parameter: product_for(name) for name, (parameter, _) in part.items()}
        converted = {parameter: convert(gguf.path, gguf.tensors[name], shape, dtype, native,
                                        as_blocks=name == lookup_table or products[parameter] is not None,
                                        piece=shard.piece(name, config) if shard else None, requantize=requantize,
                                        sub_blocks=sub_blocks, wide=wide)
                     for name, (parameter, shape) in part.items()}
        _load(model, converted, products)

    for block, part in zip(model.blk, blocks):
        load(part)
        fuse_block(block)
    load(rest)
    return model


def _load(model: nn.Module, weights: dict[str, Weight], products: dict[str, BlockProduct | None]) -> None:
    """Swap in the quantized layers that `weights` names (a matrix kept in blocks for its product
    with its `products` entry) and load its dense tensors."""

    def swap(path: str, module: nn.Module) -> nn.Module:
        weight = weights.get(f"{path}.weight")
        if not isinstance(weight, (AffineWeight, SubBlockWeight, Blocks)):
            return module
        return quantized_layer(module, weight, products.get(f"{path}.weight"))

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    # Dense tensors and the biases of quantized layers; the swapped layers already hold the rest.
    # Not strict: the architecture's tensor table names every parameter, and read_config checked their shapes.
    model.load_weights([(n, w) for n, w in weights.items() if isinstance(w, mx.array)], strict=False)
