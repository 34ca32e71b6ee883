"""K-type matrices in the affine form against the sub-block form: time a product, bits held, error.

    python benchmarks/sub_block_products.py [--shapes 151936x1024,1024x3072] [--rows 1,8] [--json OUT]

For each shape (output rows x input columns, a Qwen3-0.6B tied table and ffn_down by default) and
type (Q6_K, Q4_K, Q3_K, Q2_K), the same random blocks are converted both ways: quants.to_affine
(NativeLinear, what a GPU holds: Q4_K at 4 bits with float16 scales, the others at 8 bits, Q6_K
and Q2_K re-quantized) and quants.to_sub_blocks (SubBlockLinear, what the CPU holds: the file's
codes, sub-block scales and mins, d and dmin). Per call, milliseconds, median of 5
evaluations of a few calls each, in the runtime's compute type (float32 on the CPU); each form's
bits a value held; and each form's largest error against the exact decode (quants.decode_blocks),
relative to the largest output.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from mlx.utils import tree_flatten

from mlxllama.quantized_layers import NativeLinear, SubBlockLinear
from mlxllama.quants import FORMATS, decode_blocks, to_affine, to_sub_blocks
from mlxllama.runtime import default_dtype

from matmul_paths import per_call_ms  # benchmarks/ is the script's own folder

SHAPES = "151936x1024,1024x3072"
TYPES = tuple(GGMLQuantizationType[name] for name in ("Q6_K", "Q4_K", "Q3_K", "Q2_K"))


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes as `qtype` blocks, with each block's d (and dmin) a float16 of a model's size (0.001-0.01)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    start = 0
    for name, width in FORMATS[qtype].layout:
        if name in ("d", "dmin"):
            raw[:, start : start + width] = rng.uniform(1e-3, 1e-2, (len(raw), 1)).astype(np.float16).view(np.uint8)
        start += width
    return raw


def held_bits(layer, values: int) -> float:
    return sum(a.nbytes for _, a in tree_flatten(layer.parameters())) * 8 / values


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated ROWSxCOLS (COLS a multiple of 256)")
    parser.add_argument("--rows", default="1,8", help="comma-separated input row counts")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    dtype = default_dtype()
    results = []
    for shape in args.shapes.split(","):
        rows, cols = (int(n) for n in shape.split("x"))
        for qtype in TYPES:
            raw = random_blocks(qtype, rows, cols)
            affine = NativeLinear(to_affine(raw, qtype, (rows, cols)), output_bias=False)
            sub_blocks = SubBlockLinear(to_sub_blocks(raw, qtype, (rows, cols)), output_bias=False)
            exact = decode_blocks(mx.array(raw), qtype).reshape(rows, cols)
            mx.eval(affine.parameters(), sub_blocks.parameters(), exact)
            for n in map(int, args.rows.split(",")):
                x = mx.random.normal((n, cols), key=mx.random.key(n)).astype(dtype)
                reference = x.astype(mx.float32) @ exact.T
                scale = mx.abs(reference).max().item()
                row = {"type": qtype.name, "shape": [rows, cols], "rows": n, "dtype": str(dtype).split(".")[-1]}
                for name, layer in (("affine", affine), ("sub_blocks", sub_blocks)):
                    calls = max(1, int(2e8 // (rows * cols * n)))
                    row[f"{name}_ms"] = per_call_ms(lambda layer=layer: layer(x), calls)
                    row[f"{name}_bits"] = held_bits(layer, rows * cols)
                    row[f"{name}_error"] = (mx.abs(layer(x).astype(mx.float32) - reference).max().item() / scale)
                results.append(row)
                print(f"{qtype.name:5} {rows:>7}x{cols:<5} rows {n:>3}: affine {row['affine_ms']:8.2f} ms "
                      f"({row['affine_bits']:.4f} bits, error {row['affine_error']:.1e}), sub-blocks "
                      f"{row['sub_blocks_ms']:8.2f} ms ({row['sub_blocks_bits']:.4f} bits, error "
                      f"{row['sub_blocks_error']:.1e}): {row['affine_ms'] / row['sub_blocks_ms']:.2f}x", flush=True)
            del affine, sub_blocks, exact
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
