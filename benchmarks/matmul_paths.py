"""Which matmul path is fastest for a quantized projection, by number of rows (GPU or CPU).

    python benchmarks/matmul_paths.py [--json OUT]

For a TinyLlama ffn_up shape (2048 -> 5632) as Q4_K (4 bits, stored biases) and an ffn_down shape
(5632 -> 2048) as Q6_K (8 bits, symmetric), times per call: mx.quantized_matmul; mx.dequantize then a
dense matmul (what NativeLinear does for several rows on a GPU); and a dense matmul with the weight
already expanded (the --dequantize mode). Milliseconds, median of 5 evaluations of 20 calls each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from mlxllama.quants import symmetric_biases

ROWS = (1, 2, 8, 16, 32, 64, 512)
CALLS = 20


def per_call_ms(make) -> float:
    mx.eval([make() for _ in range(CALLS)])
    times = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval([make() for _ in range(CALLS)])
        times.append(time.perf_counter() - start)
    return statistics.median(times) / CALLS * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    dtype = mx.float16 if mx.default_device() == mx.gpu else mx.float32
    results = []
    for name, (out_dims, in_dims), bits in (("Q4_K ffn_up", (5632, 2048), 4), ("Q6_K ffn_down", (2048, 5632), 8)):
        w, scales, biases = mx.quantize(mx.random.normal((out_dims, in_dims)) * 0.02, group_size=32, bits=bits)
        scales = scales.astype(mx.float16)
        biases = symmetric_biases(scales) if bits == 8 else biases.astype(mx.float16)
        dense = mx.dequantize(w, scales, biases, group_size=32, bits=bits).astype(dtype)
        mx.eval(w, scales, biases, dense)
        for rows in ROWS:
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
            json.dump({"device": str(mx.default_device()), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
