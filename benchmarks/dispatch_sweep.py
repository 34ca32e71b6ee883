"""Pick NativeLinear's GPU dispatch (quantized matmul vs float16 expansion) per bits from end-to-end runs.

    python benchmarks/dispatch_sweep.py MODEL.gguf [--json OUT]

Runs `mlxllama bench` (pp512, tg128 at batch 1, 8, 16; 3 repetitions) with several settings of
quantized_layers.DENSE_MIN_ROWS, the number of rows from which a call expands its weight on a GPU.
"""

from __future__ import annotations

import argparse
import json

from mlxllama import bench, quantized_layers

SETTINGS = {"expand from 2 rows": 2, "expand from 32 rows": 32, "expand from 128 rows": 128,
            "quantized always": 1 << 30}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    results = {}
    for name, rows in SETTINGS.items():
        quantized_layers.DENSE_MIN_ROWS = rows
        report = bench.run(args.model, 512, 128, (1, 8, 16), repetitions=3)
        results[name] = [(t.name, t.batch, round(t.median, 1), round(t.stdev, 1)) for t in report.tests]
        print(f"{name}: {results[name]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
