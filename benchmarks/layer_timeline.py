"""Where a layer_kernel launch's time goes (CUDA only): when the blocks reach and leave each grid barrier.

    python benchmarks/layer_timeline.py MODEL.gguf [--positions 10,100,199] [--kv-bits 8|4] [--source VARIANT.cu]
    python benchmarks/layer_timeline.py --header-only > timed.cu   # to compile-check it (nvcc, NVRTC)

Builds the model's kernel step (mlxllama.cuda) from a copy of decode_step.cu in which thread 0 of
every block writes the GPU's global timer (ns) into an extra output at the kernel's start, on
reaching and on leaving each of the four grid barriers, and at the end. It decodes up to the
last of --positions and at each prints, as medians over the layers, in µs from the first
block's start: each step's start (the last block's departure from the barrier before it), its
first and last block's arrival at the barrier after it; and the gap between layer launches.
--source times another copy of decode_step.cu (a variant under study, as attention_depth.py
--sources takes it) instead of the shipped one.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

from mlxllama import load
from mlxllama.cache import KVQuantization
from mlxllama.cuda import kernels
from mlxllama.cuda.step import device_limits
from mlxllama.errors import MlxLlamaError

import attention_depth  # benchmarks/, this script's folder: the kernels built from another source

STAMPS = 10  # start, 4 barriers x (arrival, departure), end
STEPS = ["1 norm + Q/K/V + RoPE", "2 attention", "3 output projection", "4 norm + gate/up", "5 SiLU + down"]


def timed_header(header: str) -> str:
    stamp = ("__device__ inline void stamp(unsigned long long* times, int i) {\n"
             "if (threadIdx.x == 0) { unsigned long long t;\n"
             'asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); times[blockIdx.x * 16 + i] = t; }\n}\n')
    signature = "const float* scratch, float* y) {"
    anchor = header.index("__device__ inline void grid_barrier(")
    head, body = (header[:anchor] + stamp + header[anchor:]).split(signature)
    assert body.count("grid_barrier(arrivals);") == 4
    for i in range(4):
        body = body.replace("grid_barrier(arrivals);",
                            f"__syncthreads(); stamp(times, {2 * i + 1}); grid_barrier(times_arrivals); "
                            f"stamp(times, {2 * i + 2});", 1)
    body = body.replace("grid_barrier(times_arrivals);", "grid_barrier(arrivals);")
    body = body.replace("float* smem = shared_floats();", "stamp(times, 0);\nfloat* smem = shared_floats();", 1)
    end = body.rindex("}")
    body = body[:end] + "__syncthreads(); stamp(times, 9);\n" + body[end:]
    return head + signature.replace(") {", ", unsigned long long* times) {") + body


def instrumented_steps(script: str, args: argparse.Namespace, rewrite: Callable[[str], str], output: str,
                       per_block: int) -> Iterator[tuple[int, list[mx.array], int]]:
    """Decode args.model (with args.kv_bits) up to the last of args.positions, every layer_kernel
    launch built from the kernels' header as `rewrite` rewrites it and returning the extra output
    `output` [blocks * per_block] (unsigned 64-bit); at each of the positions, yield it, that step's
    launches' outputs (a layer each) and the blocks a launch has. attention_stamps.py uses this too."""
    limits = device_limits()
    if not limits or not mx.cuda.is_available():
        raise SystemExit(f"{script}: needs MLX's CUDA backend")
    blocks, collected = limits[0], []
    kernels.HEADER = rewrite(kernels.HEADER)
    make_kernel = kernels.kernel

    def kernel(function, parameters, template, shared_floats, header="step", outputs=("y",)):
        if function != "layer_kernel":
            return make_kernel(function, parameters, template, shared_floats, header, outputs)
        launch = make_kernel(function, parameters + (output,), template, shared_floats, header, outputs + (output,))

        def instrumented(**kwargs):
            kwargs["output_shapes"] = kwargs["output_shapes"] + [(blocks * per_block,)]
            kwargs["output_dtypes"] = kwargs["output_dtypes"] + [mx.uint64]
            out = launch(**kwargs)
            collected.append(out[-1])
            return out

        return instrumented

    kernels.kernel = kernel
    runtime = load(args.model, kv_quantization=KVQuantization(args.kv_bits) if args.kv_bits else None)
    model = runtime.model
    model.decode_step._compiled = None  # each launch's output is kept, which a compiled step would drop
    cache = model.make_cache()
    mx.eval(model.step(mx.array([[1]]), cache))
    positions = [int(p) for p in args.positions.split(",")]
    for position in range(1, max(positions) + 1):
        collected.clear()
        mx.eval(model.step(mx.array([[5]]), cache), collected)
        if position in positions:
            yield position, collected, blocks


def arguments(doc: str, positions: str, **switches: str) -> argparse.Namespace:
    """The options both instrumenting scripts take: MODEL, --positions, --kv-bits, --header-only; and
    a script's own on/off options, each switch's name with its help."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--positions", default=positions)
    parser.add_argument("--kv-bits", type=int, help="keys and values stored quantized (mlxllama's --kv-bits)")
    parser.add_argument("--header-only", action="store_true", help="print the instrumented kernel source and exit")
    parser.add_argument("--source", help="a copy of decode_step.cu to build the kernels from instead of the shipped one")
    for name, help in switches.items():
        parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=help)
    args = parser.parse_args()
    if not args.header_only and args.model is None:
        parser.error("MODEL is required")
    if args.source:
        if not Path(args.source).is_file():
            parser.error(f"no such file: {args.source}")
        attention_depth.use(**dict(attention_depth.SHIPPED, source=args.source))
    return args


def report(position: int, timestamps: list[mx.array]) -> None:
    t = np.stack([np.array(a).reshape(-1, 16)[:, :STAMPS].astype(np.int64) for a in timestamps])  # layer, block, stamp
    t = (t - t[:, :, :1].min(axis=1, keepdims=True)) / 1000.0
    first, last = (lambda i: np.median(t[:, :, i].min(axis=1))), (lambda i: np.median(t[:, :, i].max(axis=1)))
    print(f"position {position}: a layer {last(9):.1f} µs")
    for s, name in enumerate(STEPS):
        start = last(2 * s) if s else 0.0
        print(f"  {name:24s} starts {start:5.1f}  first block done {first(2 * s + 1):5.1f}  "
              f"last block done {last(2 * s + 1):5.1f}")


def main():
    args = arguments(__doc__, "10,100,199")
    if args.header_only:
        print(timed_header(kernels.HEADER))
        return
    for position, timestamps, _ in instrumented_steps("layer_timeline.py", args, timed_header, "times", 16):
        report(position, timestamps)
        starts = np.array([np.array(a).reshape(-1, 16)[:, 0].min() for a in timestamps], np.int64)
        ends = np.array([np.array(a).reshape(-1, 16)[:, 9].max() for a in timestamps], np.int64)
        print(f"  gap between layer launches: median {np.median(starts[1:] - ends[:-1]) / 1000:.2f} µs")


if __name__ == "__main__":
    try:
        main()
    except MlxLlamaError as error:
        raise SystemExit(f"layer_timeline.py: {error}")
