"""What each decode-path change buys: `mlxllama bench` (pp512, tg128 at batch 1 and 16) with the
changes switched on one after another, on one file.

    python benchmarks/decode_variants.py MODEL.gguf [--dequantize] [--reps 3] [--rounds 2] [--json OUT]

Each variant runs in a fresh process, and the variants take turns for --rounds rounds: in one
process the later runs came out slower than the first whatever they measured.

  plain          an uncompiled step through Transformer.__call__, separate Q/K/V and gate/up
                 projections, an explicit boolean causal mask in prefill (the code before them)
  causal         + MLX's "causal" attention mask in prefill
  fused          + fused Q/K/V and gate/up projections (fusion.py)
  compiled       + the compiled decode step over fixed-size cache buffers (Transformer.step): today's code
  compiled only  the compiled step without fused projections
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from contextlib import ExitStack
from unittest import mock

import mlx.core as mx

from mlxllama import bench, cache, fusion, model


def boolean_causal_mask(self, length):
    if length == 1:
        return None
    query_pos = mx.arange(self.offset, self.offset + length)[:, None]
    return mx.arange(self.offset + length)[None, :] <= query_pos


PATCHES = {
    "compiled step": lambda: mock.patch.object(model.Transformer, "step",
                                               lambda self, tokens, kv: self(tokens, kv)[:, -1]),
    "fusion": lambda: mock.patch.object(fusion, "stacked", lambda layers: None),
    "causal mask": lambda: mock.patch.object(cache.KVCache, "mask", boolean_causal_mask),
}
VARIANTS = {  # the changes each variant goes without
    "plain": ["compiled step", "fusion", "causal mask"],
    "causal": ["compiled step", "fusion"],
    "fused": ["compiled step"],
    "compiled": [],
    "compiled only": ["fusion"],
}


def measure(model_path: str, variant: str, reps: int, dequantize: bool) -> list:
    with ExitStack() as stack:
        for change in VARIANTS[variant]:
            stack.enter_context(PATCHES[change]())
        report = bench.run(model_path, 512, 128, (1, 16), repetitions=reps, dequantize=dequantize)
    return [(t.name, t.batch, round(t.median, 1), round(t.stdev, 1)) for t in report.tests]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", choices=VARIANTS, help="Measure this one in this process and print it as JSON.")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args.model, args.variant, args.reps, args.dequantize)))
        return
    results = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            command = [sys.executable, __file__, args.model, "--variant", name, "--reps", str(args.reps)]
            out = subprocess.run(command + (["--dequantize"] if args.dequantize else []),
                                 capture_output=True, text=True, check=True).stdout
            results[name].append(json.loads(out.splitlines()[-1]))
            print(f"{name}: {results[name][-1]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
