"""What one MLX operation costs when the work in it is tiny, as in a decode step: on the device,
and on the host, building it and handing it over.

    python benchmarks/op_cost.py [--model MODEL.gguf] [--rounds 5] [--chain 200] [--json OUT]

Each row evaluates a chain of --chain dependent links on a decode step's shapes (a [1, 2048]
float16 row, TinyLlama's heads; each needs the one before, as a transformer's layers do; the
embedding's lookups alone are apart) and reports, per operation, medians of the rounds:
- `wall`: the chain from its first operation built to its result on the host;
- `build`: the host building the graph (Python and MLX's graph code);
- `hand-over`: the host in `mx.async_eval` (on a GPU, encoding each primitive and launching).
A row whose link is several operations names them, and reports per operation. With
--model, the file's token embedding lookup and one layer of its plain step join the table (one
sequence, 16 cached positions). A decode step on a GPU is bound by the host (docs/benchmarks.md),
so the host columns say which operations a step should avoid.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

from mlxllama.errors import MlxLlamaError
from mlxllama.models.transformer import residual_add, swiglu


def seconds_per_op(link, state, rounds: int, links: int, per_link: int = 1) -> dict[str, float]:
    """Wall, build and hand-over seconds per operation of `links` links `state = link(state)`; a `state`
    of None: that many links `link()` apart, evaluated together."""
    def chain():
        begin = time.perf_counter()
        if state is None:
            y = [link() for _ in range(links)]
        else:
            y = state
            for _ in range(links):
                y = link(y)
        built = time.perf_counter()
        mx.async_eval(y)
        handed = time.perf_counter()
        mx.eval(y)
        return time.perf_counter() - begin, built - begin, handed - built

    chain()
    samples = [chain() for _ in range(rounds)]
    ops = links * per_link
    return {name: statistics.median(s[i] for s in samples) / ops
            for i, name in enumerate(("wall", "build", "hand-over"))}


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


def quantized(w: mx.array, group_size: int, bits: int):
    """A product with w quantized so: y [1, in] -> [1, out]."""
    qw, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    mx.eval(qw, scales, biases)
    return lambda y: mx.quantized_matmul(y, qw, scales, biases, transpose=True, group_size=group_size, bits=bits)


def step_ops() -> dict:
    """name -> (link, first state, operations a link): the operations of a plain decode step."""
    x = mx.random.normal((1, 2048)).astype(mx.float16)
    w = mx.random.normal((2048, 2048)).astype(mx.float16) * 0.02
    norm = mx.ones((2048,), mx.float16)
    wide = mx.random.normal((1, 5632)).astype(mx.float16)
    heads = mx.random.normal((1, 36, 1, 64)).astype(mx.float16)
    q = mx.random.normal((1, 32, 1, 64)).astype(mx.float16)
    kv = mx.random.normal((1, 4, 16, 64)).astype(mx.float16)
    mx.eval(x, w, norm, wide, heads, q, kv)

    def slice_update(buffer):
        buffer[:, :, 16:17, :] = kv[:, :, :1, :]
        return buffer

    def plain_residual(pair):
        h = pair[0] + pair[1].astype(mx.float32)
        return h, h.astype(mx.float16)

    return {
        "multiply by a constant": (lambda y: y * 1.0001, x, 1),
        "add": (lambda y: y + y, x, 1),
        "cast float16 -> float32 -> float16": (lambda y: y.astype(mx.float32).astype(mx.float16), x, 2),
        "rms_norm (mx.fast)": (lambda y: mx.fast.rms_norm(y, norm, 1e-5), x, 1),
        "4-bit matrix-vector 2048x2048, groups of 32 (ours)": (quantized(w, 32, 4), x, 1),
        "4-bit matrix-vector 2048x2048, groups of 64 (mlx-lm's)": (quantized(w, 64, 4), x, 1),
        "8-bit matrix-vector 2048x2048, groups of 64": (quantized(w, 64, 8), x, 1),
        "float16 matrix-vector 2048x2048": (lambda y: y @ w, x, 1),
        "residual add, compiled, two outputs (residual_add)": (
            lambda pair: residual_add(*pair), (x.astype(mx.float32), x), 1),
        "residual add as cast, add, cast": (plain_residual, (x.astype(mx.float32), x), 3),
        "SwiGLU, compiled, [1, 5632] (swiglu)": (lambda y: swiglu(y, y), wide, 1),
        "RoPE of 36 heads (mx.fast.rope)": (
            lambda y: mx.fast.rope(y, 64, traditional=True, base=10000.0, scale=1.0, offset=16), heads, 1),
        "attention over 16 keys (mx.fast.scaled_dot_product_attention)": (
            lambda y: mx.fast.scaled_dot_product_attention(y, kv, kv, scale=0.125), q, 1),
        "one position written into a cache buffer (slice update)": (
            slice_update, mx.zeros((1, 4, 288, 64), mx.float16), 1),
    }


def model_ops(path: str) -> dict:
    """The file's token embedding lookup, and one layer of its plain step over 16 cached positions."""
    from mlxllama import load

    runtime = load(path)
    model = runtime.model
    cache = model.make_cache()
    mx.eval(model.step(mx.array([[1] * 16]), cache))
    layer, layer_cache = model.blk[0], cache[0]
    embed = model.token_embd

    def one_layer(h):
        layer_cache.trim(1)
        return layer(h, None, layer_cache)[0]

    ids = mx.array([[1]])
    return {
        "token embedding lookup (the file's; lookups apart, not chained)": (lambda: embed(ids), None, 1),
        "one layer of the plain step, 16 cached positions": (one_layer, mx.zeros((1, model.config.hidden_size)), 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file: its embedding lookup and one layer of its plain step too")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chain", type=int, default=200, help="links a chain")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    ops = step_ops()
    if args.model:
        try:
            ops.update(model_ops(args.model))
        except MlxLlamaError as e:
            print(f"op_cost.py: error: {e}", file=sys.stderr)
            sys.exit(2)
    if mx.cuda.is_available():
        ops.update({name: (link, mx.random.normal((1, 2048)).astype(mx.float16), 1)
                    for name, link in custom_kernel_ops().items()})
    print(f"µs per operation on {mx.default_device()}, medians of {args.rounds} chains of {args.chain}:")
    print("| operation | wall | build | hand-over |\n| --- | ---: | ---: | ---: |")
    result = {}
    for name, (link, state, per_link) in ops.items():
        us = {k: round(v * 1e6, 2) for k, v in seconds_per_op(link, state, args.rounds, args.chain, per_link).items()}
        result[name] = us
        print(f"| {name} | {us['wall']} | {us['build']} | {us['hand-over']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "rounds": args.rounds, "chain": args.chain, "us_per_op": result},
                      f, indent=1)


if __name__ == "__main__":
    main()
