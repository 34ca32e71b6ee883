"""Which matmul path is fastest for a quantized projection, by number of rows (GPU or CPU).

    python benchmarks/matmul_paths.py [--dtype float32|float16|bfloat16] [--rows 1,2,8] [--json OUT]

For a TinyLlama ffn_up shape (2048 -> 5632) as Q4_K (4 bits, stored biases) and an ffn_down shape
(5632 -> 2048) as Q6_K (8 bits, symmetric), times per call: mx.quantized_matmul; mx.dequantize then a
dense matmul (what NativeLinear does for several rows on a GPU); and a dense matmul with the weight
already expanded (the --dequantize mode). Milliseconds, median of 5 evaluations of 20 calls each.
The inputs and the dense weights are in --dtype (default: runtime's, float16 on a GPU, float32 on
the CPU), as a model loaded with it holds them; the float16 scales are cast to it once here, where
NativeLinear casts them at each call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from mlxllama.quants import symmetric_biases
from mlxllama.runtime import default_dtype

ROWS = (1, 2, 8, 16, 32, 64, 512)
CALLS = 20


def per_call_ms(make, calls: int = CALLS) -> float:
    """Milliseconds a call of `make`: the median of 5 evaluations of `calls` calls, after a warm-up."""
    mx.eval([make() for _ in range(calls)])
    times = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval([make() for _ in range(calls)])
        times.append(time.perf_counter() - start)
    return statistics.median(times) / calls * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype) if args.dtype else default_dtype()
    results = []
    for name, (out_dims, in_dims), bits in (("Q4_K ffn_up", (5632, 2048), 4), ("Q6_K ffn_down", (2048, 5632), 8)):
        w, scales, biases = mx.quantize(mx.random.normal((out_dims, in_dims)) * 0.02, group_size=32, bits=bits)
        scales = scales.astype(mx.float16)
        biases = symmetric_biases(scales) if bits == 8 else biases.astype(mx.float16)
        scales, biases = scales.astype(dtype), biases.astype(dtype)
        dense = mx.dequantize(w, scales, biases, group_size=32, bits=bits).astype(dtype)
        mx.eval(w, scales, biases, dense)
        for rows in map(int, args.rows.split(",")):
            x = mx.random.normal((rows, in_dims)).astype(dtype)
            row = {
                "layer": name, "rows": rows,
                "quantized_matmul": per_call_ms(lambda: mx.quantized_matmul(
                    x, w, scales, biases, transpose=True, group_size=32, bits=bits)),
                "dequantize_then_matmul": per_call_ms(lambda: x @ mx.dequantize(
                    w, scales, biases, group_size=32, bits=bits).astype(dtype).T),
                "dense_matmul": per_call_ms(lambda: x @ dense.T),
            }
            results.append(row)
            print(f"{name:14s} rows {rows:4d}: quantized {row['quantized_matmul']:.4f} ms, dequantize+matmul "
                  f"{row['dequantize_then_matmul']:.4f} ms, dense {row['dense_matmul']:.4f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "dtype": str(dtype).removeprefix("mlx.core."),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
