"""What one MLX operation costs on the device when the work in it is tiny, as in a decode step.

    python benchmarks/op_cost.py [--json OUT]

Each row evaluates a chain of N dependent operations on a [1, 2048] float16 row (each needs the
one before, as a transformer's layers do) and reports the time per operation, median of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

N = 200


def seconds_per_op(op, x: mx.array) -> float:
    def chain():
        y = x
        for _ in range(N):
            y = op(y)
        mx.eval(y)

    chain()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        chain()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / N


def custom_kernel_ops() -> dict:
    """A one-line custom kernel, alone, behind headers as long as mlxllama.cuda's (MLX hashes a
    kernel's whole source at every launch), and with as many inputs as a layer kernel takes."""
    from mlxllama.cuda import kernels

    body = "int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 2048) y[i] = x[i] * static_cast<__half>(1.0001f);"
    layer_inputs = len(kernels.inputs_of(kernels.LAYER_PARAMETERS))
    rows = {}
    for label, head, extra in (("", "", 0), (f", {len(kernels.HEADER)}-character header", kernels.HEADER, 0),
                               (f", {len(kernels.BATCH_HEADER)}-character header", kernels.BATCH_HEADER, 0),
                               (f", {layer_inputs} inputs", "", layer_inputs - 1)):
        names = ["x"] + [f"unused{i}" for i in range(extra)]
        kernel = mx.fast.cuda_kernel(name=f"scale{len(head)}_{extra}", input_names=names, output_names=["y"],
                                     source=body, header=head)
        rows["custom kernel multiply" + label] = lambda y, kernel=kernel, n=len(names): kernel(
            inputs=[y] * n, grid=(2048, 1, 1), threadgroup=(256, 1, 1), output_shapes=[y.shape],
            output_dtypes=[y.dtype])[0]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    x = mx.random.normal((1, 2048)).astype(mx.float16)
    w = mx.random.normal((2048, 2048)).astype(mx.float16) * 0.02
    qw, scales, biases = mx.quantize(w, group_size=32, bits=4)
    norm = mx.ones((2048,), mx.float16)
    mx.eval(x, w, qw, scales, biases, norm)
    ops = {
        "multiply by a constant": lambda y: y * 1.0001,
        "rms_norm (mx.fast)": lambda y: mx.fast.rms_norm(y, norm, 1e-5),
        "4-bit matrix-vector 2048x2048 (quantized_matmul)": lambda y: mx.quantized_matmul(
            y, qw, scales, biases, transpose=True, group_size=32, bits=4),
        "float16 matrix-vector 2048x2048": lambda y: y @ w,
    }
    if mx.cuda.is_available():
        ops.update(custom_kernel_ops())
    result = {name: round(seconds_per_op(op, x) * 1e6, 2) for name, op in ops.items()}
    for name, us in result.items():
        print(f"{name}: {us} us per operation ({mx.default_device()})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
