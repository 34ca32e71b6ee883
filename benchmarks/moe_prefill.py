"""One mixture-of-experts FFN of Qwen3-30B-A3B's shape (128 experts, 8 used, hidden 2048, expert
width 768), its experts in MLX's 4-bit affine format as native mode holds a Q4_K file's: the time
of the chosen experts' products for N tokens, with the (token, expert) pairs in token order and
sorted by expert (models.transformer.expert_outputs, both paths), on the default device.

    python benchmarks/moe_prefill.py --tokens 1,8,32,128,512 [--json out.json]

The sorted path pays an argsort and two gathers, to gain where MLX runs each expert's rows as one
product; on the CPU and on CUDA (an H100, MLX 0.32.4) it gained nothing, so only Metal sorts
(transformer.SORT_EXPERTS_MIN_PAIRS; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from gguf import GGMLQuantizationType

from mlxllama.models.transformer import expert_outputs, swiglu
from mlxllama.quantized_layers import NativeExperts
from mlxllama.quants import AFFINE_GROUP_SIZE, AffineWeight


def experts(n: int, outputs: int, inputs: int, bits: int) -> NativeExperts:
    w = mx.random.normal((n, outputs, inputs)) * 0.02
    weight, scales, biases = mx.quantize(w, group_size=AFFINE_GROUP_SIZE, bits=bits)
    return NativeExperts(AffineWeight(weight, scales.astype(mx.float16), biases.astype(mx.float16), bits,
                                      GGMLQuantizationType.Q4_K))


def timed(run, repetitions: int) -> float:
    mx.eval(run())  # compiles kernels for this shape, off the clock
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--used", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    dtype = mx.float16 if mx.default_device() == mx.gpu else mx.float32  # runtime.default_dtype's choice
    mx.random.seed(0)
    gate = experts(args.experts, args.width, args.hidden, 4)
    up = experts(args.experts, args.width, args.hidden, 4)
    down = experts(args.experts, args.hidden, args.width, 4)
    mx.eval(gate.parameters(), up.parameters(), down.parameters())
    rows = []
    print(f"{mx.default_device()}, {args.experts} experts, {args.used} used, hidden {args.hidden}, width {args.width}")
    print("| tokens | pairs | token order ms | expert order ms | sorted speed-up | largest difference |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (int(t) for t in args.tokens.split(",")):
        x = (mx.random.normal((n, args.hidden)) * 0.5).astype(dtype)
        chosen = mx.stack([mx.random.permutation(args.experts)[: args.used] for _ in range(n)]).astype(mx.uint32)
        run = {sort: (lambda sort=sort: expert_outputs(gate, up, down, swiglu, x, chosen, sort=sort))
               for sort in (False, True)}
        difference = mx.abs(run[False]().astype(mx.float32) - run[True]().astype(mx.float32)).max().item()
        plain, ordered = (timed(run[sort], args.repetitions) for sort in (False, True))
        rows.append({"tokens": n, "pairs": n * args.used, "token_order_s": plain, "expert_order_s": ordered,
                     "largest_difference": difference})
        print(f"| {n} | {n * args.used} | {plain * 1e3:.2f} | {ordered * 1e3:.2f} | {plain / ordered:.2f}x"
              f" | {difference:.1e} |", flush=True)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"device": str(mx.default_device()), "mlx": mx.__version__, **vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
